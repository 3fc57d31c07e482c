"""`astrolabe bench goodput`: latency objectives, admission and goodput under overload, on the simulated fleet.

The cluster benchmark's fleet and single-turn ShareGPT trace (``bench.cluster``, ``bench.cluster_sim``), with every
request given a class, drawn per request with a fixed seed: ``--critical-frac`` (40%) critical requests (priority
0, TTFT objective ``--critical-ttft-s``, 1 s) and the rest sheddable (priority -1, TTFT objective
``--sheddable-ttft-s``, 5 s), as ``extproc.admission.Objectives``. The rates are multiples of ``--capacity``
(astrolabe-k2's capacity at the 2 s P99 TTFT SLO on this workload, measured with ``astrolabe bench cluster``:
bench/README.md), 1x included so that each router's goodput at capacity is in the same run.

Routers (``--policies``; the syntax is ``bench.goodput_report.parse_label``'s, which ``astrolabe demo
--objectives`` takes too): any ``bench.cluster.policy_spec`` label, optionally followed by ``+RULE`` (an
``extproc.admission`` rule: ``slo`` = llm-d's latency-slo-admitter rule on our predictions, ``headroom`` = ours with
the extproc's defaults, ``headroom=<S>`` with its bound S seconds instead of ``--protect-ttft-s``, ``...@<W>`` with
its critical-pressure window W seconds instead of the default 2, ``@0`` none); without ``+`` nothing is
refused. A trailing ``/priority`` runs that router's engines with vLLM's ``--scheduling-policy priority``
(``bench.cluster_sim.PolicySpec.engine_priority``: each request's priority goes to the engine, critical first).

Per (router, multiple), pooled over the seeds: goodput (requests per second that met their TTFT objective; a refused
request meets nothing), SLO attainment per class, each class's P99 TTFT over its served requests (95% block-bootstrap
interval), the share (and number) refused per class, and how many refused requests had an instance that was not
probed and was predicted to meet their objective (``bench.goodput_report`` reduces and prints them). Then, per multiple, each router's goodput as a ratio to the reference's
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
from bench.cluster import build_requests, error_model, policy_spec, run_sweep
from bench.cluster_sim import A30_LIKE_NUM_GPU_BLOCKS, ClusterConfig, ClusterRequest, PolicySpec, SeedPoint
from bench.goodput_report import (CRITICAL, CRITICAL_FRAC, GOODPUT_NOTE, SHEDDABLE, GoodputRow, class_rng,
                                  draw_classes, format_ratios, format_rows, met_objectives, parse_label, pooled_row,
                                  write_csv)
from bench.workloads import REPO_ROOT, filter_pairs
from extproc.admission import ADMISSION_RULES, DEFAULT_PRESSURE_WINDOW_S, AdmissionParams
from extproc.objectives import Objectives
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


def spec_of(label: str, num_instances: int, protect_ttft_s: float,
            pressure_window_s: float = DEFAULT_PRESSURE_WINDOW_S) -> PolicySpec:
    """``LABEL[+RULE[=S][@W]][/priority]`` (``bench.goodput_report.parse_label``) -> the policy spec with its
    admission rule and engine policy (module docstring).

    Raises:
        ValueError: an unknown label, rule or engine policy, a bound that is not a number.
    """
    parsed = parse_label(label, ADMISSION_RULES)
    spec = dataclasses.replace(policy_spec(parsed.base, num_instances), label=label,
                               engine_priority=parsed.engine_priority)
    if parsed.rule is None:
        return spec
    return dataclasses.replace(spec, admission=AdmissionParams(parsed.rule),
                               protect_ttft_s=protect_ttft_s if parsed.bound_s is None else parsed.bound_s,
                               pressure_window_s=pressure_window_s if parsed.window_s is None else parsed.window_s)


def with_classes(requests: Sequence[ClusterRequest], rng: random.Random, critical_frac: float,
                 critical: Objectives, sheddable: Objectives) -> list[ClusterRequest]:
    """Each request critical with probability ``critical_frac``, else sheddable (``bench.goodput_report.draw_classes``)."""
    objectives = {CRITICAL: critical, SHEDDABLE: sheddable}
    return [dataclasses.replace(r, objectives=objectives[c])
            for r, c in zip(requests, draw_classes(len(requests), rng, critical_frac))]


def _arrays(points: Sequence[SeedPoint], traces: dict[int, Sequence[ClusterRequest]]) -> dict[str, np.ndarray]:
    """Per request of the points' traces (seed order, then trace order): TTFT (NaN = refused), TTFT objective,
    critical, seed."""
    points = sorted(points, key=lambda p: p.seed)
    return {"ttfts": np.concatenate([p.latencies.ttfts_s for p in points]),
            "objectives": np.array([r.objectives.ttft_s if r.objectives.ttft_s is not None else np.inf
                                    for p in points for r in traces[p.seed]]),
            "critical": np.array([r.objectives.priority >= 0 for p in points for r in traces[p.seed]], dtype=bool),
            "groups": np.concatenate([np.full(len(traces[p.seed]), p.seed) for p in points])}


def _pooled(points: Sequence[SeedPoint], traces: dict[int, Sequence[ClusterRequest]], multiple: float,
            capacity_qps: float) -> GoodputRow:
    a = _arrays(points, traces)
    return pooled_row(points[0].result.policy, multiple, multiple * capacity_qps, a["ttfts"], a["objectives"],
                      a["critical"], a["groups"], np.isnan(a["ttfts"]),
                      num_shed_unprobed_met=sum(p.result.num_shed_unprobed_met for p in points))


def _met_by(points: Sequence[SeedPoint], traces: dict[int, Sequence[ClusterRequest]], multiples: Sequence[float],
            capacity_qps: float) -> dict[tuple[str, float], tuple[np.ndarray, np.ndarray]]:
    """(policy, multiple) -> (met per request over the seeds, seed of each)."""
    out = {}
    for m in multiples:
        by: dict[str, list[SeedPoint]] = {}
        for p in points:
            if math.isclose(p.result.rate_qps, m * capacity_qps):
                by.setdefault(p.result.policy, []).append(p)
        for policy, group in by.items():
            a = _arrays(group, traces)
            out[(policy, m)] = (met_objectives(a["ttfts"], a["objectives"]), a["groups"])
    return out


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="astrolabe bench goodput", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--capacity", type=float, default=DEFAULT_CAPACITY_QPS,
                   help="astrolabe-k2's capacity at the 2 s P99 TTFT SLO on this workload, req/s (the 1x rate)")
    p.add_argument("--multiples", default=",".join(map(str, DEFAULT_MULTIPLES)), help="rates as multiples of it")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="LABEL[+RULE[=S][@W]][/priority], comma-separated")
    p.add_argument("--reference", default="astrolabe-k2+slo", help="router the goodput ratios are taken to")
    p.add_argument("--critical-frac", type=float, default=CRITICAL_FRAC, help="share of critical requests (priority 0)")
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
                                                sample)[1], class_rng(seed), args.critical_frac, critical,
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
        print(format_ratios(_met_by(points, traces, multiples, args.capacity), labels, args.reference, multiples))
    path = write_csv(args.out / "goodput.csv", rows, settings)
    print(f"\n{GOODPUT_NOTE}")
    print(f"wrote {path}; {time.perf_counter() - start_s:.0f} s wall")
    return 0
