"""`astrolabe bench extproc`: what the extproc itself costs, as ratios to goals measured in the same run.

Three sections, all real processes on loopback (`bench.extproc_drive`):

1. **capacity** (``throughput``): one extproc process per policy (``random``, ``least-requests``, ``astrolabe`` with
   k = 2 and the shipped light tagger, predicting in the router from the sidecars' streamed states, and
   ``astrolabe-unary``, the same with an Admit and a Release call per request instead of the batched notice
   stream, ``astrolabe-predict``, a Predict round trip per candidate, and ``astrolabe-2w``, the default with
   ``workers: 2``: a supervisor and 2 worker processes, its CPU summed over them all, driven over 4 connections so
   that both workers decide), 2 emulated instances with their
   predictor sidecars. The bench is the ext_proc client, as Envoy is (one BUFFERED ``Process`` stream per
   decision). Each extproc is pinned to CPU 0 (``os.sched_setaffinity`` on each of its threads) and everything
   else the bench starts, and the bench itself, to the other CPUs, so "one core" is the extproc's alone among these processes. Per round and policy (policy
   order rotated each round, fresh prompts each round so the tagger's cache never answers): a latency block at
   concurrency 1 (p50 / p99 of headers-sent to routing-answer) and a saturation block at ``--concurrency``
   (decisions/s over the block's wall time, and decisions per CPU-second of the extproc process from /proc:
   the capacity of one core, whether or not the client saturated it; ``busy`` = the extproc's CPU / wall time
   says how close to saturation the block came), and the CPU of the 2 sidecar processes over the same blocks,
   summed, per decision (/proc, the same reader; the emulators not counted). The sidecars serve every extproc of
   the section all along (state streams, engine polling), so ``random`` and ``least-requests``, which call no
   sidecar, measure that background: the astrolabe rows' CPU above it = theirs minus ``random``'s sidecar cores
   times their blocks' wall time.
2. **Envoy** (``envoy``): latency added by the router through real Envoy. The same 2 `bench.fast_backend`
   instances (they answer at once, whatever the prompt: the backend's cost is constant, so the difference is the
   route's) with their sidecars, reached (a) by an Envoy with a static route and its own ``LEAST_REQUEST``
   balancer (``astrolabe envoy --mode least-request``) and (b) by an Envoy with the ext_proc filter in front of
   an ``astrolabe`` extproc (``--mode full-duplex`` and ``--mode buffered``). Open-loop arrivals at a fixed rate,
   evenly spaced, non-streaming chat requests; static and extproc blocks alternate (ABBA) with the same bodies in
   the same order, so they pair by position; added p50 / p99 = extproc arm's percentile minus the static arm's,
   with a 95% paired moving-block bootstrap interval (`bench.stats`). Small prompts and 200 KB prompts.
3. **profile** (``profile``): one more ``astrolabe`` extproc run under cProfile while driven at concurrency 8;
   its profiled time split by phase (inclusive time of each phase's entry function, module docstring of
   `phase_shares`); plus the per-stage times the extproc's decision log records for the capacity section.

Anchors printed beside the figures: the Gateway API Inference Extension's Go Endpoint Picker schedules in 0.1-0.2
ms p50 (``EPP_P50_S``); goal >= 1,000 decisions per CPU-second for ``astrolabe``; goal added p99 <= 3 ms at 200
req/s for small prompts. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import pstats
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from astrolabe.cli import HelpFormatter
from astrolabe.logs import setup_logging
from bench import stats
from bench.decisions import read_decisions
from bench.demo_fleet import cpu_seconds, group_cpu_seconds, group_pids
from bench.extproc_drive import MODEL, START_TIMEOUT_S, drive_block, prompts, start_extproc, start_fleet
from bench.fast_backend import INSTANCE_HEADER
from astrolabe.procs import ManagedProcess, ProcessGroup, exit_status_of, free_port

logger = logging.getLogger(__name__)

POLICIES = ("random", "least-requests", "astrolabe", "astrolabe-unary", "astrolabe-predict", "astrolabe-2w")
PREDICT_MODE = "astrolabe-predict"
"""``astrolabe`` with ``predictor_client.mode: predict`` (a Predict round trip per candidate, protocol v1.1): the
capacity section measures it beside the default (predictions in the router from the sidecars' streamed states)."""
UNARY_NOTICES = "astrolabe-unary"
"""``astrolabe`` (predictions in the router) with ``predictor_client.notices: unary``: an Admit and a Release call
per request instead of the batched notice stream (protocol v1.3, ``extproc/notices.py``)."""
TWO_WORKERS = "astrolabe-2w"
"""``astrolabe`` with ``workers: 2`` (a supervisor and 2 worker processes on one port, ``extproc.workers``),
driven over `TWO_WORKERS_CONNECTIONS` connections; its CPU is the sum over the supervisor and its workers."""
TWO_WORKERS_CONNECTIONS = 4
"""Connections the bench drives `TWO_WORKERS` over: the kernel gives each to one worker."""


def _extproc_args(label: str) -> dict:
    """``start_extproc`` keywords of a capacity label: its policy, and the settings of `PREDICT_MODE`,
    `UNARY_NOTICES` and `TWO_WORKERS`."""
    if label == PREDICT_MODE:
        return {"policy": "astrolabe", "extra": {"predictor_client": {"mode": "predict", "predict_timeout_s": 0.2}}}
    if label == UNARY_NOTICES:
        return {"policy": "astrolabe", "extra": {"predictor_client": {"notices": "unary"}}}
    if label == TWO_WORKERS:
        return {"policy": "astrolabe", "workers": 2}
    return {"policy": label}


def _connections(label: str) -> int:
    return TWO_WORKERS_CONNECTIONS if label == TWO_WORKERS else 1
SECTIONS = ("throughput", "envoy", "profile")
EPP_P50_S = (0.1e-3, 0.2e-3)
"""The Go Endpoint Picker's scheduling time per request, p50, seconds (the anchor of issue 14)."""
GOAL_DECISIONS_PER_CPU_S = 1000.0
"""Goal: ``astrolabe`` decisions per CPU-second of one extproc process (one core)."""
GOAL_ADDED_P99_S = 3e-3
"""Goal: p99 latency the extproc adds through Envoy at 200 req/s, small prompts, seconds."""
EXTPROC_CPU = 0
"""The CPU the capacity section pins each extproc to."""
LARGE_PROMPT_WORDS = 36_000
"""Words of a "200 KB" prompt (`bench.extproc_drive.prompts`: ~5.8 bytes per word: 210 KB bodies)."""


# --- pure helpers (unit-tested) -------------------------------------------------------------------------------

def paired_difference_ci(values_a: Sequence[float], values_b: Sequence[float], statistic: stats.Statistic, *,
                         block_len: int = stats.DEFAULT_BLOCK_LEN, num_resamples: int = stats.DEFAULT_NUM_RESAMPLES,
                         confidence: float = stats.DEFAULT_CONFIDENCE, seed: int = 0) -> stats.Interval:
    """``statistic(a) - statistic(b)`` over the same requests (same order), with a paired moving-block bootstrap
    interval: the resampling of `bench.stats.paired_ratio_ci`, a difference instead of a ratio (same unit as the
    values).

    Raises:
        ValueError: lengths differ, no values, or bad parameters (as `bench.stats.paired_ratio_ci`).
    """
    a, b = np.asarray(values_a, dtype=float), np.asarray(values_b, dtype=float)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"paired figures need the same, non-empty requests: {a.shape} vs {b.shape}")
    groups = stats._check(len(a), None, block_len, num_resamples, confidence)  # noqa: SLF001 (same package)
    blocks = stats._blocks(groups, block_len)  # noqa: SLF001
    rng = np.random.default_rng(seed)
    samples = [statistic(a[idx]) - statistic(b[idx]) for idx in stats._resample_indices(blocks, num_resamples, rng)]  # noqa: SLF001
    low, high = stats._quantiles(samples, confidence)  # noqa: SLF001
    return stats.Interval(statistic(a) - statistic(b), low, high)


