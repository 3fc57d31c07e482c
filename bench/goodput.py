"""`astrolabe bench goodput`: latency objectives, admission and goodput under overload, on the simulated fleet.

The cluster benchmark's fleet and single-turn ShareGPT trace (``bench.cluster``, ``bench.cluster_sim``), with every
request given a class, drawn per request with a fixed seed: ``--critical-frac`` (40%) critical requests (priority
0, TTFT objective ``--critical-ttft-s``, 1 s) and the rest sheddable (priority -1, TTFT objective
``--sheddable-ttft-s``, 5 s), as ``extproc.admission.Objectives``. The rates are multiples of ``--capacity``
(astrolabe-k2's capacity at the 2 s P99 TTFT SLO on this workload, measured with ``astrolabe bench cluster``:
bench/README.md), 1x included so that each router's goodput at capacity is in the same run.

Routers (``--policies``): any ``bench.cluster.policy_spec`` label, optionally followed by ``+RULE`` (an
``extproc.admission`` rule: ``slo`` = llm-d's latency-slo-admitter rule on our predictions, ``headroom`` = ours with
the extproc's defaults, ``headroom=<S>`` with its bound S seconds instead of ``--protect-ttft-s``, ``...@<W>`` with
its critical-pressure window W seconds instead of the default 2, ``@0`` none); without ``+`` nothing is
refused. A trailing ``/priority`` runs that router's engines with vLLM's ``--scheduling-policy priority``
(``bench.cluster_sim.PolicySpec.engine_priority``: each request's priority goes to the engine, critical first).

Per (router, multiple), pooled over the seeds: goodput (requests per second that met their TTFT objective; a refused
request meets nothing), SLO attainment per class, each class's P99 TTFT over its served requests (95% block-bootstrap
interval), the share refused per class, and how many refused requests had an instance that was not probed and was
predicted to meet their objective. Then, per multiple, each router's goodput as a ratio to the reference's
(``--reference``, default the llm-d rule) and, per router, its goodput as a ratio to its own at 1x, with paired
intervals ("better" only where the interval excludes 1). Writes ``DIR/goodput.csv``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from astrolabe.cli import HelpFormatter
from astrolabe.logs import setup_logging
from bench import stats
from bench.cluster import build_requests, error_model, policy_spec, run_sweep
from bench.cluster_sim import A30_LIKE_NUM_GPU_BLOCKS, ClusterConfig, ClusterRequest, PolicySpec, SeedPoint
from bench.workloads import REPO_ROOT, filter_pairs
from extproc.admission import ADMISSION_RULES, DEFAULT_PRESSURE_WINDOW_S, AdmissionParams, Objectives
from predictor.engine_flags import add_engine_arguments, engine_from_args
from predictor.sim import EngineConfig
from tagger.serve import SHIPPED_LIGHT_DIR
from tagger.sharegpt import load_sharegpt_pairs

DEFAULT_CAPACITY_QPS = 139.0
"""astrolabe-k2's capacity at the 2 s P99 TTFT SLO on single-turn ShareGPT with the shipped light tagger (the rate
where its pooled P99 TTFT crosses 2 s, 3 seeds; bench/README.md "What the length tagger buys")."""
DEFAULT_MULTIPLES = (1.0, 1.2, 1.5, 2.0)
DEFAULT_POLICIES = ("envoy-least-request", "least-requests", "astrolabe-k2", "astrolabe-k2+slo",
                    "astrolabe-k2+headroom@0", "astrolabe-k2+headroom", "astrolabe-k2+slo/priority",
                    "astrolabe-k2+headroom/priority")
DEFAULT_OUT_DIR = REPO_ROOT / "out" / "goodput"
CRITICAL, SHEDDABLE = "critical", "sheddable"


def spec_of(label: str, num_instances: int, protect_ttft_s: float,
            pressure_window_s: float = DEFAULT_PRESSURE_WINDOW_S) -> PolicySpec:
    """``LABEL[+RULE[=S][@W]][/priority]`` -> the policy spec with its admission rule and engine policy (module
    docstring).

    Raises:
        ValueError: an unknown label, rule or engine policy, a bound that is not a number.
    """
    head, slash, engine_policy = label.partition("/")
    if slash and engine_policy != "priority":
        raise ValueError(f"{label!r}: the engine policy after '/' must be 'priority', got {engine_policy!r}")
    base, plus, rule = head.partition("+")
    spec = dataclasses.replace(policy_spec(base, num_instances), label=label, engine_priority=bool(slash))
    if not plus:
        return spec
    rule, _, window = rule.partition("@")
    rule, eq, bound = rule.partition("=")
    if rule not in ADMISSION_RULES:
        raise ValueError(f"{label!r}: admission rule must be one of {ADMISSION_RULES}, got {rule!r}")
    if eq and rule != "headroom":
        raise ValueError(f"{label!r}: only the headroom rule takes a bound")
    return dataclasses.replace(spec, admission=AdmissionParams(rule),
                               protect_ttft_s=float(bound) if eq else protect_ttft_s,
                               pressure_window_s=float(window) if window else pressure_window_s)


def with_classes(requests: Sequence[ClusterRequest], rng: random.Random, critical_frac: float,
                 critical: Objectives, sheddable: Objectives) -> list[ClusterRequest]:
    """Each request critical with probability ``critical_frac``, else sheddable."""
    return [dataclasses.replace(r, objectives=critical if rng.random() < critical_frac else sheddable)
            for r in requests]


def _met(point: SeedPoint, trace: Sequence[ClusterRequest]) -> np.ndarray:
    """Per request of the trace (order): 1.0 when it was served within its TTFT objective, else 0.0."""
    ttfts = point.latencies.ttfts_s
    objective = np.array([r.objectives.ttft_s if r.objectives.ttft_s is not None else np.inf for r in trace])
    return np.where(np.isnan(ttfts), 0.0, (ttfts <= objective).astype(float))


@dataclasses.dataclass(frozen=True, slots=True)
class GoodputRow:
    """One (router, multiple) pooled over seeds. Rates in requests per second; latencies in seconds."""

    policy: str
    multiple: float
    rate_qps: float
    goodput: stats.Interval
    attainment: dict[str, float]
    ttft_p99_s: dict[str, stats.Interval]
    shed_frac: dict[str, float]
    num_shed: int
    num_shed_unprobed_met: int
    num_critical_shed: int


def _pooled(points: Sequence[SeedPoint], traces: dict[int, Sequence[ClusterRequest]], multiple: float,
            capacity_qps: float) -> GoodputRow:
    met = np.concatenate([_met(p, traces[p.seed]) for p in points])
    groups = np.concatenate([np.full(len(traces[p.seed]), p.seed) for p in points])
    ttfts = np.concatenate([p.latencies.ttfts_s for p in points])
    critical = np.concatenate([[r.objectives.priority >= 0 for r in traces[p.seed]] for p in points])
    rate = multiple * capacity_qps
    # goodput = attainment over every arrival x the offered rate (the traces are the same scaled by the rate)
    attainment_ci = stats.summary_ci(met, stats.mean, groups=groups)
    goodput = stats.Interval(*(v * rate for v in (attainment_ci.value, attainment_ci.low, attainment_ci.high)))
    row: dict = {"attainment": {}, "ttft_p99_s": {}, "shed_frac": {}}
    for name, mask in ((CRITICAL, critical), (SHEDDABLE, ~critical)):
        row["attainment"][name] = float(met[mask].mean()) if mask.any() else math.nan
        served = ttfts[mask & ~np.isnan(ttfts)]
        row["ttft_p99_s"][name] = (stats.summary_ci(served, stats.p99, groups=groups[mask & ~np.isnan(ttfts)])
                                   if len(served) else stats.Interval(math.nan, math.nan, math.nan))
        row["shed_frac"][name] = float(np.isnan(ttfts[mask]).mean()) if mask.any() else math.nan
    return GoodputRow(points[0].result.policy, multiple, rate, goodput, row["attainment"], row["ttft_p99_s"],
                      row["shed_frac"], sum(p.result.num_shed for p in points),
                      sum(p.result.num_shed_unprobed_met for p in points), int(np.isnan(ttfts[critical]).sum()))


def _f(value: float, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _ci(interval: stats.Interval, digits: int = 2) -> str:
    return f"{_f(interval.value, digits)} [{_f(interval.low, digits)}, {_f(interval.high, digits)}]"


def format_rows(rows: Sequence[GoodputRow]) -> str:
    header = ["router", "x cap", "req/s", "goodput req/s [95% CI]", "critical met", "sheddable met",
              "critical P99 TTFT s", "sheddable P99 TTFT s", "shed critical", "shed sheddable",
              "shed, unprobed met"]
    lines = [header]
    for r in rows:
        lines.append([r.policy, f"{r.multiple:g}", f"{r.rate_qps:.0f}", _ci(r.goodput, 1),
                      f"{r.attainment[CRITICAL]:.1%}", f"{r.attainment[SHEDDABLE]:.1%}",
                      _ci(r.ttft_p99_s[CRITICAL]), _ci(r.ttft_p99_s[SHEDDABLE]), f"{r.shed_frac[CRITICAL]:.1%}",
                      f"{r.shed_frac[SHEDDABLE]:.1%}",
                      f"{r.num_shed_unprobed_met}/{r.num_shed}" if r.num_shed else "-"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in lines)


def _met_by(points: Sequence[SeedPoint], traces: dict[int, Sequence[ClusterRequest]]
            ) -> dict[tuple[str, float], tuple[np.ndarray, np.ndarray]]:
    """(policy, rate) -> (met per request over the seeds, seed of each)."""
    by: dict[tuple[str, float], list[SeedPoint]] = {}
    for p in points:
        by.setdefault((p.result.policy, p.result.rate_qps), []).append(p)
    return {key: (np.concatenate([_met(p, traces[p.seed]) for p in sorted(ps, key=lambda p: p.seed)]),
                  np.concatenate([np.full(len(traces[p.seed]), p.seed) for p in sorted(ps, key=lambda p: p.seed)]))
            for key, ps in by.items()}


def higher_verdict(ratio: stats.Interval) -> str:
    """For a figure where higher is better (goodput): "higher" when the whole interval of A/B is above 1, "lower"
    when below, else "no difference"."""
    if ratio.low > 1:
        return "higher"
    if ratio.high < 1:
        return "lower"
    return "no difference"


def format_ratios(points: Sequence[SeedPoint], traces: dict[int, Sequence[ClusterRequest]], labels: Sequence[str],
                  reference: str, multiples: Sequence[float], capacity_qps: float) -> str:
    """Goodput ratios with paired intervals: to ``reference`` at each multiple, and to the router's own at 1x."""
    met = _met_by(points, traces)
    lines = [f"goodput / {reference}'s, same requests (paired 95% interval):"]
    for label in labels:
        if label == reference:
            continue
        cells = []
        for m in multiples:
            key, ref = (label, m * capacity_qps), (reference, m * capacity_qps)
            if key in met and ref in met:
                ci = stats.paired_ratio_ci(met[key][0], met[ref][0], stats.mean, groups=met[key][1])
                cells.append(f"{m:g}x {_ci(ci)} {higher_verdict(ci)}")
        lines.append(f"  {label}: " + "; ".join(cells))
    if 1.0 in multiples:
        lines.append("goodput / the router's own goodput at 1x capacity (paired over the same trace, scaled):")
        for label in labels:
            base = met.get((label, capacity_qps))
            if base is None:
                continue
            cells = []
            for m in multiples:
                if m == 1.0 or (label, m * capacity_qps) not in met:
                    continue
                ci = stats.paired_ratio_ci(met[(label, m * capacity_qps)][0], base[0], stats.mean, groups=base[1])
                cells.append(f"{m:g}x {_ci(stats.Interval(ci.value * m, ci.low * m, ci.high * m))}")
            lines.append(f"  {label}: " + "; ".join(cells))
    return "\n".join(lines)


