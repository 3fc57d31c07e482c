"""Outputs of the cluster benchmark: capacity per policy, the text tables, the CSV and the P99-TTFT plot.

Owns pure reductions of ``bench.cluster_sim.SeedPoint`` lists (pooling seeds, capacities, ratios with
bootstrap intervals from ``bench.stats``) and the two file writers (CSV with the stdlib,
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

import numpy as np

from bench import stats
from bench.cluster_sim import SHARE_WINDOW_S, SeedPoint
from bench.stats import paired_ratio_ci, summary_ci, verdict

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class PooledPoint:
    """One (policy, rate) pooled over seeds. Latencies in seconds over completed requests.

    Attributes:
        ttft_p99_low_s, ttft_p99_high_s: 95% block-bootstrap interval of ``ttft_p99_s`` (blocks within seeds).
        num_preemptions: summed over instances and seeds.
        predictor_calls_per_request: predictions made / requests routed.
        num_fallbacks: requests the policy could not place (summed over seeds).
        wall_s: wall-clock seconds the seeds took together.
        num_migrations_started / _completed / _aborted: live migrations summed over seeds (0 without).
        migrations_per_request: completed migrations / requests.
        migration_stall_s: seconds migrated requests spent stalled, summed over seeds.
        engine_time_lost_s: engine seconds lost to copies, summed over instances and seeds.
        requests_max_over_mean: requests dispatched to the busiest instance over the mean per instance, summed
            over seeds (1.0 = perfectly even).
        window_max_over_mean: ``PointResult.window_max_over_mean`` averaged over every seed's windows.
        prefix_cache_hit_rate: prompt tokens found in the engines' prefix caches over those looked up, summed
            over instances and seeds (NaN when none was looked up).
        request_rate_qps: requests per second the point's arrivals gave, mean over seeds (for multi-turn
            sessions, what ``rate_qps`` sessions per second gave).
    """

    policy: str
    rate_qps: float
    num_seeds: int
    num_requests: int
    num_completed: int
    ttft_mean_s: float
    ttft_p99_s: float
    ttft_p99_low_s: float
    ttft_p99_high_s: float
    e2e_mean_s: float
    e2e_p99_s: float
    tpot_mean_s: float
    num_preemptions: int
    predictor_calls_per_request: float
    num_fallbacks: int
    num_routers: int
    wall_s: float
    num_migrations_started: int = 0
    num_migrations_completed: int = 0
    num_migrations_aborted: int = 0
    migrations_per_request: float = 0.0
    migration_stall_s: float = 0.0
    engine_time_lost_s: float = 0.0
    requests_max_over_mean: float = math.nan
    window_max_over_mean: float = math.nan
    prefix_cache_hit_rate: float = math.nan
    request_rate_qps: float = math.nan


def _shares(results) -> dict[str, float]:
    """The request-share fields of `PooledPoint` from one point's seeds (NaN where a seed has none)."""
    if any(not r.requests_per_instance for r in results):
        return {}
    per_instance = np.sum([r.requests_per_instance for r in results], axis=0)
    num_windows = sum(r.num_windows for r in results)
    return {"requests_max_over_mean": float(per_instance.max() / per_instance.mean()),
            "window_max_over_mean": sum(r.window_max_over_mean * r.num_windows for r in results if r.num_windows)
            / num_windows if num_windows else math.nan}


def _by_point(points: Sequence[SeedPoint]) -> dict[tuple[str, float], list[SeedPoint]]:
    grouped: dict[tuple[str, float], list[SeedPoint]] = {}
    for point in points:
        grouped.setdefault((point.result.policy, point.result.rate_qps), []).append(point)
    return {k: sorted(v, key=lambda p: p.seed) for k, v in grouped.items()}


