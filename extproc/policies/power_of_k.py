"""``astrolabe``: prediction-guided power of k choices (the Astrolabe policy; the default).

Rule: sample ``k`` distinct endpoints uniformly at random (k >= number of endpoints = full fan-out), ask each
one's predictor sidecar for the request's predicted latency, and choose the smallest predicted E2E latency
(``metric: ttft`` compares time to first token instead). Ties are broken uniformly at random. Random sampling
breaks herding (many routers never pile onto one "best" endpoint); k probes keep the control-plane cost per
request constant as the fleet grows.
Inputs: ``EndpointView.prediction`` (filled by the router for the candidates; None for an endpoint without a
sidecar, or whose sidecar failed, timed out, or reported a stale state) and ``num_in_flight``.
When only some candidates have a prediction: the candidate with the fewest in-flight requests is chosen
(power of k on this router's in-flight counts, ties at random). Dropping the unpredicted candidates instead
would starve a healthy backend whose sidecar is down (measured: 0 of 151 requests under load), and the
predictions of the others are not comparable with "unknown".
When every prediction failed: returns None and the router falls back to ``least-requests`` over all healthy
endpoints (the reference system falls back to a random choice).

Source: Astrolabe global scheduler (AKafakA/Astrolabe, dispatch by sampled predictors), Mitzenmacher's power
of two choices.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from extproc.policies.base import EndpointView, Policy, min_random_tie

TYPE = "astrolabe"
METRICS = ("e2e", "ttft")


@dataclass(frozen=True, slots=True)
class Params:
    """``k``: endpoints probed per request (>= 1); ``metric``: ``e2e`` or ``ttft``."""

    k: int = 2
    metric: str = "e2e"

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ValueError(f"policy {TYPE!r}: k must be an integer >= 1, got {self.k!r}")
        if self.metric not in METRICS:
            raise ValueError(f"policy {TYPE!r}: metric must be one of {METRICS}, got {self.metric!r}")


class PowerOfKPolicy(Policy):
    TYPE = TYPE
    needs_predictions = True

    def __init__(self, params: Params, rng: random.Random) -> None:
        self.params = params
        self._rng = rng

    def candidates(self, request, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        if self.params.k >= len(endpoints):
            return endpoints
        return self._rng.sample(list(endpoints), self.params.k)

    def choose(self, request, endpoints: Sequence[EndpointView]) -> EndpointView | None:
        scored = [e for e in endpoints if e.prediction is not None]
        if not scored:
            return None
        if len(scored) < len(endpoints):
            return min_random_tie(endpoints, lambda e: e.num_in_flight, self._rng)
        if self.params.metric == "ttft":
            return min_random_tie(scored, lambda e: e.prediction.ttft_s, self._rng)
        return min_random_tie(scored, lambda e: e.prediction.e2e_s, self._rng)


def build(params: Mapping[str, Any], rng: random.Random) -> PowerOfKPolicy:
    unknown = set(params) - {"k", "metric"}
    if unknown:
        raise ValueError(f"policy {TYPE!r}: unknown parameter(s) {sorted(unknown)}; known: ['k', 'metric']")
    return PowerOfKPolicy(Params(**params), rng)
