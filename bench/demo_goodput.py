"""``astrolabe demo --objectives``: the goodput comparison of ``astrolabe bench goodput`` through real Envoy.

Owns what the objectives mode adds to the demo: its modes (routers, multiples, request counts), the class of each
request (`with_objectives`: 40% critical, 60% sheddable, drawn per request with the trace's seed, as the
simulation draws them), each router label's ``objectives`` section of the extproc config (`objectives_config`),
the header lines, and reducing the replays to the goodput tables and CSV (``bench.goodput_report``, shared with the
simulation). ``bench.demo`` starts the processes and replays; nothing else imports this module.

Classes (the Gateway API Inference Extension's objectives): a critical request names the objective ``critical``
(priority 0, TTFT objective 1 s), a sheddable one ``sheddable`` (priority -1, 5 s), in the
``x-gateway-inference-objective`` header (``bench.loadgen``); every extproc policy is configured with both
(``objectives.named``), so the router, not the client, decides what they mean.

Router labels: ``bench.goodput_report.parse_label``'s syntax over the demo's policy names: ``envoy-least-request``,
``least-requests`` or ``astrolabe`` (any extproc policy), then for a predicting policy ``+slo`` (llm-d's
latency-slo-admitter rule on our predictions) or ``+headroom`` (ours, ``extproc/admission.py``; ``=S`` its bound in
seconds, ``@W`` its critical-pressure window), and ``/priority``: the extproc writes each request's priority into
the body as vLLM's ``priority`` field (``objectives.engine_priority``). A label without ``+`` refuses nothing
(``admission: none``; the extproc's default would be headroom).

NOTE: one fleet serves every router, its emulators running vLLM's ``--scheduling-policy priority`` and its sidecars
modelling it: a request without a ``priority`` field has vLLM's default 0, so under a router that does not write it
every request has the same priority and the engines serve them in arrival order (FCFS), as the simulation's FCFS
engines do. The rates are multiples of the fleet's saturation throughput as ``predictor.sim`` measures it on the
trace (``bench.demo._rate``), not of a measured capacity at a P99 TTFT objective (``astrolabe bench goodput``'s
139 req/s is astrolabe-k2's at 2 s P99); at 1x the arrivals match what the fleet can serve at best.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from bench import goodput_report
from bench.demo_fleet import ENVOY_LEAST_REQUEST
from bench.goodput_report import CRITICAL, SHEDDABLE, GoodputRow, RouterLabel
from bench.loadgen import RequestResult
from bench.workloads import TraceRequest
from extproc.admission import DEFAULT_PRESSURE_WINDOW_S

OBJECTIVES = {CRITICAL: {"priority": 0, "ttft_ms": 1000}, SHEDDABLE: {"priority": -1, "ttft_ms": 5000}}
"""The named objectives every extproc gets (``objectives.named``): ``astrolabe bench goodput``'s classes."""
REFERENCE = "astrolabe+slo"
"""The router the goodput ratios are taken to: llm-d's admission rule on our predictions."""
ALL_POLICIES = ("envoy-least-request", "least-requests", "astrolabe", "astrolabe+slo", "astrolabe+headroom",
                "astrolabe+headroom/priority")
DEFAULT_MULTIPLES = (1.0, 1.2, 1.5, 2.0)

MODES = {
    "quick": (1500, (0,), ("astrolabe+slo", "astrolabe+headroom/priority", ENVOY_LEAST_REQUEST), (1.5,)),
    "default": (700, (0,), ALL_POLICIES, DEFAULT_MULTIPLES),
    "thorough": (700, (0, 1, 2), ALL_POLICIES, DEFAULT_MULTIPLES),
}
"""mode -> (requests per seed and multiple, seeds, router labels, multiples of the capacity). Sized by measurement
on 2 cores (README "Objectives through Envoy"): the default ~14 min, --quick ~3. A queue past capacity grows with
the replay's length (by (multiple - 1) x capacity per second) and must first fill the running batches (~30
requests per instance here) before a TTFT grows, so --quick spends its time on one multiple with more requests
(the default's 700 build little queue below 1.5x: README)."""