def write_csv(path: Path, rows: Sequence[GoodputRow], settings: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = ("policy,multiple,rate_qps,goodput_qps,goodput_low,goodput_high,critical_attainment,"
              "sheddable_attainment,critical_ttft_p99_s,critical_ttft_p99_low,critical_ttft_p99_high,"
              "sheddable_ttft_p99_s,critical_shed_frac,sheddable_shed_frac,num_shed,num_shed_unprobed_met,settings")
    lines = [header]
    for r in rows:
        c = r.ttft_p99_s[CRITICAL]
        lines.append(",".join(map(str, (
            r.policy, r.multiple, round(r.rate_qps, 3), round(r.goodput.value, 3), round(r.goodput.low, 3),
            round(r.goodput.high, 3), round(r.attainment[CRITICAL], 4), round(r.attainment[SHEDDABLE], 4),
            round(c.value, 4), round(c.low, 4), round(c.high, 4), round(r.ttft_p99_s[SHEDDABLE].value, 4),
            round(r.shed_frac[CRITICAL], 4), round(r.shed_frac[SHEDDABLE], 4), r.num_shed, r.num_shed_unprobed_met,
            '"' + settings.replace('"', "'") + '"'))))
    path.write_text("\n".join(lines) + "\n")
    return path


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="astrolabe bench goodput", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--capacity", type=float, default=DEFAULT_CAPACITY_QPS,
                   help="astrolabe-k2's capacity at the 2 s P99 TTFT SLO on this workload, req/s (the 1x rate)")
    p.add_argument("--multiples", default=",".join(map(str, DEFAULT_MULTIPLES)), help="rates as multiples of it")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="LABEL[+RULE[=S][@W]][/priority], comma-separated")
    p.add_argument("--reference", default="astrolabe-k2+slo", help="router the goodput ratios are taken to")
    p.add_argument("--critical-frac", type=float, default=0.4, help="share of critical requests (priority 0)")
    p.add_argument("--critical-ttft-s", type=float, default=1.0, help="critical requests' TTFT objective, s")
    p.add_argument("--sheddable-ttft-s", type=float, default=5.0, help="sheddable requests' TTFT objective, s")
    p.add_argument("--protect-ttft-s", type=float, default=0.5,
                   help="the headroom rule's bound, s (extproc.admission; the config's default: half the critical "
                        "objective)")
    p.add_argument("--num-instances", type=int, default=12, help="simulated vLLM instances")
    p.add_argument("--num-routers", type=int, default=4, help="router replicas (each with its own view)")
    p.add_argument("--num-requests", type=int, default=3000, help="requests per point")
    p.add_argument("--seeds", default="0,1,2", help="trace seeds, comma-separated")
    p.add_argument("--max-model-len", type=int, default=4096, help="longest prompt + reply kept, tokens")
    p.add_argument("--length-errors", default=str(SHIPPED_LIGHT_DIR),
                   help="tagger directory whose measured errors give the predicted lengths")
    p.add_argument("--batch-time-model", default="llama-2-7b", help="shipped step-time model name or JSON path")
    add_engine_arguments(p, EngineConfig(num_gpu_blocks=A30_LIKE_NUM_GPU_BLOCKS))  # as `astrolabe bench cluster`
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR, help="folder of goodput.csv")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="simulation processes")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    """Runs the sweep and prints the tables; returns 0, or 2 on a bad argument."""
    args = _parse_args(argv)
    setup_logging("WARNING")
    try:
        multiples = [float(m) for m in args.multiples.split(",") if m.strip()]
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        if not multiples or min(multiples) <= 0 or not seeds or not args.capacity > 0:
            raise ValueError("--multiples and --capacity must be positive and --seeds must list a seed")
        if not 0 <= args.critical_frac <= 1:
            raise ValueError(f"--critical-frac must be in [0, 1], got {args.critical_frac}")
        labels = [label.strip() for label in args.policies.split(",") if label.strip()]
        specs = [spec_of(label, args.num_instances, args.protect_ttft_s) for label in labels]
        critical = Objectives(args.critical_ttft_s, None, 0)
        sheddable = Objectives(args.sheddable_ttft_s, None, -1)
        engine = engine_from_args(args)
        max_len = min(args.max_model_len, engine.num_gpu_blocks * engine.block_size)
        pairs = filter_pairs(load_sharegpt_pairs(), max_model_len=max_len)
        sample, error_desc, residual = error_model(argparse.Namespace(
            oracle_lengths=False, length_errors=args.length_errors, length_sigma=0.0, workload="sharegpt"), pairs)
    except ValueError as exc:
        print(f"astrolabe bench goodput: {exc}", file=sys.stderr)
        return 2
    traces = {seed: with_classes(build_requests(pairs, args.num_requests, random.Random(seed), "poisson", 1.0,
                                                sample)[1], random.Random(seed + 7), args.critical_frac, critical,
                                 sheddable) for seed in seeds}
    config = ClusterConfig(args.num_instances, engine, args.batch_time_model, num_routers=args.num_routers,
                           residual=residual)
    settings = (f"{args.num_instances} instances, {args.num_routers} router replicas, single-turn ShareGPT, "
                f"{args.num_requests} requests x seeds {','.join(map(str, seeds))}, Poisson arrivals; "
                f"{args.critical_frac:.0%} critical (priority 0, TTFT objective {args.critical_ttft_s:g} s), the rest "
                f"sheddable (priority -1, {args.sheddable_ttft_s:g} s); capacity {args.capacity:g} req/s; headroom "
                f"bound {args.protect_ttft_s:g} s unless =S; predicted lengths: {error_desc}")
    print(f"SIMULATED (virtual time): {settings}")
    start_s = time.perf_counter()
    rates = [m * args.capacity for m in multiples]
    points = run_sweep(specs, rates, traces, config, args.workers, progress=not args.no_progress)
    rows = []
    for spec in specs:
        for m in multiples:
            group = [p for p in points if p.result.policy == spec.label and math.isclose(p.result.rate_qps,
                                                                                          m * args.capacity)]
            rows.append(_pooled(group, traces, m, args.capacity))
    print(format_rows(rows))
    print()
    if args.reference in labels:
        print(format_ratios(points, traces, labels, args.reference, multiples, args.capacity))
    path = write_csv(args.out / "goodput.csv", rows, settings)
    print(f"\ngoodput = requests that met their TTFT objective per second of arrivals (a refused request meets "
          f"nothing); P99 TTFT over served requests; [low, high] = 95% block-bootstrap interval")
    print(f"wrote {path}; {time.perf_counter() - start_s:.0f} s wall")
    return 0
