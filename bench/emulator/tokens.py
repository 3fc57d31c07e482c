"""Token ids of the emulator's prompts and replies, and the block keys its prefix cache is looked up with.

Owns `prompt_token_ids` (text -> ids with the shipped tokenizer, as the tiny vLLM model of ``make install-vllm``
tokenizes: `tagger.tokenizer`, no special tokens), `Reply` (a request's output tokens and their text),
`reply_token_ids` / `reply_text` (the deterministic words a reply is made of) and `request_block_keys`. Imports no
aiohttp and no ``predictor.sim`` scheduler.

Replies. A request's reply is a sequence of whole-word tokens drawn from `reply_vocabulary` by a generator seeded
with a hash of the prompt's token ids, so the same prompt always gets the same reply (as greedy decoding does)
and two prompts rarely get the same one. The reply's text is those words, each after a space; tokenizing it gives
back exactly the reply's ids (the shipped WordPiece splits on spaces and every word is one vocabulary entry;
`tests/bench/emulator/test_tokens.py` checks the round trip). So a next chat turn that sends the reply back as the
assistant message ("assistant: <reply>" in the chat template) has, as its prompt, the previous prompt, the reply's
ids and the new message's: it hits the previous turn's blocks, reply included, as it would on vLLM.

Recorded replies. A replay of recorded conversations (ShareGPT) resends the *recorded* replies in later turns, not
the emulator's words; a request may then name its recorded reply (`RecordedReply`, the request field
``emulator_reply_text``): the reply is that text's tokens, token for token (then generated words if it must run
longer), and its text is the recorded text cut at token boundaries, so the next turn hits the reply's blocks too.

Block keys. `predictor.sim.block_hash.block_keys` over the prompt's ids followed by the reply's (full blocks
only): the scheduler caches a request's blocks as their tokens are computed, so a block that holds reply tokens
is cached once the engine has computed them (never the last sampled token's, which is not computed), as vLLM
caches generated tokens' blocks (vllm/v1/core/kv_cache_manager.py ``allocate_slots`` -> ``cache_blocks``).
"""

from __future__ import annotations

import functools
import random
import re
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from predictor.sim.block_hash import block_keys
from tagger.tokenizer import get_tokenizer

REPLY_VOCABULARY_SIZE = 1024
"""Words a reply is drawn from: the shipped vocabulary's first `REPLY_VOCABULARY_SIZE` lowercase whole words
(the most frequent English words come first in BERT's vocabulary: "the", "of", "and", ...)."""

PAD_TOKEN_ID = 0
"""The id an empty prompt is given (the shipped vocabulary's ``[PAD]``): an engine request has at least one
token, as a real tokenizer's BOS gives every prompt."""

MAX_TOKEN_ID = (1 << 32) - 1
"""Largest token id a prompt may carry (block keys hash ids as 32-bit values)."""


def prompt_token_ids(text: str) -> list[int]:
    """The ids of ``text`` under the shipped tokenizer without special tokens; ``[PAD_TOKEN_ID]`` for a text with
    no tokens.

    Raises:
        ValueError: a text the tokenizer cannot encode (e.g. a lone surrogate, which JSON escapes can write).
    """
    try:
        ids = get_tokenizer().encode_batch_fast([text], add_special_tokens=False)[0].ids
    except Exception as exc:  # noqa: BLE001 (tokenizers raises plain Exception subclasses)
        raise ValueError(f"cannot tokenize the prompt: {exc}") from None
    return list(ids) or [PAD_TOKEN_ID]


