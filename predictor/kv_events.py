"""vLLM's KV cache events: decoding the ZMQ stream, and the exact prefix-cache index it maintains at a sidecar.

Owns `decode_batch` (one msgpack payload -> its events), the event records `BlockStored` / `BlockRemoved` /
`AllBlocksCleared`, `KvEventIndex` (the engine's cached blocks under OUR block keys, with the stream's health) and
`KvEventSubscriber` (a ZMQ SUB socket feeding an index, on the asyncio loop). Imports msgpack, pyzmq and
`predictor.sim.block_hash`.

Source: vllm/distributed/kv_events.py (vLLM 0.32: `EventBatch`, `KVCacheEvent`, `BlockStored`, `BlockRemoved`,
`AllBlocksCleared`, `ZmqEventPublisher.publish`), examples/online_serving/kv_events_subscriber.py. The engine is
started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557"}'``. What goes over the wire:
- a ZMQ multipart message ``(topic, sequence number as 8 bytes big-endian, payload)``; the sequence counts
  batches from 0 in each engine process, so it goes BACK to 0 when the engine restarts;
- the payload is a msgpack array ``[ts, events, data_parallel_rank]`` (``EventBatch``, ``array_like``; trailing
  defaults omitted);
- each event is tagged with its class name, in one of two encodings: a map with a ``"type"`` key
  (``{"type": "BlockStored", "block_hashes": [...], ...}``, vLLM's encoding since mid-2026: msgspec ``tag=True``
  without ``array_like``), or, in earlier releases, a positional array whose first element is the tag
  (``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, ...]``).
  Both are decoded; anything else raises `KvEventDecodeError`.
Block hashes are ints or bytes (sha256 digests, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` unset).

NOTE: keys. vLLM's block hashes are seeded at random per engine process (unless ``PYTHONHASHSEED`` is set), so a
router cannot compute them. The index recomputes OUR keys (`predictor.sim.block_hash.block_keys`, which the router
computes from the request's token ids) from each ``BlockStored``'s token ids and its parent, keeping vLLM's hash
-> our key to resolve later parents and removals: the approach of llm-d's KV-cache indexer. A ``BlockStored``
whose parent the index never saw (events missed) cannot be keyed: it is counted (``orphans``) and skipped. The
first block's extra keys: the event's ``lora_name`` and the string entries of ``extra_keys[0]`` (a
``cache_salt``); multimodal entries are not modelled (such prompts get keys the router's never match: a miss,
never a false hit).

NOTE: health. ``exact`` is True while the index has seen every batch since the engine started: it becomes False
on an undecodable payload or event, a gap in the sequence, a batch numbered at or below the last one but not 0
(replayed or reordered), an orphan block, more blocks than ``max_blocks`` (removals lost) or a subscription that
joined after the engine's first batch (vLLM's replay socket is not used), and True again after
``AllBlocksCleared`` or an engine restart (the sequence back to 0: the cache is empty, the index restarts empty).
Every such event is counted. Known limit: after a late join, blocks chained to a prefix stored before it are
orphans until that prefix is stored again (a prefix that stays hot is never re-stored).
Events for other media (``medium`` not ``"GPU"``/None: CPU offload tiers) and other KV cache groups (``group_idx``
not 0/None, hybrid models) are counted and ignored.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from predictor.sim.block_hash import block_key

logger = logging.getLogger(__name__)

GPU_MEDIA = (None, "GPU")
"""``medium`` values of blocks in the engine's GPU KV cache (vLLM ``MEDIUM_GPU``; None before media existed)."""

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx")
"""``BlockStored``'s fields in declaration order (vllm/distributed/kv_events.py): the positional encoding's order."""