def rotated(items: Sequence[str], round_index: int) -> list[str]:
    """``items`` rotated left by ``round_index`` (each item leads one round in turn, so drift spreads evenly)."""
    k = round_index % len(items)
    return [*items[k:], *items[:k]]


def abba(round_index: int) -> tuple[str, str]:
    """Arm order of a round: static first on even rounds, extproc first on odd ones (ABBA)."""
    return ("static", "extproc") if round_index % 2 == 0 else ("extproc", "static")


def _ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, NaN where nothing was measured (``denominator`` <= 0)."""
    return numerator / denominator if denominator > 0 else math.nan


@dataclass(slots=True)
class PolicyCapacity:
    """One policy's capacity-section figures, pooled over rounds.

    Attributes:
        policy: its registry name.
        latency_s: decision latency at concurrency 1, seconds, round by round.
        num_saturated: decisions in the saturation blocks.
        saturated_wall_s: their wall time, seconds.
        saturated_cpu_s: the extproc process's CPU (user + system) over them, seconds.
        saturated_sidecar_cpu_s: the sidecar processes' CPU (user + system) over them, summed, seconds.
        bases: decision basis (``extproc.router``) -> count, over every measured decision.
        deciders: the deciding process's pid -> its measured decisions (several: an extproc's workers).
    """

    policy: str
    latency_s: list[float] = field(default_factory=list)
    num_saturated: int = 0
    saturated_wall_s: float = 0.0
    saturated_cpu_s: float = 0.0
    saturated_sidecar_cpu_s: float = 0.0
    bases: Counter = field(default_factory=Counter)
    deciders: Counter = field(default_factory=Counter)

    @property
    def decisions_per_s(self) -> float:
        return _ratio(self.num_saturated, self.saturated_wall_s)

    @property
    def decisions_per_cpu_s(self) -> float:
        return _ratio(self.num_saturated, self.saturated_cpu_s)

    @property
    def busy_frac(self) -> float:
        return _ratio(self.saturated_cpu_s, self.saturated_wall_s)

    @property
    def sidecar_cpu_s_per_decision(self) -> float:
        """The sidecars' CPU per saturated decision, seconds (NaN: none measured)."""
        return _ratio(self.saturated_sidecar_cpu_s, self.num_saturated)

    @property
    def sidecar_cores(self) -> float:
        """The sidecars' CPU / wall time of the saturation blocks (NaN: none measured)."""
        return _ratio(self.saturated_sidecar_cpu_s, self.saturated_wall_s)

    def sidecar_cpu_s_above(self, background_cores: float) -> float:
        """The sidecars' CPU per saturated decision above a background of ``background_cores`` (CPU / wall time
        of sidecars that no extproc calls, e.g. in ``random``'s blocks) over these blocks' wall time, seconds."""
        return _ratio(self.saturated_sidecar_cpu_s - background_cores * self.saturated_wall_s, self.num_saturated)


