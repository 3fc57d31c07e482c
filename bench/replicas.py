"""`astrolabe bench replicas`: extproc replicas behind one Envoy share no state, and still do not herd.

Setup, all real processes on loopback (`bench.demo_fleet`): the demo's production fleet (4 emulated vLLM instances:
48 slots, a KV cache of 1,024 blocks that fills, H200 step times x 2, one predictor sidecar each in plugin mode) and,
per arm, ONE Envoy (the config `astrolabe envoy --mode full-duplex --extproc A,B` renders; ``--body-mode buffered``)
whose ext_proc cluster holds R extproc replicas (policy astrolabe, k = 2): Envoy spreads the streams round robin over
the healthy replicas, each replica counts only the requests it routed, the sidecars see every replica's admissions.
Each replica seeds its policy from os.urandom (as in production; ``--same-seed`` gives every replica seed 0).

Comparison. The same traces (`bench.demo.plan_trace`: the length tagger's held-out ShareGPT prompts, max_tokens
512) replayed once per arm; the arms interleave (each seed and workload runs every arm back to back, the order
reversed on every other seed). Two workloads: ``burst`` (Poisson at ``--burst-load`` x the fleet capacity that
``predictor.sim`` measures on the trace: a few seconds of arrivals far above what the fleet serves, so queues form
at once, which is where replicas that share nothing would herd) and ``steady`` (Poisson at ``--steady-load`` x
capacity). Per workload and arm: requests, lost (non-2xx, broken or timed-out streams), P50/P99 TTFT (the client's,
through Envoy), P99 per seed, each replica's share of the decisions (its ``astrolabe_extproc_decisions_total`` over
the runs), and the herding check: requests per instance max/mean, and in-flight requests per instance max/mean at
each arrival, averaged over arrivals (1.0 = even; a herd sends one instance far more than the mean). Then P99 and
P50 TTFT of R replicas / the first arm on the same requests, with a 95% paired moving-block bootstrap interval
(`bench.stats`, blocks within seeds): "same within noise" only where the interval includes 1. ``--replicas 1,2,1``
runs the first count again: its ratio is an A/A check of how far two runs of the same thing differ.

Kill phase. Two fresh replicas under the first seed's steady trace; at ``--kill-at`` of its arrival span the bench
reads the victim's in-flight gauge (requests it routed whose stream is open), then Envoy's admin ``/clusters`` (the
victim's open ext_proc streams, ``rq_active``: routed or still being decided), then sends the victim SIGKILL by PID,
then polls ``/clusters`` until Envoy's health check marks it failed (1 s interval, 2 failures). Failures the client
saw are split by what it saw: ``routed`` (status 200 had arrived: an instance was answering, the decision was made),
``undecided`` (sent before the kill, no answer: the victim held it before deciding), ``HC window`` (sent after the
kill, before the health check noticed: Envoy opened new streams on the dead replica), ``after`` (sent later).
Envoy configs of the kill phase (``--kill-configs``): ``BODY_MODE/FAILURE_MODE`` pairs, each the config `astrolabe
envoy --mode BODY_MODE --failure-mode FAILURE_MODE` renders (every rendering retries a stream whose replica refused
the connection on another replica: the ext_proc ``grpc_service`` retry policy).

NOTE: what the kill phase measured with Envoy 1.40 (350 steady requests, the victim holding ~45 routed streams;
before the templates had the stream retry, ~half of the requests sent in the ~1.2 s before the health check
noticed were lost too: Envoy opened their streams on the dead replica, refused):
- full-duplex, either failure mode: every request the victim had routed fails mid-response (200, then a reset):
  response_trailer_mode SEND keeps its stream open until the response ends, and Envoy ignores
  failure_mode_allow once the request body went to the processor in FULL_DUPLEX_STREAMED mode (ext_proc
  ``Filter::failureModeAllow()``; its failure_mode_allowed counter stays 0);
- buffered, ``--failure-mode open``: the routed requests complete (the broken stream is ignored) and the stream
  retry saves the new ones: 0 of 350 lost; buffered, closed: like full-duplex.

NOTE: `bench.demo_fleet.start_router_tier` starts one Envoy per replica; this bench stops them and runs one Envoy
(``envoy_command``, the command `astrolabe envoy` runs) in front of all the tier's replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import yaml

from astrolabe.cli import HelpFormatter
from astrolabe.envoy import FAILURE_MODES, envoy_command, render_config
from bench import demo, demo_fleet, stats
from bench.demo_fleet import HOST, RouterTier, scrape_sum, wait_idle
from bench.loadgen import RequestResult, replay
from astrolabe.procs import ManagedProcess, ProcessGroup, ProcessStartError, exit_status_of, free_port
from bench.workloads import TraceRequest

logger = logging.getLogger(__name__)

MODEL = demo.MODEL
WORKLOADS = ("burst", "steady")
MODES = {"quick": ((0,), 300, 200), "default": ((0, 1, 2), 300, 350)}
"""mode -> (seeds, burst requests per seed, steady requests per seed)."""

KILL_CONFIGS = "full-duplex/closed,full-duplex/open,buffered/closed,buffered/open"
"""The kill phase's default Envoy configs: ``BODY_MODE/FAILURE_MODE`` of `astrolabe envoy`."""
_START_TIMEOUT_S = 60.0
_EXT_PROC_STATS = "http.astrolabe_ingress.ext_proc."
_POLL_S = 0.02


