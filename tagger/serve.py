"""In-process serving of the length tagger: loading, batching, caching, capping by ``max_tokens``.

Owns: :func:`load_tagger` (a tagger directory, or the shipped light tagger when none is configured) and
:class:`TaggerService`, which the extproc awaits once per request. Imports numpy and ``tagger`` modules that
do not need torch; torch is imported only when a transformer tagger directory is loaded.

NOTE: a transformer never runs on the event loop. Requests that arrive within ``max_batch_delay_s`` of each other
(or until ``max_batch_size`` are waiting) form one batch, run by a single worker thread, so concurrent requests
share one forward pass and batches never compete with each other for the CPU. The light tagger is cheaper than
that hand-off: ~0.3 ms per prompt of a few hundred words, measured, against a 1 ms batching window plus two
thread switches (which, under the GIL, buy no parallelism); so prompts of at most ``inline_max_chars``
characters are tagged inline, on the caller's thread (``load_service`` enables it for the light tagger), and
longer ones still go through the worker. Predictions are cached by the
SHA-256 of the prompt text and its conversation's sizes (``HistoryStats``; bounded LRU) before the ``max_tokens``
cap is applied. Estimation never raises on
the request path: a prompt without text falls back to a line on the prompt's token count, and a model failure
is logged and falls back the same way.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hashlib
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tagger.artifact import MODEL_SUBDIR, LengthTagger, TaggerLoadError, read_meta
from tagger.features import NO_HISTORY, HistoryStats

logger = logging.getLogger(__name__)

SHIPPED_LIGHT_DIR = Path(__file__).resolve().parent / "weights" / "light"
"""The light tagger trained on the full training split and committed to the repository (~1 MiB)."""

DEFAULT_MAX_BATCH_SIZE = 16
DEFAULT_MAX_BATCH_DELAY_S = 0.001
DEFAULT_CACHE_SIZE = 4096
LIGHT_INLINE_MAX_CHARS = 8192
"""Longest prompt the light tagger tags inline, characters (~1,500 words: about 1 ms of hashing)."""
_FALLBACK_LOG1P = math.log1p(250)  # ~ the ShareGPT median reply, used only if a directory lacks its fallback line


@dataclasses.dataclass(frozen=True, slots=True)
class LengthFallback:
    """``log1p(output tokens) = intercept + slope * log1p(prompt tokens)``: used when there is no prompt text.

    Fitted on the training split (the prompt-length baseline of ``tagger.evaluate``) and stored in
    ``tagger.json`` as ``length_fallback``.
    """

    slope: float = 0.0
    intercept: float = _FALLBACK_LOG1P

    def predict_log1p(self, num_prompt_tokens: int) -> float:
        return self.intercept + self.slope * math.log1p(max(0, num_prompt_tokens))


def load_tagger(path: Path | str | None = None) -> LengthTagger:
    """Load a trained tagger; None means the shipped light tagger (:data:`SHIPPED_LIGHT_DIR`).

    Args:
        path: a tagger directory written by ``astrolabe tagger train``, or None.

    Returns:
        A :class:`tagger.light.LightTagger` or :class:`tagger.model.TransformerTagger`.

    Raises:
        TaggerLoadError: missing or malformed directory, or a transformer tagger without torch/transformers
            installed (``make install-tagger``).
    """
    directory = SHIPPED_LIGHT_DIR if path is None else Path(path)
    meta = read_meta(directory)
    if meta["kind"] == "light":
        from tagger.light import LightTagger

        return LightTagger.load(directory)
    if not (directory / MODEL_SUBDIR).is_dir():
        raise TaggerLoadError(f"{directory} is a transformer tagger without its weights ({MODEL_SUBDIR}/ is missing): "
                              "they are not committed; tagger/README.md, 'Weights', says how to rebuild them")
    try:
        from tagger.model import TransformerTagger
    except ImportError as exc:
        raise TaggerLoadError(f"{directory} is a transformer tagger but {exc}; run `make install-tagger`") from exc
    try:
        return TransformerTagger.load(directory, meta)
    except (OSError, KeyError, ValueError) as exc:
        raise TaggerLoadError(f"cannot load transformer tagger {directory}: {exc}") from exc


def load_length_fallback(path: Path | str | None = None) -> LengthFallback:
    """The ``length_fallback`` line stored in a tagger directory (default line if absent).

    Raises:
        TaggerLoadError: the directory's metadata cannot be read.
    """
    meta = read_meta(SHIPPED_LIGHT_DIR if path is None else Path(path))
    line = meta.get("length_fallback") or {}
    return LengthFallback(float(line.get("slope", 0.0)), float(line.get("intercept", _FALLBACK_LOG1P)))


def prompt_key(prompt_text: str, history: HistoryStats = NO_HISTORY) -> bytes:
    """Cache key of a prompt in its conversation: SHA-256 digest of its UTF-8 text and, for a later turn, the
    history's sizes (32 bytes)."""
    digest = hashlib.sha256(prompt_text.encode("utf-8", "surrogatepass"))
    if history != NO_HISTORY:
        digest.update(repr(dataclasses.astuple(history)).encode())
    return digest.digest()