@dataclass(slots=True)
class AddedLatency:
    """One (body mode, prompt size) cell of the Envoy section: paired latencies, seconds (NaN: failed).

    Attributes:
        policy: the extproc's policy.
        body_mode: ``full-duplex`` or ``buffered``.
        size: ``small`` or ``200KB``.
        rate_qps: the arrival rate, requests per second.
        static_s: through Envoy's static route, per request, blocks in order.
        extproc_s: through Envoy + extproc, the same requests in the same order.
        instances: ``x-emulator-instance`` -> requests it answered, over both arms.
        wall_s: wall time of the extproc arm's blocks, seconds.
        cpu_s: CPU over them per role (`ROLES`: extproc, sidecars, Envoys, backends), seconds.
    """

    policy: str
    body_mode: str
    size: str
    rate_qps: float
    static_s: list[float] = field(default_factory=list)
    extproc_s: list[float] = field(default_factory=list)
    instances: Counter = field(default_factory=Counter)
    wall_s: float = 0.0
    cpu_s: Counter = field(default_factory=Counter)

    @property
    def num_failed(self) -> int:
        return int(np.isnan(self.static_s).sum() + np.isnan(self.extproc_s).sum())


PHASES = ("gRPC server, protobuf, asyncio loop", "ext_proc stream handling", "body parsing (JSON)",
          "prompt token count", "length estimate (tagger)", "Predict/Admit/Release client", "policy",
          "router bookkeeping (views, metrics, decision log)")


def phase_shares(profile: pstats.Stats) -> dict[str, float]:
    """Seconds of profiled time per phase (`PHASES` order; they sum to the profile's total).

    Each phase is the inclusive (cumulative) time of its entry functions, minus the phases nested in it:
    ``stream`` = ``StreamHandler.on_message`` + ``close`` minus ``Router.route`` / ``release`` and
    ``parse_body``; ``router`` = ``route`` + ``release`` minus token count, length estimate, policy and the
    client's ``admit`` / ``release`` (called inline); the Predict client = ``predict`` (run in tasks of their own)
    + ``admit`` + ``release`` + the notification tasks (``run``); the rest of the process's time (gRPC's own
    callbacks, protobuf, the event loop) is the first phase.
    """
    cum: Counter = Counter()
    for (filename, _, name), (_, _, _, cumulative_s, _) in profile.stats.items():
        cum[(Path(filename).parent.name + "/" + Path(filename).name, name.rsplit(".", 1)[-1])] += cumulative_s

    def c(module: str, *names: str) -> float:
        return sum(cum[(module, n)] for n in names)

    policy = sum(cumulative_s for (module, name), cumulative_s in cum.items()
                 if module.startswith("policies/") and name in ("candidates", "more_candidates", "choose"))
    tokens = max(c("extproc/lengths.py", "count_prompt_tokens"), c("extproc/prompt_tokens.py", "count"))
    length = c("extproc/lengths.py", "estimate_before_cap")
    client_inline = c("extproc/predictor_client.py", "admit", "release")
    client = client_inline + c("extproc/predictor_client.py", "predict", "run")
    parse = c("extproc/request.py", "parse_body")
    routing = c("extproc/router.py", "route", "release")
    stream = c("extproc/stream.py", "on_message", "close")
    total = profile.total_tt
    shares = {
        PHASES[1]: stream - routing - parse, PHASES[2]: parse, PHASES[3]: tokens, PHASES[4]: length,
        PHASES[5]: client, PHASES[6]: policy, PHASES[7]: routing - tokens - length - policy - client_inline,
    }
    shares[PHASES[0]] = total - sum(shares.values())
    return {phase: shares[phase] for phase in PHASES}


def fmt_ms(value_s: float) -> str:
    """Seconds as milliseconds with 3 decimals ("-" for NaN)."""
    return "-" if math.isnan(value_s) else f"{value_s * 1e3:.3f}"


def fmt_interval_ms(interval: stats.Interval) -> str:
    """``value [low, high]`` in milliseconds."""
    return f"{fmt_ms(interval.value)} [{fmt_ms(interval.low)}, {fmt_ms(interval.high)}]"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths)))
             for row in (header, *rows)]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


# --- section 1: capacity --------------------------------------------------------------------------------------

def pin_threads(pid: int, cpus: set[int]) -> int:
    """Pins every thread of process ``pid`` to ``cpus`` (threads it starts later inherit it); returns the number
    of threads pinned (0 where not permitted or the process is gone)."""
    pinned = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            os.sched_setaffinity(int(task.name), cpus)
            pinned += 1
        except OSError:
            pass
    return pinned


def _cpu_sets() -> tuple[set[int], set[int]] | None:
    """(the extproc's CPU, every other CPU this process may use), or None on a single-CPU machine."""
    allowed = os.sched_getaffinity(0)
    if EXTPROC_CPU not in allowed or len(allowed) < 2:
        return None
    return {EXTPROC_CPU}, allowed - {EXTPROC_CPU}