# ---- Envoy in front of R replicas ----------------------------------------------------------------------------

def render_envoy(extprocs: Sequence[str], listen_port: int, admin_port: int, body_mode: str = "full-duplex",
                 failure_mode: str = "closed") -> str:
    """The config `astrolabe envoy --mode <body_mode> --failure-mode <failure_mode> --extproc A,B` renders.

    Raises:
        ValueError: a bad mode or address (`astrolabe.envoy.render_config`).
    """
    return render_config(body_mode, listen_address=HOST, listen_port=listen_port, admin_port=admin_port,
                         extproc_address=list(extprocs), failure_mode=failure_mode)


def cluster_hosts(admin_url: str, cluster: str = "extproc") -> dict[str, dict[str, str]]:
    """Per host of ``cluster``, Envoy's admin ``/clusters`` fields (``rq_active``, ``health_flags`` ...).

    Raises:
        OSError: the admin interface cannot be read.
    """
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{admin_url}/clusters", timeout=2.0) as resp:
        lines = resp.read().decode("utf-8", errors="replace").splitlines()
    hosts: dict[str, dict[str, str]] = {}
    for line in lines:
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster:
            hosts.setdefault(parts[1], {})[parts[2]] = parts[3]
    return hosts


def envoy_counters(admin_url: str, pattern: str = r"ext_?proc") -> dict[str, int]:
    """Envoy's counters whose name matches the regular expression ``pattern`` (admin ``/stats?filter=``): by
    default the ext_proc filter's and the extproc cluster's; name -> value.

    Raises:
        OSError: the admin interface cannot be read.
    """
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{admin_url}/stats?filter={urllib.parse.quote(pattern)}", timeout=2.0) as resp:
        lines = resp.read().decode("utf-8", errors="replace").splitlines()
    counters = {}
    for line in lines:
        name, _, value = line.partition(": ")
        if value.strip().isdigit():
            counters[name] = int(value)
    return counters


@dataclasses.dataclass(slots=True)
class Replicas:
    """R extproc replicas and the one Envoy in front of them.

    Attributes:
        tier: the replicas (their own Envoys already stopped); ``tier.metrics_urls`` in replica order.
        addresses: each replica's gRPC ``host:port``, replica order.
        envoy: the Envoy process; url / admin_url: its listener and admin interface.
    """

    tier: RouterTier
    addresses: list[str]
    envoy: ManagedProcess
    url: str
    admin_url: str

    def decisions(self) -> list[float]:
        """Each replica's ``astrolabe_extproc_decisions_total`` so far (replica order; NaN for one that exited)."""
        return [scrape_sum(u, "astrolabe_extproc_decisions_total") if p.is_running() else math.nan
                for u, p in zip(self.tier.metrics_urls, self.tier.extprocs)]

    def stop(self) -> None:
        self.envoy.stop()
        self.tier.stop()


