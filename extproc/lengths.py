"""Token counts the Astrolabe policy sends to predictors: prompt tokens and predicted output tokens.

Prompt tokens: the length of a token-id prompt, else the text counted with ``tagger.tokenizer`` (the project's
offline tokenizer). A text longer than ``MAX_TOKENIZED_CHARS`` is counted on its first ``MAX_TOKENIZED_CHARS``
characters and extrapolated by length: tokenizing megabytes takes seconds of CPU, which inline would stall every
other request on the event loop; the extrapolation costs ~3 ms. (With block keys on, ``extproc.prompt_tokens``
tokenizes prompts in full, long ones in a worker thread: ``extproc.router.OFFLOAD_TOKENIZE_CHARS``.)
Predicted output tokens, by ``source``:
- ``fixed``: ``fixed_tokens`` (the default until a tagger exists);
- ``oracle``: the request's ``max_tokens`` itself (exact only when clients send the true length with
  ``ignore_eos``, as the demo and benchmarks do); off unless configured explicitly;
- ``tagger`` (the default): the length tagger's estimate (``tagger.serve``; the shipped light tagger unless
  ``tagger_path`` names a trained one). For chat requests the tagger reads the last
  user message, the turn the reply answers, and the sizes of the messages before it; a turn after an earlier
  assistant reply is sent as LENGTH_SOURCE_TAGGER_LATER_TURN, so the sidecars price it by the tagger's
  later-turn quantiles (``predictor.residual_rules``).

`OutputLengthEstimator.estimate` caps the figure by the request's ``max_tokens`` (a point estimate: the TPOT
objective divides by it). The sidecars get the figure BEFORE the cap, with ``max_tokens`` beside it
(`OutputLengthEstimator.estimate_before_cap`): they price a request as E[min(L, max_tokens)] over the reply
lengths a tagger's estimate stands for (``predictor/sim/residual.py``). Capping first would price the
distribution around the cap instead: an estimate of 300 tokens under ``max_tokens`` 16 was priced at 11 tokens by
the light tagger's quantiles, though such a reply almost surely runs to its cap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from extproc.request import RoutingRequest
from predictor.residual_rules import LENGTH_SOURCE_EXACT, LENGTH_SOURCE_FIXED, tagger_source
from tagger.features import NO_HISTORY, HistoryStats
from tagger.tokenizer import count_tokens

MAX_TOKENIZED_CHARS = 8192
"""Longest prefix of a prompt text that is tokenized, characters."""
SOURCES = ("fixed", "oracle", "tagger")


@dataclass(frozen=True, slots=True)
class OutputLengthConfig:
    """How predicted output tokens are obtained (see the module docstring)."""

    source: str = "tagger"
    fixed_tokens: int = 256
    tagger_path: str | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source: must be one of {SOURCES}, got {self.source!r}")


def extrapolated_tokens(text: str, count: Callable[[str], int]) -> int:
    """``count(text)``, or for a text longer than `MAX_TOKENIZED_CHARS` the count of that prefix scaled by the
    length ratio (so that no request tokenizes megabytes on the event loop), tokens."""
    if len(text) <= MAX_TOKENIZED_CHARS:
        return count(text)
    return round(count(text[:MAX_TOKENIZED_CHARS]) * len(text) / MAX_TOKENIZED_CHARS)


def count_prompt_tokens(request: RoutingRequest) -> int:
    """Prompt length in tokens (>= 1: an empty prompt still costs one position); extrapolated for long texts."""
    if request.prompt_token_ids is not None:
        return max(len(request.prompt_token_ids), 1)
    return max(extrapolated_tokens(request.prompt_text or "", count_tokens), 1)


def chat_history(request: RoutingRequest) -> HistoryStats:
    """The sizes of a chat request's messages before its last user message (`NO_HISTORY` for a first turn, a
    completions request, or a chat without a user message, whose whole text the tagger reads instead)."""
    messages = request.chat_messages
    if not messages:
        return NO_HISTORY
    last_user = max((i for i, (role, _) in enumerate(messages) if role == "user"), default=0)
    return HistoryStats.of(messages[:last_user]) if last_user else NO_HISTORY


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
        self.tagger = tagger

    async def estimate(self, request: RoutingRequest) -> int:
        """Predicted output tokens (>= 1), capped by the request's ``max_tokens``."""
        return capped_output_tokens((await self.estimate_before_cap(request))[0], request.max_tokens)

    async def estimate_before_cap(self, request: RoutingRequest) -> tuple[int, int]:
        """Predicted output tokens (>= 1) BEFORE the request's ``max_tokens`` cap, which the sidecars apply
        themselves (see the module docstring), and where they came from (``predictor.residual_rules.
        LENGTH_SOURCE_*``: the sidecars condition a live request's remaining length on it). ``oracle`` without
        ``max_tokens`` falls back to ``fixed_tokens``, and says so."""
        cap = request.max_tokens
        if self.config.source == "oracle" and cap is not None:
            return max(cap, 1), LENGTH_SOURCE_EXACT
        if self.config.source == "tagger":
            text = request.last_user_message if request.last_user_message is not None else request.prompt_text
            history = chat_history(request)
            guess = await self.tagger.estimate(text, request.prompt_token_ids, None, history)
            source = tagger_source(history.num_replies > 0)
        else:
            guess, source = self.config.fixed_tokens, LENGTH_SOURCE_FIXED
        return max(guess, 1), source


def capped_output_tokens(num_output_tokens: int, max_tokens: int | None) -> int:
    """``num_output_tokens`` capped by ``max_tokens`` (None: no cap), tokens, >= 1."""
    return max(min(num_output_tokens, max_tokens) if max_tokens is not None else num_output_tokens, 1)