def _pooled(points: Sequence[SeedPoint], attr: str) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated per-request figures (seed order) and their seed groups."""
    values = np.concatenate([getattr(p.latencies, attr) for p in points])
    groups = np.concatenate([np.full(len(getattr(p.latencies, attr)), p.seed) for p in points])
    return values, groups


def pool_points(points: Sequence[SeedPoint]) -> list[PooledPoint]:
    """Pools every (policy, rate)'s seeds; first-appearance order of (policy, rate)."""
    out = []
    for (policy, rate), seeds in _by_point(points).items():
        ttfts, groups = _pooled(seeds, "ttfts_s")
        e2es, _ = _pooled(seeds, "e2es_s")
        p99 = summary_ci(ttfts, stats.p99, groups=groups, num_resamples=500)
        results = [p.result for p in seeds]
        num_requests = sum(r.num_requests for r in results)
        out.append(PooledPoint(
            policy=policy, rate_qps=rate, num_seeds=len(seeds), num_requests=num_requests,
            num_completed=sum(r.num_completed for r in results), ttft_mean_s=float(np.mean(ttfts)),
            ttft_p99_s=p99.value, ttft_p99_low_s=p99.low, ttft_p99_high_s=p99.high,
            e2e_mean_s=float(np.mean(e2es)), e2e_p99_s=float(np.percentile(e2es, 99)),
            tpot_mean_s=float(np.nanmean([r.tpot_mean_s for r in results])),
            num_preemptions=sum(r.num_preemptions for r in results),
            predictor_calls_per_request=sum(r.predictor_calls_per_request * r.num_requests for r in results)
            / max(num_requests, 1),
            num_fallbacks=sum(r.num_fallbacks for r in results), num_routers=results[0].num_routers,
            wall_s=sum(r.wall_s for r in results),
            num_migrations_started=sum(r.num_migrations_started for r in results),
            num_migrations_completed=sum(r.num_migrations_completed for r in results),
            num_migrations_aborted=sum(r.num_migrations_aborted for r in results),
            migrations_per_request=sum(r.num_migrations_completed for r in results) / max(num_requests, 1),
            migration_stall_s=sum(r.migration_stall_s for r in results),
            engine_time_lost_s=sum(r.engine_time_lost_s for r in results), **_shares(results),
            prefix_cache_hit_rate=(sum(r.prefix_cache_hits for r in results) / queries
                                   if (queries := sum(r.prefix_cache_queries for r in results)) else math.nan),
            request_rate_qps=float(np.mean([r.request_rate_qps for r in results]))))
    return out


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


def _by_policy(results: Sequence[PooledPoint]) -> dict[str, list[PooledPoint]]:
    by_policy: dict[str, list[PooledPoint]] = {}
    for result in results:
        by_policy.setdefault(result.policy, []).append(result)
    return {k: sorted(v, key=lambda r: r.rate_qps) for k, v in by_policy.items()}


def capacities(results: Sequence[PooledPoint], slo_ttft_s: float) -> list[Capacity]:
    """Capacity of each policy (first-appearance order): the highest rate of the prefix of ascending rates whose
    P99 TTFT is <= ``slo_ttft_s`` seconds (a NaN P99 counts as a miss)."""
    out = []
    for policy, points in _by_policy(results).items():
        best = None
        for point in points:
            if not point.ttft_p99_s <= slo_ttft_s:
                break
            best = point.rate_qps
        out.append(Capacity(policy, best, best is not None and best == points[-1].rate_qps))
    return out


def crossing_rates(results: Sequence[PooledPoint], slo_ttft_s: float) -> dict[str, float | None]:
    """Per policy, the rate at which P99 TTFT first crosses ``slo_ttft_s``: linear in rate and log P99 between the
    last swept rate that meets the SLO and the first that misses it (finer than the sweep's grid). None when
    the lowest rate misses or every rate meets it."""
    out: dict[str, float | None] = {}
    for policy, points in _by_policy(results).items():
        out[policy] = None
        for below, above in zip(points, points[1:]):
            if below.ttft_p99_s <= slo_ttft_s < above.ttft_p99_s or math.isnan(above.ttft_p99_s):
                if not below.ttft_p99_s <= slo_ttft_s:
                    break
                if math.isnan(above.ttft_p99_s) or math.isinf(above.ttft_p99_s):
                    out[policy] = above.rate_qps
                else:
                    lo, hi = math.log(below.ttft_p99_s), math.log(above.ttft_p99_s)
                    frac = (math.log(slo_ttft_s) - lo) / (hi - lo)
                    out[policy] = below.rate_qps + frac * (above.rate_qps - below.rate_qps)
                break
            if not below.ttft_p99_s <= slo_ttft_s:
                break
    return out