def start_replicas(procs: ProcessGroup, extproc_config: dict, num_replicas: int, instances: Sequence[str],
                   log_dir: Path, label: str, body_mode: str = "full-duplex", failure_mode: str = "closed") -> Replicas:
    """Start ``num_replicas`` extprocs (`bench.demo_fleet.start_router_tier`) and ONE Envoy whose ext_proc cluster
    holds them all (config `render_envoy`); returns once Envoy sees every replica healthy.

    Raises:
        ProcessStartError: a process exited, or was not ready within the start timeout.
    """
    tier = demo_fleet.start_router_tier(procs, "astrolabe", extproc_config, num_replicas, body_mode, instances,
                                        log_dir, label=label)
    for envoy in tier.envoys:  # one per replica; the bench wants one Envoy in front of all of them
        envoy.stop()
    addresses = [yaml.safe_load((log_dir / f"extproc-{label}-{r}.yaml").read_text(encoding="utf-8"))["listen"]
                 for r in range(num_replicas)]
    listen_port, admin_port = free_port(HOST), free_port(HOST)
    config_path = log_dir / f"envoy-{label}.yaml"
    config_path.write_text(render_envoy(addresses, listen_port, admin_port, body_mode, failure_mode), encoding="utf-8")
    envoy = procs.start(envoy_command(config_path, concurrency=1), name=f"envoy-{label}",
                        log_path=log_dir / f"envoy-{label}.log")
    replicas = Replicas(tier, addresses, envoy, f"http://{HOST}:{listen_port}", f"http://{HOST}:{admin_port}")
    envoy.wait_http(f"{replicas.admin_url}/ready", _START_TIMEOUT_S)
    deadline_s = time.monotonic() + _START_TIMEOUT_S
    while True:
        flags = {a: cluster_hosts(replicas.admin_url).get(a, {}).get("health_flags") for a in addresses}
        if all(f == "healthy" for f in flags.values()):
            return replicas
        if time.monotonic() > deadline_s:
            raise ProcessStartError(f"envoy-{label}: replicas not healthy within {_START_TIMEOUT_S} s: {flags}")
        time.sleep(0.1)


# ---- figures of one replay -------------------------------------------------------------------------------------

def ttfts(results: Sequence[RequestResult]) -> np.ndarray:
    """TTFT per request (trace order), NaN for a lost request (`bench.stats` ranks it infinitely slow)."""
    return np.array([r.ttft_s if r.ok and r.ttft_s is not None else math.nan for r in results], dtype=float)


def instance_spread(results: Sequence[RequestResult], instances: Sequence[str]) -> tuple[float, float]:
    """The herding check: (requests per instance max/mean, in-flight requests per instance max/mean at each
    arrival averaged over the arrivals that find at least one request per instance on average).

    A request is in flight on the instance that answered it from its send to its end (successful requests).
    """
    ok = [r for r in results if r.ok and r.instance in instances]
    if not ok:
        return math.nan, math.nan
    counts = Counter(r.instance for r in ok)
    per_instance = np.array([counts.get(i, 0) for i in instances], dtype=float)
    index = {a: k for k, a in enumerate(instances)}
    start = np.array([r.send_offset_s for r in ok])
    end = start + np.array([r.e2e_s for r in ok])
    where = np.array([index[r.instance] for r in ok])
    ratios = []
    for t in start:
        busy = np.bincount(where[(start <= t) & (end > t)], minlength=len(instances))
        if busy.mean() >= 1:
            ratios.append(busy.max() / busy.mean())
    return float(per_instance.max() / per_instance.mean()), float(np.mean(ratios)) if ratios else math.nan


@dataclasses.dataclass(slots=True)
class Arm:
    """One workload's replays through one replica count, pooled over seeds (seed order, trace order within).

    Attributes:
        results: seed -> the replay's results.
        decisions: per replica, decisions over all the arm's replays.
    """

    workload: str
    num_replicas: int
    label: str = ""
    results: dict[int, list[RequestResult]] = dataclasses.field(default_factory=dict)
    decisions: list[float] = dataclasses.field(default_factory=list)

    def pooled(self) -> tuple[np.ndarray, np.ndarray]:
        """(TTFT per request, seed group per request) over all seeds."""
        values = [ttfts(rs) for rs in self.results.values()]
        groups = [np.full(len(v), k) for k, v in enumerate(values)]
        return np.concatenate(values), np.concatenate(groups)

    @property
    def all_results(self) -> list[RequestResult]:
        return [r for rs in self.results.values() for r in rs]


# ---- the kill phase --------------------------------------------------------------------------------------------