_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class KvEventDecodeError(ValueError):
    """A payload or event that is not a vLLM KV event batch (message says what is wrong)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks the engine cached: ``block_hashes[i]`` covers ``token_ids[i * block_size:(i + 1) * block_size]``,
    the first one chained to ``parent_block_hash`` (None: the prompt's first block)."""

    block_hashes: tuple[Hashable, ...]
    parent_block_hash: Hashable | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted."""

    block_hashes: tuple[Hashable, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (``reset_prefix_cache``)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _hash_value(value: Any) -> Hashable:
    if isinstance(value, (bytes, int)) and not isinstance(value, bool):
        return value
    raise KvEventDecodeError(f"a block hash must be an int or bytes, got {type(value).__name__}")


def _hashes(value: Any) -> tuple[Hashable, ...]:
    if not isinstance(value, (list, tuple)):
        raise KvEventDecodeError(f"block_hashes must be an array, got {type(value).__name__}")
    return tuple(_hash_value(v) for v in value)


def _fields(raw: Any, names: Sequence[str], tag: str) -> dict[str, Any]:
    """The event's fields by name, from either encoding (the tag already read)."""
    if isinstance(raw, dict):
        return {name: raw.get(name) for name in names}
    values = list(raw[1:])
    if len(values) > len(names):
        raise KvEventDecodeError(f"{tag} has {len(values)} positional fields, at most {len(names)} known")
    return dict(zip(names, values + [None] * (len(names) - len(values))))


def decode_event(raw: Any) -> KvEvent:
    """One decoded msgpack event (a map with ``"type"`` or an array tagged by its first element) as a record.

    Raises:
        KvEventDecodeError: not a map or array, an unknown tag, or fields of the wrong type.
    """
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, (list, tuple)) and raw:
        tag = raw[0]
    else:
        raise KvEventDecodeError(f"an event must be a map with 'type' or a tagged array, got {type(raw).__name__}")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS, tag)
        return BlockRemoved(_hashes(f["block_hashes"]), f["medium"], f["group_idx"])
    if tag != "BlockStored":
        raise KvEventDecodeError(f"unknown event type {tag!r}")
    f = _fields(raw, _STORED_FIELDS, tag)
    token_ids, block_size = f["token_ids"], f["block_size"]
    if not isinstance(token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 32 for t in token_ids):
        raise KvEventDecodeError("BlockStored.token_ids must be an array of ints in [0, 2**32)")
    if not isinstance(block_size, int) or block_size < 1:
        raise KvEventDecodeError(f"BlockStored.block_size must be an int >= 1, got {block_size!r}")
    hashes = _hashes(f["block_hashes"])
    if len(token_ids) != len(hashes) * block_size:
        raise KvEventDecodeError(f"BlockStored: {len(token_ids)} token ids for {len(hashes)} blocks of {block_size}")
    parent = f["parent_block_hash"]
    extra = f["extra_keys"]
    return BlockStored(hashes, None if parent is None else _hash_value(parent), tuple(token_ids), block_size,
                       f["lora_name"] if isinstance(f["lora_name"], str) else None, f["medium"],
                       tuple(extra) if isinstance(extra, (list, tuple)) else None, f["group_idx"])


def decode_batch(payload: bytes) -> tuple[float, list[KvEvent]]:
    """A ZMQ payload (msgpack ``[ts, events, data_parallel_rank]``) as (ts seconds, events in order).

    Raises:
        KvEventDecodeError: not msgpack, not such an array, or an undecodable event (the whole batch is refused:
            applying part of it would leave the index inconsistent).
    """
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types (ExtraData, FormatError, ValueError, ...)
        raise KvEventDecodeError(f"payload is not msgpack: {exc}") from None
    if not isinstance(batch, (list, tuple)) or len(batch) < 2 or not isinstance(batch[1], (list, tuple)):
        raise KvEventDecodeError("payload is not an event batch [ts, events, ...]")
    ts = batch[0]
    if not isinstance(ts, (int, float)):
        raise KvEventDecodeError(f"batch ts must be a number, got {type(ts).__name__}")
    return float(ts), [decode_event(e) for e in batch[1]]


@dataclass(slots=True)
class KvEventCounts:
    """What an index has seen (counters since it was made)."""

    batches: int = 0
    events: int = 0
    undecodable: int = 0
    gaps: int = 0
    missed_batches: int = 0
    restarts: int = 0
    orphans: int = 0
    cleared: int = 0
    ignored: int = 0
    late_join: int = 0
    reordered: int = 0
    overflow: int = 0
    subscriber_failures: int = 0