def _group_cpu(proc: ManagedProcess) -> float:
    """CPU seconds so far of ``proc`` and every process of its group (an extproc's workers)."""
    return group_cpu_seconds({proc.pid: "extproc"})["extproc"]


def _measured(log: Path, key: str, skip_prefix: str = "warm") -> Counter:
    """The measured decisions of a decision log by ``key`` (``basis``, ``pid``)."""
    return Counter(r[key] for r in read_decisions([log]) if not r["request_id"].startswith(skip_prefix))


def run_capacity(num_rounds: int, num_latency: int, num_saturated: int, concurrency: int, seed: int,
                 policies: Sequence[str] = POLICIES) -> tuple[list[PolicyCapacity], list[dict], str]:
    """Section 1 (module docstring); returns per-policy figures (``policies`` order), the ``astrolabe``
    extproc's decision records of the latency blocks (for the stage split), and what was pinned.

    Raises:
        astrolabe.procs.ProcessStartError: a process did not start.
        RuntimeError: a decision was not routed.
    """
    results = {p: PolicyCapacity(p) for p in policies}
    with tempfile.TemporaryDirectory(prefix="astrolabe-extproc-bench-") as folder, ProcessGroup() as procs:
        tmp = Path(folder)
        fleet, sidecars = start_fleet(procs, tmp)
        sidecar_groups = {s.pid: "sidecars" for s in sidecars}  # their process groups: the emulators not counted
        extprocs = {p: start_extproc(procs, tmp, f"extproc-{p}", fleet, **_extproc_args(p)) for p in policies}
        cpu_sets = _cpu_sets()
        if cpu_sets is not None:
            for proc in procs.processes:
                for pid in group_pids(proc.pid):  # an extproc's workers too
                    pin_threads(pid, cpu_sets[0] if any(proc is e[0] for e in extprocs.values()) else cpu_sets[1])
            os.sched_setaffinity(0, cpu_sets[1])
        pinned = ("no pinning (one CPU)" if cpu_sets is None else
                  f"each extproc pinned to CPU {EXTPROC_CPU}; the client, emulators and sidecars to CPUs "
                  f"{sorted(cpu_sets[1])}")
        try:
            for p, (_, address, _) in extprocs.items():
                # connections, tokenizer, channels (of each worker: warm-up over as many connections as measured)
                drive_block(address, prompts(16 * _connections(p), seed - 1), f"warm-{p}", 4, _connections(p))
            for round_index in range(num_rounds):
                latency_bodies = prompts(num_latency, seed + 2 * round_index)
                saturated_bodies = prompts(num_saturated, seed + 2 * round_index + 1)
                for p in rotated(list(policies), round_index):
                    proc, address, _ = extprocs[p]
                    results[p].latency_s += drive_block(address, latency_bodies, f"lat{round_index}", 1)
                    sidecars_before_s = group_cpu_seconds(sidecar_groups)["sidecars"]
                    cpu_before_s, start_s = _group_cpu(proc), time.perf_counter()
                    drive_block(address, saturated_bodies, f"sat{round_index}", concurrency, _connections(p))
                    results[p].saturated_wall_s += time.perf_counter() - start_s
                    results[p].saturated_cpu_s += _group_cpu(proc) - cpu_before_s
                    results[p].saturated_sidecar_cpu_s += (group_cpu_seconds(sidecar_groups)["sidecars"]
                                                           - sidecars_before_s)
                    results[p].num_saturated += len(saturated_bodies)
        finally:
            if cpu_sets is not None:
                os.sched_setaffinity(0, cpu_sets[0] | cpu_sets[1])
        for p, (proc, _, log) in extprocs.items():
            proc.stop()  # SIGTERM: the decision log is flushed
            results[p].bases, results[p].deciders = _measured(log, "basis"), _measured(log, "pid")
        records = [r for r in read_decisions([extprocs["astrolabe"][2]]) if r["request_id"].startswith("lat")] \
            if "astrolabe" in extprocs else []
    return [results[p] for p in policies], records, pinned