@functools.cache
def reply_vocabulary() -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(ids, words) of the words replies are made of: shipped-vocabulary entries of two or more lowercase ASCII
    letters, lowest ids first, each kept only if ``" " + word`` tokenizes to its own id alone; at most
    `REPLY_VOCABULARY_SIZE`.

    Raises:
        RuntimeError: the tokenizer has no such words (not the shipped WordPiece).
    """
    tokenizer = get_tokenizer()
    candidates = sorted((token_id, word) for word, token_id in tokenizer.get_vocab().items()
                        if re.fullmatch("[a-z]{2,}", word))[:2 * REPLY_VOCABULARY_SIZE]
    encoded = tokenizer.encode_batch_fast([" " + word for _, word in candidates], add_special_tokens=False)
    kept = [(token_id, word) for (token_id, word), enc in zip(candidates, encoded) if enc.ids == [token_id]]
    kept = kept[:REPLY_VOCABULARY_SIZE]
    if not kept:
        raise RuntimeError("the tokenizer has no whole-word tokens to write replies with")
    return tuple(token_id for token_id, _ in kept), tuple(word for _, word in kept)


def reply_token_ids(prompt_ids: Sequence[int], num_tokens: int) -> list[int]:
    """The ``num_tokens`` output token ids of a request whose prompt is ``prompt_ids`` (deterministic: a function
    of the prompt's ids and the length only; a shorter reply of the same prompt is a prefix of a longer one)."""
    ids, _ = reply_vocabulary()
    rng = random.Random(zlib.crc32(array("Q", prompt_ids).tobytes()))
    return rng.choices(ids, k=num_tokens)


@functools.cache
def _word_of() -> dict[int, str]:
    ids, words = reply_vocabulary()
    return dict(zip(ids, words))


def reply_text(token_ids: Sequence[int]) -> str:
    """The text of reply tokens (each word after a space); tokenizing it gives ``token_ids`` back, and the text of
    a reply is the concatenation of the texts of its consecutive pieces (streaming).

    Raises:
        KeyError: an id that is not a reply word (not from `reply_token_ids`).
    """
    word_of = _word_of()
    return "".join(" " + word_of[token_id] for token_id in token_ids)


@dataclass(frozen=True, slots=True)
class RecordedReply:
    """A reply the emulator must generate token for token: its text, its token ids and, per token, where its text
    starts (``cuts[i]``, with ``cuts[0] = 0`` and ``cuts[-1] = len(text)``: tokens ``[a, b)`` are
    ``text[cuts[a]:cuts[b]]``, whitespace included)."""

    text: str
    token_ids: tuple[int, ...]
    cuts: tuple[int, ...]

    @classmethod
    def of(cls, text: str) -> RecordedReply:
        """Tokenizes ``text`` (shipped tokenizer, no special tokens).

        Raises:
            ValueError: a text the tokenizer cannot encode.
        """
        try:
            encoding = get_tokenizer().encode(text, add_special_tokens=False)
        except Exception as exc:  # noqa: BLE001 (tokenizers raises plain Exception subclasses)
            raise ValueError(f"cannot tokenize the reply: {exc}") from None
        starts = [start for start, _ in encoding.offsets]
        return cls(text, tuple(encoding.ids), (0, *starts[1:], len(text)) if starts else (0,))


class Reply:
    """The output tokens of one request and their text.

    Args:
        prompt_ids: the request's prompt token ids (they seed the generated words).
        num_tokens: output tokens, >= 0.
        recorded: a reply to generate first, token for token (`RecordedReply`); None = generated words only.
    """

    __slots__ = ("token_ids", "_recorded", "_num_recorded")

    def __init__(self, prompt_ids: Sequence[int], num_tokens: int, recorded: RecordedReply | None = None) -> None:
        recorded_ids = recorded.token_ids[:num_tokens] if recorded is not None else ()
        self._recorded = recorded
        self._num_recorded = len(recorded_ids)
        self.token_ids: list[int] = [*recorded_ids, *reply_token_ids([*prompt_ids, *recorded_ids],
                                                                     num_tokens - len(recorded_ids))]

    def text(self, start: int, end: int) -> str:
        """The text of output tokens ``[start, end)``; consecutive pieces concatenate to the text of their union."""
        split = min(max(start, self._num_recorded), end)
        head = ""
        if start < split:
            cuts = self._recorded.cuts
            head = self._recorded.text[cuts[start]:cuts[split]]
        return head + reply_text(self.token_ids[split:end])


def request_block_keys(prompt_ids: Sequence[int], output_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Keys of the full blocks of the prompt's ids followed by the reply's (`predictor.sim.block_hash.block_keys`),
    first block first."""
    return block_keys([*prompt_ids, *output_ids], block_size)