@dataclass(slots=True)
class KvEventIndex:
    """The engine's cached KV blocks under our keys (`predictor.sim.block_hash`), from its KV events.

    Args:
        block_size: the engine's block size, tokens (a ``BlockStored`` with another is an error: counted as
            undecodable).
        max_blocks: blocks kept at most (lost ``BlockRemoved`` events would grow it without bound): past it the
            least recently stored are forgotten (counted as ``overflow``); give the engine's ``num_gpu_blocks``.

    Attributes:
        exact: whether every batch since the engine's start was applied (module NOTE on health).
        counts: `KvEventCounts`.
    """

    block_size: int
    max_blocks: int = 1 << 20
    exact: bool = True
    counts: KvEventCounts = field(default_factory=KvEventCounts)
    _ours: dict[Hashable, int] = field(default_factory=dict)   # vLLM hash -> our key
    _keys: OrderedDict[int, int] = field(default_factory=OrderedDict)  # our key -> copies, oldest stored first
    _depth: dict[int, int] = field(default_factory=dict)  # our key -> its block's index in its chain (0: first)
    _last_seq: int | None = None
    last_message_s: float | None = None  # time.monotonic() of the last message, None: none yet
    version: int = 0  # changes whenever the index does
    _order: tuple[tuple[int, int], tuple[int, ...]] | None = None  # ((version, n), keys_in_eviction_order)

    @property
    def num_blocks(self) -> int:
        """Cached blocks the index knows (distinct keys)."""
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def keys_in_storage_order(self) -> tuple[int, ...]:
        """Our keys, least recently stored first."""
        return tuple(self._keys)

    def keys_in_eviction_order(self, num_blocks: int | None = None) -> tuple[int, ...]:
        """The ``num_blocks`` most recently stored keys (None: all) in the order
        `InstanceSnapshot.cached_block_keys` wants them: deeper blocks of a chain first (vLLM frees a request's
        blocks in reverse, so a chain's tail is evicted before its head, and a snapshot's cached keys must name
        every block before its parent), then least recently stored first. Cached until the index changes:
        O(n log n) in the blocks asked for once per change, O(1) after."""
        n = len(self._keys) if num_blocks is None else max(min(num_blocks, len(self._keys)), 0)
        if self._order is not None and self._order[0] == (self.version, n):
            return self._order[1]
        newest = list(itertools.islice(reversed(self._keys), n))
        newest.reverse()
        depth = self._depth
        order = tuple(sorted(newest, key=lambda key: -depth.get(key, 0)))
        self._order = ((self.version, n), order)
        return order

    def num_prefix_blocks(self, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` (a request's chain) the index holds."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def clear(self) -> None:
        """Forget every block (the engine's cache is empty)."""
        self._ours.clear()
        self._keys.clear()
        self._depth.clear()
        self.version += 1

    def on_message(self, seq: int, payload: bytes) -> None:
        """Applies one ZMQ message (its sequence number and payload); never raises for bad input (counted)."""
        self.last_message_s = time.monotonic()
        last = self._last_seq
        if last is None:
            if seq != 0:
                self.counts.late_join += 1
                self.exact = False
        elif seq == 0:
            self.counts.restarts += 1
            logger.warning("KV event sequence went back from %d to 0: the engine restarted, its cache index is reset",
                           last)
            self.clear()
            self.exact = True
        elif seq <= last:  # a replayed or reordered batch (vLLM numbers each batch once per engine process)
            self.counts.reordered += 1
            self.exact = False
        elif seq > last + 1:
            self.counts.gaps += 1
            self.counts.missed_batches += seq - last - 1
            self.exact = False
        self._last_seq = seq
        try:
            _, events = decode_batch(payload)
        except KvEventDecodeError as exc:
            self.counts.undecodable += 1
            self.exact = False
            logger.warning("undecodable KV event batch %d (%s): the cache index is now approximate", seq, exc)
            return
        self.counts.batches += 1
        for event in events:
            try:
                self.apply(event)
            except Exception as exc:  # noqa: BLE001 (no input may stop the index; decode checks what it can)
                self.counts.undecodable += 1
                self.exact = False
                logger.warning("KV event of batch %d not applied (%s: %s)", seq, type(exc).__name__, exc)

    def apply(self, event: KvEvent) -> None:
        """Applies one decoded event."""
        counts = self.counts
        counts.events += 1
        self.version += 1
        if isinstance(event, AllBlocksCleared):
            counts.cleared += 1
            self.clear()
            self.exact = True
            return
        if event.medium not in GPU_MEDIA or event.group_idx not in (None, 0):
            counts.ignored += 1
            return
        if isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                key = self._ours.get(h)
                if key is None:
                    continue
                copies = self._keys.get(key, 0) - 1
                if copies > 0:
                    self._keys[key] = copies
                else:
                    self._keys.pop(key, None)
                    self._depth.pop(key, None)
                    del self._ours[h]
            return
        if event.block_size != self.block_size:
            counts.undecodable += 1
            self.exact = False
            logger.warning("KV event for block size %d, the index's is %d: ignored", event.block_size, self.block_size)
            return
        if event.parent_block_hash is None:
            parent, depth = None, 0
        else:
            parent = self._ours.get(event.parent_block_hash)
            if parent is None:
                counts.orphans += 1
                self.exact = False
                return
            depth = self._depth.get(parent, 0) + 1
        extra: list[str] = []
        if parent is None:
            if event.lora_name:
                extra.append(event.lora_name)
            first = event.extra_keys[0] if event.extra_keys else None
            if isinstance(first, (list, tuple)):
                extra.extend(v for v in first if isinstance(v, str) and v != event.lora_name)
        bs = event.block_size
        tokens = event.token_ids
        for i, h in enumerate(event.block_hashes):
            key = block_key(parent, tokens[i * bs:(i + 1) * bs], extra if parent is None else ())
            # vLLM's cache does not deduplicate: two blocks with one hash are two copies, each removed on its own
            self._ours[h] = key
            self._keys[key] = self._keys.get(key, 0) + 1
            self._keys.move_to_end(key)
            self._depth[key] = depth
            depth += 1
            parent = key
        while len(self._keys) > self.max_blocks:  # BlockRemoved events lost: forget the oldest stored
            old, _ = self._keys.popitem(last=False)
            self._depth.pop(old, None)
            counts.overflow += 1
            self.exact = False
        if len(self._ours) > 2 * self.max_blocks:
            live = self._keys
            self._ours = {h: k for h, k in self._ours.items() if k in live}


class KvEventSubscriber:
    """Subscribes to one engine's KV events (ZMQ SUB) and applies them to a `KvEventIndex`.

    Args:
        endpoint: the publisher's ZMQ endpoint, e.g. ``tcp://10.0.0.5:5557``. vLLM BINDS only an endpoint with a
            wildcard (``tcp://*:5557``, its documented default) or an ipc/inproc one and CONNECTS to any other
            (``ZmqEventPublisher._is_bind_endpoint``), so configure the engine with ``tcp://*:PORT`` and give the
            subscriber the engine's address and PORT.
        index: the index to feed.
        topic: the publisher's topic (vLLM's ``kv_events_config.topic``, default "").

    A message that is not three frames, or whose sequence frame is not 8 bytes, is counted as undecodable.
    `run` returns only when cancelled; it closes its socket then.
    """

    def __init__(self, endpoint: str, index: KvEventIndex, topic: str = "") -> None:
        self.endpoint = endpoint
        self.index = index
        self.topic = topic.encode("utf-8")

    async def run(self) -> None:
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context.instance()
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, self.topic)
        socket.connect(self.endpoint)
        logger.info("subscribed to KV events at %s", self.endpoint)
        try:
            while True:
                frames = await socket.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.index.counts.undecodable += 1
                    self.index.exact = False
                    logger.warning("KV event message of %d frames ignored (want topic, 8-byte sequence, payload)",
                                   len(frames))
                    continue
                self.index.on_message(int.from_bytes(frames[1], "big"), frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:
            self.index.counts.subscriber_failures += 1
            self.index.exact = False
            logger.exception("KV event subscriber at %s stopped", self.endpoint)
            raise
        finally:
            socket.close(linger=0)
