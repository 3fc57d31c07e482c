"""Prompt tokens counted as the served model's engine counts them: a tokenizer per model, from the config.

`PromptTokenCounter` maps a request's ``model`` to the tokenizer configured for it (``tokenizers:`` in the
extproc config: a ``tokenizer.json`` file or a model directory holding one) and counts as vLLM does:

- completions: ``tokenizer(prompt)`` with the tokenizer's special tokens (vLLM's default
  ``add_special_tokens=True``);
- chat: the model's chat template rendered with ``add_generation_prompt=True``, then tokenized without special
  tokens (the template writes them), as vLLM's chat serving does. The template is rendered by ``transformers``
  (``AutoTokenizer.apply_chat_template``, a base dependency, used without torch) when the directory has one
  (``chat_template.jinja`` or ``tokenizer_config.json``); a tokenizer file alone, or an environment without
  ``transformers`` (e.g. this project installed ``--no-deps`` elsewhere), counts the message texts joined, and a
  warning at start-up says so.

Requests for a model with no configured tokenizer (or no ``model``) are counted with the shipped WordPiece
(`extproc.lengths.count_prompt_tokens`); the first time a configured counter is missing for a request, a warning
says which fallback is used (once, not per model name: names come from clients). Token-id prompts are counted
as given. The length tagger keeps its own tokenizer for its features.

Block keys (prefix caching, `PromptTokenCounter.tokens`): with ``block_size`` set, a prompt is tokenized in full
(no extrapolation: a key needs every token of its block and of the blocks before it) and its token ids, as the
engine would see them (the same rules as the count), give the keys of its full KV blocks
(``predictor.sim.block_hash.block_keys``). The router and every sidecar agree on keys because the sidecars never
compute them: they keep the keys the router sends. They match the engine's own cache only as far as the token ids
do: with the served model's tokenizer configured (and its chat template) exactly; with the shipped WordPiece
equal texts still give equal keys, so repeated prompts and shared prefixes are still recognised. A prompt longer
than ``max_keyed_chars`` characters (text and roles) gets no keys and an extrapolated count, as before: tokenizing
megabytes holds the event loop for seconds. ``astrolabe bench prompt-keys`` prints what tokenizing and hashing
cost per request.

Source: vllm/entrypoints/openai/serving_completion.py and serving_chat.py, vllm/entrypoints/chat_utils.py
``apply_hf_chat_template`` (vLLM 0.32).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from dataclasses import dataclass

from extproc.lengths import MAX_TOKENIZED_CHARS, count_prompt_tokens, extrapolated_tokens
from extproc.request import RoutingRequest
from predictor.sim.block_hash import block_keys
from tagger.tokenizer import get_tokenizer, num_tokens, token_ids

logger = logging.getLogger(__name__)


class TokenizerLoadError(ValueError):
    """A configured tokenizer cannot be loaded (the message names the model and the path)."""


VERY_LONG_TOKENS = 1 << 62
"""`model_max_length` given to transformers: no limit of its own on what it counts."""
MAX_TEMPLATE_MESSAGES = 256
"""Most messages a chat template is rendered over for one request; a longer chat's template tokens are
extrapolated from its first `MAX_TEMPLATE_MESSAGES` (`_ModelTokenizer._template_overhead`)."""
DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block of the keys: vLLM's default ``--block-size`` (vllm/config/cache.py)."""
DEFAULT_MAX_KEYED_CHARS = 262_144
"""Longest prompt (characters of text and roles) tokenized in full for its block keys: about 64,000 tokens of
English text; longer prompts get no keys."""
MAX_ROLE_CHARS = 64
"""A role's characters rendered into an extrapolated template (real roles are a word: system, user,
assistant, tool, developer); a longer role's excess is not counted."""