@dataclasses.dataclass(slots=True)
class KillRun:
    """One replay with a replica killed (times in seconds from the replay's start, the bench's clock, +-1 ms).

    Attributes:
        config: the Envoy config's name (``BODY_MODE/FAILURE_MODE``).
        results: the replay's results, trace order.
        kill_s / detected_s: when the victim got SIGKILL; when Envoy's /clusters first showed it failed (None:
            never within the replay).
        victim_streams: the victim's open ext_proc streams in Envoy just before the kill (``rq_active``).
        victim_in_flight: the victim's in-flight gauge just before the kill (requests it routed, stream open).
        survivor_streams: the same figure of the other replica(s).
        envoy_before / envoy_after: Envoy's ext_proc filter counters around the replay.
    """

    config: str
    results: list[RequestResult]
    kill_s: float
    detected_s: float | None
    victim_streams: int
    victim_in_flight: int
    survivor_streams: int
    envoy_before: dict[str, int]
    envoy_after: dict[str, int]

    def lost(self) -> list[RequestResult]:
        return [r for r in self.results if not r.ok]

    def routed_lost(self) -> list[RequestResult]:
        """Lost after an instance had answered (status 200): routed requests the kill cost."""
        return [r for r in self.lost() if r.status == 200]

    def undecided_lost(self) -> list[RequestResult]:
        """Lost without an answer, sent before the kill."""
        return [r for r in self.lost() if r.status != 200 and r.send_offset_s < self.kill_s]

    def window_lost(self) -> list[RequestResult]:
        """Lost without an answer, sent between the kill and the health check's notice."""
        end_s = math.inf if self.detected_s is None else self.detected_s
        return [r for r in self.lost() if r.status != 200 and self.kill_s <= r.send_offset_s < end_s]

    def after_lost(self) -> list[RequestResult]:
        """Lost, sent after Envoy marked the victim failed."""
        if self.detected_s is None:
            return []
        return [r for r in self.lost() if r.status != 200 and r.send_offset_s >= self.detected_s]

    def sent_in_window(self) -> int:
        end_s = math.inf if self.detected_s is None else self.detected_s
        return sum(self.kill_s <= r.send_offset_s < end_s for r in self.results)

    def envoy_delta(self, name: str) -> int:
        """Growth over the replay of Envoy's counter ``name`` (e.g. ``http.astrolabe_ingress.ext_proc.streams_failed``)."""
        return self.envoy_after.get(name, 0) - self.envoy_before.get(name, 0)

    def envoy_deltas(self) -> dict[str, int]:
        """Every counter that grew over the replay, name -> growth."""
        grown = {k: v - self.envoy_before.get(k, 0) for k, v in self.envoy_after.items()}
        return {k: d for k, d in sorted(grown.items()) if d}


def _scrape_then_kill(replicas: Replicas, victim: int) -> tuple[float, int, int, int]:
    """Reads the victim's gauge, then Envoy's streams, then SIGKILLs the victim by PID: (kill time, victim streams,
    victim in-flight, survivors' streams)."""
    in_flight = scrape_sum(replicas.tier.metrics_urls[victim], "astrolabe_extproc_in_flight_requests")
    hosts = cluster_hosts(replicas.admin_url)
    os.kill(replicas.tier.extprocs[victim].pid, signal.SIGKILL)
    kill_s = time.monotonic()
    streams = [int(hosts.get(a, {}).get("rq_active", 0)) for a in replicas.addresses]
    return kill_s, streams[victim], int(in_flight), sum(streams) - streams[victim]


