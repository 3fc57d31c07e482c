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
Near-ties are broken by load, then at random: every candidate whose score is within ``tie_tolerance`` (relative) of
the best, or within the larger step-time model error its sidecar reports (``Prediction.model_error``, capped at
`MAX_TIE_TOLERANCE`), or worse by no more than its own model's higher price of the request itself (`idle_score`:
the score of the request on that instance idle), counts as tied with it, and among those the one with the fewest
requests in flight from this replica wins (least requests: exact and current for this replica's own traffic, and
replicas that each balance their own share balance the sum), then the one with the fewest requests by its sidecar
(`load`: ``Prediction.num_requests``, which includes requests held by other routers' concurrent Predicts, plus
``EndpointView.num_unseen_dispatches``, this replica's dispatches there that the answer does not include), then
a random one. Those unseen dispatches are priced into the score too, at the answer's own cost of one more request
like this one (``Prediction.ttft_s_per_request``, ``e2e_s_per_request``). Two sidecars' models are never exactly
alike (each is calibrated on its own engine's steps): without the
tolerance a difference of a fraction of a millisecond between two idle instances decided every request of a burst
the same way (measured through Envoy: 26 of 64 simultaneous requests on one of 8 idle instances). Calibrated on
their own engines' steps, two sidecars of identical instances differed by 20% on an idle instance's TTFT in the
herding tests (6.2 against 7.5 ms after 65 steps): at low load, where queueing adds nothing, that difference alone
sent 48% of the requests to one of 4 instances (and 4 sidecars started a few seconds before a burst differed by
2x on its idle E2E). So a difference that the models' disagreement on the request's own cost explains is not a
reason to prefer a candidate; the price is that at low load an instance that is truly faster gets only its even
share. That allowance holds only between candidates whose states hold the same number of the prompt's leading
blocks (``EndpointView.num_prefix_blocks_cached``, None counting as 0): a cache hit makes the request cheaper on
one instance for a real reason (less prefill), which the allowance would otherwise cancel, sending the request to
the cold instance whenever the queues are alike.

Cache affinity (``cache_affinity``, default on): when the candidates left after the load bound (below) hold
different numbers of the prompt's leading blocks, only those holding the most (with the exceptions below) are
compared; the prediction then chooses among the instances holding the prefix (and, when none holds any, among all
candidates). The score prices this request's own TTFT, in which a miss costs only its extra prefill (about 25 ms
for a 2,048-token context on the simulated H200 fleet). What it does not price is the KV cache the miss takes: a
second copy of the prefix on a cold instance holds its blocks (128 for that context: an eighth of an instance's
cache) beside that instance's own prefixes, evicts one of them, and the evicted prefix's next requests miss in turn. Measured on the shared-prefix
workload (working set = the fleet's KV cache; bench/README.md "Against the cache-aware routers"), choosing on the
score alone left the home for 35% of the requests at 70 req/s, the hit rate fell from 0.65 to 0.31 and the
preemptions grew 25-fold: the knee was 68 req/s. Leaving the home only when its predicted TTFT passes a bound
collapsed the same way, only later (bound 0.5 and 1 s: before 70 req/s; 2 s: past 80; 4 s and no bound: 86 req/s):
every spill copies a prefix, so spilling once the home queues turns into a cascade at the rate that makes homes
queue. Affinity therefore does not yield to an ordinary queue, only to: the load bound (below), which passes over
a home whose in-flight count is past ``max_load_ratio`` times the fleet's mean; a home whose predicted TTFT is past
``affinity_max_ttft_s`` (4 s: a frozen or far slower instance; every home of the prefix among the candidates must
be past it, and another candidate must predict a TTFT within it: when every candidate is past it, as past the
knee, a copy would only add a prefill and evict a prefix; measured on the shared-prefix workload, seeds 0-5, the
P99 TTFT at 90 req/s fell from 13.0 to 8.5 s with that condition, nothing else moved, bench/README.md "Cache
affinity past the knee"); an idle candidate (its sidecar counts no request, this replica sent it none the answer
lacks and has none in flight there: ``load`` 0), which stays in the comparison beside the homes: a copy there
delays no request, and it is how a prefix that every request shares reaches the instances that hold nothing yet
(without it, such a prefix at 100 req/s on 6 instances stayed on the 4 the load bound had spread it to,
tests/bench/test_cluster_prefix.py); a candidate whose cache state is unknown (``num_prefix_blocks_cached``
None: a sidecar that publishes no state, or another block size), which its own prediction prices; and a lead too
small to be worth a copy (under `AFFINITY_MIN_LEAD` of the prompt's blocks), where the score alone decides. What
affinity costs, and is not fixed: an instance that is slower but not past the bound keeps its prefixes' traffic
up to the load bound (measured in a small simulation: one of 4 instances 10x slower, 40 req/s: P99 TTFT 0.3-5 s
against 0.12 s without affinity), and when every instance's cache could hold every prefix, the prefixes stay
partitioned where spreading them would shorten queues (bench/README.md, "Cache affinity: what it costs").
Keeping a cold candidate whose never-used blocks could take the copy without evicting anything was tried and
lost capacity (86.2 -> 82.9 req/s): such copies happen while caches fill and leave tenants with two homes that
later crowd out others (bench/README.md, "Cache affinity: what it costs"). A charge per miss in seconds (a weight on the
extra prefill, tried before this rule) did not move the knee at any weight. Off, the score alone decides (the
earlier behaviour).

A bound on what one sidecar can pull: a candidate whose in-flight count (this replica's), counting the request
being routed, would exceed ``max_load_ratio`` times the fleet's mean (``EndpointView.mean_in_flight``, + 1 on both
sides so that small counts are not over-constrained) is passed over while another candidate stays within the
bound and its sidecar counts no more requests (else the other is busier for reasons this replica cannot see:
other replicas' traffic). A sidecar whose predictions are wrong (a restarted engine, a model still calibrating, a
bug) can then draw, whatever it predicts, about ``max_load_ratio`` times the requests of the least loaded
candidate that stands in for it (+ 1 both sides), and so at most about that multiple of its fair share of the
requests in flight. Its count (``Prediction.num_requests``, see `load`) is never taken as less than this
replica's own requests in flight there, so with one replica this holds whatever it reports; with R replicas and
``confirm_load_bound`` (below), a sidecar that under-reports is passed over once this replica's own requests there
pass ``max_load_ratio`` times the stand-in's whole count, which can let it draw up to about R times the bound. The rule
is SGLang's cache-aware router's load-balance guard (sgl-router ``cache_aware.rs``: a worker over
``balance_rel_threshold`` x the least loaded is skipped), taken on this replica's own in-flight counts.
With ``confirm_load_bound`` (default) the candidate must also be past the bound by its sidecar's count, which
includes every replica's requests: ``load + 1 > max_load_ratio * (least + 1)`` against the stand-ins' fewest. With
4 replicas each sees about a quarter of an instance's requests, and near the knee instances passed one replica's
bound by chance: on the shared-prefix workload (seeds 0-5, 4 replicas) the P99 TTFT crossing of 2 s moved from
82.0 to 85.6 req/s with the confirmation (bench/README.md, "Confirming the load bound"). One case keeps this
replica's count alone: a private home, one holding at least `AFFINITY_MIN_LEAD` of the prompt's blocks more than
every stand-in where no request on it holds them now (``EndpointView.num_prefix_blocks_in_use``: its state's
running and waiting requests) and whose deepest cached block of the prompt no earlier decision of this replica
found as its deepest hit (`PowerOfKPolicy._hits_seen_before`): a conversation between its turns, whose next turn hits the previous reply.
Releasing it moves the conversation with its copy, and on the multi-turn workload that release is what the bound
buys: confirming it too lowered the crossing from 24.5 to 24.2 sessions/s (seeds 0-3), while releasing a shared
prefix's home leaves a second home that stays and takes cache from other prefixes.

Objectives (``prefer_meeting``, default on): a request with a TTFT or TPOT objective (``RoutingRequest.objectives``,
``extproc/admission.py``) is placed among the candidates predicted to meet all of its objectives when any does (the
rules below then choose among those), and among all of them otherwise; TTFT and TPOT are not weighed against each
other, they are met or not, and the score (the blend) decides within. When no first-round candidate meets them, the
second round of probes runs as for a queue. llm-d's headroom scorer instead packs requests onto the candidate with
the least positive headroom; here the candidates that meet the objective compete on the score, which keeps the
headroom of the others for the next request.

A second round when the first finds only queues: if every first-round candidate predicts that the request
would wait there (``Prediction.queue_s`` above ``queue_threshold_s``, 50 ms), up to ``extra_probes`` (4) more
endpoints, drawn at random from the rest, are asked before choosing among all of them. Below the knee nearly
every request is placed after k probes; near saturation, where two random probes most often miss the one
instance with room, the extra probes buy the capacity of a larger k at a fraction of its cost (measured:
2.07 probes per request at 135 req/s on 12 simulated instances, bench/README.md). The request pays one more
Predict round trip only when it was going to queue anyway.

Which endpoints are probed: with ``prefix_probe`` (default on), k >= 2 and a request whose prompt blocks are known
(``RoutingRequest.block_keys``), one probe goes to the prefix's home: the endpoint whose state holds the most of the
prompt's leading blocks (``EndpointView.num_prefix_blocks_cached``; among several such homes, the one with the
fewest requests in flight from this replica, then at random: a random pick among them left the shared-prefix
workload's mean TTFT 1.03x llm-d-precise's at 45-55 req/s, the least loaded 1.00-1.01x, bench/README.md), or,
when no endpoint holds any, the endpoint that the rendezvous hash of the prompt's first block key picks among the endpoints' addresses
(`rendezvous_home`: highest ``BLAKE2b(first key, address)``; Thaler & Ravishankar 1998, "Using name-based mappings
to increase hit rates"). The hash makes a burst of identical cold prompts probe the same instance (which then
caches the prefix) instead of scattering over the fleet, and router replicas that share no state agree on that
home; an endpoint joining or leaving moves only the prefixes it wins or held. The other k - 1 probes are drawn
uniformly at random from the rest, so probes per request stay k and the prediction decides: the home's shorter
prefill (the cache hit priced by its sidecar) against the others' shorter queues. Without keys, or with k = 1 (no
probe left to explore with), all k are drawn at random. With ``probe_best`` and k >= 2, one probe goes to
the endpoint with the best score
among this replica's answers of the last ``memory_s`` seconds and the other k - 1 are drawn uniformly at random
from the rest; without it (or with no recent answer), all k are drawn at random. The remembered best is handed to
one decision only: it leaves the memory when it is handed out and comes back with that decision's fresh answers
(handed to every concurrent decision, it was probed by all of a burst and drew most of it). "Best" is the least
queueing (the score less `idle_score`), then the fewest requests: by the score itself, the sidecar whose model was
most optimistic stayed the remembered one at low load and was probed by 43 of 64 decisions of a burst (5 for
another instance), which no tie rule can spread. Off by default since predictions moved into the router: even
ranked so, the remembered endpoint was probed by up to 42 of a burst's 64 decisions through Envoy (its entry
refreshed by every decision that probed it), starving the others of probes; with k uniform probes the same
bursts spread as the power of two choices does, and in the cluster simulation memory bought nothing measurable
(``astrolabe bench cluster --policies astrolabe-k2,astrolabe-k2-mem``; README "Where Astrolabe stands"). This is the power of d choices
with memory (Shah & Prabhakar 2002, "The use of memory in randomized load balancing"): the remembered endpoint
is probed afresh, never trusted blindly, so an endpoint that filled up since loses on its fresh prediction, and
several replicas cannot herd onto it (each sidecar counts every replica's admissions). Random probes keep
looking at the rest of the fleet. With both ``prefix_probe`` and ``probe_best``, the home takes one probe and the
remembered best another when k >= 3 (one probe always stays random). Probes per request stay at most k +
``extra_probes``, whatever the fleet size.

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

import collections
import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from extproc.admission import is_idle, load, meets, predicted_ttft_s
from extproc.objectives import NO_OBJECTIVES
from extproc.policies.base import EndpointView, Policy, min_random_tie

TYPE = "astrolabe"
METRICS = ("blend", "ttft", "e2e")
AFFINITY_MIN_LEAD = 1 / 8
"""Cache affinity passes a candidate over only when it lacks at least this fraction of the prompt's full blocks
against the candidate holding the most (a copy worth keeping off it). Measured on the shared-prefix workload (seed 0,
85 req/s, P99 TTFT): 1/2 7.5 s (partly evicted contexts no longer kept their home), 1/4 1.47 s, 1/8 1.15 s,
any lead 1.21 s; a lead of one 16-token block on a 400-token prompt otherwise confined a new application to the
instances that first held that block (bench/README.md, "Cache affinity: what it costs")."""
MAX_HIT_KEYS = 65536
"""Deepest-hit block keys a policy remembers (`PowerOfKPolicy._hits_seen_before`): about 8 MiB per process."""
MAX_TIE_TOLERANCE = 0.5
"""Widest near-tie, a fraction of the best score: a sidecar reporting a larger model error still leaves a
prediction twice as good as another's decisive."""


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
        tie_tolerance: scores within this fraction of the best are near-ties, broken by load then at random
            (>= 0, at most `MAX_TIE_TOLERANCE`; a sidecar's larger ``model_error`` widens it up to that cap).
        max_load_ratio: a candidate over this multiple of the fleet's mean in-flight count is passed over while
            another is not (>= 1; 0 = no bound).
        confirm_load_bound: a candidate over that bound is passed over only when its sidecar's count is over it
            too, against the stand-in's, unless it is a private home: a prefix's home whose prefix no other request
            shares (module docstring, "A bound on what one sidecar can pull"); false = this replica's count alone.
        prefix_probe: one probe goes to the prompt's prefix home (module docstring), when the request carries
            block keys and k >= 2.
        cache_affinity: only the candidates holding the most of the prompt's leading blocks
            (``EndpointView.num_prefix_blocks_cached``) are compared when others lack at least
            `AFFINITY_MIN_LEAD` of the prompt's blocks, idle candidates and ones without a cache state excepted
            (module docstring, "Cache affinity"); false = the score alone decides.
        affinity_max_ttft_s: affinity yields when every candidate holding the most predicts a TTFT past this
            and another candidate a TTFT within it, seconds (>= 0; 0 = never).
        prefer_meeting: a request with objectives (``RoutingRequest.objectives``) is placed among the candidates
            predicted to meet them (``extproc.admission.meets``) when any does, and gets the second round of
            probes when none of the first round does (module docstring, "Objectives").
    """

    k: int = 2
    metric: str = "blend"
    e2e_weight: float = 0.1
    probe_best: bool = False
    memory_s: float = 1.0
    extra_probes: int = 4
    queue_threshold_s: float = 0.05
    tie_tolerance: float = 0.05
    max_load_ratio: float = 2.0
    prefix_probe: bool = True
    cache_affinity: bool = True
    affinity_max_ttft_s: float = 4.0
    prefer_meeting: bool = True
    confirm_load_bound: bool = True

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
        if not isinstance(self.cache_affinity, bool):
            raise ValueError(f"policy {TYPE!r}: cache_affinity must be true or false, got {self.cache_affinity!r}")
        if (isinstance(self.affinity_max_ttft_s, bool) or not isinstance(self.affinity_max_ttft_s, int | float)
                or not math.isfinite(self.affinity_max_ttft_s) or self.affinity_max_ttft_s < 0):
            raise ValueError(f"policy {TYPE!r}: affinity_max_ttft_s must be a finite number >= 0, got "
                             f"{self.affinity_max_ttft_s!r}")
        if not isinstance(self.prefer_meeting, bool):
            raise ValueError(f"policy {TYPE!r}: prefer_meeting must be true or false, got {self.prefer_meeting!r}")
        if not isinstance(self.confirm_load_bound, bool):
            raise ValueError(f"policy {TYPE!r}: confirm_load_bound must be true or false, got "
                             f"{self.confirm_load_bound!r}")
        if not isinstance(self.prefix_probe, bool):
            raise ValueError(f"policy {TYPE!r}: prefix_probe must be true or false, got {self.prefix_probe!r}")
        if (isinstance(self.memory_s, bool) or not isinstance(self.memory_s, int | float)
                or not math.isfinite(self.memory_s) or not self.memory_s > 0):
            raise ValueError(f"policy {TYPE!r}: memory_s must be a finite number > 0, got {self.memory_s!r}")
        if not isinstance(self.extra_probes, int) or isinstance(self.extra_probes, bool) or self.extra_probes < 0:
            raise ValueError(f"policy {TYPE!r}: extra_probes must be an integer >= 0, got {self.extra_probes!r}")
        if (isinstance(self.queue_threshold_s, bool) or not isinstance(self.queue_threshold_s, int | float)
                or not math.isfinite(self.queue_threshold_s) or self.queue_threshold_s < 0):
            raise ValueError(f"policy {TYPE!r}: queue_threshold_s must be a finite number >= 0, got "
                             f"{self.queue_threshold_s!r}")
        if (isinstance(self.tie_tolerance, bool) or not isinstance(self.tie_tolerance, int | float)
                or not 0 <= self.tie_tolerance <= MAX_TIE_TOLERANCE):
            raise ValueError(f"policy {TYPE!r}: tie_tolerance must be a number in [0, {MAX_TIE_TOLERANCE}], got "
                             f"{self.tie_tolerance!r}")
        if (isinstance(self.max_load_ratio, bool) or not isinstance(self.max_load_ratio, int | float)
                or not math.isfinite(self.max_load_ratio) or not (self.max_load_ratio == 0 or self.max_load_ratio >= 1)):
            raise ValueError(f"policy {TYPE!r}: max_load_ratio must be 0 (no bound) or a finite number >= 1, got "
                             f"{self.max_load_ratio!r}")


class PowerOfKPolicy(Policy):
    TYPE = TYPE
    needs_predictions = True

    def __init__(self, params: Params, rng: random.Random) -> None:
        self.params = params
        self._rng = rng
        # address -> ((queueing part of the score, load), arrival_time_s of the answer)
        self._recent: dict[str, tuple[tuple[float, int], float]] = {}
        # keys of the deepest block an earlier decision's prompt found cached (`_hits_seen_before`), oldest first
        self._hit_keys: collections.OrderedDict[int, None] = collections.OrderedDict()

    def score(self, endpoint: EndpointView) -> float:
        """The figure compared (lower is better), seconds; ``endpoint.prediction`` must be set. The requests this
        replica dispatched there that the prediction does not include (``num_unseen_dispatches``) are priced at
        the prediction's own cost of one more request like this one (``Prediction.*_per_request``)."""
        prediction, unseen = endpoint.prediction, endpoint.num_unseen_dispatches
        if self.params.metric == "ttft":
            return ttft_s(endpoint)
        e2e_s = prediction.e2e_s + unseen * prediction.e2e_s_per_request
        if self.params.metric == "e2e":
            return e2e_s
        return ttft_s(endpoint) + self.params.e2e_weight * e2e_s

    def candidates(self, request, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        k = self.params.k
        if k >= len(endpoints):
            return endpoints
        # k = 1 leaves no probe to explore with: the home or the memory would take every probe
        chosen: list[EndpointView] = []
        keys = getattr(request, "block_keys", None)
        if self.params.prefix_probe and k > 1 and keys:
            chosen.append(self.prefix_home(keys, endpoints))
        if self.params.probe_best and k - len(chosen) > 1:
            best = self._best_recent(request.arrival_time_s, [e for e in endpoints if e not in chosen])
            if best is not None:
                chosen.append(best)
        if not chosen:
            return self._rng.sample(list(endpoints), k)
        rest = [e for e in endpoints if all(e is not c for c in chosen)]
        return [*chosen, *self._rng.sample(rest, k - len(chosen))]

    def prefix_home(self, keys: Sequence[int], endpoints: Sequence[EndpointView]) -> EndpointView:
        """Where the prompt whose block keys are ``keys`` (non-empty) most likely has its prefix: the endpoint with
        the most ``num_prefix_blocks_cached`` (None counts as 0; among several, the one with the fewest requests in
        flight from this replica, then at random), or `rendezvous_home` of the first key when none has any."""
        warm = most_cached(endpoints)
        if warm[0].num_prefix_blocks_cached:
            return min_random_tie(warm, lambda e: e.num_in_flight, self._rng)
        return rendezvous_home(keys[0], endpoints)

    def _best_recent(self, now_s: float, endpoints: Sequence[EndpointView]) -> EndpointView | None:
        since_s = now_s - self.params.memory_s
        recent = self._recent
        known = [e for e in endpoints if e.address in recent and recent[e.address][1] >= since_s]
        if len(recent) > 4 * len(endpoints):  # endpoints that left the pool: forget them
            addresses = {e.address for e in endpoints}
            self._recent = {a: v for a, v in recent.items() if a in addresses}
        if not known:
            return None
        best = min(known, key=lambda e: recent[e.address][0])
        del recent[best.address]  # to this decision only; its answers bring it back
        return best

    def more_candidates(self, request, scored: Sequence[EndpointView],
                        endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        extra = self.params.extra_probes
        if not extra or any(e.prediction is None for e in scored):
            return ()
        objectives = getattr(request, "objectives", NO_OBJECTIVES)
        missed = (self.params.prefer_meeting and _has_objective(objectives)
                  and not any(meets(objectives, e, request.num_predicted_output_tokens) for e in scored))
        if not missed and min(e.prediction.queue_s for e in scored) <= self.params.queue_threshold_s:
            return ()
        asked = {e.address for e in scored}
        rest = [e for e in endpoints if e.address not in asked]
        return self._rng.sample(rest, min(extra, len(rest)))

    def choose(self, request, endpoints: Sequence[EndpointView]) -> EndpointView | None:
        scored = [e for e in endpoints if e.prediction is not None]
        for endpoint in scored:
            self._recent[endpoint.address] = ((self.score(endpoint) - self.idle_score(endpoint), load(endpoint)),
                                              request.arrival_time_s)
        if not scored:
            return None
        if len(scored) < len(endpoints):
            return min_random_tie(endpoints, lambda e: e.num_in_flight, self._rng)
        objectives = getattr(request, "objectives", NO_OBJECTIVES)
        if self.params.prefer_meeting and _has_objective(objectives):
            scored = [e for e in scored if meets(objectives, e, request.num_predicted_output_tokens)] or scored
        ratio = self.params.max_load_ratio
        if ratio:
            scored = self._within_load_bound(request, scored, ratio)
        if self.params.cache_affinity:
            scored = self._affine(request, scored)
        score = self.score
        best = min(scored, key=score)
        best_s, best_idle_s = score(best), self.idle_score(best)
        tolerance = max(self.params.tie_tolerance, min(max(e.prediction.model_error for e in scored),
                                                       MAX_TIE_TOLERANCE))
        best_cached = best.num_prefix_blocks_cached or 0
        tied = [e for e in scored
                if score(e) <= best_s * (1 + tolerance) + (max(self.idle_score(e) - best_idle_s, 0.0)
                                                                if (e.num_prefix_blocks_cached or 0) == best_cached
                                                                else 0.0)]
        return min_random_tie(tied, lambda e: (e.num_in_flight, load(e)), self._rng)

    def _affine(self, request, scored: list[EndpointView]) -> list[EndpointView]:
        """``scored`` less the cold candidates that cache affinity passes over (module docstring, "Cache affinity"):
        those lacking, against the candidate holding the most, at least `AFFINITY_MIN_LEAD` of the prompt's full
        blocks (``RoutingRequest.block_keys``), unless idle (``load`` 0) or without a known cache state
        (``num_prefix_blocks_cached`` None: their sidecar prices the hit itself). None is passed over when every
        candidate holding the most predicts a TTFT (`ttft_s`) past ``affinity_max_ttft_s`` while another predicts
        one within it."""
        most = max((e.num_prefix_blocks_cached or 0) for e in scored)
        lead = affinity_lead(request)
        if not most or most < lead:
            return scored
        bound_s = self.params.affinity_max_ttft_s
        if bound_s and all(ttft_s(e) > bound_s for e in scored if e.num_prefix_blocks_cached == most) \
                and any(ttft_s(e) <= bound_s for e in scored if e.num_prefix_blocks_cached != most):
            return scored
        return [e for e in scored if e.num_prefix_blocks_cached is None or is_idle(e)
                or most - e.num_prefix_blocks_cached < lead]

    def idle_score(self, endpoint: EndpointView) -> float:
        """`score` of the request on the candidate's instance idle, by its sidecar's model (``ttft_s - queue_s``,
        ``Prediction.idle_e2e_s``; an unknown idle E2E counts as 0): the request's own cost as that sidecar prices
        it. Sidecars of like instances differ here only by their models. ``endpoint.prediction`` must be set."""
        prediction = endpoint.prediction
        idle_s = idle_ttft_s(endpoint)
        if self.params.metric == "ttft":
            return idle_s
        if self.params.metric == "e2e":
            return prediction.idle_e2e_s
        return idle_s + self.params.e2e_weight * prediction.idle_e2e_s

    def _hits_seen_before(self, request, scored: Sequence[EndpointView]) -> frozenset[str]:
        """The addresses of the candidates whose deepest cached block for this prompt (the key of the prompt's last
        block the candidate holds, ``num_prefix_blocks_cached``) an earlier decision of this replica found as its
        deepest hit: the prefix they hold is shared by several requests (a tenant's context, a system prompt), not
        the tail of one conversation (whose next turn hits the previous reply, a block no earlier prompt hit).
        Each candidate is looked up by its own deepest block, so a shallower home of a shared system prompt is
        seen even when a deeper, unseen home of the conversation was probed beside it. Records this decision's
        deepest hit (the most among ``scored``); runs on every decision with ``confirm_load_bound`` (a prefix is
        learnt as shared while the bound does not matter) and remembers the last `MAX_HIT_KEYS` such keys, one
        memory per policy object (per extproc worker process)."""
        keys = getattr(request, "block_keys", None)
        if not keys:
            return frozenset()
        hits = self._hit_keys
        seen = set()
        deepest = 0
        for e in scored:
            cached = min(e.num_prefix_blocks_cached or 0, len(keys))
            if cached and keys[cached - 1] in hits:
                seen.add(e.address)
                hits.move_to_end(keys[cached - 1])
            deepest = max(deepest, cached)
        if deepest:
            hits[keys[deepest - 1]] = None
            if len(hits) > MAX_HIT_KEYS:
                hits.popitem(last=False)
        return frozenset(seen)

    def _within_load_bound(self, request, scored: list[EndpointView], ratio: float) -> list[EndpointView]:
        """``scored`` less the candidates over the load bound that another candidate can stand in for: one within
        the bound that counts no more requests (`load`: its sidecar's count, floored at this replica's in flight)
        than the one it replaces. The second condition keeps the bound from sending work to an instance that is
        busier for reasons this replica cannot see (other replicas' or other routers' requests). With
        ``confirm_load_bound``, the candidate must moreover be past the bound by its sidecar's count, ``load + 1 >
        max_load_ratio * (least + 1)`` against the stand-ins' fewest, unless it is a private home: it holds at
        least `AFFINITY_MIN_LEAD` of the prompt's blocks more than every stand-in, no request on it holds them now
        (``EndpointView.num_prefix_blocks_in_use``) and no earlier decision's deepest hit was its own deepest cached
        block (`_hits_seen_before`) (module docstring, "A bound on what one sidecar can pull")."""
        within = [e for e in scored if e.num_in_flight + 1 <= ratio * (e.mean_in_flight + 1)]
        seen = self._hits_seen_before(request, scored) if self.params.confirm_load_bound else frozenset()
        if not within or len(within) == len(scored):
            return scored
        least = min(load(e) for e in within)
        if not self.params.confirm_load_bound:
            return [e for e in scored if e in within or load(e) < least]
        fewest = min((e.num_prefix_blocks_cached or 0) for e in within)
        lead = affinity_lead(request)

        def private_home(e: EndpointView) -> bool:
            return ((e.num_prefix_blocks_cached or 0) - fewest >= lead and e.address not in seen
                    and (e.num_prefix_blocks_in_use or 0) - fewest < lead)
        return [e for e in scored if e in within or load(e) < least
                or (not private_home(e) and load(e) + 1 <= ratio * (least + 1))]


def affinity_lead(request) -> float:
    """The fewest of the prompt's full blocks (``RoutingRequest.block_keys``) by which one candidate must hold more
    than another for affinity to count: `AFFINITY_MIN_LEAD` of them, and at least one block."""
    return max(len(getattr(request, "block_keys", None) or ()) * AFFINITY_MIN_LEAD, 1)


def _has_objective(objectives) -> bool:
    return objectives.ttft_s is not None or objectives.tpot_s is not None


def rendezvous_home(key: int, endpoints: Sequence[EndpointView]) -> EndpointView:
    """The endpoint that rendezvous (highest-random-weight) hashing gives block key ``key``: the one with the
    highest 64-bit BLAKE2b of (key, address). The same for every process given the same addresses, whatever their
    order; removing an endpoint moves only the keys it had.

    Source: Thaler & Ravishankar, "Using name-based mappings to increase hit rates", IEEE/ACM ToN 1998.

    Raises:
        ValueError: no endpoints.
    """
    prefix = (key % (1 << 64)).to_bytes(8, "little")
    return max(endpoints, key=lambda e: (hashlib.blake2b(prefix + e.address.encode("utf-8"), digest_size=8).digest(),
                                         e.address))


def most_cached(candidates: Sequence[EndpointView]) -> Sequence[EndpointView]:
    """The candidates holding the most of the prompt's leading blocks (``num_prefix_blocks_cached``, None counting
    as 0), or all of them when none holds any."""
    most = max((e.num_prefix_blocks_cached or 0) for e in candidates)
    if not most:
        return candidates
    return [e for e in candidates if (e.num_prefix_blocks_cached or 0) == most]


ttft_s = predicted_ttft_s
"""The request's predicted TTFT on a candidate, with this replica's unseen dispatches there priced in
(``extproc.admission.predicted_ttft_s``)."""


def idle_ttft_s(endpoint: EndpointView) -> float:
    """The request's TTFT on ``endpoint``'s instance idle, seconds, by its sidecar's model: ``Prediction.ttft_s`` less
    ``queue_s`` (its prefill of what the instance's cache does not hold, and its first decode step);
    ``endpoint.prediction`` must be set."""
    return endpoint.prediction.ttft_s - endpoint.prediction.queue_s


def build(params: Mapping[str, Any], rng: random.Random) -> PowerOfKPolicy:
    known = [f.name for f in fields(Params)]
    unknown = set(params) - set(known)
    if unknown:
        raise ValueError(f"policy {TYPE!r}: unknown parameter(s) {sorted(unknown)}; known: {known}")
    return PowerOfKPolicy(Params(**params), rng)