ADMISSION_POLICIES = ("astrolabe",)
"""Policies whose predictions an admission rule can refuse on (any other never refuses: ``extproc.server``)."""


def check_label(label: str, known_policies: Sequence[str]) -> RouterLabel:
    """Parse a router label of this mode (module docstring).

    Raises:
        ValueError: bad syntax, an unknown policy, an admission rule on a policy that makes no predictions, or
            ``/priority`` on ``envoy-least-request`` (no extproc to write the priority).
    """
    parsed = goodput_report.parse_label(label)
    if parsed.base not in (*known_policies, ENVOY_LEAST_REQUEST):
        raise ValueError(f"{label!r}: unknown policy {parsed.base!r}; known: "
                         f"{', '.join((*known_policies, ENVOY_LEAST_REQUEST))}")
    if parsed.rule not in (None, "none") and parsed.base not in ADMISSION_POLICIES:
        raise ValueError(f"{label!r}: admission refuses on predictions; only {', '.join(ADMISSION_POLICIES)} "
                         "makes them")
    if parsed.engine_priority and parsed.base == ENVOY_LEAST_REQUEST:
        raise ValueError(f"{label!r}: without an extproc nothing writes the requests' priority")
    return parsed


def with_objectives(trace: Sequence[TraceRequest], seed: int,
                    critical_frac: float = goodput_report.CRITICAL_FRAC) -> list[TraceRequest]:
    """``trace`` with each request's class drawn with trace seed ``seed`` (``bench.goodput_report.draw_classes``)."""
    classes = goodput_report.draw_classes(len(trace), goodput_report.class_rng(seed), critical_frac)
    return [dataclasses.replace(r, objective=c) for r, c in zip(trace, classes)]


REPLAY_TAG_SEP = "~"
"""Separates a request's trace id from its replay's tag in the id it is sent with (`at_multiple`)."""


def at_multiple(trace: Sequence[TraceRequest], multiple: float, tag: str = "") -> list[TraceRequest]:
    """A trace at 1x capacity replayed at ``multiple`` x: the same requests, gaps divided by ``multiple``; with a
    ``tag``, each id becomes ``<id>~<tag>``. Tag every replay: the fleet's sidecars live through all of them, and
    an id they saw in an earlier replay must not name a new request (a client's ids are unique)."""
    suffix = f"{REPLAY_TAG_SEP}{tag}" if tag else ""
    return [dataclasses.replace(r, arrival_offset_s=r.arrival_offset_s / multiple, id=r.id + suffix) for r in trace]


def _same_request(trace_id: str, result_id: str) -> bool:
    return result_id == trace_id or result_id.startswith(trace_id + REPLAY_TAG_SEP)


def objectives_config(label: RouterLabel) -> dict:
    """The extproc config's ``objectives`` section for ``label``."""
    config: dict = {"named": {name: dict(entry) for name, entry in OBJECTIVES.items()},
                    "admission": label.rule or "none"}
    if label.bound_s is not None:
        config["protect_ttft_ms"] = label.bound_s * 1000
    if label.window_s is not None:
        config["pressure_window_s"] = label.window_s
    if label.engine_priority:
        config["engine_priority"] = True
    return config


def pressure_window_s(label: str) -> float:
    """How long the extprocs of ``label`` keep refusing sheddable requests after a critical one was predicted to
    wait (the headroom rule's critical-pressure window; 0 for other rules), seconds."""
    parsed = goodput_report.parse_label(label)
    if parsed.rule != "headroom":
        return 0.0
    return DEFAULT_PRESSURE_WINDOW_S if parsed.window_s is None else parsed.window_s


def file_label(label: str) -> str:
    """``label`` as it names processes and files (no ``/``)."""
    return label.replace("/", "-")


def _ttft_objective_s(objective: str | None) -> float:
    entry = OBJECTIVES.get(objective or "")
    return math.inf if entry is None else entry["ttft_ms"] / 1000