def _wait_failed(replicas: Replicas, victim: int, timeout_s: float) -> float | None:
    """Polls /clusters until the victim's health flags are no longer ``healthy``; returns when (None: timeout)."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        flags = cluster_hosts(replicas.admin_url).get(replicas.addresses[victim], {}).get("health_flags", "")
        if flags != "healthy":
            return time.monotonic()
        time.sleep(_POLL_S)
    return None


async def _replay_and_kill(replicas: Replicas, trace: Sequence[TraceRequest], kill_after_s: float, victim: int,
                           request_timeout_s: float, progress: bool, label: str):
    duration_s = trace[-1].arrival_offset_s if trace else 0.0
    start_s = time.monotonic()
    task = asyncio.create_task(replay(replicas.url, trace, model=MODEL, request_timeout_s=request_timeout_s,
                                      overall_timeout_s=duration_s + 2 * request_timeout_s, progress=progress,
                                      progress_desc=label))
    await asyncio.sleep(kill_after_s)
    kill_s, streams, in_flight, survivors = await asyncio.to_thread(_scrape_then_kill, replicas, victim)
    detected_s = await asyncio.to_thread(_wait_failed, replicas, victim, max(duration_s - kill_after_s, 10.0))
    results = await task
    return (results, kill_s - start_s, None if detected_s is None else detected_s - start_s, streams, in_flight,
            survivors)


def replay_with_kill(replicas: Replicas, trace: Sequence[TraceRequest], kill_after_s: float, *, config: str,
                     victim: int = 1, request_timeout_s: float = 60.0, progress: bool = False) -> KillRun:
    """Replays ``trace`` through ``replicas`` and SIGKILLs replica ``victim`` ``kill_after_s`` into it
    (the module docstring's kill phase)."""
    before = envoy_counters(replicas.admin_url)
    results, kill_s, detected_s, streams, in_flight, survivors = asyncio.run(_replay_and_kill(
        replicas, trace, kill_after_s, victim, request_timeout_s, progress, f"kill {config}"))
    return KillRun(config, results, kill_s, detected_s, streams, in_flight, survivors, before,
                   envoy_counters(replicas.admin_url))


# ---- tables ----------------------------------------------------------------------------------------------------

def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if k == 0 else h.rjust(w) for k, (h, w) in enumerate(zip(header, widths))),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(row, widths)))
              for row in rows]
    return "\n".join(lines)


def _shares(decisions: Sequence[float]) -> str:
    total = sum(decisions)
    return " / ".join(f"{100 * d / total:.0f}%" for d in decisions) if total else "-"


def format_arms(arms: Sequence[Arm], instances: Sequence[str]) -> str:
    rows = []
    for arm in arms:
        values, groups = arm.pooled()
        interval = stats.summary_ci(values, stats.p99, groups=groups.tolist())
        per_seed = " / ".join(f"{stats.p99(ttfts(rs)):.2f}" for rs in arm.results.values())
        per_request, in_flight = instance_spread(arm.all_results, instances)
        rows.append([arm.workload, arm.label or str(arm.num_replicas), str(len(values)), str(int(np.isnan(values).sum())),
                     f"{stats.p50(values):.3f}", f"{interval.value:.3f}", f"[{interval.low:.3f}, {interval.high:.3f}]",
                     per_seed, _shares(arm.decisions), f"{per_request:.2f}", f"{in_flight:.2f}"])
    return _table(["workload", "replicas", "requests", "lost", "TTFT p50", "TTFT p99", "p99 95% interval",
                   "p99 per seed", "decisions per replica", "req/instance max/mean", "in-flight max/mean"], rows)


def verdict(interval: stats.Interval) -> str:
    """"same within noise" when the interval includes 1, else which side it lies on."""
    if interval.low <= 1 <= interval.high:
        return "same within noise"
    return "lower" if interval.high < 1 else "higher"


def format_ratios(arms: Sequence[Arm]) -> str:
    rows = []
    for workload in dict.fromkeys(a.workload for a in arms):
        mine = [a for a in arms if a.workload == workload]
        base_values, groups = mine[0].pooled()
        for arm in mine[1:]:
            values, _ = arm.pooled()
            for name, statistic in (("TTFT p99", stats.p99), ("TTFT p50", stats.p50)):
                ratio = stats.paired_ratio_ci(values, base_values, statistic, groups=groups.tolist())
                rows.append([workload, name, f"{arm.label or arm.num_replicas} / {mine[0].label or mine[0].num_replicas}", f"{ratio.value:.3f}",
                             f"[{ratio.low:.3f}, {ratio.high:.3f}]", verdict(ratio)])
    return _table(["workload", "figure", "replicas", "ratio", "95% interval", "verdict"], rows)


