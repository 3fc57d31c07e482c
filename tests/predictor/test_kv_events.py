"""vLLM KV cache events: both encodings decoded, the index under our keys, the stream's health, a real ZMQ socket."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq
import zmq.asyncio

from predictor.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventDecodeError,
    KvEventIndex,
    KvEventSubscriber,
    decode_batch,
)
from predictor.sim.block_hash import block_keys

BS = 4


def stored_map(hashes, parent, tokens, **extra):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", **extra}


def stored_array(hashes, parent, tokens):
    # vLLM before the map encoding: msgspec array_like + tag, trailing defaults omitted
    return ["BlockStored", hashes, parent, tokens, BS, None, "GPU"]


def payload(*events, ts=1.0):
    return msgpack.packb([ts, list(events), 0])


TOKENS = list(range(100, 112))  # three blocks of 4


@pytest.mark.parametrize("encode", [stored_map, stored_array])
def test_both_encodings_decode_to_the_same_event(encode):
    _, events = decode_batch(payload(encode([11, 12], None, TOKENS[:8])))
    assert events == [BlockStored((11, 12), None, tuple(TOKENS[:8]), BS, None, "GPU")]


def test_removed_and_cleared_in_both_encodings():
    _, events = decode_batch(payload({"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"},
                                      ["BlockRemoved", [7]], {"type": "AllBlocksCleared"}, ["AllBlocksCleared"]))
    assert events == [BlockRemoved((b"\x01" * 32,), "GPU"), BlockRemoved((7,)), AllBlocksCleared(),
                      AllBlocksCleared()]


@pytest.mark.parametrize("bad", [
    b"\xc1not msgpack",
    msgpack.packb({"ts": 1}),
    msgpack.packb([1.0, [{"type": "BlockMoved"}]]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                          "token_ids": [1, 2], "block_size": BS}]]),  # 2 tokens for one block of 4
    msgpack.packb([1.0, [["BlockStored", [1.5], None, [1, 2, 3, 4], BS]]]),  # a float hash
    msgpack.packb([1.0, [42]]),
])
def test_undecodable_payloads_raise_a_decode_error(bad):
    with pytest.raises(KvEventDecodeError):
        decode_batch(bad)


def test_index_keys_equal_the_routers_keys_from_the_same_tokens():
    index = KvEventIndex(BS)
    index.on_message(0, payload(stored_map([b"h1", b"h2"], None, TOKENS[:8])))
    index.on_message(1, payload(stored_array([b"h3"], b"h2", TOKENS[8:12])))
    ours = block_keys(TOKENS, BS)
    assert index.keys_in_storage_order() == ours
    assert index.num_prefix_blocks(ours) == 3
    assert index.num_prefix_blocks(block_keys(TOKENS[:4] + [0] * 8, BS)) == 1
    assert index.exact and index.counts.batches == 2 and index.counts.events == 2


def test_lora_name_and_cache_salt_key_the_first_block():
    index = KvEventIndex(BS)
    index.on_message(0, payload(stored_map([1], None, TOKENS[:4], lora_name="sql-lora",
                                           extra_keys=[["sql-lora", "salt-1"]])))
    assert index.keys_in_storage_order() == block_keys(TOKENS[:4], BS, ("sql-lora", "salt-1"))
    assert index.num_prefix_blocks(block_keys(TOKENS[:4], BS)) == 0


def test_removal_copies_and_clear():
    index = KvEventIndex(BS)
    index.on_message(0, payload(stored_map([1, 2], None, TOKENS[:8]), stored_map([1], None, TOKENS[:4])))
    first, second = block_keys(TOKENS[:8], BS)
    index.on_message(1, payload(["BlockRemoved", [1]]))
    assert first in index  # the second copy of block 1 is still cached
    index.on_message(2, payload(["BlockRemoved", [1, 2]]))
    assert index.num_blocks == 0
    index.on_message(3, payload(stored_map([5], None, TOKENS[:4]), {"type": "AllBlocksCleared"}))
    assert index.num_blocks == 0 and index.counts.cleared == 1 and index.exact


def test_gap_orphan_and_undecodable_make_the_index_approximate_until_cleared():
    index = KvEventIndex(BS)
    index.on_message(0, payload(stored_map([1], None, TOKENS[:4])))
    index.on_message(3, payload(stored_map([9], 8, TOKENS[4:8])))  # batches 1-2 missed; parent 8 never seen
    assert not index.exact
    assert (index.counts.gaps, index.counts.missed_batches, index.counts.orphans) == (1, 2, 1)
    assert index.num_blocks == 1
    index.on_message(4, b"garbage")
    assert index.counts.undecodable == 1 and index.counts.batches == 2
    index.on_message(5, payload({"type": "AllBlocksCleared"}))
    assert index.exact


def test_sequence_back_to_zero_is_a_restart_that_drops_the_old_cache():
    index = KvEventIndex(BS)
    index.on_message(0, payload(stored_map([1], None, TOKENS[:4])))
    index.on_message(1, payload(stored_map([2], 1, TOKENS[4:8])))
    index.on_message(0, payload(stored_map([77], None, TOKENS[4:8])))  # a new engine process, same address
    assert index.counts.restarts == 1 and index.exact
    assert index.keys_in_storage_order() == block_keys(TOKENS[4:8], BS)


def test_a_late_subscription_is_not_exact():
    index = KvEventIndex(BS)
    index.on_message(57, payload(stored_map([1], None, TOKENS[:4])))
    assert not index.exact and index.counts.late_join == 1 and index.num_blocks == 1


def test_other_media_groups_and_block_sizes_are_not_indexed():
    index = KvEventIndex(BS)
    index.on_message(0, payload(stored_map([1], None, TOKENS[:4], medium="CPU"),
                                stored_map([2], None, TOKENS[:4], group_idx=1),
                                {**stored_map([3], None, TOKENS[:8]), "block_size": 8}))
    assert index.num_blocks == 0
    assert index.counts.ignored == 2 and index.counts.undecodable == 1 and not index.exact


def test_subscriber_over_a_real_zmq_socket_counts_malformed_messages():
    async def scenario():
        context = zmq.asyncio.Context.instance()
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        index = KvEventIndex(BS)
        task = asyncio.create_task(KvEventSubscriber(f"tcp://127.0.0.1:{port}", index, topic="kv").run())
        try:
            for _ in range(200):  # a SUB socket misses what is published before it connects
                await pub.send_multipart((b"kv", (0).to_bytes(8, "big"), payload({"type": "AllBlocksCleared"})))
                await asyncio.sleep(0.01)
                if index.counts.batches:
                    break
            await pub.send_multipart((b"kv", b"\x00", b"short sequence frame"))
            await pub.send_multipart((b"other", (9).to_bytes(8, "big"), b"another topic"))
            for seq in (1, 2):
                start = TOKENS[(seq - 1) * BS:seq * BS]
                await pub.send_multipart((b"kv", seq.to_bytes(8, "big"),
                                          payload(stored_map([seq], None if seq == 1 else 1, start))))
            for _ in range(200):
                await asyncio.sleep(0.01)
                if index.num_blocks == 2:
                    break
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            pub.close(linger=0)
        return index

    index = asyncio.run(scenario())
    assert index.keys_in_storage_order() == block_keys(TOKENS[:8], BS)
    assert index.counts.undecodable == 1 and index.counts.gaps == 0  # the other topic never arrived


def test_eviction_order_names_every_block_before_its_parent():
    index = KvEventIndex(BS)
    index.on_message(0, payload(stored_map([1, 2], None, TOKENS[:8])))
    index.on_message(1, payload(stored_map([3], 2, TOKENS[8:12]), stored_map([9], None, [5] * 4)))
    chain = block_keys(TOKENS, BS)
    order = index.keys_in_eviction_order()
    assert order[0] == chain[2] and order.index(chain[1]) < order.index(chain[0])
    assert set(order) == set(chain) | set(block_keys([5] * 4, BS))
    assert index.last_message_s is not None


@pytest.mark.parametrize("token", [2 ** 32, -1, True])
def test_an_out_of_range_token_id_is_undecodable_and_the_next_batch_still_applies(token):
    index = KvEventIndex(BS)
    index.on_message(0, payload(stored_map([1], None, [token, 1, 2, 3])))
    index.on_message(1, payload(stored_map([2], None, TOKENS[:4])))
    assert index.counts.undecodable == 1 and index.keys_in_storage_order() == block_keys(TOKENS[:4], BS)


def test_a_replayed_batch_is_reordered_not_a_restart():
    index = KvEventIndex(BS)
    index.on_message(0, payload(stored_map([1], None, TOKENS[:4])))
    index.on_message(5, payload())
    index.on_message(3, payload())
    assert index.counts.reordered == 1 and index.counts.restarts == 0 and index.num_blocks == 1
    assert not index.exact


def test_lost_removals_cannot_grow_the_index_past_its_bound():
    index = KvEventIndex(BS, max_blocks=2)
    index.on_message(0, payload(stored_map([1, 2, 3], None, TOKENS)))
    assert index.num_blocks == 2 and index.counts.overflow == 1 and not index.exact
    assert index.keys_in_storage_order() == block_keys(TOKENS, BS)[1:]
    assert index.keys_in_eviction_order(1) == block_keys(TOKENS, BS)[2:]
