"""One cluster-benchmark point: N simulated vLLM instances behind one production policy, in virtual time.

Owns ``ClusterConfig``, ``ClusterRequest``, ``ClusterSession``, ``PointResult``, the output-length error models
(``sample_predicted_tokens``-style callables), ``simulate_point`` (an open trace) and
``simulate_sessions_latencies`` (closed-loop sessions). Imports ``predictor.sim`` (one ``Engine``
per instance: the project's only scheduler model), ``extproc.policies`` (the policy objects the extproc
runs, built by ``build_policy``) and ``bench.migration`` (Llumnix's live migration, run beside a policy whose
spec carries ``MigrationParams``: ``llumnix-migrate``); no I/O, no processes, no real clock except for ``wall_s``.

NOTE: what each policy sees, as in production:
- ``num_in_flight``: the router's own count, dispatched minus finished (a request's finish is known when its
  last token is produced, as Envoy closes the ext_proc stream then);
- ``num_recent_requests``: the router's dispatch times within the policy's ``recent_window_s``;
- ``metrics`` (policies with ``needs_metrics``): the engine's gauges sampled at the last multiple of
  ``metrics_interval_s`` before the arrival, not the engine's state at the arrival (GIE scrapes every 50 ms).
  ``num_waiting_prompt_blocks`` is filled from the sampled waiting queue (prompt + generated tokens of each
  waiting request, in blocks), as Llumnix's in-engine llumlet would report it; vLLM's /metrics does not carry
  it, so the extproc's scraper leaves it None;
- ``prediction`` (policies with ``needs_predictions``, candidates only): ``predictor.sim.predict`` on the
  instance's snapshot in which every admitted request's output length is its PREDICTED length (the sidecar
  knows only the tagger's estimates), for the new request with its predicted length. The engine itself runs
  every request with its TRUE length.
- ``num_prefix_blocks_cached`` (requests with block keys: ``ClusterRequest.block_keys``): the leading prompt blocks
  the instance holds or caches, read from the engine's block pool with exact states, from the last published
  state (its requests' prompt keys and ``InstanceSnapshot.cached_block_keys``) with stale ones. The engine gets the
  keys of prompt and reply blocks; sidecar states and the router see the prompt's only. Every policy hears of each
  finished request (``Policy.on_finished``).
Sampling an engine at time t completes the step in flight at t (steps are atomic), so a sample may be up to one
step (~10-40 ms) newer than t.

NOTE: the decision path (``ClusterConfig.staleness_s``, ``decision_latency_s``), as the extproc's default
``predictor_client.mode: watch`` runs it (``extproc/fleet_state.py``):
- **stale states**: with ``staleness_s`` > 0 each instance's sidecar publishes its state (the snapshot above) every
  ``staleness_s`` seconds, at its own phase (sidecars start at different times), and every decision predicts
  from the last one published: a state up to ``staleness_s`` old, the same for every decision until the next
  one. ``staleness_s`` 0 = each decision sees the instance as it is at the decision (the exact state);
- **a replica's own dispatches**: the ones a state does not include (dispatched after it was taken, or not yet
  at the instance) are queued into that state as waiting requests for that replica's decisions only, as
  ``FleetState.predict`` queues its own unseen Admits; other replicas' dispatches are seen only from the first
  state that includes them. A state includes a request once the request has reached its instance (the Admit
  and the request travel about as long);
- **the state's age**: with the router's own function (``extproc.fleet_state.predict_from_state``), TTFT and E2E
  shrink by ``min(age, the wait the state's own requests cause)`` plus ``min(time since the replica's first unseen
  dispatch there, the wait the unseen dispatches add)``;
- **decision latency**: every request (every policy's) reaches its instance ``decision_latency_s`` after it
  arrived; TTFT and E2E are measured from the arrival, so they include it. The replica counts the request in
  flight from the decision.
With both 0 the simulation is the exact one it always was (same seed, same numbers).

NOTE: with migration, one controller (Llumnix's global scheduler, not a router replica) polls the engines'
exact state every ``MigrationParams.polling_interval_s`` and moves running requests with their KV between
engines (``bench.migration``). A moved request keeps its progress and timestamps; the routers keep counting it
against the instance they dispatched it to (they never learn of the move); its sidecar state moves with it.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import itertools
import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.migration import MigrationController, MigrationParams
from extproc.admission import AdmissionParams, CriticalPressure, meets, shed_reason
from extproc.objectives import NO_OBJECTIVES, Objectives
from extproc.fleet_state import leading_blocks, predict_from_state
from extproc.lengths import capped_output_tokens
from extproc.policies.base import EndpointMetrics, EndpointView, Policy, Prediction
from extproc.policies.least_requests import LeastRequestsPolicy
from extproc.policies.registry import build_policy
from extproc.request import RoutingRequest
from predictor.sim import (
    Engine,
    EngineConfig,
    InstanceSnapshot,
    LinearBatchTimeModel,
    RequestState,
    SimRequest,
    StepResult,
    blocks_for_tokens,
)
from predictor.sim.request import vllm_priority
from predictor.sim.residual import FixedExtraTokens, ResidualLengthModel

logger = logging.getLogger(__name__)

A30_LIKE_NUM_GPU_BLOCKS = 1024
"""Default KV cache: 1,024 blocks of 16 tokens = 16,384 tokens, what Llama-2-7B (fp16, 0.5 MiB of KV per token)
leaves on a 24 GiB A30 at gpu_memory_utilization 0.9: 21.6 GiB - 12.6 GiB weights - ~1 GiB activations ≈ 8 GiB.
The paper's testbed was 12x A30; an H200 would hold ~13,800 blocks, enough that 48 ShareGPT requests never press
on KV and the memory-aware baselines (INFaaS++, Llumnix-) would degenerate to counting running requests. Step
times still come from the H200 model, so absolute rates are higher than the paper's."""

