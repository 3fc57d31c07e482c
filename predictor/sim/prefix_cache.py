"""The KV block pool with prefix caching: cached blocks by key, reference counts and the LRU free queue.

Owns `PrefixCachePool`, a `predictor.sim.kv_blocks.BlockPool` (the same count API, which the scheduler uses for
requests without block keys) that also gives identities to the blocks a key names. Pure and synchronous: imports
only the standard library and `predictor.sim`.

Source: vllm/v1/core/block_pool.py `BlockPool` (`get_cached_block`, `cache_full_blocks`, `get_new_blocks`,
`_maybe_evict_cached_block`, `touch`, `free_blocks`), vllm/v1/core/kv_cache_utils.py `FreeKVCacheBlockQueue`,
vllm/v1/core/kv_cache_manager.py `KVCacheManager.get_computed_blocks` / `allocate_slots` and
single_type_kv_cache_manager.py `SingleTypeKVCacheManager.free` (vLLM V1). The rules kept:
- a block whose reference count drops to 0 keeps its key and goes to the TAIL of the free queue: it is free (an
  allocation may take it) but still reusable; a freed block WITHOUT a key (a partial block, or one past the
  request's keys) goes to the HEAD (vLLM: "LIFO reuse of non-cached blocks", ``prepend_n``; cached ones:
  "FIFO reuse ... for LRU eviction", ``append_n``, block_pool.py `BlockPool.free_blocks`). So the free queue is
  always every anonymous free block, then the cached free blocks in LRU order, and anonymous blocks are taken
  before any cached one is evicted (`InstanceSnapshot.cached_block_keys` relies on it). A request frees its blocks
  in REVERSE order (its tail block first), so its last cached blocks are evicted first;
- an allocation takes blocks from the HEAD of the free queue (least recently freed) and drops the key of each
  cached block it takes (eviction);
- a hit on a free cached block takes it out of the free queue and counts a reference ("touch"); a hit on a block
  in use only counts a reference: blocks shared by running requests are held once;
- the cache does not deduplicate: two requests that compute the same block at the same time both register it, and
  a lookup returns the first registered.

Representation (ours): only blocks that carry a key have an identity (a small int id, not vLLM's block id, indexing
lists of keys and reference counts; an evicted block's id names the next block cached, so there are never more ids
than KV blocks). A request's other blocks (its partial last block, blocks past its keys) are anonymous and counted,
as in `BlockPool`. The anonymous free blocks are a count (their order does not matter: none carries a key), so with
no cached block free the pool costs what `BlockPool` does (requests without keys). The cached section of the free
queue is an ordered dict, LRU first, of a cached block (id -> 1) or a run of cached free blocks kept WITHOUT identity
(a negative id -> its count): blocks whose key no lookup will ask for (`predictor.sim.fast_predict` only), which
must still be evicted in their LRU place.
Not modelled: the null block (block 0, never free in vLLM), KV cache groups and hybrid models, KV events.

NOTE: compiled with mypyc where the build can (setup.py, with `predictor.sim.kv_blocks`, whose `BlockPool` it
extends): every prediction with block keys runs this pool's per-block work. Keep every attribute and local typed so
mypy accepts it; the tests run whichever is loaded.

NOTE: invariants (`check_invariants`, asserted by the property tests): the cached section <= free blocks;
no identified block is both in the free queue and referenced; each cached key maps to live blocks with that key.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from predictor.sim.kv_blocks import BlockPool

logger = logging.getLogger(__name__)


class PrefixCachePool(BlockPool):
    """KV blocks of one instance: counts, plus identities, reference counts and LRU order for cached blocks.

    Anonymous blocks: `allocate` / `free` (`BlockPool`'s API; `allocate` evicts cached free blocks in LRU order).
    Identified blocks: `cache_block` names one of the caller's anonymous blocks by its key, `lookup` finds the
    longest cached prefix of a key chain, `touch` takes references on hit blocks, `release` frees a request's
    blocks in vLLM's order.

    Args:
        num_gpu_blocks: Total KV blocks (vLLM `num_gpu_blocks`), >= 1.

    Raises:
        ValueError: If num_gpu_blocks < 1.
    """

    __slots__ = ("_lru", "_num_lru", "_key_of", "_ref", "_free_ids", "_blocks_of_key", "_num_cached",
                 "_num_cached_free", "_num_extra_refs", "_next_run_id", "num_evicted_blocks")

    def __init__(self, num_gpu_blocks: int) -> None:
        super().__init__(num_gpu_blocks)
        # The free queue's cached section, head (next evicted) first: a cached block's id -> 1, or a run of
        # cached free blocks kept without identity (a negative id -> its count). The anonymous free blocks
        # (ahead of it) are a count: num_free_blocks - _num_lru.
        self._lru: OrderedDict[int, int] = OrderedDict()
        self._num_lru = 0
        # Indexed by block id: its key, and its references (-1: the id names no cached block, and is in
        # _free_ids for the next block named).
        self._key_of: list[int] = []
        self._ref: list[int] = []
        self._free_ids: list[int] = []
        self._blocks_of_key: dict[int, list[int]] = {}
        self._num_cached = 0
        self._num_cached_free = 0
        self._num_extra_refs = 0
        self._next_run_id = -1
        self.num_evicted_blocks = 0
        """Cached blocks evicted by allocations so far (vLLM: a `BlockRemoved` KV event each)."""

    # ---- views ---------------------------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        """Blocks that carry a key (in use or free-but-reusable)."""
        return self._num_cached

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still carry a key (evictable, reusable by a hit)."""
        return self._num_cached_free

    @property
    def num_anonymous_free_blocks(self) -> int:
        """Free blocks without a key: the head of the free queue, all taken before any cached block is evicted."""
        return self._num_free_blocks - self._num_lru

    @property
    def num_extra_refs(self) -> int:
        """Sum over cached blocks of (references - 1) where > 0: how much the holders' block counts exceed the
        used blocks (a block shared by n requests is used once, held n times)."""
        return self._num_extra_refs

    def ref_count(self, block_id: int) -> int:
        """References on a cached block (0: free but reusable; unknown ids: 0)."""
        return max(self._refs_of(block_id), 0)

    def key_of(self, block_id: int) -> int | None:
        """The key of a cached block, or None if the id is not (or no longer) cached."""
        return self._key_of[block_id] if self._refs_of(block_id) >= 0 else None

    def free_queue(self) -> list[int | None]:
        """The free queue, head (next evicted) first: None for an anonymous free block (all of them first), then
        the cached free blocks' ids in LRU order, None for a cached free block kept without identity
        (`restore_cached_free` with `needed`, `release` with `num_unnamed`) (for tests and debugging;
        O(free blocks))."""
        order: list[int | None] = [None] * (self._num_free_blocks - self._num_lru)
        for entry, count in self._lru.items():
            order.extend([entry] if entry >= 0 else [None] * count)
        return order

    def cached_free_keys(self) -> list[int]:
        """Keys of the free cached blocks, head (next evicted) first (`InstanceSnapshot.cached_block_keys`;
        O(cached free blocks); blocks kept without identity have no key to give and are left out)."""
        if not self._num_cached_free:
            return []
        key_of = self._key_of
        return [key_of[entry] for entry in self._lru if entry >= 0]

    def restore_cached_free(self, keys: Sequence[int], needed: dict[int, int] | None = None) -> None:
        """Give `len(keys)` anonymous free blocks these keys and append them, in this order, to the TAIL of the
        free queue (free but reusable: a snapshot's cached blocks no request holds,
        `InstanceSnapshot.cached_block_keys`). Anonymous free blocks stay at the head, so they are all taken before
        these (vLLM's order, see the module docstring).

        Args:
            keys: Block keys, eviction order.
            needed: If given, only keys in it get an identity; the others are cached free blocks without identity
                in their place in the LRU order (the same eviction order for all of them, no identity to keep for
                keys no lookup will ask for).

        Raises:
            ValueError: If fewer anonymous blocks are free than keys are given (state unchanged).
        """
        num_keys = len(keys)
        if not num_keys:
            return
        num_anonymous = self.num_anonymous_free_blocks
        if num_keys > num_anonymous:
            raise ValueError(f"{num_keys} cached free blocks to restore, {num_anonymous} anonymous blocks free")
        lru = self._lru
        if needed is None:
            for block_id in self._name_blocks(keys, 0):
                lru[block_id] = 1
            self._num_cached_free += num_keys
            self._num_lru += num_keys
            return
        named = [key for key in keys if key in needed]
        block_ids = self._name_blocks(named, 0) if named else []
        num_run = 0
        index = 0
        for key in keys:
            if key in needed:
                if num_run:
                    self._append_unnamed(num_run)
                    num_run = 0
                lru[block_ids[index]] = 1
                index += 1
            else:
                num_run += 1
        if num_run:
            self._append_unnamed(num_run)
        self._num_cached_free += len(named)
        self._num_lru += num_keys

    # ---- anonymous blocks ----------------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> bool:
        """Take `num_blocks` blocks from the head of the free queue (all or nothing): anonymous free blocks first,
        then cached free blocks in LRU order, whose keys are dropped (eviction). The blocks taken are anonymous.

        Returns:
            True if taken; False (nothing changed) if fewer are free.

        Raises:
            ValueError: If num_blocks < 0.

        Source: block_pool.py `BlockPool.get_new_blocks` (``free_block_queue.popleft_n``,
        `_maybe_evict_cached_block`).
        """
        num_anonymous = self._num_free_blocks - self._num_lru
        if not super().allocate(num_blocks):
            return False
        num_left = num_blocks - num_anonymous
        if num_left <= 0:
            return True  # only anonymous free blocks taken: a count (BlockPool's cost)
        lru = self._lru
        key_of = self._key_of
        ref = self._ref
        free_ids = self._free_ids
        blocks_of_key = self._blocks_of_key
        self._num_lru -= num_left
        self.num_evicted_blocks += num_left
        num_evicted = 0
        while num_left:
            entry, count = lru.popitem(last=False)
            if entry >= 0:  # a cached free block: evict it (block_pool.py `_maybe_evict_cached_block`)
                key = key_of[entry]
                ref[entry] = -1
                free_ids.append(entry)
                blocks = blocks_of_key[key]
                if len(blocks) == 1:
                    del blocks_of_key[key]
                else:
                    blocks.remove(entry)
                num_evicted += 1
                num_left -= 1
            elif count > num_left:  # cached free blocks without identity
                lru[entry] = count - num_left
                lru.move_to_end(entry, last=False)
                num_left = 0
            else:
                num_left -= count
        self._num_cached_free -= num_evicted
        self._num_cached -= num_evicted
        return True

    def free(self, num_blocks: int) -> None:
        """Return `num_blocks` anonymous blocks to the HEAD of the free queue (taken before any cached free block).

        Raises:
            ValueError: If num_blocks < 0 or more blocks would be free than exist (a double free).

        Source: block_pool.py `BlockPool.free_blocks` (blocks without a hash: ``free_block_queue.prepend_n``).
        """
        super().free(num_blocks)

    # ---- identified blocks ---------------------------------------------------------------------------------
    def cache_block(self, key: int) -> int:
        """Give one of the caller's anonymous (held) blocks the identity of a full block with this key.

        The block stays held (one reference); no count changes. A key already cached gets a second block (vLLM
        does not deduplicate; `lookup` returns the first).

        Returns:
            The block's id.

        Source: block_pool.py `BlockPool.cache_full_blocks`.
        """
        return self.cache_blocks((key,))[0]

    def cache_blocks(self, keys: Sequence[int]) -> list[int]:
        """`cache_block` for each key in order (one call for a request's newly full blocks).

        Returns:
            The blocks' ids, in key order.
        """
        return self._name_blocks(keys, 1)

    def _name_blocks(self, keys: Sequence[int], refs: int) -> list[int]:
        """New block ids for these keys, each with `refs` references (the caller keeps the free queue)."""
        key_of = self._key_of
        ref = self._ref
        free_ids = self._free_ids
        blocks_of_key = self._blocks_of_key
        block_ids: list[int] = []
        for key in keys:
            if free_ids:
                block_id = free_ids.pop()
                key_of[block_id] = key
                ref[block_id] = refs
            else:
                block_id = len(ref)
                key_of.append(key)
                ref.append(refs)
            blocks = blocks_of_key.get(key)
            if blocks is None:
                blocks_of_key[key] = [block_id]
            else:
                blocks.append(block_id)
            block_ids.append(block_id)
        self._num_cached += len(block_ids)
        return block_ids

    def lookup(self, keys: Sequence[int], max_blocks: int) -> list[int]:
        """The cached blocks of the longest prefix of `keys` whose every key is cached, at most `max_blocks`.

        Returns:
            Block ids, one per hit key, in key order (no reference taken: see `touch`).

        Source: kv_cache_manager.py `KVCacheManager.get_computed_blocks`; single_type_kv_cache_manager.py
        `FullAttentionManager.find_longest_cache_hit` (stop at the first miss); block_pool.py `get_cached_block`.
        """
        hits: list[int] = []
        blocks_of_key = self._blocks_of_key
        for key in keys[:max(max_blocks, 0)]:
            blocks = blocks_of_key.get(key)
            if not blocks:
                break
            hits.append(blocks[0])
        return hits

    def num_free_among(self, block_ids: Sequence[int]) -> int:
        """How many of these cached blocks are free (a hit on them takes them out of the free blocks)."""
        ref = self._ref
        num_free = 0
        for block_id in block_ids:
            if not ref[block_id]:
                num_free += 1
        return num_free

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one reference on each hit block; a free one leaves the free queue.

        Raises:
            ValueError: An id that is not cached (state unchanged only if it is the first).

        Source: block_pool.py `BlockPool.touch`.
        """
        ref = self._ref
        lru = self._lru
        num_taken_free = 0
        num_extra_refs = 0
        for block_id in block_ids:
            refs = ref[block_id] if 0 <= block_id < len(ref) else -1
            if refs < 0:
                self._num_cached_free -= num_taken_free
                self._num_free_blocks -= num_taken_free
                self._num_lru -= num_taken_free
                self._num_extra_refs += num_extra_refs
                raise ValueError(f"block {block_id} is not cached")
            if refs == 0:
                del lru[block_id]
                num_taken_free += 1
            else:
                num_extra_refs += 1
            ref[block_id] = refs + 1
        self._num_cached_free -= num_taken_free
        self._num_free_blocks -= num_taken_free
        self._num_lru -= num_taken_free
        self._num_extra_refs += num_extra_refs

    def release(self, block_ids: Sequence[int], num_anonymous: int, num_unnamed: int = 0) -> None:
        """Free one holder's blocks in vLLM's order: its table is `block_ids` (cached, in table order), then
        `num_unnamed` full blocks that carry a key no lookup will ask for (kept without identity), then
        `num_anonymous` anonymous blocks; they are freed last block first. The anonymous ones go to the HEAD of the
        free queue, the cached ones to its TAIL (unnamed ones first, then `block_ids` reversed), so the table's tail
        is evicted first among them. A cached block still referenced by another holder only loses a reference.

        Raises:
            ValueError: As `free` (for all `num_anonymous + num_unnamed` blocks), or an id that is not cached or not
                referenced.

        Source: single_type_kv_cache_manager.py `SingleTypeKVCacheManager.free` (``reversed(req_blocks)``),
        block_pool.py `BlockPool.free_blocks` (when the count reaches 0: ``prepend_n`` without a hash, ``append_n``
        with one).
        """
        super().free(num_anonymous + num_unnamed)
        if num_unnamed:
            self._append_unnamed(num_unnamed)
            self._num_lru += num_unnamed
        ref = self._ref
        lru = self._lru
        num_freed = 0
        for block_id in reversed(block_ids):
            refs = ref[block_id] if 0 <= block_id < len(ref) else -1
            if refs <= 0:
                self._num_free_blocks += num_freed
                self._num_cached_free += num_freed
                self._num_lru += num_freed
                raise ValueError(f"block {block_id} is not cached or not referenced")
            ref[block_id] = refs - 1
            if refs > 1:
                self._num_extra_refs -= 1
                continue
            lru[block_id] = 1
            num_freed += 1
        self._num_free_blocks += num_freed
        self._num_cached_free += num_freed
        self._num_lru += num_freed

    # ---- internals -----------------------------------------------------------------------------------------
    def _refs_of(self, block_id: int) -> int:
        """References on block id (-1: not a cached block)."""
        ref = self._ref
        return ref[block_id] if 0 <= block_id < len(ref) else -1

    def _append_unnamed(self, num_blocks: int) -> None:
        """Append a run of cached free blocks without identity to the LRU tail (the caller counts `_num_lru`)."""
        lru = self._lru
        if lru:
            tail = next(reversed(lru))
            if tail < 0:
                lru[tail] += num_blocks
                return
        lru[self._next_run_id] = num_blocks
        self._next_run_id -= 1

    def check_invariants(self) -> None:
        """Assert the pool's invariants (see the module docstring); O(cached blocks)."""
        assert sum(self._lru.values()) == self._num_lru, (self._lru, self._num_lru)
        assert 0 <= self._num_lru <= self._num_free_blocks <= self._num_gpu_blocks
        free_cached = [b for b in self._lru if b >= 0]
        assert len(free_cached) == self._num_cached_free
        assert all(self._ref[b] == 0 for b in free_cached), "a free block is referenced"
        assert all(n >= 1 for n in self._lru.values())
        num_unreferenced = sum(1 for n in self._ref if n == 0)
        assert num_unreferenced == self._num_cached_free, "a cached block is unreferenced but not free"
        assert self._num_extra_refs == sum(n - 1 for n in self._ref if n > 1)
        for key, blocks in self._blocks_of_key.items():
            assert blocks and all(self._ref[b] >= 0 and self._key_of[b] == key for b in blocks)
        assert sum(len(b) for b in self._blocks_of_key.values()) == self._num_cached
        assert self._num_cached == sum(1 for n in self._ref if n >= 0) == len(self._ref) - len(self._free_ids)
        assert all(self._ref[b] == -1 for b in self._free_ids)
