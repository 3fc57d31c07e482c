"""Tests for predictor.sim.prefix_cache: vLLM V1's free queue (LRU, reverse-order free, touch) and lookups."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.sim.prefix_cache import PrefixCachePool


def _hold(pool: PrefixCachePool, keys: list[int], num_anonymous: int = 0) -> list[int]:
    """A holder that allocates len(keys) + num_anonymous blocks and caches the first len(keys)."""
    assert pool.allocate(len(keys) + num_anonymous)
    return [pool.cache_block(k) for k in keys]


def test_a_pool_without_cached_blocks_is_a_count():
    pool = PrefixCachePool(10)
    assert pool.allocate(7) and not pool.allocate(4)
    pool.free(3)
    assert pool.num_free_blocks == 6 and pool.free_queue() == [None] * 6
    pool.check_invariants()
    with pytest.raises(ValueError):
        pool.free(5)


def test_freed_blocks_stay_cached_and_are_freed_tail_first():
    pool = PrefixCachePool(6)
    ids = _hold(pool, [11, 12, 13], num_anonymous=1)  # table: 11 12 13 + one partial block
    assert pool.num_free_blocks == 2
    pool.release(ids, 1)
    # head first: the 2 never-used blocks, then the request's partial block, then 13, 12, 11
    assert pool.free_queue() == [None, None, None, ids[2], ids[1], ids[0]]
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 3
    assert pool.lookup([11, 12, 13], 10) == ids
    pool.check_invariants()


def test_anonymous_blocks_are_reused_before_any_cached_block_whatever_the_free_order():
    # vLLM 0.32 block_pool.py `BlockPool.free_blocks`: blocks without a hash are prepended, cached ones appended.
    pool = PrefixCachePool(5)
    ids = _hold(pool, [1, 2], num_anonymous=1)
    other = _hold(pool, [], num_anonymous=2)
    pool.release(ids, 1)  # queue: its partial block, then 2, 1
    pool.release(other, 2)  # its 2 anonymous blocks go to the head, ahead of the cached ones
    assert pool.free_queue() == [None, None, None, ids[1], ids[0]]
    assert pool.allocate(3) and pool.num_evicted_blocks == 0 and pool.cached_free_keys() == [2, 1]
    assert pool.allocate(1) and pool.cached_free_keys() == [1]
    pool.check_invariants()


def test_full_blocks_released_without_identity_queue_with_the_cached_ones():
    pool = PrefixCachePool(6)
    ids = _hold(pool, [1], num_anonymous=3)  # table: 1, two full blocks no lookup needs, a partial block
    pool.release(ids, 1, num_unnamed=2)  # queue: 2 never used + partial, then the two unnamed, then 1
    assert pool.free_queue() == [None] * 5 + [ids[0]] and pool.num_cached_free_blocks == 1
    assert pool.allocate(5) and pool.num_evicted_blocks == 2 and pool.cached_free_keys() == [1]
    pool.check_invariants()


def test_allocation_evicts_least_recently_freed_first():
    pool = PrefixCachePool(4)
    first = _hold(pool, [1, 2])
    second = _hold(pool, [7, 8])
    pool.release(first, 0)  # queue: 2, 1
    pool.release(second, 0)  # queue: 2, 1, 8, 7
    assert pool.allocate(1)  # evicts block 2 (the tail of the first request)
    assert pool.key_of(first[1]) is None and pool.key_of(first[0]) == 1
    assert pool.lookup([1, 2], 5) == [first[0]]  # the chain now stops after its first block
    assert pool.allocate(2)  # evicts 1, then 8
    assert pool.lookup([7, 8], 5) == [second[0]]
    assert pool.num_evicted_blocks == 3 and pool.num_free_blocks == 1
    pool.check_invariants()


def test_touch_takes_a_free_hit_out_of_the_queue_and_shares_a_used_one():
    pool = PrefixCachePool(5)
    ids = _hold(pool, [1, 2])
    pool.release(ids, 0)
    hits = pool.lookup([1, 2, 3], 10)
    assert hits == ids and pool.num_free_among(hits) == 2
    pool.touch(hits)  # a second request hits both
    assert pool.num_free_blocks == 3 and pool.num_cached_free_blocks == 0
    pool.touch(hits[:1])  # a third one shares the first block: used once, referenced twice
    assert pool.ref_count(hits[0]) == 2 and pool.num_extra_refs == 1
    assert pool.num_used_blocks == 2
    assert pool.allocate(3) and pool.key_of(hits[0]) == 1  # hit blocks are never evicted while in use
    pool.release(hits, 0)
    assert pool.ref_count(hits[0]) == 1 and pool.free_queue() == [hits[1]]
    pool.check_invariants()


def test_lookup_stops_at_the_first_miss_and_at_max_blocks():
    pool = PrefixCachePool(8)
    ids = _hold(pool, [1, 2, 3])
    assert pool.lookup([1, 2, 3], 2) == ids[:2]
    assert pool.lookup([1, 9, 3], 5) == ids[:1]
    assert pool.lookup([9, 2, 3], 5) == []
    assert pool.lookup([1, 2, 3], 0) == []


def test_duplicate_keys_are_not_deduplicated_and_lookup_returns_the_first():
    pool = PrefixCachePool(4)
    a = _hold(pool, [5])
    b = _hold(pool, [5])
    assert a != b and pool.lookup([5], 1) == a
    pool.release(a, 0)
    assert pool.allocate(3)  # evicts a (the only free block besides 2 anonymous ones)
    assert pool.lookup([5], 1) == b
    pool.check_invariants()


def test_bad_release_and_touch_are_errors():
    pool = PrefixCachePool(3)
    with pytest.raises(ValueError):
        pool.touch([42])
    ids = _hold(pool, [1])
    pool.release(ids, 0)
    with pytest.raises(ValueError):
        pool.release(ids, 0)


def test_evicted_ids_name_later_blocks_so_ids_stay_below_the_block_count():
    pool = PrefixCachePool(4)
    seen: set[int] = set()
    for round_ in range(50):  # each round caches 3 new keys, evicting the previous round's blocks
        ids = _hold(pool, [3 * round_, 3 * round_ + 1, 3 * round_ + 2])
        seen.update(ids)
        pool.release(ids, 0)
        pool.check_invariants()
    assert max(seen) < 4 and pool.num_cached_blocks == 4 and pool.num_evicted_blocks == 146
    assert pool.lookup([147, 148, 149], 3) == ids and pool.lookup([141], 1) == []


def test_restored_cached_free_blocks_queue_behind_the_anonymous_ones_in_order():
    pool = PrefixCachePool(8)
    assert pool.allocate(2)
    pool.restore_cached_free([21, 22, 23])
    queue = pool.free_queue()
    assert queue[:3] == [None] * 3 and [pool.key_of(b) for b in queue[3:]] == [21, 22, 23]
    assert pool.cached_free_keys() == [21, 22, 23] and pool.num_free_blocks == 6
    assert pool.lookup([21, 22], 5) == queue[3:5]
    assert pool.allocate(4)  # the 3 anonymous blocks, then 21 (evicted)
    assert pool.cached_free_keys() == [22, 23] and pool.num_evicted_blocks == 1
    pool.check_invariants()
    # Anonymous blocks freed after cached ones still go ahead of them; a restored block joins the LRU tail.
    pool.free(4)  # queue: 4 anonymous + 22 23
    pool.restore_cached_free([31])
    assert [pool.key_of(b) for b in pool.free_queue() if b is not None] == [22, 23, 31]
    assert pool.free_queue()[:3] == [None] * 3
    pool.check_invariants()
    with pytest.raises(ValueError):
        pool.restore_cached_free([1, 2, 3, 4])  # 3 anonymous blocks free
    assert pool.cached_free_keys() == [22, 23, 31]
    pool.check_invariants()


def test_restored_keys_no_lookup_needs_keep_their_lru_place_without_identity():
    pool = PrefixCachePool(6)
    assert pool.allocate(1)
    pool.restore_cached_free([1, 2, 3, 4], needed={2: 1, 4: 1})
    queue = pool.free_queue()
    assert queue[:2] == [None, None] and pool.key_of(queue[2]) == 2 and queue[3] is None and pool.key_of(queue[4]) == 4
    assert pool.cached_free_keys() == [2, 4] and pool.num_free_blocks == 5 and pool.lookup([1], 1) == []
    pool.check_invariants()
    pool.free(0)
    assert pool.allocate(2)  # the anonymous block, then key 1's block (evicted in its place, before key 2's)
    assert pool.cached_free_keys() == [2, 4] and pool.num_evicted_blocks == 1
    assert pool.allocate(1) and pool.cached_free_keys() == [4]
    pool.check_invariants()
    pool.restore_cached_free([], needed={})
    other = PrefixCachePool(6)
    other.restore_cached_free([1, 2], needed={})  # nothing needed: all anonymous, the pool stays a count
    assert other.free_queue() == [None] * 6 and other.num_cached_blocks == 0
    other.check_invariants()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["hold", "hit", "release", "anon", "free", "restore"]), st.integers(0, 5)),
                max_size=60))
def test_invariants_hold_under_random_operations(ops):
    pool = PrefixCachePool(12)
    holders: list[tuple[list[int], int]] = []  # (cached ids, anonymous count)
    anonymous = 0
    for op, n in ops:
        if op == "hold":
            keys = list(range(n % 4))
            num_anon = 1 + n % 2  # a partial block, and maybe a full one no lookup needs (released unnamed)
            if pool.num_free_blocks >= len(keys) + num_anon:
                holders.append((_hold(pool, keys, num_anon), num_anon))
        elif op == "hit":
            hits = pool.lookup(list(range(4)), n)
            if pool.num_free_among(hits) <= pool.num_free_blocks:
                pool.touch(hits)
                holders.append((hits, 0))
        elif op == "release" and holders:
            ids, num_anon = holders.pop(n % len(holders))
            pool.release(ids, min(num_anon, 1), num_anon - min(num_anon, 1))
        elif op == "anon" and pool.allocate(n):
            anonymous += n
        elif op == "free":
            take = min(n, anonymous)
            pool.free(take)
            anonymous -= take
        elif op == "restore" and n <= pool.num_anonymous_free_blocks:
            before = pool.cached_free_keys()
            keys = [100 + k for k in range(n)]
            needed = {k: 1 for k in keys if k % 2} if n % 2 else None
            pool.restore_cached_free(keys, needed)
            assert pool.cached_free_keys() == before + [k for k in keys if needed is None or k in needed]
        pool.check_invariants()
        held = anonymous + sum(len(ids) + a for ids, a in holders)
        assert pool.num_used_blocks == held - pool.num_extra_refs
        queue = pool.free_queue()
        assert len(queue) == pool.num_free_blocks
        assert all(pool.ref_count(b) == 0 for b in queue if b is not None)
        num_anonymous = pool.num_anonymous_free_blocks
        assert queue[:num_anonymous] == [None] * num_anonymous  # vLLM's order: anonymous free blocks first
