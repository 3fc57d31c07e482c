"""`astrolabe bench cluster`: dispatch policies compared on a simulated fleet, in virtual time.

N simulated vLLM V1 instances (``predictor.sim.Engine``, Llama-2-7B shape with the shipped H200 step-time model)
receive ShareGPT traces (prompt and reply token counts, ``bench.workloads``) with Poisson or Gamma arrivals,
routed by R router replicas running the extproc's own policy objects (``extproc.policies.registry``) or a
model of Envoy's ``LEAST_REQUEST`` (``bench.cluster_sim.EnvoyLeastRequest``), at each rate of a sweep and for
each seed. Per (policy, rate), pooled over the seeds, it reports TTFT mean and P99 (with a block-bootstrap
interval), E2E mean/P99, TPOT mean, preemptions and predictor calls per request; per policy the capacity (the
highest rate whose pooled P99 TTFT meets the SLO, and the rate where P99 TTFT crosses it, interpolated); and,
at the rates around the knee, astrolabe's P99 TTFT as a ratio to the best baseline's with a paired interval.
It writes ``DIR/cluster.csv`` (every pooled point) and ``DIR/p99_ttft.png``. What each policy sees is described
in ``bench.cluster_sim``.

``llumnix-migrate`` is full Llumnix: the ``llumnix`` dispatch policy plus Llumnix's live KV-cache migration, run
by the simulation (``bench.migration``: its rules, sources, cost model and defaults); ``llumnix-migrate-bw<X>``
the same at X GB/s. ``--migration-bandwidths 1,5,25,100,400`` adds one such label per bandwidth (with
``llumnix`` and ``astrolabe-k2`` if missing) and prints, per bandwidth, capacity, P99 TTFT, mean TPOT and
migrations per request at the knee rates next to them, each bandwidth's P99 ratio to ``llumnix`` with a paired
interval, and the bandwidth below which migration stops paying.

Workloads (``--workload``): ``sharegpt`` (default) is the single-turn trace above, without token identities.
``multi-turn`` replays ShareGPT conversations as closed-loop chat sessions (``build_sessions``: the swept rate is
in sessions per second; each turn's prompt is the conversation so far, sent a think time after the previous reply
ends in the simulation) and ``shared-prefix`` is a tenant mix with long shared contexts sized to the fleet's KV
cache (``build_shared_prefix``); both carry block keys, so the engines cache prefixes and the tables add the
requests per second the arrivals gave and the prefix-cache hit rate (bench/README.md "Workloads with prefix
reuse").

The decision path (``--staleness-s``, ``--decision-latency-s``; ``bench.cluster_sim`` NOTE): by default a decision
sees each instance's exact state at the request's arrival, which the extproc never does. In production each
sidecar streams its state every 20 ms under load (``predictor/server.py``: ``--watch-interval-s`` 0.02, and a
heartbeat every 0.1 s when nothing changed; the extproc drops states older than 0.25 s), a replica's own unseen
dispatches are queued into those states (``extproc/fleet_state.py``) but other replicas' are not, and a decision
takes ~3 ms from headers to answer (the demo's route time p50, 2.6-3.4 ms, README "Where Astrolabe stands").
``--staleness-s 0.02 --decision-latency-s 0.003`` models that path; ``-stale<S>`` on an astrolabe label sets its
staleness alone, so that one run compares several on the same traces, and the results print each such label's
P99 and mean TTFT against ``least-requests`` with paired intervals. The defaults stay 0 (exact) so that the
figures quoted in bench/README.md repeat; the staleness sweep there gives what the measured path changes.

Defaults and why (all printed with the results):
- 4 router replicas (production runs several; each sees only its own in-flight counts and scrapes, while the
  sidecars see every replica's admissions); ``--num-routers 1`` gives the single-router case.
- KV cache 1,024 blocks x 16 tokens per instance (A30-like, as the paper's 12x A30 testbed; see
  ``bench.cluster_sim.A30_LIKE_NUM_GPU_BLOCKS``); max_num_seqs 48, max_num_batched_tokens 512 (chunked prefill).
- Predicted output lengths: sampled from the shipped light tagger's measured held-out errors
  (``tagger/weights/light/errors.npz``, binned by true length); the sidecars' residual lengths are conditioned
  on the same tagger's (predicted, true) pairs, as a production sidecar does with ``--length-distribution
  binned`` (``predictor.residual_rules``; its default since v1.6, each request's own quantiles, is
  ``--length-distribution quantiles`` here, within noise of it: bench/README.md).
- SLO: P99 TTFT <= 2 s, not the paper's 10 s: with H200 step times a trace of a few thousand requests reaches a
  10 s P99 TTFT only in deep overload, where every policy has already failed.
- 3 seeds x 3,000 requests per point: a P99 over one 3,000-request trace moves by a factor of 10 between seeds
  near the knee (one burst decides it); pooling seeds and bootstrapping blocks of requests makes the figures
  and their intervals mean something.
The traces are the same for every policy, and the same up to a time scale for every rate (unit-rate arrivals
divided by the rate), so that differences come from the policies, not from sampling.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import random
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from astrolabe.cli import HelpFormatter
from astrolabe.logs import setup_logging
from bench.cluster_report import (
    capacities,
    crossing_rates,
    format_capacities,
    format_migration_sweep,
    format_pair_ratios,
    format_points,
    format_ratios,
    pool_points,
    sweep_verdicts,
    write_csv,
    write_plot,
)
from bench.cluster_sim import (
    A30_LIKE_NUM_GPU_BLOCKS,
    ENVOY_LEAST_REQUEST,
    LOGNORMAL_SIGMA,
    MIN_THINK_TIME_S,
    ClusterConfig,
    ClusterRequest,
    ClusterSession,
    LognormalLengthError,
    PolicySpec,
    SamplePredictedTokens,
    SeedPoint,
    oracle_lengths,
    simulate_point_latencies,
    simulate_sessions_latencies,
)
from bench.migration import REQUEST_POLICIES, MigrationParams, with_bandwidth
from bench.workloads import (
    REPO_ROOT,
    KeyedTurn,
    SharedPrefixShape,
    WorkloadError,
    arrival_offsets_s,
    filter_pairs,
    session_turns,
    shared_prefix_turns,
)
from extproc.policies.registry import POLICY_NAMES
from predictor.engine_flags import add_engine_arguments, engine_from_args
from predictor.sim import EngineConfig
from predictor.sim.residual import (
    EmpiricalResidual,
    ExactLengths,
    FixedExtraTokens,
    ResidualLengthModel,
    TaggerQuantileResidual,
)
from tagger.serve import SHIPPED_LIGHT_DIR
from tagger.sharegpt import SharegptConversation, SharegptPair, load_sharegpt_conversations, load_sharegpt_pairs

logger = logging.getLogger(__name__)

DEFAULT_POLICIES = ("random", "round-robin", "least-requests", ENVOY_LEAST_REQUEST, "min-qpm", "infaas", "llumnix",
                    "llumnix-migrate", "gie", "astrolabe-paper", "astrolabe-k2-noextra", "astrolabe-k2", "astrolabe-k4-noextra",
                    "astrolabe-full")
DEFAULT_RATES_QPS = (100.0, 110.0, 120.0, 125.0, 130.0, 135.0, 140.0)
WORKLOADS = ("sharegpt", "multi-turn", "shared-prefix")
DEFAULT_WORKLOAD_RATES = {"sharegpt": DEFAULT_RATES_QPS, "multi-turn": (16.0, 20.0, 24.0, 28.0),
                          "shared-prefix": (60.0, 70.0, 80.0, 90.0)}
"""Default sweep per ``--workload`` (requests/s; sessions/s for multi-turn): around the knees measured in
bench/README.md "Workloads with prefix reuse"."""
DEFAULT_WORKLOAD_REQUESTS = {"sharegpt": 3000, "multi-turn": 6000, "shared-prefix": 3000}
"""Default requests per point per ``--workload``. Multi-turn needs more: ~1,800 sessions of ~20 s each, started at
16-28 sessions/s, keep the fleet at its steady load for about two thirds of the trace; with 3,000 requests most of
it is ramp-up and ramp-down."""
DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_OUT_DIR = REPO_ROOT / "out" / "cluster"
_LABEL = re.compile(r"astrolabe-(k(?P<k>\d+)|full|paper)"
                    r"(?P<mods>(-(ttft|e2e|blend|nomem|mem|noextra|noprefix|stale\d+(\.\d+)?))*)")
LLUMNIX_MIGRATE = "llumnix-migrate"
"""Label of full Llumnix: ``llumnix`` dispatch plus live migration (``bench.migration``)."""
_MIGRATE_LABEL = re.compile(r"llumnix-migrate(-bw(?P<bw>\d+(\.\d+)?))?")


def migrate_label(bandwidth_gbytes_per_s: float) -> str:
    """``llumnix-migrate-bw<X>``: full Llumnix with a copy bandwidth of X GB/s."""
    return f"{LLUMNIX_MIGRATE}-bw{bandwidth_gbytes_per_s:g}"


def _label_params(label: str, assignments: str) -> dict[str, Any]:
    """``key=value:key=value`` -> params; values are JSON numbers or true/false, else strings.

    Raises:
        ValueError: an assignment without ``=``.
    """
    params: dict[str, Any] = {}
    for assignment in assignments.split(":"):
        key, sep, text = assignment.partition("=")
        if not sep or not key:
            raise ValueError(f"policy label {label!r}: expected NAME:KEY=VALUE[:KEY=VALUE...], got {assignment!r}")
        try:
            params[key] = json.loads(text)
        except json.JSONDecodeError:
            params[key] = text
    return params


def policy_spec(label: str, num_instances: int, paper_residual: ResidualLengthModel | None = None,
                migration: MigrationParams | None = None) -> PolicySpec:
    """Maps a label to a policy.

    Labels: a registry name, ``envoy-least-request``, ``astrolabe-k<N>`` (power of N), ``astrolabe-full``
    (k = fleet size), ``astrolabe-paper`` (the reference system: k = 2, E2E, no memory, no second round, the
    "10 more tokens" residual), each astrolabe label optionally followed by ``-ttft``/``-e2e``/``-blend``
    (metric), ``-nomem`` / ``-mem`` (no probe, or one probe, of the best recent answer; the default has none) and
    ``-noextra`` (no second round of probes), ``-noprefix`` (no probe of the prompt's prefix home: all k at
    random) and ``-stale<S>`` (its sidecars' states published every S seconds,
    replacing ``--staleness-s`` for this label: ``bench.cluster_sim`` NOTE on the decision path);
    ``llumnix-migrate`` (``llumnix`` dispatch + live migration with ``migration``, default `MigrationParams()`)
    and ``llumnix-migrate-bw<X>`` (the same at X GB/s); a registry name other than astrolabe, or an astrolabe
    label, followed by ``:KEY=VALUE[:KEY=VALUE...]`` sets its parameters (e.g. ``llm-d:max_tokens_in_flight_penalty=50000``, for
    tuning a baseline; checked when the policy is built).

    Raises:
        ValueError: unknown label.
    """
    if label == ENVOY_LEAST_REQUEST or label in POLICY_NAMES and label != "astrolabe":
        return PolicySpec(label, label)
    name, _, assignments = label.partition(":")
    if assignments and name in POLICY_NAMES and name != "astrolabe":
        return PolicySpec(label, name, _label_params(label, assignments))
    migrate = _MIGRATE_LABEL.fullmatch(label)
    if migrate is not None:
        params = migration or MigrationParams()
        if migrate.group("bw") is not None:
            params = with_bandwidth(params, float(migrate.group("bw")))
        return PolicySpec(label, "llumnix", migration=params)
    base, _, assignments = label.partition(":")
    match = _LABEL.fullmatch(base)
    if match is None:
        raise ValueError(f"unknown policy {label!r}; known: {', '.join(POLICY_NAMES)}, {ENVOY_LEAST_REQUEST}, "
                         "astrolabe-k<N>, astrolabe-full, astrolabe-paper (+ -ttft, -e2e, -blend, -mem, -nomem, "
                         "-noextra, -noprefix, -stale<S>), llumnix-migrate[-bw<GB/s>]")
    params: dict = {}
    residual = None
    staleness_s = None
    if match.group(1) == "full":
        params["k"] = num_instances
    elif match.group(1) == "paper":
        params.update(k=2, metric="e2e", probe_best=False, extra_probes=0)
        residual = paper_residual or FixedExtraTokens()
    else:
        params["k"] = int(match.group("k"))
    for mod in filter(None, match.group("mods").split("-")):
        if mod == "nomem":
            params["probe_best"] = False
        elif mod == "mem":
            params["probe_best"] = True
        elif mod == "noextra":
            params["extra_probes"] = 0
        elif mod == "noprefix":
            params["prefix_probe"] = False
        elif mod.startswith("stale"):
            staleness_s = float(mod.removeprefix("stale"))
        else:
            params["metric"] = mod
    if assignments:
        params.update(_label_params(label, assignments))
    return PolicySpec(label, "astrolabe", params, residual, staleness_s=staleness_s)


def build_requests(pairs: Sequence[SharegptPair], num_requests: int, rng: random.Random, arrival: str, cv: float,
                   sample_predicted_tokens: SamplePredictedTokens) -> tuple[list[float], list[ClusterRequest]]:
    """Samples the trace at unit rate: (unit offsets in seconds at 1 req/s, requests with those offsets).

    Pairs are drawn with replacement when ``num_requests`` exceeds ``len(pairs)``. Scale the offsets by
    1 / rate with ``at_rate``.

    Raises:
        bench.workloads.WorkloadError: unknown arrival or bad ``cv``.
    """
    chosen = rng.sample(list(pairs), num_requests) if num_requests <= len(pairs) else rng.choices(pairs, k=num_requests)
    offsets_s = arrival_offsets_s(num_requests, 1.0, rng, arrival, cv=cv)
    requests = [ClusterRequest(t_s, p.num_prompt_tokens, p.num_output_tokens,
                               sample_predicted_tokens(p.num_output_tokens, rng))
                for p, t_s in zip(chosen, offsets_s)]
    return offsets_s, requests


def _keyed_requests(turns: Sequence[KeyedTurn], rng: random.Random,
                    sample_predicted_tokens: SamplePredictedTokens) -> list[ClusterRequest]:
    """Requests (arrival 0) of keyed turns, each with its predicted output length."""
    return [ClusterRequest(0.0, t.num_prompt_tokens, t.num_output_tokens,
                           sample_predicted_tokens(t.num_output_tokens, rng), block_keys=t.block_keys)
            for t in turns]


def build_sessions(conversations: Sequence[SharegptConversation], num_requests: int, rng: random.Random,
                   arrival: str, cv: float, sample_predicted_tokens: SamplePredictedTokens, *, block_size: int,
                   max_model_len: int, think_time_s: float, min_think_time_s: float) -> list[ClusterSession]:
    """The multi-turn workload at unit rate: ShareGPT conversations (``bench.workloads.session_turns``) drawn
    without replacement (with, once all are used) until their turns reach ``num_requests``; session starts at
    1 session/s (``arrival``); think times ``min_think_time_s`` + Exponential(mean ``think_time_s`` -
    ``min_think_time_s``), i.e. mean ``think_time_s`` seconds. Scale the starts by 1 / rate with ``at_rate``.

    Raises:
        bench.workloads.WorkloadError: no conversation fits ``max_model_len``, bad think times, unknown arrival.
    """
    if not MIN_THINK_TIME_S <= min_think_time_s < think_time_s:
        raise WorkloadError(f"think times need {MIN_THINK_TIME_S} <= --min-think-time-s < --think-time-s, got "
                            f"{min_think_time_s} and {think_time_s}")
    order = list(range(len(conversations)))
    rng.shuffle(order)
    chosen: list[list[KeyedTurn]] = []
    total = 0
    n = 0
    while total < num_requests:
        if n == len(order) and not chosen:
            raise WorkloadError(f"no ShareGPT conversation fits max_model_len {max_model_len}")
        turns = session_turns(conversations[order[n % len(order)]], block_size, max_model_len)
        n += 1
        if turns:
            chosen.append(turns)
            total += len(turns)
    starts_s = arrival_offsets_s(len(chosen), 1.0, rng, arrival, cv=cv)
    rate = 1.0 / (think_time_s - min_think_time_s)
    return [ClusterSession(start_s, tuple(_keyed_requests(turns, rng, sample_predicted_tokens)),
                           tuple(min_think_time_s + rng.expovariate(rate) for _ in turns[1:]))
            for start_s, turns in zip(starts_s, chosen)]


def build_shared_prefix(shape: SharedPrefixShape, num_requests: int, rng: random.Random, arrival: str, cv: float,
                        sample_predicted_tokens: SamplePredictedTokens, block_size: int) -> list[ClusterRequest]:
    """The shared-prefix workload at unit rate (``bench.workloads.shared_prefix_turns``), ``arrival`` gaps.

    Raises:
        bench.workloads.WorkloadError: unknown arrival or bad ``cv``.
    """
    requests = _keyed_requests(shared_prefix_turns(shape, num_requests, rng, block_size), rng,
                               sample_predicted_tokens)
    offsets_s = arrival_offsets_s(num_requests, 1.0, rng, arrival, cv=cv)
    return [dataclasses.replace(r, arrival_time_s=t_s) for r, t_s in zip(requests, offsets_s)]


Trace = Sequence[ClusterRequest] | Sequence[ClusterSession]
"""A unit-rate workload: open-loop requests, or closed-loop sessions (multi-turn)."""


def at_rate(requests: Trace, rate_qps: float) -> list:
    """The unit-rate trace with every arrival time (a session's start) divided by ``rate_qps``."""
    return [dataclasses.replace(r, start_s=r.start_s / rate_qps) if isinstance(r, ClusterSession)
            else dataclasses.replace(r, arrival_time_s=r.arrival_time_s / rate_qps) for r in requests]


def _run_point(task: tuple[PolicySpec, float, list, ClusterConfig]) -> SeedPoint:
    spec, rate_qps, trace, config = task
    simulate = simulate_sessions_latencies if trace and isinstance(trace[0], ClusterSession) else simulate_point_latencies
    result, latencies = simulate(spec, rate_qps, trace, config)
    return SeedPoint(config.seed, result, latencies)


def run_sweep(specs: Sequence[PolicySpec], rates_qps: Sequence[float],
              requests_by_seed: dict[int, Trace], config: ClusterConfig, workers: int = 1,
              progress: bool = True) -> list[SeedPoint]:
    """Simulates every (policy, rate, seed) point, ``workers`` processes at a time.

    Args:
        specs: policies, display order.
        rates_qps: rates, requests per second.
        requests_by_seed: seed -> its unit-rate trace (``build_requests``, ``build_shared_prefix``) or sessions
            (``build_sessions``); the seed also seeds the routers.
        config: fleet settings (its ``seed`` is replaced by each trace's).
        workers: processes (1 = in this process).
        progress: show a tqdm bar of points on stderr when it is a terminal.

    Returns:
        One point per (policy, rate, seed), ordered by policy (``specs`` order), rate (ascending), seed.
    """
    tasks = [(spec, rate, at_rate(requests, rate), dataclasses.replace(config, seed=seed))
             for spec in specs for rate in sorted(rates_qps) for seed, requests in requests_by_seed.items()]
    # Most expensive first (predictions per request x rate) so that a slow point does not finish last alone.
    tasks.sort(key=lambda t: -(t[0].params.get("k", 0) + 0.1) * t[1])
    points: list[SeedPoint] = []
    bar = tqdm(total=len(tasks), desc="cluster points", unit="pt", disable=None if progress else True)
    try:
        if workers <= 1:
            for task in tasks:
                points.append(_run_point(task))
                bar.update()
        else:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                for point in pool.imap_unordered(_run_point, tasks):
                    points.append(point)
                    bar.update()
    finally:
        bar.close()
    order = {spec.label: i for i, spec in enumerate(specs)}
    return sorted(points, key=lambda p: (order[p.result.policy], p.result.rate_qps, p.seed))


def error_model(args: argparse.Namespace, pairs: Sequence[SharegptPair]
                ) -> tuple[SamplePredictedTokens, str, ResidualLengthModel]:
    """(predicted-length sampler, its description, the sidecars' residual rule calibrated on the same errors).

    Args:
        args: reads ``oracle_lengths``, ``length_errors`` (a tagger directory, an errors.npz, or ``lognormal``),
            ``length_sigma`` and ``workload`` (multi-turn traffic takes the errors on every exchange).
        pairs: the ShareGPT pairs (the log-normal model's residual rule samples their lengths).

    Raises:
        ValueError: an error sample without (predicted, true) pairs.
    """
    if args.oracle_lengths:
        return oracle_lengths, "oracle (predicted = true)", ExactLengths()
    if str(args.length_errors) == "lognormal":
        model = LognormalLengthError(args.length_sigma)
        rng = random.Random(12345)
        true = [p.num_output_tokens for p in rng.choices(list(pairs), k=5000)]
        residual = EmpiricalResidual([model(t, rng) for t in true], true)
        return model, f"log-normal, sigma {args.length_sigma:g}", residual
    from tagger.errors import FIRST_ERRORS_FILE, LengthErrorModel  # noqa: PLC0415 (numpy only; no torch)

    path = Path(args.length_errors)
    # A tagger directory holds its errors on every exchange (errors.npz: multi-turn traffic) and on first
    # exchanges only (errors_first.npz: single-turn traffic and the shared-prefix questions).
    if path.is_dir() and args.workload != "multi-turn" and (path / FIRST_ERRORS_FILE).exists():
        path = path / FIRST_ERRORS_FILE
    errors = LengthErrorModel.load(path)
    if errors.predicted_tokens is None:
        raise ValueError(f"{args.length_errors}: the error sample has no (predicted, true) pairs")
    residual = EmpiricalResidual(errors.predicted_tokens, errors.true_tokens)
    return (lambda n, rng: errors.sample(n, rng)), f"tagger's measured errors ({_shown(str(path))})", residual


def _shown(path: str) -> str:
    """``path`` relative to the repository when it lies inside it (printed and written into results)."""
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="astrolabe bench cluster", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--num-instances", type=int, default=12, help="simulated vLLM instances")
    p.add_argument("--num-routers", type=int, default=4, help="router replicas (each with its own view)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per (policy, rate, seed) point; default per workload: "
                        + "; ".join(f"{w} {n}" for w, n in DEFAULT_WORKLOAD_REQUESTS.items()))
    p.add_argument("--workload", choices=WORKLOADS, default="sharegpt",
                   help="sharegpt: single-turn ShareGPT requests (no prefix reuse); multi-turn: ShareGPT "
                        "conversations replayed as closed-loop chat sessions; shared-prefix: tenants with long "
                        "shared contexts and short questions (bench/README.md)")
    p.add_argument("--rates", default=None,
                   help="arrival rates of the sweep, comma-separated: requests/s (sessions/s for multi-turn); "
                        "default per workload: " + "; ".join(
                            f"{w} {','.join(f'{r:g}' for r in rates)}" for w, rates in DEFAULT_WORKLOAD_RATES.items()))
    p.add_argument("--think-time-s", type=float, default=5.0,
                   help="multi-turn: mean think time from a reply's end to the next turn, seconds")
    p.add_argument("--min-think-time-s", type=float, default=1.0,
                   help="multi-turn: shortest think time, seconds (think = this + exponential)")
    p.add_argument("--working-set", type=float, default=1.0,
                   help="shared-prefix: the tenants' distinct contexts, as a fraction of the fleet's total KV cache")
    p.add_argument("--context-tokens", type=int, default=2048,
                   help="shared-prefix: tokens of each tenant's shared context")
    p.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)), help="trace seeds, comma-separated")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="comma-separated labels: a policy name, envoy-least-request, or astrolabe-k<N>|full|paper "
                        "with -ttft|-e2e|-blend|-mem|-nomem|-noextra|-noprefix|-stale<S>, any of them + "
                        ":KEY=VALUE[:KEY=VALUE...] (policy params) (policy_spec)")
    p.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson", help="arrival process")
    p.add_argument("--cv", type=float, default=2.0, help="coefficient of variation of gaps for --arrival gamma")
    add_engine_arguments(p, EngineConfig(num_gpu_blocks=A30_LIKE_NUM_GPU_BLOCKS))  # an A30-like KV cache
    p.add_argument("--batch-time-model", default="llama-2-7b", help="shipped step-time model name or JSON path")
    p.add_argument("--slow-fraction", type=float, default=0.0,
                   help="fraction of instances whose steps take --slow-factor times as long (a mixed fleet)")
    p.add_argument("--slow-factor", type=float, default=1.6, help="step-time factor of the slow instances")
    p.add_argument("--max-model-len", type=int, default=4096, help="longest prompt + reply kept, tokens")
    p.add_argument("--metrics-interval-s", type=float, default=0.05,
                   help="how often the metrics policies' scrapes refresh, virtual seconds")
    p.add_argument("--staleness-s", type=float, default=0.0,
                   help="each sidecar publishes its state every this many virtual seconds and astrolabe decisions "
                        "predict from the last one (production: 0.02, the sidecars' --watch-interval-s); 0 = the "
                        "exact state at each decision")
    p.add_argument("--decision-latency-s", type=float, default=0.0,
                   help="from a request's arrival to its arrival at the chosen instance, virtual seconds, every "
                        "policy (production: ~0.003, the demo's astrolabe route time p50)")
    p.add_argument("--oracle-lengths", action="store_true", help="predictors get the true output lengths")
    p.add_argument("--length-errors", default=str(SHIPPED_LIGHT_DIR),
                   help="a tagger directory (its errors_first.npz for single-turn workloads, errors.npz for "
                        "multi-turn) or an errors file whose measured errors give predicted lengths, or 'lognormal'")
    p.add_argument("--length-sigma", type=float, default=LOGNORMAL_SIGMA, help="log-normal error sigma")
    p.add_argument("--length-distribution", choices=("quantiles", "binned"), default="binned",
                   help="the sidecars' residual length of a live request: quantiles = from the request's own "
                        "predicted distribution (the tagger's quantiles.npz around its predicted length, for a "
                        "first or a later turn; past its top quantile, the binned rule), what real sidecars do "
                        "unless told otherwise; binned (this bench's default, so that recorded figures stay "
                        "comparable) = from the tagger's held-out errors in the bin of its predicted length")
    p.add_argument("--prediction-noise", type=float, default=0.0,
                   help="stddev of multiplicative Gaussian noise on predicted latencies (0-1)")
    p.add_argument("--slo-ttft-s", type=float, default=2.0, help="P99 TTFT SLO for capacity, seconds")
    defaults = MigrationParams()
    p.add_argument("--migration-bandwidth", type=float, default=defaults.bandwidth_gbytes_per_s,
                   help="KV copy bandwidth of llumnix-migrate, GB/s (1e9 bytes/s; 0 = no migration)")
    p.add_argument("--migration-bandwidths", default="",
                   help="sweep: one llumnix-migrate-bw<X> per bandwidth (GB/s, comma-separated), compared with "
                        "llumnix and astrolabe-k2 (added if missing)")
    p.add_argument("--migration-stage-overhead-s", type=float, default=defaults.stage_overhead_s,
                   help="fixed orchestration time of one migration stage, seconds")
    p.add_argument("--migration-interference", type=float, default=defaults.copy_interference_frac,
                   help="while a stage copies, source and destination steps take (1 + this) as long")
    p.add_argument("--migration-blocking-copy", action="store_true",
                   help="the copy blocks both engines for the whole stage instead")
    p.add_argument("--migration-request-policy", choices=REQUEST_POLICIES, default=defaults.request_policy,
                   help="which running request migrates: last (LCR), shortest (SR) or longest (LR)")
    p.add_argument("--migration-threshold", type=float, default=defaults.migrate_out_threshold,
                   help="migrate-out load threshold, -free blocks per request (Llumnix migrate_out_threshold)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR, help="folder of cluster.csv and p99_ttft.png")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                   help="worker processes (default: 2, at most the CPUs)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args(argv)
    if args.num_requests is None:
        args.num_requests = DEFAULT_WORKLOAD_REQUESTS[args.workload]
    if args.rates is None:
        args.rates = ",".join(f"{r:g}" for r in DEFAULT_WORKLOAD_RATES[args.workload])
    if not 0 <= args.prediction_noise <= 1:
        p.error("--prediction-noise must be in [0, 1]")
    if min(args.num_requests, args.num_instances, args.workers, args.num_routers) < 1:
        p.error("--num-requests, --num-instances, --num-routers and --workers must be >= 1")
    if not 0 <= args.slow_fraction <= 1 or not args.slow_factor > 0:
        p.error("--slow-fraction must be in [0, 1] and --slow-factor > 0")
    if not (0 <= args.staleness_s < math.inf and 0 <= args.decision_latency_s < math.inf):
        p.error("--staleness-s and --decision-latency-s must be finite numbers >= 0 (seconds)")
    try:
        args.migration = MigrationParams(
            bandwidth_gbytes_per_s=args.migration_bandwidth, stage_overhead_s=args.migration_stage_overhead_s,
            copy_interference_frac=args.migration_interference, blocking_copy=args.migration_blocking_copy,
            request_policy=args.migration_request_policy, migrate_out_threshold=args.migration_threshold)
        args.sweep_bandwidths = [float(b) for b in args.migration_bandwidths.split(",") if b.strip()]
    except ValueError as exc:
        p.error(f"migration settings: {exc}")
    if any(not b > 0 for b in args.sweep_bandwidths):
        p.error("--migration-bandwidths must list bandwidths > 0 (GB/s)")
    return args


def _labels(args: argparse.Namespace) -> list[str]:
    """The policy labels of the run: --policies, plus the sweep's labels and its references when sweeping."""
    labels = [label.strip() for label in args.policies.split(",") if label.strip()]
    if args.sweep_bandwidths:
        for label in ("llumnix", "astrolabe-k2", *map(migrate_label, args.sweep_bandwidths)):
            if label not in labels:
                labels.append(label)
    return labels


def _migration_settings(args: argparse.Namespace, specs: Sequence[PolicySpec], block_size: int) -> str:
    """The migration part of the settings line ('' when no policy migrates)."""
    if not any(s.migration is not None for s in specs):
        return ""
    m: MigrationParams = args.migration
    copy = "blocking both engines" if m.blocking_copy else f"beside the steps, slowing them by {m.copy_interference_frac:g}"
    return (f"; migration (llumnix-migrate): {m.bandwidth_gbytes_per_s:g} GB/s unless -bw<X>, "
            f"{m.kv_bytes_per_token * block_size / 2**20:g} MiB per {block_size}-token block, {m.stage_overhead_s:g} s per stage, copy "
            f"{copy}, poll every {m.polling_interval_s:g} s, threshold {m.migrate_out_threshold:g}, "
            f"{m.request_policy}, last stage <= {m.last_stage_max_blocks} blocks, <= {m.max_stages} stages")


def _time_scales(args: argparse.Namespace) -> tuple[float, ...] | None:
    num_slow = round(args.slow_fraction * args.num_instances)
    if num_slow == 0:
        return None
    return (1.0,) * (args.num_instances - num_slow) + (args.slow_factor,) * num_slow


def _settings(args: argparse.Namespace, engine: EngineConfig, error_desc: str, seeds: Sequence[int]) -> str:
    fleet = f"{args.num_instances} instances"
    if _time_scales(args):
        num_slow = round(args.slow_fraction * args.num_instances)
        fleet += f" ({num_slow} with steps x {args.slow_factor:g}: a mixed fleet)"
    arrival = args.arrival + (f" (cv {args.cv:g})" if args.arrival == "gamma" else "")
    return (f"{fleet}, {args.num_routers} router replica(s), Llama-2-7B shape, H200 step-time model "
            f"'{args.batch_time_model}'; max_num_seqs {engine.max_num_seqs}, max_num_batched_tokens "
            f"{engine.max_num_batched_tokens}, KV cache {engine.num_gpu_blocks} blocks x {engine.block_size} tokens "
            f"= {engine.num_gpu_blocks * engine.block_size} tokens per instance; {args.num_requests} "
            f"{'ShareGPT' if args.workload == 'sharegpt' else args.workload} requests per point x seeds {','.join(map(str, seeds))}, {arrival} arrivals; predicted lengths: "
            f"{error_desc}; prediction noise {args.prediction_noise:g}; metrics every {args.metrics_interval_s:g} s; "
            f"sidecar states every {args.staleness_s:g} s (0 = exact; -stale<S> labels their own), decision "
            f"latency {args.decision_latency_s:g} s")


def _traces(args: argparse.Namespace, engine: EngineConfig, pairs: Sequence[SharegptPair], seeds: Sequence[int],
            sample_predicted_tokens: SamplePredictedTokens, max_len: int) -> tuple[dict[int, Trace], str]:
    """Each seed's unit-rate trace of ``args.workload`` and a line describing the workload.

    Raises:
        ValueError: bad workload settings.
    """
    if args.workload == "sharegpt":
        return ({seed: build_requests(pairs, args.num_requests, random.Random(seed), args.arrival, args.cv,
                                      sample_predicted_tokens)[1] for seed in seeds},
                "single-turn ShareGPT (no block keys: no prefix reuse); rate axis: requests/s")
    if args.workload == "shared-prefix":
        fleet_tokens = args.num_instances * engine.num_gpu_blocks * engine.block_size
        shape = SharedPrefixShape.for_working_set(args.working_set, fleet_tokens, args.context_tokens)
        traces = {seed: build_shared_prefix(shape, args.num_requests, random.Random(seed), args.arrival, args.cv,
                                            sample_predicted_tokens, engine.block_size) for seed in seeds}
        return traces, (f"shared-prefix: {shape.num_tenants} tenants x {shape.context_tokens}-token shared context "
                        f"(working set {shape.num_tenants * shape.context_tokens} tokens = "
                        f"{shape.num_tenants * shape.context_tokens / fleet_tokens:.2f} x the fleet's KV cache), "
                        f"tenant uniform per request, questions {shape.question_tokens[0]}-"
                        f"{shape.question_tokens[1]} tokens, answers {shape.answer_tokens[0]}-"
                        f"{shape.answer_tokens[1]} tokens (uniform); rate axis: requests/s")
    conversations = load_sharegpt_conversations()
    traces = {seed: build_sessions(conversations, args.num_requests, random.Random(seed), args.arrival, args.cv,
                                   sample_predicted_tokens, block_size=engine.block_size, max_model_len=max_len,
                                   think_time_s=args.think_time_s, min_think_time_s=args.min_think_time_s)
              for seed in seeds}
    sessions = [s for trace in traces.values() for s in trace]
    turns = sum(len(s.turns) for s in sessions) / len(sessions)
    prompt = sum(t.num_prompt_tokens for s in sessions for t in s.turns) / sum(len(s.turns) for s in sessions)
    return traces, (f"multi-turn ShareGPT sessions (closed loop): {len(sessions) // len(traces)} sessions per seed, "
                    f"{turns:.2f} turns per session on average (so X sessions/s offer ~{turns:.2f}X requests/s), "
                    f"mean prompt {prompt:.0f} tokens; turn k = the conversation so far (recorded replies) + the "
                    f"next human message, sent {args.min_think_time_s:g} s + Exponential(mean "
                    f"{args.think_time_s - args.min_think_time_s:g} s) after the previous reply ends; conversations "
                    f"end before outgrowing {max_len} tokens; rate axis: sessions/s")


def _with_length_distributions(traces: dict[int, Trace], quantiles, beyond: ResidualLengthModel
                                ) -> dict[int, Trace]:
    """Each request with its own predicted length distribution: the tagger's quantiles (``tagger.quantiles``)
    around its predicted length, as the sidecars price a request the extproc marks as a first or later turn
    (``predictor.residual_rules``: a session's later turns have a history); past its top quantile, ``beyond``."""
    by_turn = {has_history: TaggerQuantileResidual(quantiles, has_history, beyond) for has_history in (False, True)}

    def own(request: ClusterRequest, has_history: bool) -> ClusterRequest:
        return dataclasses.replace(request, length_residual=by_turn[has_history])

    out: dict[int, Trace] = {}
    for seed, trace in traces.items():
        if trace and isinstance(trace[0], ClusterSession):
            out[seed] = [dataclasses.replace(s, turns=tuple(own(t, k > 0) for k, t in enumerate(s.turns)))
                         for s in trace]
        else:
            out[seed] = [own(r, False) for r in trace]
    return out


def main(argv: Sequence[str]) -> int:
    """Runs the sweep and prints the tables; returns 0, or 2 on a bad argument."""
    args = _parse_args(argv)
    setup_logging("WARNING")
    try:
        rates_qps = [float(r) for r in args.rates.split(",") if r.strip()]
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        engine = engine_from_args(args)
        max_len = min(args.max_model_len, engine.num_gpu_blocks * engine.block_size)
        pairs = filter_pairs(load_sharegpt_pairs(), max_model_len=max_len)
        sample_predicted_tokens, error_desc, residual = error_model(args, pairs)
        specs = [policy_spec(label, args.num_instances, migration=args.migration) for label in _labels(args)]
        requests_by_seed, workload_desc = _traces(args, engine, pairs, seeds, sample_predicted_tokens, max_len)
        if args.length_distribution == "quantiles" and not args.oracle_lengths \
                and str(args.length_errors) != "lognormal":
            from tagger.quantiles import LengthQuantiles  # noqa: PLC0415 (numpy only)

            directory = Path(args.length_errors)
            quantiles = LengthQuantiles.load(directory if directory.is_dir() else directory.parent)
            requests_by_seed = _with_length_distributions(requests_by_seed, quantiles, residual)
            error_desc += ", each request's own quantiles (tagger/quantiles.py) for its residual length"
    except ValueError as exc:
        print(f"astrolabe bench cluster: {exc}", file=sys.stderr)
        return 2
    if not rates_qps or min(rates_qps) <= 0 or not seeds:
        print("astrolabe bench cluster: --rates must list positive rates and --seeds at least one seed",
              file=sys.stderr)
        return 2
    config = ClusterConfig(args.num_instances, engine, args.batch_time_model, args.metrics_interval_s,
                           args.prediction_noise, 0, args.num_routers, residual, _time_scales(args),
                           staleness_s=args.staleness_s, decision_latency_s=args.decision_latency_s)
    print(f"SIMULATED (virtual time): {_settings(args, engine, error_desc, seeds)}{_migration_settings(args, specs, engine.block_size)}")
    print(f"workload: {workload_desc}")
    start_s = time.perf_counter()
    points = run_sweep(specs, rates_qps, requests_by_seed, config, args.workers, progress=not args.no_progress)
    wall_s = time.perf_counter() - start_s
    pooled = pool_points(points)
    caps = capacities(pooled, args.slo_ttft_s)
    crossings = crossing_rates(pooled, args.slo_ttft_s)
    extra = {"num_instances": args.num_instances, "arrival": args.arrival,
             "cv": args.cv if args.arrival == "gamma" else "", "seeds": " ".join(map(str, seeds)),
             "num_gpu_blocks": engine.num_gpu_blocks, "block_size": engine.block_size,
             "max_num_seqs": engine.max_num_seqs, "max_num_batched_tokens": engine.max_num_batched_tokens,
             "slow_fraction": args.slow_fraction, "slow_factor": args.slow_factor, "length_errors": error_desc,
             "prediction_noise": args.prediction_noise, "slo_ttft_s": args.slo_ttft_s,
             "migration_bandwidth_gbytes_per_s": args.migration.bandwidth_gbytes_per_s,
             "migration_stage_overhead_s": args.migration.stage_overhead_s,
             "migration_interference": args.migration.copy_interference_frac,
             "migration_blocking_copy": args.migration.blocking_copy,
             "migration_request_policy": args.migration.request_policy,
             "migration_threshold": args.migration.migrate_out_threshold, "staleness_s": args.staleness_s,
             "decision_latency_s": args.decision_latency_s, "workload": args.workload}
    csv_path = write_csv(args.out / "cluster.csv", pooled, extra)
    plot_path = write_plot(args.out / "p99_ttft.png", pooled, args.slo_ttft_s,
                           f"simulated: {args.num_instances} instances, {args.num_routers} routers, "
                           f"{args.arrival} arrivals, seeds {','.join(map(str, seeds))}")
    num_simulated = sum(p.result.num_requests for p in points)
    print(format_points(pooled))
    print()
    print(format_capacities(caps, crossings, args.slo_ttft_s))
    ratios = format_ratios(points, pooled, "astrolabe-k2", args.slo_ttft_s)
    if ratios:
        print()
        print(ratios)
    astrolabes = [s.label for s in specs if s.label.startswith("astrolabe")]
    stale = [s.label for s in specs if s.label.startswith("astrolabe") and s.staleness_s is not None]
    for target, reference in ((LLUMNIX_MIGRATE, "llumnix"), *((a, LLUMNIX_MIGRATE) for a in astrolabes),
                              *((a, "least-requests") for a in stale)):
        pair = format_pair_ratios(points, target, reference)
        if pair:
            print()
            print(pair)
    if args.sweep_bandwidths:
        bandwidths = {s.label: s.migration.bandwidth_gbytes_per_s for s in specs
                      if s.migration is not None and s.migration.enabled}
        verdicts = sweep_verdicts(points, pooled, bandwidths, "llumnix", args.slo_ttft_s)
        print()
        print(format_migration_sweep(pooled, verdicts, "llumnix", ["astrolabe-k2"], args.slo_ttft_s))
    print(f"\nlatencies in seconds (virtual time), pooled over seeds; [low, high] = 95% block-bootstrap interval; "
          f"SLO for capacity: P99 TTFT <= {args.slo_ttft_s:g} s")
    print(f"wrote {csv_path} and {plot_path}")
    print(f"{num_simulated} simulated requests in {wall_s:.1f} s wall = {num_simulated / wall_s:.0f} requests per "
          f"wall second ({args.workers} worker process(es))")
    return 0