def format_kills(runs: Sequence[KillRun]) -> str:
    rows = []
    for run in runs:
        lost = run.lost()
        detected = "never" if run.detected_s is None else f"{run.detected_s - run.kill_s:.2f}"
        rows.append([run.config, str(len(run.results)), str(len(lost)), str(sum(r.status not in (None, 200)
                                                                                 for r in lost)),
                     str(sum(r.status in (None, 200) for r in lost)), f"{run.kill_s:.2f}",
                     f"{run.victim_streams} ({run.victim_in_flight})", str(run.survivor_streams),
                     str(len(run.routed_lost())), str(len(run.undecided_lost())),
                     f"{len(run.window_lost())} of {run.sent_in_window()}", detected, str(len(run.after_lost())),
                     str(run.envoy_delta(f"{_EXT_PROC_STATS}streams_failed")),
                     str(run.envoy_delta(f"{_EXT_PROC_STATS}failure_mode_allowed")),
                     str(run.envoy_delta("cluster.extproc.upstream_rq_retry"))])
    return _table(["envoy mode/failure mode", "requests", "lost", "non-2xx", "broken/reset", "kill at s",
                   "victim streams (routed)", "survivor streams", "lost routed", "lost undecided",
                   "lost in HC window", "HC noticed after s", "lost after", "ext_proc streams_failed",
                   "failure_mode_allowed", "stream retries"], rows)


# ---- the run ---------------------------------------------------------------------------------------------------

def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="astrolabe bench replicas", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"one seed, {MODES['quick'][1]} burst and {MODES['quick'][2]} steady requests (a smoke run: one "
                        "run's interval misses run-to-run noise, judge nothing by it; "
                        f"without it: seeds {','.join(map(str, MODES['default'][0]))}, {MODES['default'][1]} burst "
                        f"and {MODES['default'][2]} steady requests per seed)")
    p.add_argument("--seeds", default=None, help="comma-separated trace seeds (default: the mode's)")
    p.add_argument("--replicas", default="1,2",
                   help="replica counts compared, the first is the baseline; a count given twice runs twice, "
                        "through the same processes (1,2,1: the 1 / 1 ratio is an A/A check of run-to-run noise)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: burst, steady")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                   help="run the 1-vs-N comparison (--no-compare: the kill phase only)")
    p.add_argument("--body-mode", choices=("full-duplex", "buffered"), default="full-duplex",
                   help="Envoy's ext_proc body mode (`astrolabe envoy --mode`)")
    p.add_argument("--burst-requests", type=int, default=None, help="burst requests per seed (default: the mode's)")
    p.add_argument("--steady-requests", type=int, default=None, help="steady requests per seed (default: the mode's)")
    p.add_argument("--burst-load", type=float, default=4.0,
                   help="burst arrival rate as a multiple of the estimated fleet capacity")
    p.add_argument("--steady-load", type=float, default=0.95,
                   help="steady arrival rate as a multiple of the estimated fleet capacity")
    p.add_argument("--num-instances", type=int, default=4, help="emulated vLLM instances")
    p.add_argument("--same-seed", action="store_true",
                   help="give every replica policy seed 0 (their random probes then repeat each other's)")
    p.add_argument("--kill", action=argparse.BooleanOptionalAction, default=True,
                   help="run the kill phase (2 replicas, steady trace of the first seed, one replica SIGKILLed)")
    p.add_argument("--kill-at", type=float, default=0.4, help="when the victim dies, as a fraction of the trace's span")
    p.add_argument("--kill-configs", default=KILL_CONFIGS,
                   help="comma-separated Envoy configs of the kill phase, each BODY_MODE/FAILURE_MODE of "
                        "`astrolabe envoy` (full-duplex|buffered / closed|open), one kill run each")
    p.add_argument("--request-timeout-s", type=float, default=60.0, help="limit per request, seconds")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="process logs, configs and decision logs (default: a new temporary folder)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars on stderr")
    args = p.parse_args(list(argv))
    mode = MODES["quick" if args.quick else "default"]
    try:
        args.seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else mode[0]
        args.replicas = tuple(int(r) for r in args.replicas.split(","))
    except ValueError:
        p.error("--seeds and --replicas must be comma-separated integers")
    args.workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
    if set(args.workloads) - set(WORKLOADS) or not args.workloads:
        p.error(f"--workloads must name some of {', '.join(WORKLOADS)}")
    if not args.seeds or not args.replicas or min(args.replicas) < 1:
        p.error("--seeds must name a seed; --replicas counts >= 1")
    args.burst_requests = args.burst_requests or mode[1]
    args.steady_requests = args.steady_requests or mode[2]
    try:
        args.kill_configs = tuple(_kill_config(c) for c in args.kill_configs.split(",") if c.strip())
    except ValueError as exc:
        p.error(f"--kill-configs: {exc}")
    if not 0 < args.kill_at < 1 or args.burst_load <= 0 or args.steady_load <= 0:
        p.error("--kill-at must be in (0, 1); --burst-load and --steady-load > 0")
    return args