def _f(value: float, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def format_points(results: Sequence[PooledPoint]) -> str:
    """One row per (policy, rate): TTFT mean, P99 [interval], the requests' spread over instances (busiest over
    mean, over the whole point and per ``SHARE_WINDOW_S`` window), E2E mean/p99, TPOT mean (s), preemptions, calls; plus
    the requests per second the arrivals gave and the prefix-cache hit rate (cached / looked-up prompt tokens) when
    any point hit the cache, and completed migrations per request and aborted / started migrations when any point
    migrated."""
    header = ["policy", "rate qps", "done", "TTFT mean", "TTFT p99 [95% interval]", "req/inst max/mean",
              f"per {SHARE_WINDOW_S:g} s", "E2E mean", "E2E p99", "TPOT mean", "preempt", "pred/req", "fallback"]
    rows = [[r.policy, f"{r.rate_qps:g}", f"{r.num_completed}/{r.num_requests}", _f(r.ttft_mean_s),
             f"{_f(r.ttft_p99_s)} [{_f(r.ttft_p99_low_s)}, {_f(r.ttft_p99_high_s)}]",
             _f(r.requests_max_over_mean, 2), _f(r.window_max_over_mean, 2), _f(r.e2e_mean_s),
             _f(r.e2e_p99_s), _f(r.tpot_mean_s, 4), str(r.num_preemptions), _f(r.predictor_calls_per_request, 1),
             str(r.num_fallbacks)] for r in results]
    if any(r.prefix_cache_hit_rate > 0 for r in results):
        header += ["req/s", "cache hit"]
        for row, r in zip(rows, results):
            row += [_f(r.request_rate_qps, 1), _f(r.prefix_cache_hit_rate, 3)]
    if any(r.num_migrations_started for r in results):
        header += ["migr/req", "aborted/started"]
        for row, r in zip(rows, results):
            row += [_f(r.migrations_per_request, 4), f"{r.num_migrations_aborted}/{r.num_migrations_started}"]
    return _table(header, rows)


def format_capacities(caps: Sequence[Capacity], crossings: Mapping[str, float | None], slo_ttft_s: float) -> str:
    """The capacity table (one row per policy): swept capacity and the interpolated crossing rate."""
    return _table(["policy", f"capacity qps (P99 TTFT <= {slo_ttft_s:g} s)", "P99 crosses SLO at (qps)"],
                  [[c.policy, str(c), _f(crossings.get(c.policy), 1)] for c in caps])


def is_astrolabe(label: str) -> bool:
    return label.startswith("astrolabe")


def _paired(grouped: Mapping[tuple[str, float], list[SeedPoint]], target: str, reference: str, rate: float,
            statistic: Any) -> stats.Interval:
    """``statistic`` (``stats.p99`` or ``stats.mean``) of ``target``'s TTFTs over ``reference``'s at ``rate``, with
    its 95% paired block-bootstrap interval over the same requests (blocks within seeds)."""
    a, groups = _pooled(grouped[(target, rate)], "ttfts_s")
    b, _ = _pooled(grouped[(reference, rate)], "ttfts_s")
    return paired_ratio_ci(a, b, statistic, groups=groups, num_resamples=500)


def _ratio_text(ci: stats.Interval) -> str:
    return f"{ci.value:.2f} [{ci.low:.2f}, {ci.high:.2f}]"


def format_ratios(points: Sequence[SeedPoint], pooled: Sequence[PooledPoint], target: str,
                  slo_ttft_s: float) -> str:
    """Per rate: ``target``'s P99 and mean TTFT over the best baseline's (lowest pooled P99 TTFT among
    non-astrolabe policies), with 95% paired block-bootstrap intervals (same requests, blocks within seeds) and a
    verdict; empty when ``target`` or every baseline is missing."""
    grouped = _by_point(points)
    rows = []
    for rate in sorted({p.rate_qps for p in pooled}):
        here = [p for p in pooled if p.rate_qps == rate]
        baselines = [p for p in here if not is_astrolabe(p.policy)]
        if (target, rate) not in grouped or not baselines:
            continue
        best = min(baselines, key=lambda p: (p.ttft_p99_s, p.ttft_mean_s))
        p99 = _paired(grouped, target, best.policy, rate, stats.p99)
        mean = _paired(grouped, target, best.policy, rate, stats.mean)
        rows.append([f"{rate:g}", best.policy, _ratio_text(p99), verdict(p99), _ratio_text(mean), verdict(mean)])
    if not rows:
        return ""
    return (f"{target} / best baseline (lowest pooled P99 TTFT at that rate), 95% paired intervals:\n"
            + _table(["rate qps", "best baseline", "P99 TTFT ratio", "verdict", "mean TTFT ratio", "verdict"], rows))


def format_pair_ratios(points: Sequence[SeedPoint], target: str, reference: str) -> str:
    """Per rate: ``target``'s P99 and mean TTFT over ``reference``'s, with 95% paired block-bootstrap intervals and
    a verdict; empty when either is missing."""
    grouped = _by_point(points)
    rows = []
    for rate in sorted({rate for policy, rate in grouped if policy == target}):
        if (reference, rate) not in grouped:
            continue
        p99 = _paired(grouped, target, reference, rate, stats.p99)
        mean = _paired(grouped, target, reference, rate, stats.mean)
        rows.append([f"{rate:g}", _ratio_text(p99), verdict(p99), _ratio_text(mean), verdict(mean)])
    if not rows:
        return ""
    return (f"{target} / {reference}, 95% paired intervals:\n"
            + _table(["rate qps", "P99 TTFT ratio", "verdict", "mean TTFT ratio", "verdict"], rows))


def write_csv(path: Path, results: Sequence[PooledPoint], extra: Mapping[str, Any]) -> Path:
    """Writes one row per point: the ``PooledPoint`` fields, then ``extra`` (run settings) as constant columns.

    Raises:
        OSError: the file cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [f.name for f in dataclasses.fields(PooledPoint)]
    with path.open("w", newline="") as fp:
        writer = csv.writer(fp)
        writer.writerow([*names, *extra])
        for result in results:
            writer.writerow([*(getattr(result, n) for n in names), *extra.values()])
    return path


def write_plot(path: Path, results: Sequence[PooledPoint], slo_ttft_s: float, title: str) -> Path:
    """P99 TTFT (log scale) against rate, one line per policy, the SLO as a dashed line; PNG via Agg.

    Raises:
        OSError: the file cannot be written.
    """
    import matplotlib  # noqa: PLC0415 (plotting is optional at import time)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 5))
    for policy, points in _by_policy(results).items():
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


def knee_rates(results: Sequence[PooledPoint], reference: str, slo_ttft_s: float, max_rates: int = 3) -> list[float]:
    """The swept rates where migration is judged: from ``reference``'s capacity (its highest rate meeting the SLO)
    upwards, at most ``max_rates`` of them; the lowest rates when it meets the SLO nowhere, the highest when it
    meets it everywhere. Empty when ``reference`` is missing."""
    points = _by_policy(results).get(reference, [])
    rates = [p.rate_qps for p in points]
    if not rates:
        return []
    (cap,) = capacities(points, slo_ttft_s)
    if cap.capacity_qps is None:
        return rates[:max_rates]
    if cap.at_max_rate:
        return rates[-max_rates:]
    start = rates.index(cap.capacity_qps)
    return rates[start:start + max_rates]


@dataclasses.dataclass(frozen=True, slots=True)
class SweepVerdict:
    """Whether migration paid at one bandwidth, against the policy without it.

    Attributes:
        label: the migrating policy's label; bandwidth_gbytes_per_s: its bandwidth, GB/s.
        p99_ratios: per knee rate, (rate qps, P99 TTFT ratio to the reference with its paired 95% interval).
        crossing_qps / reference_crossing_qps: interpolated rates where P99 TTFT crosses the SLO (None: not swept).
        capacity_not_worse: its swept capacity is at least the reference's and, where both cross the SLO within
            the sweep, so is its crossing rate.
        pays: capacity not worse, and the P99 ratio's interval lies below 1 at some knee rate and above 1 at none.
    """

    label: str
    bandwidth_gbytes_per_s: float
    p99_ratios: tuple[tuple[float, stats.Interval], ...]
    crossing_qps: float | None
    reference_crossing_qps: float | None
    capacity_not_worse: bool
    pays: bool


def sweep_verdicts(points: Sequence[SeedPoint], pooled: Sequence[PooledPoint],
                   bandwidths: Mapping[str, float], reference: str, slo_ttft_s: float) -> list[SweepVerdict]:
    """One `SweepVerdict` per migrating label (``bandwidths``: label -> GB/s), ascending bandwidth, judged at
    `knee_rates` of ``reference`` with paired block-bootstrap intervals over the same requests."""
    grouped = _by_point(points)
    rates = knee_rates(pooled, reference, slo_ttft_s)
    crossings = crossing_rates(pooled, slo_ttft_s)
    caps = {c.policy: -math.inf if c.capacity_qps is None else c.capacity_qps for c in capacities(pooled, slo_ttft_s)}
    out = []
    for label, bandwidth in sorted(bandwidths.items(), key=lambda kv: kv[1]):
        ratios = []
        for rate in rates:
            if (label, rate) not in grouped or (reference, rate) not in grouped:
                continue
            ratios.append((rate, _paired(grouped, label, reference, rate, stats.p99)))
        verdicts = [verdict(r) for _, r in ratios]
        crossing, reference_crossing = crossings.get(label), crossings.get(reference)
        capacity_ok = caps.get(label, -math.inf) >= caps.get(reference, -math.inf) and (
            crossing is None or reference_crossing is None or crossing >= reference_crossing)
        out.append(SweepVerdict(label, bandwidth, tuple(ratios), crossing, reference_crossing, capacity_ok,
                                capacity_ok and "better" in verdicts and "worse" not in verdicts))
    return out


def format_migration_sweep(pooled: Sequence[PooledPoint], verdicts: Sequence[SweepVerdict], reference: str,
                           others: Sequence[str], slo_ttft_s: float) -> str:
    """The bandwidth sweep: per policy (``reference``, ``others``, then each bandwidth) capacity, crossing rate,
    P99 TTFT, mean TPOT and migrations per request at the knee rates; then each bandwidth's P99 ratio to
    ``reference`` and the bandwidth below which migration stops paying. Empty without verdicts."""
    if not verdicts:
        return ""
    rates = [rate for rate, _ in verdicts[0].p99_ratios] or knee_rates(pooled, reference, slo_ttft_s)
    by_point = {(p.policy, p.rate_qps): p for p in pooled}
    caps = {c.policy: c for c in capacities(pooled, slo_ttft_s)}
    crossings = crossing_rates(pooled, slo_ttft_s)
    labels = [(reference, "none"), *((o, "none") for o in others), *((v.label, f"{v.bandwidth_gbytes_per_s:g}")
                                                                     for v in verdicts)]
    header = ["policy", "GB/s", "capacity", "crosses at"]
    header += [f"P99 @{r:g}" for r in rates] + [f"TPOT @{r:g}" for r in rates] + [f"migr/req @{r:g}" for r in rates]
    rows = []
    for label, bandwidth in labels:
        if label not in caps:
            continue
        here = [by_point.get((label, r)) for r in rates]
        rows.append([label, bandwidth, str(caps[label]), _f(crossings.get(label), 1),
                     *(_f(p.ttft_p99_s) if p else "-" for p in here),
                     *(_f(p.tpot_mean_s, 4) if p else "-" for p in here),
                     *(_f(p.migrations_per_request, 4) if p else "-" for p in here)])
    ratio_rows = [[v.label, f"{v.bandwidth_gbytes_per_s:g}",
                   *(f"{_ratio_text(r)} {verdict(r)}" for _, r in v.p99_ratios),
                   "no worse" if v.capacity_not_worse else "worse", "yes" if v.pays else "no"] for v in verdicts]
    ratio_table = _table(["policy", "GB/s", *(f"P99 ratio @{r:g}" for r, _ in verdicts[0].p99_ratios), "capacity",
                          "pays"], ratio_rows)
    return (f"migration bandwidth sweep (knee rates: {reference}'s capacity and above):\n" + _table(header, rows)
            + f"\n\nllumnix-migrate / {reference} P99 TTFT, 95% paired intervals ('pays': capacity and crossing rate"
            " no lower, P99 better at some knee rate and worse at none):\n" + ratio_table + "\n"
            + stops_paying(verdicts))


def stops_paying(verdicts: Sequence[SweepVerdict]) -> str:
    """One sentence: the bandwidth below which migration stops paying, or that it always / never pays at the swept
    values (or where it pays when that is not monotone in bandwidth)."""
    paying = [v.pays for v in verdicts]
    shown = [f"{v.bandwidth_gbytes_per_s:g}" for v in verdicts]
    if all(paying):
        return f"migration pays at every swept bandwidth ({', '.join(shown)} GB/s)."
    if not any(paying):
        return f"migration never pays at the swept bandwidths ({', '.join(shown)} GB/s)."
    first = paying.index(True)
    if all(paying[first:]):
        return (f"migration stops paying below {shown[first]} GB/s: no better than without it at "
                f"{', '.join(shown[:first])} GB/s, better at {', '.join(shown[first:])} GB/s.")
    return ("migration pays at " + ", ".join(s for s, p in zip(shown, paying) if p) + " GB/s and not at "
            + ", ".join(s for s, p in zip(shown, paying) if not p) + " GB/s (not monotone in bandwidth).")