def format_capacity(results: Sequence[PolicyCapacity], concurrency: int) -> str:
    """The capacity table, then the astrolabe figures as ratios to the anchors and to ``random``."""
    rows = []
    for r in results:
        total = sum(r.bases.values()) or 1
        on_predictions = (f"{r.bases['prediction'] / total:.1%}" if r.policy.startswith("astrolabe") else "-")
        rows.append([r.policy, str(len(r.latency_s)), fmt_ms(stats.p50(np.array(r.latency_s))),
                     fmt_ms(stats.p99(np.array(r.latency_s))), str(r.num_saturated), f"{r.decisions_per_s:.0f}",
                     f"{r.busy_frac:.2f}", f"{r.decisions_per_cpu_s:.0f}", f"{1e3 / r.decisions_per_cpu_s:.3f}",
                     fmt_ms(r.sidecar_cpu_s_per_decision), on_predictions])
    lines = [_table(["policy", "decisions c=1", "p50 ms", "p99 ms", f"decisions c={concurrency}", "decisions/s",
                     "busy", "decisions/CPU-s", "extproc CPU ms/decision", "sidecars CPU ms/decision",
                     "on predictions"],
                    rows)]
    by_policy = {r.policy: r for r in results}
    astrolabe = by_policy.get("astrolabe")
    if astrolabe is not None:
        p50_s = stats.p50(np.array(astrolabe.latency_s))
        lines.append(f"astrolabe: {astrolabe.decisions_per_cpu_s:.0f} decisions per CPU-second = "
                     f"{astrolabe.decisions_per_cpu_s / GOAL_DECISIONS_PER_CPU_S:.2f} x the goal of "
                     f"{GOAL_DECISIONS_PER_CPU_S:.0f}/s per core "
                     f"({'meets' if astrolabe.decisions_per_cpu_s >= GOAL_DECISIONS_PER_CPU_S else 'misses'} it); "
                     f"p50 decision {fmt_ms(p50_s)} ms = {p50_s / EPP_P50_S[1]:.1f}-{p50_s / EPP_P50_S[0]:.1f} x the "
                     f"Go Endpoint Picker's scheduler (0.1-0.2 ms p50)")
        two = by_policy.get(TWO_WORKERS)
        if two is not None:
            lines.append(f"astrolabe with 2 workers: {two.decisions_per_cpu_s:.0f} decisions per CPU-second summed "
                         f"over the supervisor and its workers = {two.decisions_per_cpu_s / astrolabe.decisions_per_cpu_s:.2f}"
                         f" x one process's (1 = no shared bottleneck); driven over {TWO_WORKERS_CONNECTIONS} "
                         f"connections, all its processes on the extproc's CPU; decisions per worker "
                         f"{'/'.join(str(n) for n in sorted(two.deciders.values(), reverse=True)) or '-'}")
        background = by_policy.get("random")
        if background is not None:
            above = [f"{r.policy} {fmt_ms(r.sidecar_cpu_s_above(background.sidecar_cores))}"
                     for r in results if r.policy.startswith("astrolabe")]
            lines.append(f"sidecars' CPU ms/decision above the background ({background.sidecar_cores:.2f} sidecar "
                         f"cores in random's blocks, times each row's wall time): {', '.join(above)}")
        for baseline in ("random", "least-requests"):
            if baseline in by_policy and len(by_policy[baseline].latency_s) == len(astrolabe.latency_s):
                ratio = stats.paired_ratio_ci(astrolabe.latency_s, by_policy[baseline].latency_s, stats.p50)
                lines.append(f"astrolabe / {baseline}: p50 latency {ratio.value:.2f} [95% interval {ratio.low:.2f}, "
                             f"{ratio.high:.2f}], CPU per decision "
                             f"{by_policy[baseline].decisions_per_cpu_s / astrolabe.decisions_per_cpu_s:.2f}")
    lines.append("latency = ext_proc headers sent -> routing answer received, client side (what Envoy waits), at "
                 "concurrency 1; decisions/s = saturation blocks' decisions / their wall time; busy = the extproc's "
                 "CPU / wall time in them (< ~0.9: the client or the sidecars, not the extproc, set the pace); "
                 "decisions/CPU-s = decisions / the extproc process's user+system CPU: one core's capacity; "
                 "sidecars CPU ms/decision = the 2 sidecar processes' user+system CPU over the same blocks, summed, / "
                 "decisions (emulators not counted; the sidecars serve every extproc of the section all along: state "
                 "streams, engine polling, so random's and least-requests' rows, which call no sidecar, are that "
                 "background); on predictions = decisions where both probed sidecars answered in time "
                 "(predict_timeout_s 0.2)")
    return "\n".join(lines)


def format_stages(records: Sequence[dict]) -> str:
    """The ``astrolabe`` extproc's own time per decision at concurrency 1, by stage (its decision log)."""
    if not records:
        return "no astrolabe decision records"
    routing = np.array([r["routing_s"] for r in records])
    stage = {name: np.array([r["stage_s"].get(name, 0.0) for r in records]) for name in ("tokens", "length", "predict")}
    rest = routing - sum(stage.values())
    rows = [[name, fmt_ms(stats.p50(v)), fmt_ms(float(np.mean(v))), f"{np.mean(v) / np.mean(routing):.1%}"]
            for name, v in (*stage.items(), ("rest", rest), ("routing_s (all)", routing))]
    return "\n".join([
        _table(["stage (decision log, c=1)", "p50 ms", "mean ms", "share of mean"], rows),
        "tokens = prompt token count; length = the tagger's estimate; predict = the 2 Predict calls (concurrent, "
        "round trip to the sidecars); rest = headers -> body wait (one client round trip), body parsing, endpoint "
        "views, policy, Admit, metrics, decision log (routing_s runs from the request's headers to the decision)"])


# --- section 2: latency added through Envoy -------------------------------------------------------------------

def large_prompts(num_requests: int, seed: int) -> list[bytes]:
    """``num_requests`` ~210 KB chat bodies: one seeded text of `LARGE_PROMPT_WORDS` words, each body's made unique
    by a leading number (so no cache answers), ``max_tokens`` 1."""
    base = prompts(1, seed, LARGE_PROMPT_WORDS, LARGE_PROMPT_WORDS, max_tokens=1)[0]
    marker = b'"content": "'
    return [base.replace(marker, marker + f"{seed}-{i} ".encode(), 1) for i in range(num_requests)]


