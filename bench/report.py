"""Per-policy latency summaries of a replay and the plain-text table that compares them.

Owns: reducing a list of :class:`bench.loadgen.RequestResult` to a :class:`PolicySummary` and formatting summaries
as one fixed-width table. Pure functions; no I/O, no printing.

NOTE: latency statistics are computed over successful requests only (an error has no meaningful latency); the
error count sits beside them. Percentiles are ``numpy.percentile`` with its default linear interpolation
(NumPy's "linear" method, Hyndman & Fan type 7).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from bench.loadgen import RequestResult

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class PolicySummary:
    """One row of the comparison table. Latencies are seconds (NaN when no request succeeded).

    Attributes:
        policy: policy name.
        num_requests: requests in the trace.
        num_errors: requests that failed (see ``RequestResult.error``).
        ttft_mean_s, ttft_p50_s, ttft_p99_s: time to first token over successful requests.
        e2e_mean_s, e2e_p99_s: end-to-end latency over successful requests.
        requests_per_instance: instance (``host:port`` from ``x-emulator-instance``) -> requests it answered,
            errors included; requests that reached no instance are not counted.
    """

    policy: str
    num_requests: int
    num_errors: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_mean_s: float
    e2e_p99_s: float
    requests_per_instance: dict[str, int]


def _stats(values_s: list[float], percentiles: Sequence[float]) -> tuple[float, ...]:
    if not values_s:
        return (math.nan,) * (1 + len(percentiles))
    arr = np.asarray(values_s, dtype=float)
    return (float(arr.mean()), *(float(v) for v in np.percentile(arr, percentiles)))


def summarize(policy: str, results: Sequence[RequestResult]) -> PolicySummary:
    """Reduce the results of one policy's replay to a table row.

    Args:
        policy: policy name.
        results: one per trace request.

    Returns:
        The summary; latency fields are NaN if no request succeeded.
    """
    ok = [r for r in results if r.ok]
    ttft_mean_s, ttft_p50_s, ttft_p99_s = _stats([r.ttft_s for r in ok if r.ttft_s is not None], (50, 99))
    e2e_mean_s, e2e_p99_s = _stats([r.e2e_s for r in ok if r.e2e_s is not None], (99,))
    per_instance = Counter(r.instance for r in results if r.instance)
    return PolicySummary(
        policy=policy,
        num_requests=len(results),
        num_errors=len(results) - len(ok),
        ttft_mean_s=ttft_mean_s,
        ttft_p50_s=ttft_p50_s,
        ttft_p99_s=ttft_p99_s,
        e2e_mean_s=e2e_mean_s,
        e2e_p99_s=e2e_p99_s,
        requests_per_instance=dict(per_instance),
    )


def _fmt_s(value_s: float) -> str:
    return "-" if math.isnan(value_s) else f"{value_s:.3f}"


def _render(header: list[str], rows: list[list[str]]) -> list[str]:
    """Fixed-width lines: header, rule, rows; first column left-aligned, the others right-aligned."""
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def format_table(summaries: Sequence[PolicySummary], instances: Sequence[str]) -> str:
    """A fixed-width table, one row per summary, plus a legend of the instance columns.

    Columns: policy, requests, errors, TTFT mean/p50/p99 (s), E2E mean/p99 (s), then one column per instance
    (``i0``, ``i1``, ... in the order of ``instances``) with the requests it answered; answers from an instance
    not in ``instances`` are added up in a final ``other`` column, shown only when non-zero somewhere.

    Args:
        summaries: rows, in display order.
        instances: instance addresses (``host:port``), column order.

    Returns:
        The table as lines joined with ``\\n`` (no trailing newline).
    """
    known = set(instances)
    others = [sum(n for inst, n in s.requests_per_instance.items() if inst not in known) for s in summaries]
    header = ["policy", "requests", "errors", "TTFT mean", "TTFT p50", "TTFT p99", "E2E mean", "E2E p99"]
    header += [f"i{i}" for i in range(len(instances))]
    if any(others):
        header.append("other")
    rows = []
    for summary, other in zip(summaries, others):
        row = [
            summary.policy,
            str(summary.num_requests),
            str(summary.num_errors),
            *(_fmt_s(v) for v in (summary.ttft_mean_s, summary.ttft_p50_s, summary.ttft_p99_s)),
            *(_fmt_s(v) for v in (summary.e2e_mean_s, summary.e2e_p99_s)),
            *(str(summary.requests_per_instance.get(inst, 0)) for inst in instances),
        ]
        if any(others):
            row.append(str(other))
        rows.append(row)
    out = _render(header, rows)
    out.append("latencies in seconds over successful requests; i<k> = requests answered by instance k:")
    out += [f"  i{i} = {inst}" for i, inst in enumerate(instances)]
    return "\n".join(out)


_COMPARED = (("TTFT mean", "ttft_mean_s"), ("TTFT p50", "ttft_p50_s"), ("TTFT p99", "ttft_p99_s"),
             ("E2E mean", "e2e_mean_s"), ("E2E p99", "e2e_p99_s"))


def format_comparison(summaries: Sequence[PolicySummary], policy: str) -> str:
    """Each latency figure of ``policy`` as a ratio to the best (lowest) baseline of the same run.

    A ratio below 1 means ``policy`` is better. Returns an explanatory line instead when ``policy`` or every
    baseline is missing from ``summaries``.
    """
    ours = next((s for s in summaries if s.policy == policy), None)
    baselines = [s for s in summaries if s.policy != policy]
    if ours is None or not baselines:
        return f"(no comparison: the run needs {policy!r} and at least one baseline)"
    rows = []
    for label, field in _COMPARED:
        best = min(baselines, key=lambda s: getattr(s, field))
        best_s, ours_s = getattr(best, field), getattr(ours, field)
        ratio = ours_s / best_s if best_s > 0 else math.nan
        rows.append([label, _fmt_s(ours_s), _fmt_s(best_s), best.policy, "-" if math.isnan(ratio) else f"{ratio:.2f}x"])
    lines = _render(["figure", policy, "best baseline", "which", "ratio"], rows)
    lines.append(f"ratio = {policy} / best baseline (lower is better for {policy})")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True, slots=True)
class ControlPlaneCost:
    """What routing cost during one policy's replay.

    Attributes:
        policy: policy name.
        num_requests: requests replayed.
        num_predictions: predictor calls the extproc made (any outcome).
        num_fallbacks: requests routed by the least-requests fallback (no usable prediction).
        extproc_cpu_s: CPU time of the extproc process over its whole life, seconds.
        sidecar_cpu_s: CPU time of all predictor sidecars during the replay, seconds.
    """

    policy: str
    num_requests: int
    num_predictions: float
    num_fallbacks: float
    extproc_cpu_s: float
    sidecar_cpu_s: float


def format_costs(costs: Sequence[ControlPlaneCost]) -> str:
    """Control-plane cost per request: predictions, fallbacks, extproc and sidecar CPU milliseconds."""
    rows = [[c.policy, f"{c.num_predictions / max(c.num_requests, 1):.2f}", str(int(c.num_fallbacks)),
             f"{1000 * c.extproc_cpu_s / max(c.num_requests, 1):.2f}",
             f"{1000 * c.sidecar_cpu_s / max(c.num_requests, 1):.2f}"] for c in costs]
    lines = _render(["policy", "predictions/req", "fallbacks", "extproc CPU ms/req", "sidecars CPU ms/req"], rows)
    lines.append("CPU: user+system time of the extproc process (start-up included) and of the predictor sidecars "
                 "(during the replay, reconciliation included), divided by the requests")
    return "\n".join(lines)