def _demo_config(args: argparse.Namespace, num_requests: int, load: float, log_dir: Path) -> demo.DemoConfig:
    """The demo's production setting, one router, Poisson arrivals at ``load`` x capacity."""
    s = demo.SETTINGS["production"]
    return demo.DemoConfig(
        setting=s.name, mode="quick" if args.quick else "default", num_instances=args.num_instances, num_routers=1,
        policies=("astrolabe",), num_requests=num_requests, seeds=args.seeds, load=load, rate_qps=None,
        arrival="poisson", cv=1.0, time_scale=s.time_scale, stream_interval=s.stream_interval,
        max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens, num_gpu_blocks=s.num_gpu_blocks,
        block_size=16, max_output_tokens=s.max_output_tokens, max_model_len=4096, body_mode="full-duplex",
        request_timeout_s=args.request_timeout_s, log_dir=log_dir, progress=args.progress)


def _kill_config(text: str) -> tuple[str, str]:
    """``BODY_MODE/FAILURE_MODE`` -> (body mode, failure mode); raises ValueError naming what is wrong."""
    body_mode, _, failure_mode = text.strip().partition("/")
    if body_mode not in ("full-duplex", "buffered") or failure_mode not in FAILURE_MODES:
        raise ValueError(f"{text.strip()!r} is not BODY_MODE/FAILURE_MODE (full-duplex|buffered / "
                         f"{'|'.join(FAILURE_MODES)})")
    return body_mode, failure_mode


def _replay_arm(replicas: Replicas, arm: Arm, seed: int, trace: Sequence[TraceRequest], instances: Sequence[str],
                args: argparse.Namespace) -> None:
    before = replicas.decisions()
    duration_s = trace[-1].arrival_offset_s if trace else 0.0
    started_s = time.monotonic()
    arm.results[seed] = asyncio.run(replay(
        replicas.url, trace, model=MODEL, request_timeout_s=args.request_timeout_s,
        overall_timeout_s=duration_s + 2 * args.request_timeout_s, progress=args.progress,
        progress_desc=f"{arm.workload} {arm.label} s{seed}"))
    wait_idle(instances)
    demo._log_errors(f"{arm.workload}-{arm.label.replace(' ', '')}-s{seed}", arm.results[seed], args.log_dir)
    delta = [a - b for a, b in zip(replicas.decisions(), before)]
    arm.decisions = [a + d for a, d in zip(arm.decisions, delta)] if arm.decisions else delta
    logger.info("%s, %s replica(s), seed %d: %d requests in %.0f s, decisions %s", arm.workload, arm.label,
                seed, len(trace), time.monotonic() - started_s, delta)


