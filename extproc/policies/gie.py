"""``gie``: the Gateway API Inference Extension's default scoring, without its prefix-cache scorer.

Rule: total = queue_weight * queue_score + kv_cache_weight * kv_score, choose the highest total, where
- queue_score = (max_waiting - waiting) / (max_waiting - min_waiting) over the endpoints scored, 1.0 for every
  endpoint when all wait equally (``queue-scorer``);
- kv_score = 1 - kv_cache_usage_frac (``kv-cache-utilization-scorer``);
- weights 2 and 2 by default, as GIE's default profile (which also has ``prefix-cache-scorer`` at weight 3,
  left out here: ``gie-prefix``, ``extproc/policies/gie_prefix.py``, is the whole profile).
Ties: uniformly at random (GIE's ``max-score-picker`` shuffles before a stable sort).
Inputs: ``EndpointView.metrics`` (``num_requests_waiting``, ``kv_cache_usage_frac``), scraped at an interval
(GIE refreshes every 50 ms).
Missing metrics: endpoints with None are left out of scoring (and of the min/max normalisation); when none has
metrics, returns None and the router falls back to ``least-requests``.

Source: kubernetes-sigs/gateway-api-inference-extension
``pkg/epp/scheduling/framework/plugins/scorer/queue.go`` (QueueScorer.Score),
``pkg/epp/scheduling/framework/plugins/scorer/kvcache_utilization.go`` (KVCacheUtilizationScorer.Score),
``pkg/epp/scheduling/framework/plugins/picker/max_score_picker.go`` (MaxScorePicker.Pick) and
``pkg/epp/config/loader/defaults.go`` (loadDefaultConfig: queue 2.0, kv-cache-utilization 2.0, prefix 3.0).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from extproc.policies.base import EndpointView, Policy, min_random_tie

TYPE = "gie"


@dataclass(frozen=True, slots=True)
class Params:
    """Scorer weights (>= 0): ``queue_weight`` (GIE default 2.0), ``kv_cache_weight`` (GIE default 2.0)."""

    queue_weight: float = 2.0
    kv_cache_weight: float = 2.0

    def __post_init__(self) -> None:
        for name in ("queue_weight", "kv_cache_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"policy {TYPE!r}: {name} must be a number >= 0, got {value!r}")


def scores(endpoints: Sequence[EndpointView], params: Params) -> list[float]:
    """Weighted total score of each endpoint (same order); every endpoint must have metrics.

    Raises:
        AttributeError: an endpoint's metrics is None.
    """
    waiting = [e.metrics.num_requests_waiting for e in endpoints]
    low, high = min(waiting), max(waiting)
    totals = []
    for endpoint, num_waiting in zip(endpoints, waiting):
        queue_score = 1.0 if high == low else (high - num_waiting) / (high - low)
        kv_score = 1.0 - endpoint.metrics.kv_cache_usage_frac
        totals.append(params.queue_weight * queue_score + params.kv_cache_weight * kv_score)
    return totals


class GiePolicy(Policy):
    TYPE = TYPE
    needs_block_keys = False  # load only: no prompt keys
    needs_metrics = True

    def __init__(self, params: Params, rng: random.Random) -> None:
        self.params = params
        self._rng = rng

    def choose(self, request, endpoints: Sequence[EndpointView]) -> EndpointView | None:
        known = [e for e in endpoints if e.metrics is not None]
        if not known:
            return None
        totals = scores(known, self.params)
        # Highest total wins: minimise the negated total so that min_random_tie breaks ties.
        best = min_random_tie(range(len(known)), lambda i: -totals[i], self._rng)
        return known[best]


def build(params: Mapping[str, Any], rng: random.Random) -> GiePolicy:
    unknown = set(params) - {"queue_weight", "kv_cache_weight"}
    if unknown:
        raise ValueError(f"policy {TYPE!r}: unknown parameter(s) {sorted(unknown)}; known: "
                         "['kv_cache_weight', 'queue_weight']")
    return GiePolicy(Params(**params), rng)
