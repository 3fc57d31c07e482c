"""``sglang-cache-aware``: SGLang router's ``cache_aware`` policy (sgl-router), over block keys instead of text.

Rule, per request (load = ``EndpointView.num_in_flight``, this replica's requests in flight there, as sgl-router's
``worker.load()`` counts the requests it forwarded and has not seen finish):
1. Imbalanced when max load - min load > ``balance_abs_threshold`` and max load > min load *
   ``balance_rel_threshold``: choose the least loaded endpoint (the first of them in address order, as
   ``min_by_key``), and record the request's blocks there.
2. Otherwise, cache-aware: walk the request's block keys from the first while some endpoint's tree holds the key;
   match rate = walked keys / all keys. Above ``cache_threshold`` (strictly): choose an endpoint holding the last
   walked key (upstream takes the first tenant of the deepest matched node, an order fixed per node by its hash
   map; here a hash of (key, address) fixes it the same way). Else: the endpoint with the smallest tree (fewest
   recorded blocks; ties at random). Record the request's blocks at the chosen endpoint.
3. Record = insert into the endpoint's tree: each block becomes most recent, the first block last, so parents stay
   more recent than their children; over ``max_tree_size`` blocks, the least recently used are evicted (leaves
   first, as the upstream LRU leaf eviction).
Without block keys (None or empty): the least loaded endpoint (load only).
Defaults: sgl-router's launcher (``RouterArgs``): cache_threshold 0.3, balance_abs_threshold 64,
balance_rel_threshold 1.5, max_tree_size 2**26 characters -> 2**20 blocks here (about 4 characters per token and
16 tokens per block). They were tuned for other fleets: sweep them.
Cost per decision: O(block keys) dict operations plus O(endpoints).

Source: sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs`` (select_worker), ``sgl-router/src/policies/
tree.rs`` (insert, prefix_match, get_smallest_tenant, evict_tenant_by_size), ``sgl-router/src/policies/mod.rs``
(CacheAwareConfig's struct defaults: 0.5, 32, 1.1, 30 s, 10,000) and ``sgl-router/py_src/sglang_router/
router_args.py`` (the defaults users launch with, taken here).
Simplified: the tree is a radix tree over the request's text upstream; here it is over block keys (a key is a whole
prefix, so a tree's nodes are its keys); match rate counts blocks, not characters; eviction runs at each insert
instead of every ``eviction_interval_secs`` (60 s); the tree of an endpoint that left is not removed (it is never
chosen while absent from ``endpoints``); holders outside ``endpoints`` are skipped instead of falling back to the
first healthy worker.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from extproc.policies.approx_prefix_index import ApproxPrefixIndex
from extproc.policies.base import EndpointView, Policy, build_params, check_number, min_random_tie

TYPE = "sglang-cache-aware"

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Params:
    """``cache_threshold`` in [0, 1], ``balance_abs_threshold`` (requests, >= 0), ``balance_rel_threshold``
    (>= 1), ``max_tree_size`` (blocks per endpoint, >= 1)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2 ** 20

    def __post_init__(self) -> None:
        check_number(TYPE, "cache_threshold", self.cache_threshold, 0, 1)
        check_number(TYPE, "balance_abs_threshold", self.balance_abs_threshold, 0, integer=True)
        check_number(TYPE, "balance_rel_threshold", self.balance_rel_threshold, 1)
        check_number(TYPE, "max_tree_size", self.max_tree_size, 1, integer=True)


class SglangCacheAwarePolicy(Policy):
    TYPE = TYPE

    def __init__(self, params: Params, rng: random.Random) -> None:
        self.params = params
        self._rng = rng
        self.trees = ApproxPrefixIndex(params.max_tree_size)
        self._salt = rng.getrandbits(64)
        self._address_hash: dict[str, int] = {}

    def choose(self, request, endpoints: Sequence[EndpointView]) -> EndpointView | None:
        p = self.params
        keys = request.block_keys
        least = min(endpoints, key=lambda e: e.num_in_flight)
        if not keys:
            return least
        low, high = least.num_in_flight, max(e.num_in_flight for e in endpoints)
        if high - low > p.balance_abs_threshold and high > low * p.balance_rel_threshold:
            chosen = least
        else:
            chosen = self._cache_aware(keys, endpoints)
        self.trees.add(reversed(keys), chosen.address)
        return chosen

    def _cache_aware(self, keys: Sequence[int], endpoints: Sequence[EndpointView]) -> EndpointView:
        walked = 0
        for key in keys:
            if not self.trees.holders(key):
                break
            walked += 1
        if walked / len(keys) > self.params.cache_threshold:
            holders = self.trees.holders(keys[walked - 1])
            present = [e for e in endpoints if e.address in holders]
            if present:
                return min(present, key=lambda e: self._node_order(keys[walked - 1], e.address))
        return min_random_tie(endpoints, lambda e: self.trees.size(e.address), self._rng)

    def _node_order(self, key: int, address: str) -> int:
        """A fixed, arbitrary order of the endpoints holding ``key`` (upstream: the tenants' order in the node's
        hash map)."""
        base = self._address_hash.get(address)
        if base is None:
            base = self._address_hash[address] = zlib.crc32(address.encode())
        return ((key ^ self._salt ^ (base * 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9) & _MASK64


def build(params: Mapping[str, Any], rng: random.Random) -> SglangCacheAwarePolicy:
    return SglangCacheAwarePolicy(build_params(TYPE, Params, params), rng)
