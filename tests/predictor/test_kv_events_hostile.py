"""Hostile KV event batches at the sidecar's index: each is counted as a problem (the index turns approximate), and
the next well-formed batch still applies (the stream is never given up on)."""

from __future__ import annotations

import msgpack
import pytest

from predictor.kv_events import KvEventIndex

BS = 4


def _stored(hashes, parent, tokens, **extra) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, **extra}


def _batch(*events) -> bytes:
    return msgpack.packb([1.0, list(events), 0])


HOSTILE = {
    "garbage": b"\xc1\xc1 not msgpack",
    "empty": b"",
    "truncated": _batch(_stored([1], None, [1, 2, 3, 4]))[:-3],
    "deep nesting": b"\x91" * 100_000 + b"\xc0",
    "extension type": msgpack.packb(msgpack.ExtType(5, b"xx")),
    "a map, not a batch": msgpack.packb({1: 2}),
    "ts a string": msgpack.packb(["now", [], 0]),
    "hash a float": _batch(_stored([1.5], None, [1, 2, 3, 4])),
    "hash a list": _batch({"type": "BlockRemoved", "block_hashes": [[1]]}),
    "parent a list": _batch(_stored([9], [1], [1, 2, 3, 4])),
    "type a list": _batch({"type": [1]}),
    "tag a map": _batch([{"a": 1}]),
    "too many positional fields": _batch(["BlockStored", *[None] * 20]),
    "tokens not ints": _batch(_stored([9], None, ["a", "b", "c", "d"])),
    "block size 0": _batch(_stored([], None, [], block_size=0)),
}


@pytest.mark.parametrize("payload", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_batch_is_counted_and_the_next_batch_still_applies(payload):
    index = KvEventIndex(BS)
    index.on_message(0, _batch(_stored([1], None, [1, 2, 3, 4])))
    index.on_message(1, payload)
    assert index.counts.undecodable == 1 and not index.exact
    assert index.num_blocks == 1  # nothing of the hostile batch applied
    index.on_message(2, _batch(_stored([2], 1, [5, 6, 7, 8])))
    assert index.num_blocks == 2 and index.counts.batches == 2


def test_a_block_stored_at_another_block_size_is_counted_not_indexed():
    index = KvEventIndex(BS)
    index.on_message(0, _batch(_stored([1], None, [1] * 8, block_size=8)))
    assert index.num_blocks == 0 and index.counts.undecodable == 1 and not index.exact
