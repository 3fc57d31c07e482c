"""``llm-d``: llm-d's recommended "optimized baseline", sticky until saturated (August 2026).

Rule, per request (``prefix-cache-affinity-filter`` then ``token-load-scorer`` and ``max-score-picker``):
1. Hashes: the request's block keys grouped ``hash_block_tokens / block_size`` to a hash (the chain key that ends
   each group names its whole prefix), at most ``max_prefix_tokens_to_match`` tokens; total = number of hashes.
2. Match (``approx-prefix-cache-producer``): for each endpoint, how many of the leading hashes its LRU holds,
   walking from the first hash while any endpoint holds it; prefix score = matched / total (0 without hashes).
3. Filter: sticky = endpoints with prefix score >= ``affinity_threshold``. None sticky, one endpoint, or (with
   probability ``exploration_probability``) exploration: keep all. Load gate: when some are not sticky and the
   least in-flight tokens among the sticky exceed the least among the others by more than
   ``max_tokens_in_flight_penalty``, keep all (stickiness released). Else keep the sticky ones.
4. Score: token load = the endpoint's in-flight uncached tokens + this request's uncached tokens there
   (prompt tokens - min(matched * hash tokens, prompt tokens)); score = 1 - min(load, Q) / Q with
   Q = ``queue_threshold_tokens``; the highest score wins, ties uniformly at random.
5. Record: the hashes are added, first to last, to the chosen endpoint's LRU, whose size is the endpoint's
   ``num_gpu_blocks`` when its metrics say (``autoTune``), else ``lru_capacity_per_server``; its in-flight tokens
   grow by the request's uncached tokens there, and shrink by them in ``on_finished``.
Defaults: the guide's configuration (``affinityThreshold`` 0.80, ``maxTokensInFlightPenalty`` 286,720 tokens,
``maxTTFTPenaltyMs`` 0 = that gate off, ``maxPrefixTokensToMatch`` 40,960, token-load ``queueThresholdTokens``
4,194,304, 64-token hash blocks); the 286,720-token release was calibrated for Qwen3-32B on 2 x H100 (TP 2):
tune it per fleet.
Precise variant (``llm-d-precise``, or ``precise: true``): the match of step 2 is the endpoint's
``EndpointView.num_prefix_blocks_cached`` (what its engine's published state caches, as llm-d's KV-event-fed
``precise-prefix-cache`` producer sees it) in whole hashes, its uncached tokens prompt - cached blocks * block_size;
no approximate index is kept.
Inputs: ``RoutingRequest.block_keys`` (prompt tokens: ``approx_prefix_index.prompt_tokens``), ``EndpointView.metrics``
only for ``num_gpu_blocks``; never fails on missing metrics. Without block keys there are no hashes: nothing is
sticky and the choice is the token load alone (upstream without prefix matches).
Cost per decision: O(hashes) dict lookups plus O(endpoints).

Source: llm-d/llm-d ``guides/optimized-baseline/router/optimized-baseline.values.yaml`` (the composition and its
parameters); llm-d/llm-d-inference-scheduler ``pkg/epp/framework/plugins/scheduling/filter/prefixcacheaffinity/
plugin.go`` (Filter: sticky set, exploration, in-flight-tokens gate); llm-d/llm-d-router
``pkg/epp/framework/plugins/scheduling/scorer/tokenload/token_load.go`` (Score, queueThresholdTokens),
``pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/plugin.go`` (Produce, PreRequest,
matchLongestPrefix, autoTune LRU size, 64-token minimum hash block), ``.../approximateprefix/indexer.go`` (per-pod
LRU) and ``.../dataproducer/inflightload/README.md`` (uncached prompt tokens counted in flight).
Simplified: in-flight tokens are released when the request ends (upstream: at the first streamed chunk, or at the
end for non-streaming requests), so a decoding request still counts; ``maxTTFTPenaltyMs`` (off in the guide) and
the optional estimated-output tokens (off by default) are not modelled; hashes are our block keys, not llm-d's
hashes of token ids (same boundaries when ``hash_block_tokens`` is a multiple of the pool's block size).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from extproc.policies.approx_prefix_index import ApproxPrefixIndex, prompt_tokens
from extproc.policies.base import (
    EndpointView,
    Policy,
    build_params,
    check_number,
    min_random_tie,
    reject_unknown_params,
)

TYPE = "llm-d"
PRECISE_TYPE = "llm-d-precise"

DEFAULT_LRU_CAPACITY_PER_SERVER = 31250
"""Index entries per endpoint when its metrics give no ``num_gpu_blocks`` (upstream ``defaultLRUCapacityPerServer``,
the Inference Extension's 31,250)."""


@dataclass(frozen=True, slots=True)
class Params:
    """Parameters (upstream name in parentheses).

    Attributes:
        affinity_threshold: prefix score at or above which an endpoint is sticky, (0, 1] (``affinityThreshold``).
        max_tokens_in_flight_penalty: in-flight token lead of the least loaded sticky endpoint over the least
            loaded other one past which stickiness is released, tokens, >= 0; 0 = never released
            (``maxTokensInFlightPenalty``).
        exploration_probability: probability of skipping the filter, [0, 1] (``explorationProbability``).
        queue_threshold_tokens: token load at which the token-load score reaches 0, > 0 (``queueThresholdTokens``).
        block_size: tokens per KV block of the pool (the block keys' block size), >= 1.
        hash_block_tokens: tokens per index hash, a multiple of ``block_size`` (llm-d's minimum, 64).
        max_prefix_tokens_to_match: prompt tokens hashed at most, >= 1 (``maxPrefixTokensToMatch``).
        lru_capacity_per_server: index entries per endpoint without ``num_gpu_blocks`` (``lruCapacityPerServer``).
        precise: match from ``EndpointView.num_prefix_blocks_cached`` (the engines' published cache state, llm-d's
            ``precise-prefix-cache`` producer fed by KV events) instead of the approximate index; an endpoint
            without that state matches nothing.
    """

    affinity_threshold: float = 0.80
    max_tokens_in_flight_penalty: int = 286720
    exploration_probability: float = 0.0
    queue_threshold_tokens: int = 4194304
    block_size: int = 16
    hash_block_tokens: int = 64
    max_prefix_tokens_to_match: int = 40960
    lru_capacity_per_server: int = DEFAULT_LRU_CAPACITY_PER_SERVER
    precise: bool = False

    def __post_init__(self) -> None:
        check_number(TYPE, "affinity_threshold", self.affinity_threshold, 0, 1, low_open=True)
        check_number(TYPE, "exploration_probability", self.exploration_probability, 0, 1)
        check_number(TYPE, "max_tokens_in_flight_penalty", self.max_tokens_in_flight_penalty, 0)
        for name in ("queue_threshold_tokens", "block_size", "hash_block_tokens", "max_prefix_tokens_to_match",
                     "lru_capacity_per_server"):
            check_number(TYPE, name, getattr(self, name), 1, integer=True)
        if not isinstance(self.precise, bool):
            raise ValueError(f"policy {TYPE!r}: precise must be true or false, got {self.precise!r}")
        if self.hash_block_tokens % self.block_size:
            raise ValueError(f"policy {TYPE!r}: hash_block_tokens ({self.hash_block_tokens}) must be a multiple of "
                             f"block_size ({self.block_size})")


_PARAM_NAMES = tuple(f.name for f in fields(Params))


class LlmdBaselinePolicy(Policy):
    TYPE = TYPE
    needs_metrics = True

    def __init__(self, params: Params, rng: random.Random) -> None:
        self.params = params
        self._rng = rng
        self._group = params.hash_block_tokens // params.block_size
        self._max_hashes = params.max_prefix_tokens_to_match // params.hash_block_tokens
        self.index = ApproxPrefixIndex(params.lru_capacity_per_server)
        self.in_flight_tokens: dict[str, int] = {}
        """Uncached prompt tokens of the requests this policy sent to each endpoint that have not finished."""
        self._charged: dict[tuple[str, str], list[int]] = {}

    def hashes(self, block_keys: Sequence[int] | None) -> Sequence[int]:
        """The index hashes of a prompt: every ``hash_block_tokens / block_size``-th block key (the last of each
        group), at most ``max_prefix_tokens_to_match / hash_block_tokens`` of them."""
        if not block_keys:
            return ()
        group = self._group
        return block_keys[group - 1:group * self._max_hashes:group]

    def choose(self, request, endpoints: Sequence[EndpointView]) -> EndpointView | None:
        p = self.params
        hashes = self.hashes(request.block_keys)
        prompt = prompt_tokens(request, p.block_size)
        if p.precise:
            cached_blocks = {e.address: e.num_prefix_blocks_cached or 0 for e in endpoints}
            counts = {a: min(n // self._group, len(hashes)) for a, n in cached_blocks.items()}
            uncached = {a: prompt - min(n * p.block_size, prompt) for a, n in cached_blocks.items()}
        else:
            counts = self.index.match_counts(hashes) if hashes else {}
            uncached = {e.address: prompt - min(counts.get(e.address, 0) * p.hash_block_tokens, prompt)
                        for e in endpoints}
        kept = self._filter(endpoints, counts, len(hashes))
        load = self.in_flight_tokens
        threshold = p.queue_threshold_tokens

        def score(e: EndpointView) -> float:
            return 1.0 - min(load.get(e.address, 0) + uncached[e.address], threshold) / threshold

        chosen = min_random_tie(kept, lambda e: -score(e), self._rng)
        if not p.precise:
            capacity = chosen.metrics.num_gpu_blocks if chosen.metrics is not None else None
            self.index.add(hashes, chosen.address, capacity or None)
        tokens = uncached[chosen.address]
        load[chosen.address] = load.get(chosen.address, 0) + tokens
        self._charged.setdefault((request.request_id, chosen.address), []).append(tokens)
        return chosen

    def _filter(self, endpoints: Sequence[EndpointView], counts: Mapping[str, int],
                total: int) -> Sequence[EndpointView]:
        """``prefix-cache-affinity-filter``."""
        p = self.params
        if len(endpoints) <= 1 or total == 0:
            return endpoints
        if p.exploration_probability and self._rng.random() < p.exploration_probability:
            return endpoints
        sticky = [e for e in endpoints if counts.get(e.address, 0) / total >= p.affinity_threshold]
        if not sticky:
            return endpoints
        if p.max_tokens_in_flight_penalty > 0 and len(sticky) < len(endpoints):
            load = self.in_flight_tokens
            sticky_set = {e.address for e in sticky}
            best_sticky = min(load.get(a, 0) for a in sticky_set)
            best_other = min(load.get(e.address, 0) for e in endpoints if e.address not in sticky_set)
            if best_sticky - best_other > p.max_tokens_in_flight_penalty:
                return endpoints
        return sticky

    def on_finished(self, request, address: str) -> None:
        charges = self._charged.get((request.request_id, address))
        if not charges:
            return
        tokens = charges.pop()
        if not charges:
            del self._charged[(request.request_id, address)]
        remaining = self.in_flight_tokens.get(address, 0) - tokens
        if remaining > 0:
            self.in_flight_tokens[address] = remaining
        else:
            self.in_flight_tokens.pop(address, None)


def build(params: Mapping[str, Any], rng: random.Random) -> LlmdBaselinePolicy:
    return LlmdBaselinePolicy(build_params(TYPE, Params, params), rng)


def build_precise(params: Mapping[str, Any], rng: random.Random) -> LlmdBaselinePolicy:
    """``llm-d-precise``: ``llm-d`` with ``precise: true`` (its own ``precise`` parameter is refused)."""
    reject_unknown_params(PRECISE_TYPE, params, set(_PARAM_NAMES) - {"precise"})
    return build({**params, "precise": True}, rng)
