"""``astrolabe``: prediction-guided power of k choices (the Astrolabe policy; the default).

Rule: probe ``k`` distinct endpoints (k >= number of endpoints = full fan-out), ask each one's predictor sidecar
for the request's predicted latency, and choose the lowest score:
- ``metric: blend`` (default): predicted TTFT + ``e2e_weight`` x predicted E2E latency. TTFT leads (the
  users' SLO and the tail that queueing makes); the E2E term breaks near-ties between endpoints that would
  both start the request at once in favour of the lighter batch (faster decode, and headroom left for the
  next arrival).
- ``metric: ttft``: predicted TTFT alone.
- ``metric: e2e``: predicted E2E latency alone (the paper's objective). Measured here it sends requests to
  full instances while others have free slots: on small batches E2E barely moves with queueing (a full
  instance scored 2.935 s against 2.940 s for one with a free slot, /work/shared/FACTS.md).
Ties are broken uniformly at random.

A second round when the first finds only queues: if every first-round candidate predicts that the request
would wait there (``Prediction.queue_s`` above ``queue_threshold_s``, 50 ms), up to ``extra_probes`` (4) more
endpoints, drawn at random from the rest, are asked before choosing among all of them. Below the knee nearly
every request is placed after k probes; near saturation, where two random probes most often miss the one
instance with room, the extra probes buy the capacity of a larger k at a fraction of its cost (measured:
2.07 probes per request at 135 req/s on 12 simulated instances, bench/README.md). The request pays one more
Predict round trip only when it was going to queue anyway.

Which endpoints are probed: with ``probe_best`` (default) and k >= 2, one probe goes to the endpoint with the best score
among this replica's answers of the last ``memory_s`` seconds and the other k - 1 are drawn uniformly at random
from the rest; without it (or with no recent answer), all k are drawn at random. This is the power of d choices
with memory (Shah & Prabhakar 2002, "The use of memory in randomized load balancing"): the remembered endpoint
is probed afresh, never trusted blindly, so an endpoint that filled up since loses on its fresh prediction, and
several replicas cannot herd onto it (each sidecar counts every replica's admissions). Random probes keep
looking at the rest of the fleet. Probes per request stay at most k + ``extra_probes``, whatever the fleet size.

Inputs: ``EndpointView.prediction`` (filled by the router for the candidates; None for an endpoint without a
sidecar, or whose sidecar failed, timed out, or reported a stale state), ``num_in_flight`` and
``RoutingRequest.arrival_time_s`` (the memory's clock).
When only some candidates have a prediction: the candidate with the fewest in-flight requests is chosen
(power of k on this router's in-flight counts, ties at random). Dropping the unpredicted candidates instead
would starve a healthy backend whose sidecar is down (measured: 0 of 151 requests under load), and the
predictions of the others are not comparable with "unknown".
When every prediction failed: returns None and the router falls back to ``least-requests`` over all healthy
endpoints (the reference system falls back to a random choice).

Source: Astrolabe global scheduler (AKafakA/Astrolabe, dispatch by sampled predictors), Mitzenmacher's power
of two choices; measurements behind the defaults: bench/README.md "Choosing the objective".
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from extproc.policies.base import EndpointView, Policy, min_random_tie

TYPE = "astrolabe"
METRICS = ("blend", "ttft", "e2e")


@dataclass(frozen=True, slots=True)
class Params:
    """Parameters (policy_params of the extproc config).

    Attributes:
        k: endpoints probed per request (>= 1).
        metric: ``blend``, ``ttft`` or ``e2e`` (module docstring).
        e2e_weight: weight of predicted E2E in ``blend`` (>= 0; 0 = ``ttft``).
        probe_best: one probe goes to the best endpoint of this replica's recent answers.
        memory_s: how long an answer counts as recent, seconds (> 0).
        extra_probes: endpoints probed in a second round when every first-round candidate would make the
            request wait (>= 0; 0 = never).
        queue_threshold_s: "would make it wait": the candidate's predicted queueing delay (``Prediction.queue_s``)
            exceeds this, seconds (>= 0).
    """

    k: int = 2
    metric: str = "blend"
    e2e_weight: float = 0.1
    probe_best: bool = True
    memory_s: float = 1.0
    extra_probes: int = 4
    queue_threshold_s: float = 0.05

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ValueError(f"policy {TYPE!r}: k must be an integer >= 1, got {self.k!r}")
        if self.metric not in METRICS:
            raise ValueError(f"policy {TYPE!r}: metric must be one of {METRICS}, got {self.metric!r}")
        if (isinstance(self.e2e_weight, bool) or not isinstance(self.e2e_weight, int | float)
                or not math.isfinite(self.e2e_weight) or self.e2e_weight < 0):
            raise ValueError(f"policy {TYPE!r}: e2e_weight must be a finite number >= 0, got {self.e2e_weight!r}")
        if not isinstance(self.probe_best, bool):
            raise ValueError(f"policy {TYPE!r}: probe_best must be true or false, got {self.probe_best!r}")
        if (isinstance(self.memory_s, bool) or not isinstance(self.memory_s, int | float)
                or not math.isfinite(self.memory_s) or not self.memory_s > 0):
            raise ValueError(f"policy {TYPE!r}: memory_s must be a finite number > 0, got {self.memory_s!r}")
        if not isinstance(self.extra_probes, int) or isinstance(self.extra_probes, bool) or self.extra_probes < 0:
            raise ValueError(f"policy {TYPE!r}: extra_probes must be an integer >= 0, got {self.extra_probes!r}")
        if (isinstance(self.queue_threshold_s, bool) or not isinstance(self.queue_threshold_s, int | float)
                or not math.isfinite(self.queue_threshold_s) or self.queue_threshold_s < 0):
            raise ValueError(f"policy {TYPE!r}: queue_threshold_s must be a finite number >= 0, got "
                             f"{self.queue_threshold_s!r}")


class PowerOfKPolicy(Policy):
    TYPE = TYPE
    needs_predictions = True

    def __init__(self, params: Params, rng: random.Random) -> None:
        self.params = params
        self._rng = rng
        self._recent: dict[str, tuple[float, float]] = {}  # address -> (score, arrival_time_s of the answer)

    def score(self, endpoint: EndpointView) -> float:
        """The figure compared (lower is better), seconds; ``endpoint.prediction`` must be set."""
        prediction = endpoint.prediction
        if self.params.metric == "e2e":
            return prediction.e2e_s
        if self.params.metric == "ttft":
            return prediction.ttft_s
        return prediction.ttft_s + self.params.e2e_weight * prediction.e2e_s

    def candidates(self, request, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        k = self.params.k
        if k >= len(endpoints):
            return endpoints
        # k = 1 leaves no probe to explore with: memory would stick to one endpoint forever
        best = self._best_recent(request.arrival_time_s, endpoints) if self.params.probe_best and k > 1 else None
        if best is None:
            return self._rng.sample(list(endpoints), k)
        return [best, *self._rng.sample([e for e in endpoints if e is not best], k - 1)]

    def _best_recent(self, now_s: float, endpoints: Sequence[EndpointView]) -> EndpointView | None:
        since_s = now_s - self.params.memory_s
        recent = self._recent
        known = [e for e in endpoints if e.address in recent and recent[e.address][1] >= since_s]
        if len(recent) > 4 * len(endpoints):  # endpoints that left the pool: forget them
            addresses = {e.address for e in endpoints}
            self._recent = {a: v for a, v in recent.items() if a in addresses}
        return min(known, key=lambda e: recent[e.address][0]) if known else None

    def more_candidates(self, request, scored: Sequence[EndpointView],
                        endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        extra = self.params.extra_probes
        if not extra or any(e.prediction is None for e in scored):
            return ()
        if min(e.prediction.queue_s for e in scored) <= self.params.queue_threshold_s:
            return ()
        asked = {e.address for e in scored}
        rest = [e for e in endpoints if e.address not in asked]
        return self._rng.sample(rest, min(extra, len(rest)))

    def choose(self, request, endpoints: Sequence[EndpointView]) -> EndpointView | None:
        scored = [e for e in endpoints if e.prediction is not None]
        for endpoint in scored:
            self._recent[endpoint.address] = (self.score(endpoint), request.arrival_time_s)
        if not scored:
            return None
        if len(scored) < len(endpoints):
            return min_random_tie(endpoints, lambda e: e.num_in_flight, self._rng)
        return min_random_tie(scored, self.score, self._rng)


def build(params: Mapping[str, Any], rng: random.Random) -> PowerOfKPolicy:
    known = [f.name for f in fields(Params)]
    unknown = set(params) - set(known)
    if unknown:
        raise ValueError(f"policy {TYPE!r}: unknown parameter(s) {sorted(unknown)}; known: {known}")
    return PowerOfKPolicy(Params(**params), rng)
