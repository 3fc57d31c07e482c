"""Token counts the Astrolabe policy sends to predictors: prompt tokens and predicted output tokens.

Prompt tokens: the length of a token-id prompt, else the text counted with ``tagger.tokenizer`` (the project's
offline tokenizer); texts above ``_INLINE_TOKENIZE_CHARS`` are counted in a worker thread so a long prompt
never stalls the event loop.
Predicted output tokens, by ``source``:
- ``fixed``: ``fixed_tokens``, capped by the request's ``max_tokens`` (the default until a tagger exists);
- ``oracle``: the request's ``max_tokens`` itself (exact only when clients send the true length with
  ``ignore_eos``, as the demo and benchmarks do); off unless configured explicitly;
- ``tagger``: the length tagger's estimate, capped by ``max_tokens``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from extproc.request import RoutingRequest
from tagger.tokenizer import count_tokens

_INLINE_TOKENIZE_CHARS = 16_384
SOURCES = ("fixed", "oracle", "tagger")


@dataclass(frozen=True, slots=True)
class OutputLengthConfig:
    """How predicted output tokens are obtained (see the module docstring)."""

    source: str = "fixed"
    fixed_tokens: int = 256
    tagger_path: str | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source: must be one of {SOURCES}, got {self.source!r}")


async def count_prompt_tokens(request: RoutingRequest) -> int:
    """Prompt length in tokens (>= 1: an empty prompt still costs one position)."""
    if request.prompt_token_ids is not None:
        return max(len(request.prompt_token_ids), 1)
    text = request.prompt_text or ""
    if len(text) > _INLINE_TOKENIZE_CHARS:
        return max(await asyncio.to_thread(count_tokens, text), 1)
    return max(count_tokens(text), 1)


class OutputLengthEstimator:
    """Predicted output tokens of a request.

    Args:
        config: the source and its settings.
        tagger: an object with ``async estimate(prompt_text, prompt_token_ids, max_tokens) -> int`` when
            ``config.source == "tagger"``.

    Raises:
        ValueError: ``source`` is ``tagger`` but no tagger is given, or the source is unknown.
    """

    def __init__(self, config: OutputLengthConfig, tagger=None) -> None:
        if config.source not in SOURCES:
            raise ValueError(f"output_length.source must be one of {SOURCES}, got {config.source!r}")
        if config.source == "tagger" and tagger is None:
            raise ValueError("output_length.source is 'tagger' but no tagger is loaded")
        self.config = config
        self._tagger = tagger

    async def estimate(self, request: RoutingRequest) -> int:
        """Predicted output tokens (>= 1)."""
        cap = request.max_tokens
        if self.config.source == "oracle" and cap is not None:
            return max(cap, 1)
        if self.config.source == "tagger":
            guess = await self._tagger.estimate(request.prompt_text, request.prompt_token_ids, cap)
        else:
            guess = self.config.fixed_tokens
        return max(min(guess, cap) if cap is not None else guess, 1)