def row_of(label: str, multiple: float, capacity_qps: float, traces: Mapping[int, Sequence[TraceRequest]],
           results_by_seed: Mapping[int, Sequence[RequestResult]]) -> GoodputRow:
    """One table row: the replays of ``label`` at ``multiple`` x ``capacity_qps``, pooled over the seeds (each
    seed's results in its trace's order). A refused request (429 with a drop reason) met nothing and counts as
    shed; a failed one met nothing and counts as an error."""
    a = _arrays(traces, results_by_seed)
    return goodput_report.pooled_row(label, multiple, multiple * capacity_qps, a["ttfts"], a["objectives"],
                                     a["critical"], a["groups"], a["refused"], num_errors=int(a["errors"].sum()))


def met_of(traces: Mapping[int, Sequence[TraceRequest]],
           results_by_seed: Mapping[int, Sequence[RequestResult]]) -> tuple[np.ndarray, np.ndarray]:
    """(met per request (``bench.goodput_report.met_objectives``), seed of each), seed then trace order."""
    a = _arrays(traces, results_by_seed)
    return goodput_report.met_objectives(a["ttfts"], a["objectives"]), a["groups"]


def _arrays(traces: Mapping[int, Sequence[TraceRequest]],
            results_by_seed: Mapping[int, Sequence[RequestResult]]) -> dict[str, np.ndarray]:
    ttfts, objectives, critical, groups, refused, errors = [], [], [], [], [], []
    for seed in sorted(results_by_seed):
        trace, results = traces[seed], results_by_seed[seed]
        if len(trace) != len(results) or not all(_same_request(t.id, r.id) for t, r in zip(trace, results)):
            raise ValueError(f"seed {seed}: the results are not the trace's requests in its order")
        for request, result in zip(trace, results):
            ttfts.append(result.ttft_s if result.ok and result.ttft_s is not None else math.nan)
            objectives.append(_ttft_objective_s(request.objective))
            critical.append(request.objective == CRITICAL)
            groups.append(seed)
            refused.append(result.refused)
            errors.append(result.error is not None)
    return {"ttfts": np.array(ttfts, dtype=float), "objectives": np.array(objectives, dtype=float),
            "critical": np.array(critical, dtype=bool), "groups": np.array(groups), "refused": np.array(refused),
            "errors": np.array(errors, dtype=bool)}


def header_lines(labels: Sequence[str], multiples: Sequence[float]) -> list[str]:
    """What the objectives mode adds to the demo's header."""
    c, s = OBJECTIVES[CRITICAL], OBJECTIVES[SHEDDABLE]
    return [
        f"objectives: each request drawn critical with probability {goodput_report.CRITICAL_FRAC:g} (the trace's "
        f"seed), else sheddable; the client names its class in x-gateway-inference-objective and every extproc is "
        f"configured with critical = priority {c['priority']}, TTFT objective {c['ttft_ms'] / 1000:g} s and "
        f"sheddable = priority {s['priority']}, {s['ttft_ms'] / 1000:g} s (objectives.named)",
        f"compared: {', '.join(labels)} at {', '.join(f'{m:g}' for m in multiples)} x capacity; +slo = llm-d's "
        "latency-slo-admitter rule on our predictions, +headroom = ours (extproc/admission.py), no '+' = nothing "
        "refused; /priority = the extproc writes each request's priority into the body (vLLM's priority field); "
        "each router tier is started once and replays every multiple in turn",
        "engines: one fleet serves every router: the emulators run vLLM's --scheduling-policy priority and the "
        "sidecars model it; a request without a priority field has priority 0, so under a router that does not "
        "write it the engines serve requests in arrival order (FCFS)",
    ]


def step_scale(states: Mapping[str, dict]) -> float:
    """The median over sidecars of their online step-time fit's predicted time over the modelled one
    (``calibration.scale_vs_prior`` of a sidecar's ``State``; 1.0 = the emulator kept its modelled step times);
    NaN when no sidecar has refitted."""
    scales = [float(c["scale_vs_prior"]) for state in states.values()
              if (c := state.get("calibration") or {}).get("source") == "online" and c.get("scale_vs_prior")]
    return float(np.median(scales)) if scales else math.nan