class _ModelTokenizer:
    """One model's tokenizer: the fast tokenizer (``tokenizers``) and, when available, its chat template."""

    def __init__(self, model: str, path: str) -> None:
        from tokenizers import Tokenizer  # noqa: PLC0415 (loaded only when configured)

        location = Path(path)
        file = location / "tokenizer.json" if location.is_dir() else location
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # noqa: BLE001 (tokenizers raises plain Exception subclasses)
            raise TokenizerLoadError(f"tokenizers.{model}: cannot load {file}: {exc}") from None
        # A tokenizer.json may carry padding or truncation settings (for training): an engine counts neither.
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.model = model
        self.chat = None  # a transformers tokenizer with a chat template, or None
        if location.is_dir() and ((location / "chat_template.jinja").exists()
                                  or "chat_template" in _read(location / "tokenizer_config.json")):
            try:
                # model_max_length: the model's context is the engine's to enforce; counting tokens past it is
                # no error here (transformers would warn "indexing errors" for a model nothing here runs).
                self.chat = _auto_tokenizer().from_pretrained(str(location), model_max_length=VERY_LONG_TOKENS)
            except ImportError:
                logger.warning("tokenizers.%s: transformers is not installed: chat prompts are counted without "
                               "the chat template (it is a dependency of astrolabe: pip install "
                               "'transformers[chat-template]')", model)
            except Exception as exc:  # noqa: BLE001
                logger.warning("tokenizers.%s: chat template not loaded (%s): chat prompts are counted without it",
                               model, exc)

    def count(self, request: RoutingRequest) -> int:
        text = request.prompt_text or ""
        messages = request.chat_messages
        if messages is not None and self.chat is not None:
            try:
                if len(messages) <= MAX_TEMPLATE_MESSAGES and len(text) + sum(
                        len(role) for role, _ in messages) <= MAX_TOKENIZED_CHARS:
                    return max(self._template_tokens(messages), 1)
                return max(self._template_overhead(messages) + self._text_tokens(text, special=False), 1)
            except Exception as exc:  # noqa: BLE001 (a template may raise_exception, e.g. roles must alternate)
                # The engine will refuse such a request itself (400); routing counts the text without the template.
                logger.debug("tokenizers.%s: chat template failed (%s); counting the messages' text", self.model, exc)
        return max(self._text_tokens(text, special=messages is None), 1)

    def token_ids(self, request: RoutingRequest) -> list[int]:
        """Every token id of ``request``'s prompt as its engine sees it (chat: the template rendered and
        tokenized; the messages' text joined when there is no template or it raises, as `count` counts), in full.

        The caller bounds the prompt's size (`PromptTokenCounter.tokens`)."""
        text = request.prompt_text or ""
        messages = request.chat_messages
        if messages is not None and self.chat is not None:
            try:
                return self._template_ids(messages)
            except Exception as exc:  # noqa: BLE001 (as in `count`)
                logger.debug("tokenizers.%s: chat template failed (%s); keying the messages' text", self.model, exc)
        return token_ids(self.tokenizer, text, special=messages is None)

    def _template_overhead(self, messages: tuple[tuple[str, str], ...]) -> int:
        """The template's own tokens for a long chat (over `MAX_TOKENIZED_CHARS` or `MAX_TEMPLATE_MESSAGES`),
        bounded like a long text's count: rendered with empty contents and roles clipped to `MAX_ROLE_CHARS`,
        over at most `MAX_TEMPLATE_MESSAGES` messages and scaled by the messages' count, so that neither a
        megabyte of content, nor a megabyte role, nor 200,000 messages renders in full on the event loop
        (rendering and tokenizing cost about 0.09 ms a message: 18 s for 200,000), tokens."""
        sample = messages[:MAX_TEMPLATE_MESSAGES]
        overhead = self._template_tokens(tuple((role[:MAX_ROLE_CHARS], "") for role, _ in sample))
        return round(overhead * len(messages) / len(sample))

    def _template_tokens(self, messages: tuple[tuple[str, str], ...]) -> int:
        return len(self._template_ids(messages))

    def _template_ids(self, messages: tuple[tuple[str, str], ...]) -> list[int]:
        ids = self.chat.apply_chat_template([{"role": role, "content": content} for role, content in messages],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def _text_tokens(self, text: str, *, special: bool) -> int:
        return extrapolated_tokens(text, lambda t: num_tokens(self.tokenizer, t, special=special))


def _auto_tokenizer() -> type:
    """``transformers.AutoTokenizer``, imported so that transformers logs through this process's logging.

    transformers installs a stderr handler of its own, and without torch it warns at import that models are not
    available (an advisory: only its tokenizers are used here). The advisory is turned off
    (``TRANSFORMERS_NO_ADVISORY_WARNINGS=1`` unless the environment sets it), and transformers' other records
    (WARNING and above, its default level) propagate to the root logger's handler (``astrolabe.logs``: text or
    JSON lines) instead of its own.

    Raises:
        ImportError: transformers is not installed.
    """
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer  # noqa: PLC0415 (loaded only for a model directory with a template)
    from transformers.utils import logging as transformers_logging  # noqa: PLC0415

    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()
    return AutoTokenizer


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """A prompt as routing sees it: its tokens (>= 1) and, with block keys on, the keys of its full KV blocks
    (first block first; None = not computed: keys off, a prompt over ``max_keyed_chars``, token ids out of the
    keys' range)."""

    num_tokens: int
    block_keys: tuple[int, ...] | None = None


class PromptTokenCounter:
    """Counts prompt tokens per served model, and computes the prompt's KV block keys (module docstring).

    Args:
        tokenizers: served model name -> tokenizer file or model directory.
        block_size: tokens per KV block of the keys (the instances' ``--block-size``), >= 1; None = no keys.
        max_keyed_chars: longest prompt tokenized in full for its keys, characters (text and chat roles); also
            the most ids of a token-id prompt that is keyed.
        max_keyed_messages: most chat messages rendered in full for the keys (a template renders ~0.09 ms a
            message); a longer chat gets no keys.

    Raises:
        TokenizerLoadError: a configured tokenizer cannot be loaded.
        ValueError: ``block_size``, ``max_keyed_chars`` or ``max_keyed_messages`` < 1.
    """

    def __init__(self, tokenizers: Mapping[str, str] | None = None, *, block_size: int | None = None,
                 max_keyed_chars: int = DEFAULT_MAX_KEYED_CHARS, max_keyed_messages: int = 1024) -> None:
        if block_size is not None and block_size < 1 or max_keyed_chars < 1 or max_keyed_messages < 1:
            raise ValueError(f"block_size, max_keyed_chars and max_keyed_messages must be >= 1, got {block_size}, "
                             f"{max_keyed_chars}, {max_keyed_messages}")
        self.max_keyed_messages = max_keyed_messages
        self._by_model = {model: _ModelTokenizer(model, path) for model, path in (tokenizers or {}).items()}
        self.block_size = block_size
        self.max_keyed_chars = max_keyed_chars
        self._warned = False
        for model, tokenizer in self._by_model.items():
            logger.info("prompt tokens for model %r: %s (%s)", model, tokenizers[model],
                        "with its chat template" if tokenizer.chat is not None else "no chat template")

    @property
    def models(self) -> tuple[str, ...]:
        """Models with a configured tokenizer."""
        return tuple(self._by_model)

    def count(self, request: RoutingRequest) -> int:
        """Prompt tokens of ``request`` as its model's engine counts them (>= 1)."""
        if request.prompt_token_ids is not None:
            return max(len(request.prompt_token_ids), 1)
        tokenizer = self._by_model.get(request.model or "")
        if tokenizer is None:
            self._warn_unconfigured()
            return count_prompt_tokens(request)
        return tokenizer.count(request)

    def token_ids(self, request: RoutingRequest) -> list[int] | tuple[int, ...] | None:
        """Every token id of ``request``'s prompt, as `count` would count it but in full; None for a prompt over
        ``max_keyed_chars`` (text and chat roles) or without a prompt. A model without a configured tokenizer
        gets the shipped WordPiece's ids (no special tokens, the messages' text joined for a chat)."""
        if request.prompt_token_ids is not None:
            ids = request.prompt_token_ids
            return ids if len(ids) <= self.max_keyed_chars else None
        text = request.prompt_text
        if text is None:
            return None
        messages = request.chat_messages
        if messages is not None and len(messages) > self.max_keyed_messages:
            return None
        if len(text) + (sum(len(role) for role, _ in messages) if messages else 0) > self.max_keyed_chars:
            return None
        tokenizer = self._by_model.get(request.model or "")
        if tokenizer is None:
            self._warn_unconfigured()
            return token_ids(get_tokenizer(), text, special=False)
        return tokenizer.token_ids(request)

    def _warn_unconfigured(self) -> None:
        """The first time a request's model has no configured tokenizer (while some are): one warning."""
        if self._by_model and not self._warned:
            self._warned = True
            logger.warning("a request for a model without a configured tokenizer is counted with the shipped "
                           "WordPiece (configured: %s); this warning is not repeated", ", ".join(self._by_model))

    def tokens(self, request: RoutingRequest) -> PromptTokens:
        """``request``'s prompt tokens and, with ``block_size`` set, its block keys (`PromptTokens`). With keys,
        the count is exact (every token was tokenized) unless the prompt had to go without them."""
        if self.block_size is None or request.num_prompts > 1:  # a join of prompts is no engine request's prompt
            return PromptTokens(self.count(request))
        ids = self.token_ids(request)
        if ids is None:
            return PromptTokens(self.count(request))
        try:
            keys = block_keys(ids, self.block_size)
        except ValueError:  # a token id of 2**32 or more: no engine has such a vocabulary, the engine refuses it
            keys = None
        return PromptTokens(max(len(ids), 1), keys)
