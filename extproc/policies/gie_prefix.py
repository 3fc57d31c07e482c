"""``gie-prefix``: the Inference Extension's (and llm-d's former) default profile with its approximate prefix scorer.

Rule: total = queue_weight * queue_score + kv_cache_weight * kv_score + prefix_weight * prefix_score; choose the
highest total, ties uniformly at random (``max-score-picker``). The first two terms are ``gie``'s
(``extproc/policies/gie.py`` ``scores``, reused); prefix_score is ``prefix-cache-scorer``'s:
- the request's hashes are its first ``max_prefix_blocks`` block keys (``RoutingRequest.block_keys``);
- matched = for each endpoint, how many of the leading hashes it holds, walking from the first hash while any
  endpoint holds it (``matchLongestPrefix``); prefix_score = matched / number of hashes, 0 without hashes;
- the index (``approx_prefix_index.ApproxPrefixIndex``) is fed by this policy's own decisions: after choosing, the
  request's hashes are added, first to last, to the chosen endpoint's LRU of ``lru_capacity_per_server`` entries
  (``PreRequest`` / ``indexer.Add``). It never hears of evictions in the engine: it is approximate by design.
Defaults: weights 2 / 2 / 3 (``loadDefaultConfig``), 256 blocks matched at most, 31,250 entries per server.
Inputs: ``EndpointView.metrics`` (waiting requests, KV usage) and ``RoutingRequest.block_keys``; requests without
keys score 0 everywhere on prefix (load only), as upstream prompts shorter than one hash block do.
Missing metrics: as ``gie`` (endpoints without are left out; none with metrics -> None, the router falls back to
``least-requests``, and the index is not fed).

Source: kubernetes-sigs/gateway-api-inference-extension
``pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go`` (Score, PreRequest, matchLongestPrefix, defaults
DefaultMaxPrefixBlocks 256 and DefaultLRUCapacityPerServer 31250), ``.../multi/prefix/indexer.go`` (per-pod LRU,
Add in order, eviction callback) and ``pkg/epp/config/loader/defaults.go`` (weights).
Simplified: upstream hashes 64-character chunks of the prompt text (~16 tokens) into a chain whose first element is
the model name's hash (so any earlier request to a server matches one block); here the hashes are the engine's block
keys (token blocks, no model element: the keys of one pool's model already differ from another's).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from extproc.policies import gie
from extproc.policies.approx_prefix_index import ApproxPrefixIndex
from extproc.policies.base import EndpointView, Policy, check_number, min_random_tie, reject_unknown_params

TYPE = "gie-prefix"

DEFAULT_LRU_CAPACITY_PER_SERVER = 31250
"""Upstream ``DefaultLRUCapacityPerServer``: 500K tokens of a Llama-3-8B's free HBM on an H100 / 16 per block."""
DEFAULT_MAX_PREFIX_BLOCKS = 256
"""Upstream ``DefaultMaxPrefixBlocks``."""


@dataclass(frozen=True, slots=True)
class Params:
    """``prefix_weight`` (>= 0, default 3.0), ``lru_capacity_per_server`` (entries, >= 1, default 31,250),
    ``max_prefix_blocks`` (>= 1, default 256); the queue and KV weights are ``gie.Params``."""

    load: gie.Params = gie.Params()
    prefix_weight: float = 3.0
    lru_capacity_per_server: int = DEFAULT_LRU_CAPACITY_PER_SERVER
    max_prefix_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS

    def __post_init__(self) -> None:
        check_number(TYPE, "prefix_weight", self.prefix_weight, 0)
        check_number(TYPE, "lru_capacity_per_server", self.lru_capacity_per_server, 1, integer=True)
        check_number(TYPE, "max_prefix_blocks", self.max_prefix_blocks, 1, integer=True)


class GiePrefixPolicy(Policy):
    TYPE = TYPE
    needs_metrics = True

    def __init__(self, params: Params, rng: random.Random) -> None:
        self.params = params
        self._rng = rng
        self.index = ApproxPrefixIndex(params.lru_capacity_per_server)

    def prefix_scores(self, request, endpoints: Sequence[EndpointView]) -> list[float]:
        """``prefix-cache-scorer``'s score of each endpoint (same order), in [0, 1]."""
        hashes = (request.block_keys or ())[:self.params.max_prefix_blocks]
        if not hashes:
            return [0.0] * len(endpoints)
        counts = self.index.match_counts(hashes)
        return [counts.get(e.address, 0) / len(hashes) for e in endpoints]

    def choose(self, request, endpoints: Sequence[EndpointView]) -> EndpointView | None:
        known = [e for e in endpoints if e.metrics is not None]
        if not known:
            return None
        weight = self.params.prefix_weight
        totals = [load + weight * prefix for load, prefix in
                  zip(gie.scores(known, self.params.load), self.prefix_scores(request, known))]
        chosen = known[min_random_tie(range(len(known)), lambda i: -totals[i], self._rng)]
        if request.block_keys:
            self.index.add(request.block_keys[:self.params.max_prefix_blocks], chosen.address)
        return chosen


_LOAD_KEYS = frozenset({"queue_weight", "kv_cache_weight"})


def build(params: Mapping[str, Any], rng: random.Random) -> GiePrefixPolicy:
    reject_unknown_params(TYPE, params, _LOAD_KEYS | {"prefix_weight", "lru_capacity_per_server", "max_prefix_blocks"})
    load = gie.Params(**{k: v for k, v in params.items() if k in _LOAD_KEYS})
    return GiePrefixPolicy(Params(load, **{k: v for k, v in params.items() if k not in _LOAD_KEYS}), rng)