def _start_envoy(procs: ProcessGroup, tmp: Path, mode: str, *, extproc: str | None = None,
                 backends: Sequence[str] = ()) -> str:
    """One Envoy (``astrolabe envoy --mode``, one worker thread); returns its base URL once it is ready."""
    port, admin = free_port(), free_port()
    cmd = [sys.executable, "-m", "astrolabe", "envoy", "--mode", mode, "--listen-port", str(port),
           "--admin-port", str(admin), "--concurrency", "1"]
    cmd += ["--extproc", extproc] if extproc else ["--backends", ",".join(backends)]
    proc = procs.start(cmd, name=f"envoy-{mode}", log_path=tmp / f"envoy-{mode}.log")
    proc.wait_http(f"http://127.0.0.1:{admin}/ready", START_TIMEOUT_S)
    return f"http://127.0.0.1:{port}"


async def open_loop(url: str, bodies: Sequence[bytes], rate_qps: float) -> tuple[list[float], Counter]:
    """POSTs ``bodies`` to ``url``'s chat path at ``rate_qps``, evenly spaced (open loop); returns each request's
    latency (send to the whole answer read, seconds; NaN unless 200 with an ``x-emulator-instance`` header) in
    ``bodies`` order, and how many requests each instance answered."""
    import aiohttp  # noqa: PLC0415

    latencies, instances = [math.nan] * len(bodies), Counter()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        start_s = time.perf_counter() + 0.01

        async def one(i: int, body: bytes) -> None:
            await asyncio.sleep(max(0.0, start_s + i / rate_qps - time.perf_counter()))
            sent_s = time.perf_counter()
            try:
                async with session.post(f"{url}/v1/chat/completions", data=body,
                                        headers={"content-type": "application/json"}) as response:
                    await response.read()
                    instance = response.headers.get(INSTANCE_HEADER)
                    if response.status == 200 and instance:
                        latencies[i] = time.perf_counter() - sent_s
                        instances[instance] += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                logger.warning("request %d to %s failed: %r", i, url, exc)

        await asyncio.gather(*(one(i, body) for i, body in enumerate(bodies)))
    return latencies, instances