LOGNORMAL_SIGMA = 0.88
"""Spread of the default length-error model, log(pred / true) ~ Normal(0, 0.88²): the standard deviation of the
held-out log errors of the project's light tagger (``tagger/weights/light/errors.npz``, 2,054 ShareGPT pairs);
median |error| ≈ 0.49 in log space, i.e. a typical miss by a factor of ~1.6."""


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The simulated fleet and what the routers see.

    Attributes:
        num_instances: simulated vLLM instances (>= 1).
        engine: each instance's scheduler settings (vLLM names).
        batch_time_model: shipped ``LinearBatchTimeModel`` name (H200 profile).
        metrics_interval_s: metrics refresh period for ``needs_metrics`` policies, seconds (> 0).
        prediction_noise_frac: stddev of the multiplicative Gaussian noise on predicted TTFT and E2E (>= 0).
        seed: seeds the policies', the router assignment's and the noise's RNGs.
        num_routers: router replicas (>= 1). Each arrival goes to one chosen uniformly at random (as a Service
            spreads connections); each replica has its own policy object, in-flight counts, dispatch history
            and metrics scrapes (at its own phase of the interval); the sidecars see every replica's admissions.
        residual: expected output length of a live request from its predicted length and progress
            (``predictor.sim.residual``), as the sidecars apply it; default: the reference system's rule.
        instance_time_scales: per instance, a factor on every step time (a heterogeneous fleet: older GPUs, a
            noisy neighbour); None = all 1.0. Each instance's sidecar predicts with its own instance's model
            (a sidecar is calibrated to the instance beside it).
        staleness_s: each sidecar publishes its state every this many seconds and decisions predict from the last
            one (module NOTE on the decision path); 0 = the exact state at each decision. Seconds, >= 0.
        decision_latency_s: from a request's arrival to its arrival at the chosen instance, seconds (>= 0).

    Raises:
        ValueError: a count below 1, bad time scales, a negative or non-finite staleness or latency.
    """

    num_instances: int = 12
    engine: EngineConfig = EngineConfig(max_num_seqs=48, max_num_batched_tokens=512, block_size=16,
                                        num_gpu_blocks=A30_LIKE_NUM_GPU_BLOCKS)
    batch_time_model: str = "llama-2-7b"
    metrics_interval_s: float = 0.05
    prediction_noise_frac: float = 0.0
    seed: int = 0
    num_routers: int = 1
    residual: ResidualLengthModel = field(default_factory=FixedExtraTokens)
    instance_time_scales: tuple[float, ...] | None = None
    staleness_s: float = 0.0
    decision_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_routers < 1 or self.num_instances < 1:
            raise ValueError("num_routers and num_instances must be >= 1")
        for name in ("staleness_s", "decision_latency_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (seconds), got {value!r}")
        scales = self.instance_time_scales
        if scales is not None and (len(scales) != self.num_instances or not all(s > 0 for s in scales)):
            raise ValueError(f"instance_time_scales needs {self.num_instances} factors > 0, got {scales}")


@dataclass(frozen=True, slots=True)
class ClusterRequest:
    """One trace request: arrival (virtual seconds), true prompt/output tokens, output tokens the router predicts,
    and the request's ``max_tokens`` cap (None: uncapped; the sidecars cap residual lengths with it).

    ``block_keys``: keys of the full blocks of its prompt AND reply tokens (``bench.workloads.KeyedTurn``); None =
    token ids unknown (no prefix caching for it). The engine gets them all (a reply's blocks are cached for the
    next turn, as vLLM does); the router and the sidecar states see only the prompt's (`prompt_block_keys`).

    ``length_residual``: the request's own predicted length distribution (``predictor.sim.residual
    .TaggerQuantileResidual`` over the tagger's quantiles for its kind of turn), which the sidecars then use for it
    instead of the fleet's rule; None = the fleet's rule (``ClusterConfig.residual``).

    ``objectives``: its latency objectives and priority (``extproc.admission``), as the extproc resolves them from
    its headers; they steer the choice and, with a policy's ``admission``, may refuse it.
    """

    arrival_time_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_predicted_output_tokens: int
    max_tokens: int | None = None
    block_keys: tuple[int, ...] | None = None
    length_residual: ResidualLengthModel | None = None
    objectives: Objectives = NO_OBJECTIVES

    def prompt_block_keys(self, block_size: int) -> tuple[int, ...] | None:
        """The keys of the prompt's full blocks (None without keys)."""
        return None if self.block_keys is None else self.block_keys[:self.num_prompt_tokens // block_size]


MIN_THINK_TIME_S = 0.1
"""Shortest think time a session may have, seconds: the closed-loop simulation advances the fleet in steps of the
shortest think time of the run (`simulate_sessions_latencies`), so a shorter one would make it slow."""


@dataclass(frozen=True, slots=True)
class ClusterSession:
    """A closed-loop session (multi-turn chat): its first turn arrives at ``start_s`` (virtual seconds), each
    later turn ``think_times_s[k]`` seconds after turn k's reply ENDS (its last token) in the simulation.

    Attributes:
        start_s: the first turn's arrival, seconds.
        turns: the turns in order (their ``arrival_time_s`` is ignored: the simulation sets it).
        think_times_s: one per gap between turns (``len(turns) - 1``), each >= `MIN_THINK_TIME_S`.

    Raises:
        ValueError: no turns, a wrong number of think times, or one below `MIN_THINK_TIME_S`.
    """

    start_s: float
    turns: tuple[ClusterRequest, ...]
    think_times_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.turns or len(self.think_times_s) != len(self.turns) - 1:
            raise ValueError(f"a session needs >= 1 turn and one think time per gap, got {len(self.turns)} turns, "
                             f"{len(self.think_times_s)} think times")
        if any(not t >= MIN_THINK_TIME_S for t in self.think_times_s):
            raise ValueError(f"think times must be >= {MIN_THINK_TIME_S} s, got {min(self.think_times_s)}")


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A policy under test: ``label`` (table/plot name), registry ``name`` and its ``params``.

    ``name`` is a registry name of ``extproc.policies`` or `ENVOY_LEAST_REQUEST` (Envoy's own load balancer,
    `EnvoyLeastRequest`, no ext_proc). ``residual`` replaces the fleet's residual-length rule for this policy's
    sidecars (e.g. the reference system's rule for the paper's configuration); None = ``ClusterConfig.residual``.
    ``migration``: Llumnix's live migration run beside the policy (``bench.migration``); None or a bandwidth of 0
    = none. ``staleness_s`` replaces ``ClusterConfig.staleness_s`` for this policy (None = the fleet's), so that
    one run compares several stalenesses on the same traces.
    ``admission``: the extproc's admission rule (``extproc.admission.shed_reason``) applied to this policy's
    probed candidates, with ``protect_ttft_s`` the ``headroom`` rule's bound (seconds; None = none) and
    ``pressure_window_s`` its ``extproc.admission.CriticalPressure`` window (seconds; 0 = none), one per router
    replica; None = no admission. Only a predicting policy can refuse (the rule reads predictions).
    ``engine_priority``: the engines run vLLM's ``--scheduling-policy priority`` (``predictor.sim.scheduler``) and
    every request carries its objectives' priority to them (``predictor.sim.request.vllm_priority``); the sidecars'
    states and the predictions carry it too. False = FCFS, as ``ClusterConfig.engine`` says.
    """

    label: str
    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    residual: ResidualLengthModel | None = None
    migration: MigrationParams | None = None
    staleness_s: float | None = None
    admission: AdmissionParams | None = None
    protect_ttft_s: float | None = None
    pressure_window_s: float = 0.0
    engine_priority: bool = False


@dataclass(frozen=True, slots=True)
class PointResult:
    """Outcome of one (policy, rate) point. Latencies in seconds, over completed requests.

    Attributes:
        num_preemptions: preemptions summed over instances.
        predictor_calls_per_request: predictions made / requests routed.
        num_fallbacks: requests the policy could not place (returned None) that went to least-requests.
        wall_s: wall-clock seconds the point took.
        num_routers: router replicas of the point.
        num_migrations_started / num_migrations_completed / num_migrations_aborted: live migrations
            (``bench.migration.MigrationStats``; 0 without migration).
        migration_stall_s: seconds migrated requests spent stalled in their last stage, summed.
        engine_time_lost_s: seconds of engine time lost to copies, summed over instances (steps slowed by the
            copy's interference plus steps held back by a blocking copy).
        requests_per_instance: requests dispatched to each instance (address order).
        window_max_over_mean: per `SHARE_WINDOW_S` window of arrivals, the most requests any instance got over the
            mean per instance, averaged over the windows (1.0 = perfectly even; herding shows here before it
            shows in the whole trace's shares).
        num_windows: windows averaged in ``window_max_over_mean``.
        prefix_cache_queries / prefix_cache_hits: prompt tokens looked up in the engines' prefix caches at first
            admissions and those found cached, summed over instances (``Scheduler.prefix_cache_queries`` /
            ``prefix_cache_hits``, vLLM's ``vllm:prefix_cache_queries`` / ``hits``).
        request_rate_qps: requests per second that arrived between the first and the last arrival (for sessions:
            between the first and the last session's START, while sessions keep starting, which leaves out the
            ramp-down of the last sessions' later turns): what ``rate_qps`` gave.
        num_shed: requests the policy's admission rule refused (``PolicySpec.admission``; never dispatched).
        num_shed_unprobed_met: of those, the ones for which an instance that was not probed was predicted (by the
            same model, at the same moment) to meet the request's objectives: what probing only k + extra
            instances costs admission.
        arrival_span_s: seconds from the first to the last arrival (the span goodput is taken over).
    """

    policy: str
    rate_qps: float
    num_requests: int
    num_completed: int
    ttft_mean_s: float
    ttft_p99_s: float
    e2e_mean_s: float
    e2e_p99_s: float
    tpot_mean_s: float
    num_preemptions: int
    predictor_calls_per_request: float
    num_fallbacks: int
    wall_s: float
    num_routers: int = 1
    num_migrations_started: int = 0
    num_migrations_completed: int = 0
    num_migrations_aborted: int = 0
    migration_stall_s: float = 0.0
    engine_time_lost_s: float = 0.0
    requests_per_instance: tuple[int, ...] = ()
    window_max_over_mean: float = math.nan
    num_windows: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    request_rate_qps: float = math.nan
    num_shed: int = 0
    num_shed_unprobed_met: int = 0
    arrival_span_s: float = math.nan


SHARE_WINDOW_S = 1.0
"""Window of `PointResult.window_max_over_mean`, seconds of arrivals: ~130 requests over 12 instances near the
knee, enough that a policy spreading evenly stays near 1 and short enough that a herd of one state's lifetime
(<= 0.25 s) shows."""

ENVOY_LEAST_REQUEST = "envoy-least-request"
"""Label of Envoy's own ``LEAST_REQUEST`` load balancer in the benchmarks (a baseline, not an extproc policy)."""


class EnvoyLeastRequest(Policy):
    """A model of Envoy's ``LEAST_REQUEST`` load balancer with its defaults (what a user picks without us).

    Rule (equal host weights, ``choice_count`` 2, N_CHOICES): draw ``choice_count`` hosts uniformly WITH
    replacement, keep the first draw unless a later one has strictly fewer active requests. Active requests are
    that Envoy's own (``rq_active`` of the host, shared by its workers, not by other Envoy replicas): here the
    router replica's ``num_in_flight``.

    Source: envoyproxy/envoy ``source/extensions/load_balancing_policies/least_request/least_request_lb.cc``
    (``LeastRequestLoadBalancer::unweightedHostPickNChoices``), ``least_request.proto`` (choice_count default 2).
    """

    TYPE = ENVOY_LEAST_REQUEST

    def __init__(self, rng: random.Random, choice_count: int = 2) -> None:
        self._rng = rng
        self.choice_count = choice_count

    def choose(self, request, endpoints: Sequence[EndpointView]) -> EndpointView:
        best = endpoints[self._rng.randrange(len(endpoints))]
        for _ in range(self.choice_count - 1):
            sampled = endpoints[self._rng.randrange(len(endpoints))]
            if sampled.num_in_flight < best.num_in_flight:
                best = sampled
        return best


def build_sim_policy(spec: PolicySpec, rng: random.Random) -> Policy:
    """The policy object of ``spec``: `EnvoyLeastRequest` or a production policy from the registry.

    Raises:
        ValueError: unknown name or bad parameters.
    """
    if spec.name == ENVOY_LEAST_REQUEST:
        unknown = set(spec.params) - {"choice_count"}
        if unknown:
            raise ValueError(f"{ENVOY_LEAST_REQUEST}: unknown parameter(s) {sorted(unknown)}")
        return EnvoyLeastRequest(rng, int(spec.params.get("choice_count", 2)))
    return build_policy(spec.name, spec.params, rng)


class LognormalLengthError:
    """``sample_predicted_tokens(true_tokens, rng) -> int``: true × exp(Normal(0, sigma²)), rounded, >= 1.

    Args:
        sigma: stddev of log(pred / true) (>= 0); default ``LOGNORMAL_SIGMA``.
    """

    def __init__(self, sigma: float = LOGNORMAL_SIGMA) -> None:
        if not sigma >= 0:
            raise ValueError(f"sigma must be >= 0, got {sigma}")
        self.sigma = sigma

    def __call__(self, num_true_tokens: int, rng: random.Random) -> int:
        return max(1, round(num_true_tokens * math.exp(rng.gauss(0.0, self.sigma))))


SamplePredictedTokens = Callable[[int, random.Random], int]
"""An output-length error model: (true output tokens, rng) -> predicted output tokens (>= 1)."""


def oracle_lengths(num_true_tokens: int, rng: random.Random) -> int:
    """The error-free model (``--oracle-lengths``): predicted = true."""
    return num_true_tokens


def _sampled_metrics(engine: Engine, sample_time_s: float) -> tuple[float, EndpointMetrics]:
    scheduler = engine.scheduler
    block_size = scheduler.config.block_size
    return sample_time_s, EndpointMetrics(
        num_requests_running=len(scheduler.running),
        num_requests_waiting=len(scheduler.waiting),
        kv_cache_usage_frac=scheduler.kv_cache_usage_frac,
        num_free_blocks=scheduler.num_free_blocks,
        num_gpu_blocks=scheduler.config.num_gpu_blocks,
        num_waiting_prompt_blocks=sum(blocks_for_tokens(r.num_tokens, block_size) for r in scheduler.waiting),
    )


class _Router:
    """One router replica's own view: its policy object, in-flight counts, dispatch times and metrics scrapes."""

    def __init__(self, config: ClusterConfig, spec: PolicySpec, index: int) -> None:
        rng = random.Random(config.seed * 1000 + index)
        self.policy = build_sim_policy(spec, rng)
        self.fallback = LeastRequestsPolicy(rng)
        self.in_flight = [0] * config.num_instances
        self.dispatch_times_s = [collections.deque() for _ in range(config.num_instances)]
        self.metrics: list[tuple[float, EndpointMetrics] | None] = [None] * config.num_instances
        # per instance, this replica's dispatches its sidecar's last state may not include yet:
        # (decision time, request id, request), oldest first (only with stale states or a decision latency)
        self.unseen: list[collections.deque] = [collections.deque() for _ in range(config.num_instances)]
        # Replicas scrape at their own phase of the interval (they start at different times).
        self.phase_s = config.metrics_interval_s * index / config.num_routers
        self.last_sample_s = -math.inf
        self.pressure = CriticalPressure(spec.pressure_window_s)


class _Cluster:
    """Engines plus the router-side state of one point (see the module NOTE)."""

    def __init__(self, config: ClusterConfig, spec: PolicySpec) -> None:
        self.config = config
        self.routers = [_Router(config, spec, r) for r in range(config.num_routers)]
        self.residual = spec.residual or config.residual
        self._per_request_rules = spec.residual is None  # a policy's own rule (the paper's) applies to every request
        self.policy = self.routers[0].policy
        self._assign_rng = random.Random(config.seed + 2)
        self._noise_rng = random.Random(config.seed + 1)
        base = LinearBatchTimeModel.default(config.batch_time_model)
        scales = config.instance_time_scales or (1.0,) * config.num_instances
        self.batch_times = [base.scaled(scale) for scale in scales]
        engine = dataclasses.replace(config.engine, scheduling_policy="priority") if spec.engine_priority else (
            config.engine)
        self.engines = [Engine(engine, model) for model in self.batch_times]
        # Zero-padded names keep address order equal to index order (policies see endpoints in address order).
        self.addresses = [f"instance-{i:03d}" for i in range(config.num_instances)]
        self.index = {a: i for i, a in enumerate(self.addresses)}
        # request id -> (router replica, instance it dispatched the request to)
        self.router_of: dict[str, tuple[int, int]] = {}
        self.predicted: list[dict[str, tuple[int, int | None, ResidualLengthModel]]] = [
            {} for _ in range(config.num_instances)]
        self.finished: list[SimRequest] = []
        # request id -> the RoutingRequest its policy decided on (for Policy.on_finished)
        self.routing_requests: dict[str, RoutingRequest] = {}
        # called with each finished request (the closed-loop sessions schedule the next turn from it)
        self.on_request_finished: Callable[[SimRequest], None] | None = None
        self.block_size = config.engine.block_size
        self.num_predictions = 0
        self.num_fallbacks = 0
        self.admission = spec.admission if self.policy.needs_predictions else None
        self.protect_ttft_s = spec.protect_ttft_s
        # request id -> the admission rule's reason for refusing it
        self.shed: dict[str, str] = {}
        self.num_shed_unprobed_met = 0
        migration = spec.migration
        self.migration = (MigrationController(migration, self.engines, self._moved)
                          if migration is not None and migration.enabled else None)
        self.dispatched_to: dict[str, int] = {}
        self.latency_s = config.decision_latency_s
        self.staleness_s = config.staleness_s if spec.staleness_s is None else spec.staleness_s
        if not (math.isfinite(self.staleness_s) and self.staleness_s >= 0):
            raise ValueError(f"staleness_s must be a finite number >= 0 (seconds), got {self.staleness_s!r}")
        # Sidecar states the routers predict from (staleness_s > 0): per instance the last one published (the
        # snapshot and the ids of the requests in it) and when the next one is due; the first at time 0 (the
        # extproc waits for every sidecar's first state before it decides), then every staleness_s at a phase
        # of the instance's own.
        self.tracks_unseen = self.policy.needs_predictions and (self.staleness_s > 0 or self.latency_s > 0)
        # per instance, dispatches on their way (arrival at the instance, id, request), earliest first
        self.in_transit: list[collections.deque] = [collections.deque() for _ in self.engines]
        self.published: list[tuple[InstanceSnapshot, frozenset[str]]] = []
        # per instance, the block keys its last published state shows: those held or cached, and those its
        # requests hold (built on first use after a publish)
        self.published_keys: list[tuple[frozenset[int], frozenset[int]] | None] = []  # (held or cached, held)
        self.next_state_s: list[float] = []
        if self.staleness_s > 0 and self.policy.needs_predictions:
            phase_rng = random.Random(config.seed + 3)
            self.next_state_s = [phase_rng.uniform(0.0, self.staleness_s) for _ in self.engines]
            self.published = [self._sidecar_state(i, 0.0) for i in range(config.num_instances)]
            self.published_keys = [None] * config.num_instances

    def _collect(self, i: int, steps: list[StepResult]) -> None:
        for step in steps:
            for request in step.output.finished:
                self.finished.append(request)
                r, dispatched_to = self.router_of.pop(request.request_id)
                self.routers[r].in_flight[dispatched_to] -= 1
                del self.predicted[i][request.request_id]
                routed = self.routing_requests.pop(request.request_id, None)  # None: dispatched without route()
                if routed is not None:
                    self.routers[r].policy.on_finished(routed, self.addresses[dispatched_to])
                if self.on_request_finished is not None:
                    self.on_request_finished(request)

    def _moved(self, request_id: str, src: int, dst: int) -> None:
        """A migration moved ``request_id`` from instance ``src`` to ``dst``: its sidecar state follows it."""
        self.predicted[dst][request_id] = self.predicted[src].pop(request_id)

    def _next_scrape(self, time_s: float) -> tuple[float, _Router] | None:
        """The earliest replica scrape due at or before ``time_s`` (None: none, or a policy without metrics)."""
        if not self.policy.needs_metrics:
            return None
        interval_s = self.config.metrics_interval_s
        due = [(r.phase_s + math.floor((time_s - r.phase_s) / interval_s) * interval_s, r) for r in self.routers]
        due = [(t, r) for t, r in due if t > r.last_sample_s and t <= time_s]
        return min(due, key=lambda x: x[0]) if due else None

    def _advance_engines(self, time_s: float) -> None:
        for i, engine in enumerate(self.engines):
            self._collect(i, engine.advance_to(time_s))

    def _sidecar_state(self, i: int, time_s: float) -> tuple[InstanceSnapshot, frozenset[str]]:
        """Instance ``i``'s state as its sidecar publishes it at ``time_s`` (the engine advanced to it), and the ids
        of the requests in it: the engine's queues plus, as waiting, the requests that reached the instance by
        ``time_s`` but wait for the engine's next step to join (a sidecar counts them from their Admit)."""
        snapshot = self.snapshot(i).fit_to_kv_cache()
        ids = {r.request_id for r in (*snapshot.running, *snapshot.waiting)}
        transit = self.in_transit[i]
        while transit and (transit[0][1] in ids or transit[0][1] not in self.router_of):
            transit.popleft()
        arrived = []
        for arrival_s, request_id, request in transit:
            if arrival_s > time_s:
                break
            if request_id not in ids and request_id in self.router_of:
                arrived.append(snapshot.fit_request(self._expected_state(request_id, request)))
                ids.add(request_id)
        if arrived:
            snapshot = dataclasses.replace(snapshot, waiting=(*snapshot.waiting, *arrived))
        return snapshot, frozenset(ids)

    def advance_to(self, time_s: float) -> None:
        # Every replica's scrapes, every migration event and every sidecar state published up to time_s, in time
        # order (scrapes first on ties, then migrations), each seeing the engines at its own time.
        while True:
            scrape = self._next_scrape(time_s)
            migration_s = self.migration.next_event_s() if self.migration is not None else math.inf
            state_s = min(self.next_state_s, default=math.inf)
            if scrape is not None and scrape[0] <= migration_s and scrape[0] <= state_s:
                sample_s, router = scrape
                for i, engine in enumerate(self.engines):
                    self._collect(i, engine.advance_to(sample_s))
                    router.metrics[i] = _sampled_metrics(engine, sample_s)
                router.last_sample_s = sample_s
            elif migration_s <= time_s and migration_s <= state_s:
                self._advance_engines(migration_s)
                self.migration.handle(migration_s)
            elif state_s <= time_s:
                i = self.next_state_s.index(state_s)
                self._collect(i, self.engines[i].advance_to(state_s))
                self.published[i] = self._sidecar_state(i, state_s)
                self.published_keys[i] = None
                self.next_state_s[i] = state_s + self.staleness_s
            else:
                break
        self._advance_engines(time_s)

    def drain(self) -> None:
        """Runs every engine (and the migrations) until every request has finished."""
        if self.migration is None:
            for i, engine in enumerate(self.engines):
                self._collect(i, engine.run_until_idle())
            return
        while self.migration.num_in_flight or any(e.has_work() for e in self.engines):
            self.advance_to(self.migration.next_event_s())
        assert not any(e.num_reserved_blocks for e in self.engines), "a migration left blocks reserved"

    def has_work(self) -> bool:
        """True while any engine has a request to run or to receive, or a migration is in flight."""
        return any(e.has_work() for e in self.engines) or (self.migration is not None
                                                           and bool(self.migration.num_in_flight))

    def prefix_blocks(self, i: int, keys: tuple[int, ...] | None) -> tuple[int | None, int | None]:
        """(``EndpointView.num_prefix_blocks_cached``, ``EndpointView.num_prefix_blocks_in_use``) of instance ``i``
        for a prompt of block keys ``keys`` as the router's state shows them: the leading blocks it holds or
        caches, and those its requests hold. With stale states: the last published state (its requests' prompt
        keys, running and waiting, and ``InstanceSnapshot.cached_block_keys``); else the engine's own block pool
        and queues (exact: a running request holds a reference on a block in use, a waiting one has its key).
        (None, None) without keys."""
        if keys is None:
            return None, None
        if not self.published:
            scheduler = self.engines[i].scheduler
            pool = scheduler.prefix_cache
            hits = pool.lookup(keys, len(keys))
            n = len(hits)
            in_use = 0
            while in_use < n and pool.ref_count(hits[in_use]):  # held by a running request
                in_use += 1
            for waiting in scheduler.waiting:  # or in a waiting one's prompt (a key chains its whole prefix)
                held = waiting.block_keys or ()
                while in_use < n and in_use < len(held) and held[in_use] == keys[in_use]:
                    in_use += 1
                if in_use == n:
                    break
            return n, in_use
        shown = self.published_keys[i]
        if shown is None:
            snapshot = self.published[i][0]
            held = frozenset(k for r in (*snapshot.running, *snapshot.waiting) for k in r.block_keys or ())
            shown = self.published_keys[i] = (held | frozenset(snapshot.cached_block_keys), held)
        return leading_blocks(keys, *shown)

    def views(self, router: _Router, now_s: float, keys: tuple[int, ...] | None = None) -> list[EndpointView]:
        since_s = now_s - router.policy.recent_window_s
        views = []
        for i, address in enumerate(self.addresses):
            times_s = router.dispatch_times_s[i]
            while times_s and times_s[0] < since_s:
                times_s.popleft()
            sampled = router.metrics[i]
            metrics = None if sampled is None else dataclasses.replace(sampled[1], age_s=now_s - sampled[0])
            cached, in_use = self.prefix_blocks(i, keys)
            views.append(EndpointView(address, router.in_flight[i], address, metrics=metrics,
                                      num_recent_requests=len(times_s), num_prefix_blocks_cached=cached,
                                      num_prefix_blocks_in_use=in_use))
        # as extproc/router.py fills it: the astrolabe policy's load bound reads it
        mean_in_flight = sum(router.in_flight) / len(router.in_flight) if router.in_flight else 0.0
        return [dataclasses.replace(v, mean_in_flight=mean_in_flight) for v in views]

    def snapshot(self, i: int) -> InstanceSnapshot:
        """Instance ``i`` as its sidecar sees it: exact queues, each request's expected output length from its
        predicted length and progress (``config.residual``) instead of its true length."""
        engine = self.engines[i]
        predicted = self.predicted[i]
        block_size = self.block_size

        def expected(r: RequestState) -> RequestState:
            # a sidecar knows a request's prompt blocks only (the router sends those)
            num_predicted, max_tokens, rule = predicted[r.request_id]
            keys = r.block_keys if r.block_keys is None else r.block_keys[:r.num_prompt_tokens // block_size]
            return dataclasses.replace(r, num_output_tokens=rule.expected_output_tokens(
                num_predicted, r.num_generated_tokens, max_tokens), block_keys=keys)

        snapshot = InstanceSnapshot.from_scheduler(engine.scheduler, engine.now_s)
        return dataclasses.replace(snapshot, waiting=tuple(map(expected, snapshot.waiting)),
                                   running=tuple(map(expected, snapshot.running)))

    def _rule(self, request: ClusterRequest) -> ResidualLengthModel:
        """The residual-length rule a sidecar applies to ``request``: its own distribution when it has one."""
        return (request.length_residual or self.residual) if self._per_request_rules else self.residual

    def _expected_state(self, request_id: str, request: ClusterRequest) -> RequestState:
        """A request not started yet as a sidecar prices it: its expected output length from its predicted one,
        its prompt's block keys."""
        rule = self._rule(request)
        return RequestState(request_id, request.num_prompt_tokens, rule.expected_output_tokens(
            request.num_predicted_output_tokens, 0, request.max_tokens),
            arrival_time_s=request.arrival_time_s + self.latency_s,
            block_keys=request.prompt_block_keys(self.block_size),
            priority=vllm_priority(request.objectives.priority))

    def _unseen(self, router: _Router, i: int, seen: frozenset[str]) -> list[tuple[float, str, ClusterRequest]]:
        """``router``'s dispatches to instance ``i`` still in flight that a state holding ``seen`` lacks, oldest
        first (those it includes or that finished are dropped: a state never loses a request before it ends)."""
        queue = router.unseen[i]
        while queue and (queue[0][1] in seen or queue[0][1] not in self.router_of):
            queue.popleft()
        return [u for u in queue if u[1] not in seen and u[1] in self.router_of]

    def predict(self, i: int, request_id: str, request: ClusterRequest, router: _Router | None = None) -> Prediction:
        """The prediction for ``request`` on instance ``i`` that ``router`` (default: the first replica) decides
        with (module NOTEs): from the exact state at the decision, or from the last state published, with the
        replica's own unseen dispatches queued in and the state's age taken off by the router's own
        ``extproc.fleet_state.predict_from_state``."""
        router = router or self.routers[0]
        now_s = request.arrival_time_s
        snapshot, seen = self.published[i] if self.published else self._sidecar_state(i, now_s)
        unseen = self._unseen(router, i, seen) if self.tracks_unseen else []
        priced = predict_from_state(
            snapshot, self._expected_state(request_id, request),
            [self._expected_state(f"unseen-{u_id}", u) for _, u_id, u in unseen], self.batch_times[i],
            max(now_s - snapshot.now_s, 0.0), max(now_s - unseen[0][0], 0.0) if unseen else 0.0)
        result, idle, queue_s, shift_s, snapshot = (priced.result, priced.idle, priced.queue_s, priced.shift_s,
                                                    priced.snapshot)
        self.num_predictions += 1
        factor = 1.0
        if self.config.prediction_noise_frac > 0:
            factor = max(0.0, 1.0 + self._noise_rng.gauss(0.0, self.config.prediction_noise_frac))
        # the fields a sidecar's answer carries (predictor/server.py): queue, requests on the instance, idle E2E
        return Prediction((result.ttft_s - shift_s) * factor, (result.e2e_s - shift_s) * factor, 0.0,
                          (queue_s - shift_s) * factor,
                          num_requests=len(snapshot.running) + len(snapshot.waiting), idle_e2e_s=idle.e2e_s * factor)

    def route(self, request_id: str, request: ClusterRequest) -> tuple[int, int] | None:
        """(router replica, instance) for ``request``; None when the policy's admission rule refuses it (counted in
        ``shed``; it is never dispatched)."""
        r = self._assign_rng.randrange(len(self.routers))
        router = self.routers[r]
        keys = request.prompt_block_keys(self.block_size)
        # a TPOT objective is checked with the estimate capped by max_tokens, as extproc.router does
        num_capped_tokens = capped_output_tokens(request.num_predicted_output_tokens, request.max_tokens)
        routing_request = RoutingRequest(request_id, "POST", "/v1/completions", max_tokens=request.max_tokens,
                                         arrival_time_s=request.arrival_time_s, block_keys=keys,
                                         objectives=request.objectives, num_predicted_output_tokens=num_capped_tokens)
        views = self.views(router, request.arrival_time_s, keys)
        if router.policy.needs_predictions:
            candidates = router.policy.candidates(routing_request, views)
            scored = [dataclasses.replace(v, prediction=self.predict(self.index[v.address], request_id, request,
                                                                     router)) for v in candidates]
            more = router.policy.more_candidates(routing_request, scored, views)
            scored += [dataclasses.replace(v, prediction=self.predict(self.index[v.address], request_id, request,
                                                                      router)) for v in more]
            if self.admission is not None:
                now_s = request.arrival_time_s
                router.pressure.observe(request.objectives, scored, now_s, self.protect_ttft_s)
                reason = shed_reason(request.objectives, scored, num_capped_tokens,
                                     self.admission.rule, self.protect_ttft_s, router.pressure.active(now_s))
                if reason is not None:
                    self._refuse(request_id, request, num_capped_tokens, reason, router, scored, views)
                    return None
            chosen = router.policy.choose(routing_request, scored)
        else:
            chosen = router.policy.choose(routing_request, views)
        if chosen is None:  # the policy did not choose: it does not hear of the request again (as extproc.router)
            self.num_fallbacks += 1
            chosen = router.fallback.choose(routing_request, views)
        else:
            self.routing_requests[request_id] = routing_request
        return r, self.index[chosen.address]

    def _refuse(self, request_id: str, request: ClusterRequest, num_capped_tokens: int, reason: str,
                router: _Router, scored: Sequence[EndpointView], views: Sequence[EndpointView]) -> None:
        """Records a refusal and whether an unprobed instance was predicted to meet the request's objectives (the
        simulation can ask every instance; those predictions are not counted as the policy's); ``num_capped_tokens``:
        the request's estimate capped by its max_tokens, what TPOT objectives are checked with."""
        self.shed[request_id] = reason
        probed = {v.address for v in scored}
        num_predictions = self.num_predictions
        unprobed_met = any(meets(request.objectives, dataclasses.replace(
            v, prediction=self.predict(self.index[v.address], request_id, request, router)), num_capped_tokens)
            for v in views if v.address not in probed)
        self.num_predictions = num_predictions
        self.num_shed_unprobed_met += unprobed_met

    def dispatch(self, r: int, i: int, request_id: str, request: ClusterRequest) -> None:
        """Sends ``request`` to instance ``i``, where it arrives ``decision_latency_s`` later; replica ``r``
        counts it from now."""
        self.engines[i].add_request(SimRequest(request_id, request.num_prompt_tokens, request.num_output_tokens,
                                               arrival_time_s=request.arrival_time_s + self.latency_s,
                                               block_keys=request.block_keys,
                                               priority=vllm_priority(request.objectives.priority)))
        router = self.routers[r]
        router.in_flight[i] += 1
        router.dispatch_times_s[i].append(request.arrival_time_s)
        if self.tracks_unseen:
            router.unseen[i].append((request.arrival_time_s, request_id, request))
            self.in_transit[i].append((request.arrival_time_s + self.latency_s, request_id, request))
        self.router_of[request_id] = (r, i)
        self.dispatched_to[request_id] = i
        self.predicted[i][request_id] = (request.num_predicted_output_tokens, request.max_tokens,
                                         self._rule(request))


def _migration_fields(cluster: _Cluster) -> dict[str, Any]:
    """The migration figures of ``PointResult`` (zeros without migration)."""
    if cluster.migration is None:
        return {}
    stats = cluster.migration.stats
    return {"num_migrations_started": stats.num_started, "num_migrations_completed": stats.num_completed,
            "num_migrations_aborted": stats.num_aborted, "migration_stall_s": stats.stall_s,
            "engine_time_lost_s": sum(e.extra_step_time_s + e.stalled_s for e in cluster.engines)}


def _shares(cluster: _Cluster, requests: Sequence[ClusterRequest]) -> dict[str, Any]:
    """The request-share fields of ``PointResult``: requests per instance and the windowed max / mean."""
    num_instances = cluster.config.num_instances
    dispatched = [(requests[int(request_id[1:])].arrival_time_s, i) for request_id, i in cluster.dispatched_to.items()]
    per_instance = np.bincount([i for _, i in dispatched], minlength=num_instances)
    windows: dict[int, np.ndarray] = {}
    for arrival_s, i in dispatched:
        windows.setdefault(int(arrival_s // SHARE_WINDOW_S), np.zeros(num_instances, dtype=int))[i] += 1
    ratios = [counts.max() / counts.mean() for counts in windows.values()]
    return {"requests_per_instance": tuple(int(n) for n in per_instance),
            "window_max_over_mean": float(np.mean(ratios)) if ratios else math.nan, "num_windows": len(ratios)}


def _mean_p99(values_s: list[float]) -> tuple[float, float]:
    # Same estimator as bench/report.py: numpy's default linear interpolation.
    if not values_s:
        return math.nan, math.nan
    array = np.asarray(values_s, dtype=float)
    return float(array.mean()), float(np.percentile(array, 99))


@dataclass(frozen=True, slots=True)
class PointLatencies:
    """Per-request latencies of one point, trace (arrival) order, seconds: what bootstrap intervals resample. A
    request the admission rule refused has NaN (``bench.stats``: a failure)."""

    ttfts_s: np.ndarray
    e2es_s: np.ndarray


@dataclass(frozen=True, slots=True)
class SeedPoint:
    """One simulated (policy, rate, seed) point with its per-request latencies."""

    seed: int
    result: PointResult
    latencies: PointLatencies


def simulate_point(spec: PolicySpec, rate_qps: float, requests: Sequence[ClusterRequest],
                   config: ClusterConfig) -> PointResult:
    """Routes every request of ``requests`` with ``spec``'s policy and runs the fleet until all finish.

    Args:
        spec: the policy under test.
        rate_qps: the trace's mean arrival rate (recorded, not used to schedule).
        requests: the trace, in arrival order (non-decreasing ``arrival_time_s``).
        config: fleet settings.

    Returns:
        Latency summary over completed requests (every request completes: the engines run until idle).

    Raises:
        ValueError: unknown policy or bad parameters; a request that cannot fit one instance's KV cache.
    """
    return simulate_point_latencies(spec, rate_qps, requests, config)[0]


def simulate_point_latencies(spec: PolicySpec, rate_qps: float, requests: Sequence[ClusterRequest],
                             config: ClusterConfig) -> tuple[PointResult, PointLatencies]:
    """`simulate_point` plus every request's TTFT and E2E (trace order). Same arguments and errors."""
    start_s = time.perf_counter()
    cluster = _Cluster(config, spec)
    for n, request in enumerate(requests):
        cluster.advance_to(request.arrival_time_s)
        request_id = f"r{n}"
        routed = cluster.route(request_id, request)
        if routed is not None:
            cluster.dispatch(*routed, request_id, request)
    cluster.drain()
    return _point_result(cluster, spec, rate_qps, requests, start_s)


def simulate_sessions_latencies(spec: PolicySpec, rate_sps: float, sessions: Sequence[ClusterSession],
                                config: ClusterConfig) -> tuple[PointResult, PointLatencies]:
    """Closed-loop sessions (multi-turn chat) routed by ``spec``'s policy: each session's turn k + 1 arrives its
    think time after turn k's last token; the fleet runs until every turn of every session has finished.

    Arrivals depend on completions, so the fleet advances in steps no longer than the run's shortest think time:
    a reply that ends inside a step starts its next turn after that step's end, so every arrival is routed at its
    own time, in time order, exactly as an open trace's (ties: session order).

    Args:
        spec: the policy under test.
        rate_sps: the sessions' start rate, sessions per second (recorded as ``PointResult.rate_qps``).
        sessions: the sessions, any order (their requests are numbered session by session, turn by turn: the
            latencies come back in that order, the same for every policy).
        config: fleet settings.

    Returns:
        The point's result (``request_rate_qps``: the requests per second the sessions gave) and every turn's
        TTFT and E2E.

    Raises:
        ValueError: as `simulate_point`.
    """
    start_s = time.perf_counter()
    cluster = _Cluster(config, spec)
    first = list(itertools.accumulate((len(s.turns) for s in sessions), initial=0))
    realized: list[ClusterRequest | None] = [None] * first[-1]
    owner = [(s, k) for s, session in enumerate(sessions) for k in range(len(session.turns))]
    # (arrival, request number, session, turn); the request number orders ties
    due = [(session.start_s, first[s], s, 0) for s, session in enumerate(sessions)]
    heapq.heapify(due)
    think_s = [t for session in sessions for t in session.think_times_s]
    step_s = min(think_s, default=math.inf)

    def next_turn(request_id: str, end_s: float) -> None:
        n = int(request_id[1:])
        s, k = owner[n]
        if k + 1 < len(sessions[s].turns):
            heapq.heappush(due, (end_s + sessions[s].think_times_s[k], n + 1, s, k + 1))

    cluster.on_request_finished = lambda request: next_turn(request.request_id, request.finish_time_s)
    now_s = -math.inf
    while due or cluster.has_work():
        if due and due[0][0] <= now_s:
            arrival_s, n, s, k = heapq.heappop(due)
            request = realized[n] = dataclasses.replace(sessions[s].turns[k], arrival_time_s=arrival_s)
            cluster.advance_to(arrival_s)
            request_id = f"r{n}"
            routed = cluster.route(request_id, request)
            if routed is not None:
                cluster.dispatch(*routed, request_id, request)
            else:  # refused: the client sends its next message a think time after the refusal
                next_turn(request_id, arrival_s)
            continue
        next_s = due[0][0] if due else math.inf
        now_s = min(next_s, now_s + step_s) if now_s > -math.inf else next_s
        if now_s == math.inf:  # no arrival due and no think time: the last replies end the run
            cluster.drain()
            break
        cluster.advance_to(now_s)
    cluster.drain()
    assert all(r is not None for r in realized), "a session turn was never sent"
    starts_s = [session.start_s for session in sessions]
    return _point_result(cluster, spec, rate_sps, realized, start_s, (min(starts_s), max(starts_s)))


def _point_result(cluster: _Cluster, spec: PolicySpec, rate_qps: float, requests: Sequence[ClusterRequest],
                  start_s: float, window_s: tuple[float, float] | None = None) -> tuple[PointResult, PointLatencies]:
    """The point's summary and latencies once every request of ``requests`` (numbered ``r<index>``) finished;
    ``window_s``: the span whose arrivals give ``request_rate_qps`` (default: first to last arrival)."""
    config = cluster.config
    done = sorted(cluster.finished, key=lambda r: int(r.request_id[1:]))
    assert len({r.request_id for r in done}) == len(done), "a request finished twice"
    assert len(done) + len(cluster.shed) == len(requests), "a request was neither served nor refused"
    # from the request's arrival at the router (the instance sees it decision_latency_s later)
    arrivals_s = np.array([requests[int(r.request_id[1:])].arrival_time_s for r in done])
    ttfts_s = np.array([r.first_token_time_s for r in done]) - arrivals_s
    e2es_s = np.array([r.finish_time_s for r in done]) - arrivals_s
    ttft_mean_s, ttft_p99_s = _mean_p99(list(ttfts_s))
    e2e_mean_s, e2e_p99_s = _mean_p99(list(e2es_s))
    if cluster.shed:  # trace order, NaN for the refused
        index = np.array([int(r.request_id[1:]) for r in done], dtype=int)
        all_ttfts_s, all_e2es_s = np.full(len(requests), np.nan), np.full(len(requests), np.nan)
        all_ttfts_s[index], all_e2es_s[index] = ttfts_s, e2es_s
        ttfts_s, e2es_s = all_ttfts_s, all_e2es_s
    tpots_s = [(r.finish_time_s - r.first_token_time_s) / (r.num_output_tokens - 1)
               for r in done if r.num_output_tokens > 1]
    arrivals = sorted(r.arrival_time_s for r in requests)
    low_s, high_s = window_s or ((arrivals[0], arrivals[-1]) if arrivals else (0.0, 0.0))
    span_s = high_s - low_s
    num_in_window = bisect.bisect_right(arrivals, high_s) - bisect.bisect_left(arrivals, low_s)
    result = PointResult(
        policy=spec.label,
        rate_qps=rate_qps,
        num_requests=len(requests),
        num_completed=len(done),
        ttft_mean_s=ttft_mean_s,
        ttft_p99_s=ttft_p99_s,
        e2e_mean_s=e2e_mean_s,
        e2e_p99_s=e2e_p99_s,
        tpot_mean_s=float(np.mean(tpots_s)) if tpots_s else math.nan,
        num_preemptions=sum(e.scheduler.num_preemptions_total for e in cluster.engines),
        predictor_calls_per_request=cluster.num_predictions / max(len(requests), 1),
        num_fallbacks=cluster.num_fallbacks,
        wall_s=time.perf_counter() - start_s,
        num_routers=config.num_routers,
        **_migration_fields(cluster),
        **_shares(cluster, requests),
        prefix_cache_queries=sum(e.scheduler.prefix_cache_queries for e in cluster.engines),
        prefix_cache_hits=sum(e.scheduler.prefix_cache_hits for e in cluster.engines),
        request_rate_qps=(num_in_window - 1) / span_s if span_s > 0 else math.nan,
        num_shed=len(cluster.shed),
        num_shed_unprobed_met=cluster.num_shed_unprobed_met,
        arrival_span_s=span_s,
    )
    return result, PointLatencies(ttfts_s, e2es_s)