def run(args: argparse.Namespace, log_dir: Path) -> int:
    plans = {"burst": demo.plan_trace(_demo_config(args, args.burst_requests, args.burst_load, log_dir)),
             "steady": demo.plan_trace(_demo_config(args, args.steady_requests, args.steady_load, log_dir))}
    cfg = _demo_config(args, args.steady_requests, args.steady_load, log_dir)
    labels = [f"{n}" + " (again)" * args.replicas[:k].count(n) for k, n in enumerate(args.replicas)]
    arms = {(w, k): Arm(w, n, labels[k]) for w in args.workloads for k, n in enumerate(args.replicas)
            if args.compare}
    kills: list[KillRun] = []
    state_dir = Path(tempfile.mkdtemp(prefix="astrolabe-replicas-state-",
                                      dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        with ProcessGroup() as procs:
            instances = demo_fleet.start_emulators(procs, cfg.num_instances, cfg.engine, cfg.seed, log_dir, state_dir)
            sidecars = demo_fleet.start_sidecars(procs, instances, cfg.engine, log_dir, state_dir)
            config = demo.extproc_config(cfg, "astrolabe", instances, sidecars)
            config["seed"] = 0 if args.same_seed else None
            tiers = {n: start_replicas(procs, config, n, instances, log_dir, f"r{n}", body_mode=args.body_mode)
                     for n in (dict.fromkeys(args.replicas) if args.compare else ())}
            for k, seed in enumerate(args.seeds if args.compare else ()):
                for workload in args.workloads:
                    order = list(enumerate(args.replicas))
                    for j, n in (order if k % 2 == 0 else order[::-1]):
                        _replay_arm(tiers[n], arms[workload, j], seed, plans[workload].traces[seed], instances, args)
            for tier in tiers.values():
                tier.stop()
            trace = plans["steady"].traces[args.seeds[0]]
            for body_mode, failure_mode in args.kill_configs if args.kill else ():
                name = f"{body_mode}/{failure_mode}"
                replicas = start_replicas(procs, config, 2, instances, log_dir, f"kill-{body_mode}-{failure_mode}",
                                          body_mode, failure_mode)
                kills.append(replay_with_kill(replicas, trace, args.kill_at * trace[-1].arrival_offset_s,
                                              config=name, request_timeout_s=args.request_timeout_s,
                                              progress=args.progress))
                demo._log_errors(f"kill-{body_mode}-{failure_mode}", kills[-1].results, log_dir)
                logger.info("kill %s: Envoy counters grown %s", name, kills[-1].envoy_deltas())
                replicas.stop()
                wait_idle(instances)
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
    print(format_header(args, plans, instances))
    if arms:
        print()
        print(format_arms(list(arms.values()), instances))
        print()
        print(format_ratios(list(arms.values())))
        print("ratio = figure with N replicas / with the first count, same requests; 95% paired moving-block "
              "bootstrap (blocks of 50 within seeds); 'same within noise' only where the interval includes 1")
    if kills:
        print()
        print(format_kills(kills))
        print(KILL_LEGEND)
    print(f"logs: {log_dir}")
    return 1 if any(not r.ok for a in arms.values() for r in a.all_results) else 0


KILL_LEGEND = (
    "victim streams = its open ext_proc streams in Envoy just before the SIGKILL (rq_active; in brackets its own "
    "in-flight gauge: the ones it had routed); lost routed = failed after status 200 (an instance was answering); "
    "lost undecided = sent before the kill, failed without an answer; lost in HC window = sent after the kill and "
    "before Envoy's health check marked the victim failed (of all requests sent then); lost after = sent later; "
    "the last two columns are Envoy's ext_proc filter counters over the replay")


def format_header(args: argparse.Namespace, plans: dict, instances: Sequence[str]) -> str:
    s = demo.SETTINGS["production"]
    lines = [
        (f"Astrolabe replicas benchmark: extproc replicas behind ONE Envoy ({args.body_mode} ext_proc, round robin "
         "over healthy replicas, 1 s gRPC health checks), sharing no state"),
        (f"fleet: {len(instances)} emulated vLLM instances ({MODEL}, max_num_seqs={s.max_num_seqs}, "
         f"num_gpu_blocks={s.num_gpu_blocks}, H200 step times x {s.time_scale:g}), one predictor sidecar each "
         f"(plugin mode); policy astrolabe k=2; replica seeds: {'all 0' if args.same_seed else 'os.urandom'}"),
    ]
    for workload in args.workloads:
        plan = plans[workload]
        lines.append(f"{workload}: {len(plan.traces)} seed(s) ({', '.join(map(str, plan.traces))}) x "
                     f"{len(plan.trace)} requests, Poisson at {plan.rate_qps:.1f} req/s = "
                     f"{args.burst_load if workload == 'burst' else args.steady_load:g} x estimated capacity "
                     f"{plan.capacity_qps:.1f} req/s ({plan.trace[-1].arrival_offset_s:.1f} s of arrivals)")
    lines.append("arms interleaved per seed and workload (order reversed every other seed); the same requests "
                 "for every replica count; TTFT in seconds (client, through Envoy)")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """Entry point of ``astrolabe bench replicas``; 0 when no request of the comparison was lost (the kill phase's
    losses are what it measures), 1 otherwise, 2 when a process failed to start, 130 on Ctrl-C."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_dir = args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="astrolabe-replicas-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    logger.info("logs and configs in %s", log_dir)
    started_s = time.monotonic()
    status = exit_status_of(lambda: run(args, log_dir))
    if status in (2, 130):
        return status
    logger.info("replicas benchmark finished in %.0f s", time.monotonic() - started_s)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