def _wait_routes(url: str, body: bytes, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until a request through ``url`` is answered by an instance (Envoy connected to its upstreams).

    Raises:
        TimeoutError: none was within ``timeout_s``.
    """
    deadline_s = time.monotonic() + timeout_s
    while not math.isfinite(asyncio.run(open_loop(url, [body], 1.0))[0][0]):
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"no request through {url} was answered within {timeout_s} s")
        time.sleep(0.1)


ROLES = ("extproc", "sidecar", "envoy", "fast")
"""Process name prefixes whose CPU the Envoy section reports (``fast`` = the backends)."""




def _cpu_of(procs: ProcessGroup) -> Counter:
    return group_cpu_seconds({p.pid: next((r for r in ROLES if p.name.startswith(r)), "other")
                              for p in procs.processes})


def run_envoy(num_rounds: int, num_requests: int, rate_qps: float, num_large: int, large_rate_qps: float,
              seed: int, policy: str = "astrolabe",
              body_modes: Sequence[str] = ("full-duplex", "buffered")) -> list[AddedLatency]:
    """Section 2 (module docstring) for one extproc ``policy``; one `AddedLatency` per (body mode, size), sizes
    small then 200KB.

    Raises:
        astrolabe.procs.ProcessStartError: a process did not start.
        TimeoutError: an Envoy never routed a request.
    """
    cells = []
    with tempfile.TemporaryDirectory(prefix="astrolabe-extproc-envoy-") as folder, ProcessGroup() as procs:
        tmp = Path(folder)
        fleet, _ = start_fleet(procs, tmp, time_scale=1.0, backend="fast")
        args = _extproc_args(policy)
        _, extproc, _ = start_extproc(procs, tmp, "extproc", fleet,
                                      {"max_body_bytes": 8 * 1024 * 1024, **args.get("extra", {})},
                                      policy=args["policy"], workers=args.get("workers", 1))
        urls = {"static": _start_envoy(procs, tmp, "least-request", backends=list(fleet))}
        urls.update({mode: _start_envoy(procs, tmp, mode, extproc=extproc) for mode in body_modes})
        warm = prompts(20, seed - 1, max_tokens=1)
        for url in urls.values():
            _wait_routes(url, warm[0])
            asyncio.run(open_loop(url, warm, 100.0))  # connections, tokenizer, tagger
        plan = [("small", num_requests, rate_qps, lambda r: prompts(num_requests, seed + r, max_tokens=1)),
                ("200KB", num_large, large_rate_qps, lambda r: large_prompts(num_large, seed + r))]
        for size, n, rate, make_bodies in plan:
            if n == 0:
                continue
            for mode in body_modes:
                cell = AddedLatency(policy, mode, size, rate)
                for round_index in range(num_rounds):
                    bodies = make_bodies(round_index)
                    for arm in abba(round_index):
                        cpu_before_s, start_s = _cpu_of(procs), time.perf_counter()
                        latencies, instances = asyncio.run(open_loop(urls[arm if arm == "static" else mode],
                                                                     bodies, rate))
                        if arm == "extproc":
                            cell.wall_s += time.perf_counter() - start_s
                            cell.cpu_s.update(_cpu_of(procs) - cpu_before_s)
                        (cell.static_s if arm == "static" else cell.extproc_s).extend(latencies)
                        cell.instances.update(instances)
                cells.append(cell)
    return cells


def format_envoy(cells: Sequence[AddedLatency]) -> str:
    """The Envoy table: per cell both arms' p50 / p99 and the added p50 / p99 with their intervals."""
    rows, goal_lines = [], []
    for cell in cells:
        static, extproc = (np.where(np.isnan(v), np.inf, v) for v in (np.array(cell.static_s), np.array(cell.extproc_s)))
        added = {q: paired_difference_ci(extproc, static, fn) for q, fn in (("p50", stats.p50), ("p99", stats.p99))}
        if cell.size == "small":
            added_p99 = added["p99"].value
            goal_lines.append(f"{cell.policy}, {cell.body_mode}, small prompts at {cell.rate_qps:g} req/s: added p99 "
                              f"{fmt_ms(added_p99)} ms = {added_p99 / GOAL_ADDED_P99_S:.2f} x the goal of "
                              f"{GOAL_ADDED_P99_S * 1e3:g} ms ({'meets' if added_p99 <= GOAL_ADDED_P99_S else 'misses'}"
                              f" it)")
        rows.append([cell.policy, cell.body_mode, cell.size, f"{cell.rate_qps:g}", str(len(cell.static_s)), str(cell.num_failed),
                     fmt_ms(stats.p50(static)), fmt_ms(stats.p99(static)), fmt_ms(stats.p50(extproc)),
                     fmt_ms(stats.p99(extproc)), fmt_interval_ms(added["p50"]), fmt_interval_ms(added["p99"]),
                     *(f"{cell.cpu_s[r] / cell.wall_s:.2f}" if cell.wall_s > 0 else "-" for r in ROLES)])
    lines = [_table(["policy", "body mode", "prompt", "req/s", "pairs", "failed", "static p50", "static p99", "extproc p50",
                     "extproc p99", "added p50 ms [95%]", "added p99 ms [95%]", "extproc cores", "sidecar cores",
                     "Envoy cores", "backend cores"], rows)]
    lines += goal_lines
    lines.append("times in ms, client side, send -> whole answer; static = Envoy's own LEAST_REQUEST over the two "
                 "fast backends, no ext_proc; extproc = Envoy + ext_proc (that body mode) + the extproc (astrolabe: k=2, "
                 "the backends' sidecars asked); cores = CPU / wall time of the extproc arm's blocks, per role (the"
                 " client's not counted); added = extproc arm's percentile - static arm's, same requests, 95% paired "
                 "moving-block bootstrap; failed = requests of either arm without a 200 from an instance")
    return "\n".join(lines)


# --- section 3: where the time goes ---------------------------------------------------------------------------

_PROFILE_FLAG = "--profiled-extproc"


def profiled_extproc_main(argv: list[str]) -> int:
    """``python -m bench.extproc_bench --profiled-extproc OUT [astrolabe extproc args]``: the extproc with a
    cProfile on its main thread's CPU clock (``time.thread_time``: the event loop's CPU, idle waits excluded),
    enabled by SIGUSR1 and written to OUT (then disabled) by SIGUSR2."""
    import cProfile  # noqa: PLC0415
    import signal  # noqa: PLC0415

    from extproc.server import main as extproc_main  # noqa: PLC0415

    out_path, extproc_argv = argv[1], argv[2:]
    profiler = cProfile.Profile(time.thread_time)

    def dump(*_: object) -> None:
        profiler.disable()
        profiler.dump_stats(out_path + ".part")
        os.replace(out_path + ".part", out_path)

    signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
    signal.signal(signal.SIGUSR2, dump)
    return extproc_main(extproc_argv)


@dataclass(frozen=True, slots=True)
class ProfileResult:
    """Section 3's cProfile run.

    Attributes:
        phase_s: profiled main-thread CPU seconds per phase (`PHASES` order), over ``num_decisions``.
        num_decisions: decisions driven while profiling.
        process_cpu_s: the extproc process's CPU over them (all threads, profiler overhead included), seconds.
    """

    phase_s: dict[str, float]
    num_decisions: int
    process_cpu_s: float


def _wait_file(path: Path, proc: ManagedProcess, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not path.exists():
        if not proc.is_running() or time.monotonic() > deadline_s:
            raise RuntimeError(f"no profile from {proc.name}; log:\n{proc.log_tail()}")
        time.sleep(0.05)


def run_profile(num_decisions: int, concurrency: int, seed: int) -> ProfileResult:
    """Section 3 (module docstring).

    Raises:
        astrolabe.procs.ProcessStartError: a process did not start.
        RuntimeError: no profile was written, or a decision was not routed.
    """
    import signal  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="astrolabe-extproc-profile-") as folder, ProcessGroup() as procs:
        tmp = Path(folder)
        fleet, _ = start_fleet(procs, tmp)
        out = tmp / "extproc.prof"
        proc, address, _ = start_extproc(procs, tmp, "extproc-profiled", fleet,
                                         launcher=("-m", "bench.extproc_bench", _PROFILE_FLAG, str(out)))
        drive_block(address, prompts(16, seed - 1), "warm", 4)
        bodies = prompts(num_decisions, seed + 10_000)
        os.kill(proc.pid, signal.SIGUSR1)
        cpu_before_s = cpu_seconds(proc.pid)
        drive_block(address, bodies, "profiled", concurrency)
        process_cpu_s = cpu_seconds(proc.pid) - cpu_before_s
        os.kill(proc.pid, signal.SIGUSR2)
        _wait_file(out, proc)
        profile = pstats.Stats(str(out))
    return ProfileResult(phase_shares(profile), num_decisions, process_cpu_s)


def format_profile(result: ProfileResult) -> str:
    """The phase table of a profiled run: ms per decision and share of the profiled time."""
    total_s = sum(result.phase_s.values())
    n = result.num_decisions
    rows = [[phase, f"{seconds / n * 1e3:.3f}", f"{seconds / total_s:.1%}"] for phase, seconds in result.phase_s.items()]
    rows.append(["profiled main thread (all)", f"{total_s / n * 1e3:.3f}", "100%"])
    return "\n".join([
        _table(["phase (cProfile, astrolabe)", "CPU ms/decision", "share"], rows),
        f"process CPU over the same decisions, all threads: {result.process_cpu_s / n * 1e3:.3f} ms/decision (the "
        f"profiler's overhead inflates Python-heavy phases; gRPC's C-core threads are outside the profile); "
        f"{n} decisions at concurrency 8; a phase = inclusive time of its entry functions minus the phases nested "
        f"in it (bench.extproc_bench.phase_shares)"])


# --- CLI ------------------------------------------------------------------------------------------------------

QUICK = {"rounds": 1, "num_latency": 40, "num_saturated": 200, "concurrency": 16, "num_requests": 100,
         "num_large": 10, "num_profiled": 300}
"""``--quick``'s defaults."""


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="astrolabe bench extproc", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every section's blocks (default 3)")
    parser.add_argument("--num-latency", type=int, default=300,
                        help="capacity: decisions per latency block at concurrency 1 (default 300)")
    parser.add_argument("--num-saturated", type=int, default=1500,
                        help="capacity: decisions per saturation block (default 1500)")
    parser.add_argument("--concurrency", type=int, default=32,
                        help="capacity: streams in flight in a saturation block (default 32)")
    parser.add_argument("--num-requests", type=int, default=1000,
                        help="envoy: small-prompt requests per block (default 1000: 5 s at 200 req/s)")
    parser.add_argument("--rate-qps", type=float, default=200.0, help="envoy: small-prompt rate (default 200)")
    parser.add_argument("--num-large", type=int, default=100,
                        help="envoy: 200 KB-prompt requests per block, 0 = none (default 100: 5 s at 20 req/s)")
    parser.add_argument("--large-rate-qps", type=float, default=20.0,
                        help="envoy: 200 KB-prompt rate (default 20; bench/README.md says why not 200)")
    parser.add_argument("--envoy-policies", default="least-requests,astrolabe",
                        help="envoy: the extproc policies measured, each against the static route "
                             "(default least-requests,astrolabe)")
    parser.add_argument("--num-profiled", type=int, default=2000, help="profile: decisions profiled (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts (default 0)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 1 round, 40 + 200 decisions (concurrency 16), 100 + 10 requests, 300 "
                             "profiled (flags given explicitly still win)")
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.envoy_policies = [p.strip() for p in args.envoy_policies.split(",") if p.strip()]
    if not args.envoy_policies or set(args.envoy_policies) - set(POLICIES):
        parser.error(f"--envoy-policies must name some of {','.join(POLICIES)}")
    if not args.sections or set(args.sections) - set(SECTIONS):
        parser.error(f"--sections must name some of {','.join(SECTIONS)}")
    if min(args.rounds, args.num_latency, args.num_saturated, args.concurrency, args.num_requests,
           args.num_profiled) < 1 or args.num_large < 0 or not (args.rate_qps > 0 and args.large_rate_qps > 0):
        parser.error("counts, --rounds and --concurrency must be >= 1 (--num-large >= 0), rates > 0")
    return args


def main(argv: Sequence[str]) -> int:
    """Entry point of `astrolabe bench extproc`; prints the report; returns 0 (2: a process did not start)."""
    args = _parse_args(argv)
    setup_logging("WARNING")
    return exit_status_of(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    print(f"extproc bench: model {MODEL}, {args.rounds} round(s), {os.cpu_count()} CPUs on this machine; "
          f"sections {','.join(args.sections)}", flush=True)
    if "throughput" in args.sections:
        results, records, pinned = run_capacity(args.rounds, args.num_latency, args.num_saturated, args.concurrency,
                                                args.seed)
        print(f"\n1. decisions per second of one extproc process (2 emulated instances with sidecars; {pinned})")
        print(format_capacity(results, args.concurrency))
        print()
        print(format_stages(records), flush=True)
    if "envoy" in args.sections:
        cells = [cell for policy in args.envoy_policies
                 for cell in run_envoy(args.rounds, args.num_requests, args.rate_qps, args.num_large,
                                       args.large_rate_qps, args.seed, policy)]
        print("\n2. latency added through Envoy (2 fast backends with sidecars, evenly spaced arrivals, ABBA blocks)")
        print(format_envoy(cells), flush=True)
    if "profile" in args.sections:
        print("\n3. where one decision's time goes")
        print(format_profile(run_profile(args.num_profiled, 8, args.seed)), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == _PROFILE_FLAG:
        sys.exit(profiled_extproc_main(sys.argv[1:]))
    sys.exit(main(sys.argv[1:]))