def cap_tokens(log1p_value: float, max_tokens: int | None) -> int:
    """Predicted tokens (>= 1) from a ``log1p`` prediction, capped by ``max_tokens`` when it is >= 1."""
    tokens = max(1, int(round(math.expm1(min(log1p_value, 20.0)))))
    return min(tokens, max_tokens) if max_tokens is not None and max_tokens >= 1 else tokens


class TaggerService:
    """Async front of one tagger: batched, cached, off the event loop.

    Args:
        tagger: the model.
        length_fallback: line used when a request has no prompt text or the model fails.
        max_batch_size: most prompts per forward pass (>= 1).
        max_batch_delay_s: longest a prompt waits for others to join its batch, seconds (>= 0).
        cache_size: most cached prompts (LRU; 0 disables the cache).
        inline_max_chars: prompts up to this many characters are tagged on the caller's thread, without batching
            (0 = never; for cheap models only).

    Raises:
        ValueError: a bound is out of range.
    """

    def __init__(self, tagger: LengthTagger, *, length_fallback: LengthFallback | None = None,
                 max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, max_batch_delay_s: float = DEFAULT_MAX_BATCH_DELAY_S,
                 cache_size: int = DEFAULT_CACHE_SIZE, inline_max_chars: int = 0) -> None:
        if max_batch_size < 1 or max_batch_delay_s < 0 or cache_size < 0 or inline_max_chars < 0:
            raise ValueError("need max_batch_size >= 1, max_batch_delay_s >= 0, cache_size >= 0, "
                             "inline_max_chars >= 0")
        self.inline_max_chars = inline_max_chars
        self.num_inline = 0
        self.tagger = tagger
        self.length_fallback = length_fallback or LengthFallback()
        self.max_batch_size = max_batch_size
        self.max_batch_delay_s = max_batch_delay_s
        self.cache_size = cache_size
        self._cache: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._pending: list[tuple[bytes, str, HistoryStats]] = []
        self._inflight: dict[bytes, asyncio.Future[float]] = {}
        self._flush_handle: asyncio.TimerHandle | None = None
        # One worker: batches run one after another, and the next batch fills up meanwhile.
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tagger")
        self.num_batches = 0
        self.num_cache_hits = 0

    @property
    def kind(self) -> str:
        return self.tagger.kind

    async def estimate(self, prompt_text: str | None, prompt_token_ids: Sequence[int] | None = None,
                       max_tokens: int | None = None, history: HistoryStats = NO_HISTORY) -> int:
        """Predicted output tokens of one request, capped by ``max_tokens``.

        Args:
            prompt_text: the prompt (for chat requests, the last user message); None if only token ids are known.
            prompt_token_ids: prompt token ids (any tokenizer; only their count is used, and only without text).
            max_tokens: the request's ``max_tokens``; None or < 1 means no cap.
            history: a chat request's messages before its last user message (sizes only).

        Returns:
            Predicted output tokens, >= 1 and <= ``max_tokens`` when it is >= 1. Never raises for model errors.
        """
        if not prompt_text:
            num_prompt_tokens = len(prompt_token_ids) if prompt_token_ids is not None else 0
            return cap_tokens(self.length_fallback.predict_log1p(num_prompt_tokens), max_tokens)
        key = prompt_key(prompt_text, history)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
            return cap_tokens(cached, max_tokens)
        if len(prompt_text) <= self.inline_max_chars and key not in self._inflight:
            try:
                value = float(self.tagger.predict_log1p([prompt_text], [history])[0])
            except Exception:  # noqa: BLE001 - the request path must not fail because of the tagger
                logger.warning("tagger failed; using the prompt-length fallback", exc_info=True)
                return cap_tokens(self.length_fallback.predict_log1p(
                    len(prompt_token_ids) if prompt_token_ids else 0), max_tokens)
            self.num_inline += 1
            self._store(key, value)
            return cap_tokens(value, max_tokens)
        future = self._inflight.get(key)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._inflight[key] = future
            self._pending.append((key, prompt_text, history))
            self._schedule_flush()
        try:
            value = await asyncio.shield(future)
        except Exception:  # noqa: BLE001 - the request path must not fail because of the tagger
            logger.warning("tagger failed; using the prompt-length fallback", exc_info=True)
            value = self.length_fallback.predict_log1p(len(prompt_token_ids) if prompt_token_ids else 0)
        return cap_tokens(value, max_tokens)

    def _schedule_flush(self) -> None:
        if len(self._pending) >= self.max_batch_size:
            if self._flush_handle is not None:
                self._flush_handle.cancel()
                self._flush_handle = None
            self._flush()
        elif self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(self.max_batch_delay_s, self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        batch, self._pending = self._pending, []
        if batch:
            asyncio.get_running_loop().create_task(self._run_batch(batch))

    async def _run_batch(self, batch: list[tuple[bytes, str, HistoryStats]]) -> None:
        keys = [k for k, _, _ in batch]
        try:
            values = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.tagger.predict_log1p, [t for _, t, _ in batch], [h for _, _, h in batch]
            )
            self.num_batches += 1
        except Exception as exc:  # noqa: BLE001 - handed to every waiter instead
            for key in keys:
                self._resolve(key, exc=exc)
            return
        for key, value in zip(keys, np.asarray(values, dtype=np.float64).tolist()):
            self._store(key, value)
            self._resolve(key, value=value)

    def _resolve(self, key: bytes, *, value: float | None = None, exc: BaseException | None = None) -> None:
        future = self._inflight.pop(key, None)
        if future is None or future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(value)

    def _store(self, key: bytes, value: float) -> None:
        if self.cache_size == 0:
            return
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def close(self) -> None:
        """Stop the worker thread (waits for a running batch)."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        self._executor.shutdown(wait=True)


def load_service(path: Path | str | None = None, **kwargs) -> TaggerService:
    """A :class:`TaggerService` over :func:`load_tagger` ``(path)`` and its length fallback.

    Args:
        path: tagger directory, or None for the shipped light tagger.
        **kwargs: :class:`TaggerService` bounds (``max_batch_size``, ``max_batch_delay_s``, ``cache_size``,
            ``inline_max_chars``: default `LIGHT_INLINE_MAX_CHARS` for the light tagger, 0 for others).

    Raises:
        TaggerLoadError: see :func:`load_tagger`.
    """
    tagger = load_tagger(path)
    kwargs.setdefault("inline_max_chars", LIGHT_INLINE_MAX_CHARS if tagger.kind == "light" else 0)
    return TaggerService(tagger, length_fallback=load_length_fallback(path), **kwargs)