PRIORITY_BODIES_WRITTEN = 'astrolabe_extproc_engine_priority_bodies_total{outcome="written"}'
"""The extprocs' count of request bodies they wrote a priority into (``extproc/engine_priority.py``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectivesRun:
    """One router label's replays: multiple -> seed -> results (trace order), multiple -> `step_scale` after
    that multiple's replays (NaN without sidecars), and how many bodies its extprocs wrote a priority into
    (`PRIORITY_BODIES_WRITTEN`, summed over the replicas; None without extprocs)."""

    label: str
    results: dict[float, dict[int, list[RequestResult]]]
    step_scales: dict[float, float] = dataclasses.field(default_factory=dict)
    priority_bodies: int | None = None
    route_s: dict[float, tuple[float, float]] = dataclasses.field(default_factory=dict)
    """multiple -> the extprocs' decision time (headers to decision) p50 and p99, seconds (`route_times`)."""


def route_times(records: Sequence[dict], windows: Mapping[float, tuple[float, float]]
                ) -> dict[float, tuple[float, float]]:
    """Decision-log records (``extproc.decision_log``) -> per multiple, the p50 and p99 of ``routing_s`` over the
    records whose ``time_unix_s`` falls in that multiple's replay window (``windows``: multiple -> (start, end)
    Unix seconds); a multiple without records is left out."""
    out = {}
    for multiple, (start_s, end_s) in windows.items():
        times = [r["routing_s"] for r in records if start_s <= r.get("time_unix_s", -1.0) <= end_s
                 and r.get("routing_s") is not None]
        if times:
            out[multiple] = (float(np.percentile(times, 50)), float(np.percentile(times, 99)))
    return out


def report(runs: Sequence[ObjectivesRun], traces: Mapping[int, Sequence[TraceRequest]], capacity_qps: float,
           multiples: Sequence[float], csv_path: Path, settings: str) -> list[GoodputRow]:
    """Print the goodput table, the ratio tables and the notes on stdout; write the rows to ``csv_path``; returns
    the rows (per label, then multiple)."""
    rows = [row_of(run.label, m, capacity_qps, traces, run.results[m]) for run in runs for m in multiples
            if m in run.results]
    print(goodput_report.format_rows(rows))
    print()
    labels = [run.label for run in runs]
    met = {(run.label, m): met_of(traces, run.results[m]) for run in runs for m in multiples if m in run.results}
    ratios = goodput_report.format_ratios(met, labels, REFERENCE, multiples)
    if ratios:
        print(ratios)
        print()
    print(goodput_report.GOODPUT_NOTE + "; shed = refused with 429 (the count in parentheses); errors = other "
          "failures (they meet nothing too)")
    routed = [run for run in runs if run.route_s]
    if routed:
        print("extproc decision time (a request's headers to its decision), ms p50 / p99: " + "; ".join(
            f"{run.label} " + ", ".join(f"{m:g}x {1000 * p50:.1f} / {1000 * p99:.0f}"
                                        for m, (p50, p99) in run.route_s.items()) for run in routed))
    for run in runs:
        if run.priority_bodies is not None and goodput_report.parse_label(run.label).engine_priority:
            answered = sum(r.status is not None and not r.refused for by_seed in run.results.values()
                           for rs in by_seed.values() for r in rs)
            print(f"engine priority: {run.label}'s extprocs wrote the priority into {run.priority_bodies} request "
                  f"bodies; {answered} requests were answered and not refused")
    scales = [s for run in runs for s in run.step_scales.values() if not math.isnan(s)]
    if scales:
        print(f"emulator step times: the sidecars' online step-time fit / the modelled step times after each replay "
              f"(median over sidecars, their last 512 steps): {min(scales):.2f}-{max(scales):.2f} (1 = the emulators "
              "kept their modelled step times on this machine)")
    print(f"rows: {goodput_report.write_csv(csv_path, rows, settings)}")
    return rows
