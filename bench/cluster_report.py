"""Outputs of the cluster benchmark: capacity per policy, the text tables, the CSV and the P99-TTFT plot.

Owns pure reductions of ``bench.cluster_sim.PointResult`` lists and the two file writers (CSV with the stdlib,
PNG with matplotlib's Agg backend, imported only inside ``write_plot``). No printing.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.cluster_sim import PointResult

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Capacity:
    """A policy's capacity at an SLO.

    Attributes:
        policy: policy label.
        capacity_qps: highest swept rate such that it and every lower swept rate meet the SLO; None when the
            lowest rate already misses it.
        at_max_rate: True when every swept rate met the SLO (the true capacity may be higher).
    """

    policy: str
    capacity_qps: float | None
    at_max_rate: bool

    def __str__(self) -> str:
        if self.capacity_qps is None:
            return "< lowest rate"
        return f">= {self.capacity_qps:g}" if self.at_max_rate else f"{self.capacity_qps:g}"


def capacities(results: Sequence[PointResult], slo_ttft_s: float) -> list[Capacity]:
    """Capacity of each policy (first-appearance order): the highest rate of the prefix of ascending rates whose
    P99 TTFT is <= ``slo_ttft_s`` seconds (a NaN P99 counts as a miss)."""
    by_policy: dict[str, list[PointResult]] = {}
    for result in results:
        by_policy.setdefault(result.policy, []).append(result)
    out = []
    for policy, points in by_policy.items():
        points = sorted(points, key=lambda r: r.rate_qps)
        best = None
        for point in points:
            if not point.ttft_p99_s <= slo_ttft_s:
                break
            best = point.rate_qps
        out.append(Capacity(policy, best, best is not None and best == points[-1].rate_qps))
    return out


def _f(value: float, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def format_points(results: Sequence[PointResult]) -> str:
    """One row per (policy, rate): TTFT mean/p99, E2E mean/p99, TPOT mean (s), preemptions, predictor calls."""
    header = ["policy", "rate qps", "done", "TTFT mean", "TTFT p99", "E2E mean", "E2E p99", "TPOT mean",
              "preempt", "pred/req", "fallback"]
    rows = [[r.policy, f"{r.rate_qps:g}", f"{r.num_completed}/{r.num_requests}", _f(r.ttft_mean_s),
             _f(r.ttft_p99_s), _f(r.e2e_mean_s), _f(r.e2e_p99_s), _f(r.tpot_mean_s, 4), str(r.num_preemptions),
             _f(r.predictor_calls_per_request, 1), str(r.num_fallbacks)] for r in results]
    return _table(header, rows)


def format_capacities(caps: Sequence[Capacity], slo_ttft_s: float) -> str:
    """The capacity table (one row per policy)."""
    return _table(["policy", f"capacity qps (P99 TTFT <= {slo_ttft_s:g} s)"], [[c.policy, str(c)] for c in caps])


def write_csv(path: Path, results: Sequence[PointResult], extra: Mapping[str, Any]) -> Path:
    """Writes one row per point: the ``PointResult`` fields, then ``extra`` (run settings) as constant columns.

    Raises:
        OSError: the file cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [f.name for f in dataclasses.fields(PointResult)]
    with path.open("w", newline="") as fp:
        writer = csv.writer(fp)
        writer.writerow([*names, *extra])
        for result in results:
            writer.writerow([*(getattr(result, n) for n in names), *extra.values()])
    return path


def write_plot(path: Path, results: Sequence[PointResult], slo_ttft_s: float, title: str) -> Path:
    """P99 TTFT (log scale) against rate, one line per policy, the SLO as a dashed line; PNG via Agg.

    Raises:
        OSError: the file cannot be written.
    """
    import matplotlib  # noqa: PLC0415 (plotting is optional at import time)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 5))
    by_policy: dict[str, list[PointResult]] = {}
    for result in results:
        by_policy.setdefault(result.policy, []).append(result)
    for policy, points in by_policy.items():
        points = sorted(points, key=lambda r: r.rate_qps)
        ax.plot([p.rate_qps for p in points], [p.ttft_p99_s for p in points], marker="o", label=policy)
    ax.axhline(slo_ttft_s, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo_ttft_s:g} s")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("P99 TTFT (s, simulated)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
