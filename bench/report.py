"""The demo's tables: per-policy latencies with intervals, astrolabe against every baseline, costs, predictions.

Owns reducing the replays of one policy (:class:`PolicyRun`: its results per seed, its decision-log summary,
its CPU cost) to table rows and formatting them as fixed-width text. Pure functions; no I/O, no printing.

NOTE: latency figures are computed over successful requests (an error has no latency; errors are counted
beside them); the intervals and ratios come from ``bench.stats`` (moving-block bootstrap over the trace,
paired between policies, blocks within seeds), where a failed request counts as infinitely slow. Percentiles
are ``numpy.percentile`` with its default linear interpolation (Hyndman & Fan type 7).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from bench import stats
from bench.decisions import DecisionSummary
from bench.loadgen import RequestResult
from bench.sidecar_checks import SidecarChecks

logger = logging.getLogger(__name__)

TARGET = "astrolabe"


@dataclasses.dataclass(frozen=True, slots=True)
class PolicySummary:
    """One row of the latency table. Latencies are seconds (NaN when no request succeeded).

    Attributes:
        policy: policy name.
        num_requests: requests replayed.
        num_errors: requests that failed (see ``RequestResult.error``).
        ttft_mean_s, ttft_p50_s, ttft_p99_s: time to first token over successful requests.
        ttft_p99_low_s, ttft_p99_high_s: 95% block-bootstrap interval of ``ttft_p99_s`` (NaN if not computed).
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
    ttft_p99_low_s: float = math.nan
    ttft_p99_high_s: float = math.nan


@dataclasses.dataclass(frozen=True, slots=True)
class ControlPlaneCost:
    """What routing cost during one policy's replays.

    Attributes:
        policy: policy name.
        num_requests: requests replayed.
        num_predictions: predictor calls the extprocs made (any outcome).
        num_fallbacks: requests routed by the least-requests fallback (no usable prediction).
        extproc_cpu_s: CPU time of the extproc processes over their whole lives, seconds.
        sidecar_cpu_s: CPU time of all predictor sidecars during the replays, seconds.
        envoy_cpu_s: CPU time of the Envoy processes over their whole lives, seconds.
    """

    policy: str
    num_requests: int
    num_predictions: float
    num_fallbacks: float
    extproc_cpu_s: float
    sidecar_cpu_s: float
    envoy_cpu_s: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class PolicyRun:
    """Everything one policy's replays produced.

    Attributes:
        policy: policy name.
        results_by_seed: seed -> one result per trace request, trace order (every policy replays the same
            traces, so results of two policies pair up by position).
        decisions: the decision-log summary (None for a policy without extproc).
        cost: control-plane cost.
        sidecar_checks: what the sidecars checked themselves during this policy's replays (None: no sidecars).
        prefix_cache_tokens: (queried, hit) prompt tokens of the instances' prefix caches during the replays
            (``vllm:prefix_cache_queries_total`` / ``_hits_total``), or None if not counted.
    """

    policy: str
    results_by_seed: dict[int, list[RequestResult]]
    decisions: DecisionSummary | None
    cost: ControlPlaneCost
    sidecar_checks: SidecarChecks | None = None
    prefix_cache_tokens: tuple[float, float] | None = None

    @property
    def results(self) -> list[RequestResult]:
        return [r for seed in sorted(self.results_by_seed) for r in self.results_by_seed[seed]]

    def figures(self, attr: str) -> tuple[np.ndarray, np.ndarray]:
        """(per-request ``ttft_s``/``e2e_s`` with NaN for failures, seed of each), seed then trace order."""
        values, groups = [], []
        for seed in sorted(self.results_by_seed):
            for r in self.results_by_seed[seed]:
                value = getattr(r, attr)
                values.append(value if r.ok and value is not None else math.nan)
                groups.append(seed)
        return np.asarray(values, dtype=float), np.asarray(groups)


def _stats(values_s: list[float], percentiles: Sequence[float]) -> tuple[float, ...]:
    if not values_s:
        return (math.nan,) * (1 + len(percentiles))
    arr = np.asarray(values_s, dtype=float)
    return (float(arr.mean()), *(float(v) for v in np.percentile(arr, percentiles)))


def summarize(policy: str, results: Sequence[RequestResult], groups: Sequence[int] | None = None,
              with_interval: bool = False) -> PolicySummary:
    """Reduce one policy's results to a table row.

    Args:
        policy: policy name.
        results: one per trace request (seed then trace order when several seeds).
        groups: the seed of each result (for the interval's blocks); None = one trace.
        with_interval: compute the 95% block-bootstrap interval of the P99 TTFT (over successful requests).

    Returns:
        The summary; latency fields are NaN if no request succeeded.
    """
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    ttft_mean_s, ttft_p50_s, ttft_p99_s = _stats(ttfts, (50, 99))
    e2e_mean_s, e2e_p99_s = _stats([r.e2e_s for r in ok if r.e2e_s is not None], (99,))
    per_instance = Counter(r.instance for r in results if r.instance)
    low = high = math.nan
    if with_interval and ttfts:
        kept = [i for i, r in enumerate(results) if r.ok and r.ttft_s is not None]
        kept_groups = None if groups is None else [groups[i] for i in kept]
        interval = stats.summary_ci(ttfts, stats.p99, groups=kept_groups)
        low, high = interval.low, interval.high
    num_errors = sum(r.error is not None for r in results)  # a refusal (admission's 429) is not an error
    return PolicySummary(policy, len(results), num_errors, ttft_mean_s, ttft_p50_s, ttft_p99_s,
                         e2e_mean_s, e2e_p99_s, dict(per_instance), low, high)


def _fmt_s(value_s: float) -> str:
    return "-" if value_s is None or math.isnan(value_s) else f"{value_s:.3f}"


def _fmt_ms(value_s: float) -> str:
    return "-" if value_s is None or math.isnan(value_s) else f"{1000 * value_s:.1f}"


def _fmt_pct(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{100 * value:.1f}%"


def _render(header: list[str], rows: list[list[str]]) -> list[str]:
    """Fixed-width lines: header, rule, rows; first column left-aligned, the others right-aligned."""
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def format_table(summaries: Sequence[PolicySummary], instances: Sequence[str],
                 decisions: Sequence[DecisionSummary | None] | None = None,
                 hit_rates: Sequence[float | None] | None = None) -> str:
    """A fixed-width table, one row per summary, plus a legend of the instance columns.

    Columns: policy, requests, errors, TTFT mean/p50/p99 (s) and the P99's 95% interval when computed, E2E
    mean/p99 (s), the instances' prefix-cache hit rate (hit / queried prompt tokens, when ``hit_rates`` is given;
    None = not counted), routing overhead p50/p99 (ms, from the decision logs, when given), then one column per
    instance (``i0``, ``i1``, ... in the order of ``instances``) with the requests it answered; answers from an
    instance not in ``instances`` are added up in a final ``other`` column, shown only when non-zero somewhere.

    Returns:
        The table as lines joined with ``\\n`` (no trailing newline).
    """
    known = set(instances)
    others = [sum(n for inst, n in s.requests_per_instance.items() if inst not in known) for s in summaries]
    with_ci = any(not math.isnan(s.ttft_p99_low_s) for s in summaries)
    header = ["policy", "requests", "errors", "TTFT mean", "TTFT p50", "TTFT p99"]
    header += ["p99 95% interval"] if with_ci else []
    header += ["E2E mean", "E2E p99"]
    header += ["cache hit"] if hit_rates is not None else []
    header += ["route p50 ms", "route p99 ms"] if decisions is not None else []
    header += [f"i{i}" for i in range(len(instances))]
    if any(others):
        header.append("other")
    rows = []
    for n, (summary, other) in enumerate(zip(summaries, others)):
        row = [summary.policy, str(summary.num_requests), str(summary.num_errors),
               *(_fmt_s(v) for v in (summary.ttft_mean_s, summary.ttft_p50_s, summary.ttft_p99_s))]
        if with_ci:
            row.append(f"[{_fmt_s(summary.ttft_p99_low_s)}, {_fmt_s(summary.ttft_p99_high_s)}]")
        row += [_fmt_s(summary.e2e_mean_s), _fmt_s(summary.e2e_p99_s)]
        if hit_rates is not None:
            row.append(_fmt_pct(math.nan if hit_rates[n] is None else hit_rates[n]))
        if decisions is not None:
            d = decisions[n]
            row += [_fmt_ms(d.routing_p50_s), _fmt_ms(d.routing_p99_s)] if d is not None else ["-", "-"]
        row += [str(summary.requests_per_instance.get(inst, 0)) for inst in instances]
        if any(others):
            row.append(str(other))
        rows.append(row)
    out = _render(header, rows)
    out.append("latencies in seconds over successful requests (measured by the client, through Envoy); route = "
               "the extproc's time from the request's headers to its decision; "
               + ("cache hit = prompt tokens found in the instances' prefix caches / prompt tokens looked up "
                  "(vllm:prefix_cache_hits_total / _queries_total over the policy's replays); " if hit_rates is not None
                  else "")
               + "i<k> = requests answered by instance k:")
    out += [f"  i{i} = {inst}" for i, inst in enumerate(instances)]
    return "\n".join(out)


_COMPARED = (("TTFT p99", "ttft_s", stats.p99), ("TTFT mean", "ttft_s", stats.mean),
             ("TTFT p50", "ttft_s", stats.p50), ("E2E mean", "e2e_s", stats.mean), ("E2E p99", "e2e_s", stats.p99))


@dataclasses.dataclass(frozen=True, slots=True)
class Comparison:
    """``target``'s figure over one baseline's, on the same requests, with its paired interval and verdict."""

    figure: str
    baseline: str
    ratio: stats.Interval
    verdict: str


def compare(runs: Sequence[PolicyRun], target: str = TARGET) -> list[Comparison]:
    """Every figure of ``_COMPARED`` of ``target`` against every other policy (paired block bootstrap).

    Raises:
        ValueError: the runs did not replay the same traces (different seeds or lengths).
    """
    ours = next((r for r in runs if r.policy == target), None)
    if ours is None:
        return []
    out = []
    for figure, attr, statistic in _COMPARED:
        a, groups = ours.figures(attr)
        for run in runs:
            if run.policy == target:
                continue
            b, other_groups = run.figures(attr)
            if a.shape != b.shape or not np.array_equal(groups, other_groups):
                raise ValueError(f"{target} and {run.policy} did not replay the same traces")
            ratio = stats.paired_ratio_ci(a, b, statistic, groups=groups)
            out.append(Comparison(figure, run.policy, ratio, stats.verdict(ratio)))
    return out


def format_comparison(comparisons: Sequence[Comparison], target: str = TARGET) -> str:
    """One row per (figure, baseline): ratio, its 95% interval and the verdict; then a one-line verdict on P99
    TTFT against every baseline. An explanatory line when there is nothing to compare."""
    if not comparisons:
        return f"(no comparison: the run needs {target!r} and at least one baseline)"
    rows = [[c.figure, c.baseline, f"{c.ratio.value:.3f}", f"[{c.ratio.low:.3f}, {c.ratio.high:.3f}]", c.verdict]
            for c in comparisons]
    lines = _render(["figure", "baseline", f"{target} / baseline", "95% interval", "verdict"], rows)
    lines.append(f"ratio < 1: {target} is lower (better); \"better\"/\"worse\" only where the whole interval of the "
                 "ratio is below/above 1 (paired moving-block bootstrap over the same requests)")
    p99 = [c for c in comparisons if c.figure == "TTFT p99"]
    mean = {c.baseline: c for c in comparisons if c.figure == "TTFT mean"}
    beats = [c.baseline for c in p99 if c.verdict == "better"]
    worse_mean = [c.baseline for c in p99 if c.baseline in mean and mean[c.baseline].verdict == "worse"]
    if len(beats) == len(p99):
        lines.append(f"verdict: {target}'s P99 TTFT is lower than every baseline's"
                     + (f", but its mean TTFT is worse than {', '.join(worse_mean)}'s" if worse_mean
                        else ", and its mean TTFT is no worse"))
    else:
        lines.append(f"verdict: {target}'s P99 TTFT is NOT lower than that of "
                     + ", ".join(f"{c.baseline} ({c.verdict})" for c in p99 if c.verdict != "better")
                     + (f"; its mean TTFT is worse than {', '.join(worse_mean)}'s" if worse_mean
                        else "; its mean TTFT is no worse than any baseline's"))
    return "\n".join(lines)


def format_costs(runs: Sequence[PolicyRun]) -> str:
    """Control-plane cost per request and what the decisions were based on."""
    rows = []
    for run in runs:
        c = run.cost
        n = max(c.num_requests, 1)
        predicting = run.decisions is not None and run.decisions.basis_share.get("policy", 0.0) < 1.0
        share = run.decisions.basis_share if predicting else {}
        rows.append([c.policy, f"{c.num_predictions / n:.2f}", _fmt_pct(share.get("prediction", math.nan)),
                     _fmt_pct(share.get("partial", math.nan)), _fmt_pct(share.get("fallback", math.nan)),
                     f"{1000 * c.extproc_cpu_s / n:.2f}", f"{1000 * c.envoy_cpu_s / n:.2f}",
                     f"{1000 * c.sidecar_cpu_s / n:.2f}"])
    lines = _render(["policy", "predictions/req", "on predictions", "partial", "fallback", "extproc CPU ms/req",
                     "Envoy CPU ms/req", "sidecars CPU ms/req"], rows)
    lines.append("decisions: on predictions = every probed sidecar answered in time; partial = some did (fewest "
                 "in-flight among the probed); fallback = none did (least-requests). CPU: user+system time of the "
                 "extproc, Envoy and sidecar processes during the replays (start-up not included), per request")
    return "\n".join(lines)


def format_prediction_quality(runs: Sequence[PolicyRun]) -> str:
    """Prediction quality of the policies that predict, from their decision logs joined with the results."""
    rows = []
    for run in runs:
        d = run.decisions
        if d is None or d.num_scored == 0:
            continue
        rows.append([run.policy, str(d.num_scored), _fmt_pct(d.ttft_mape), _fmt_ms(d.ttft_median_abs_error_s),
                     _fmt_pct(d.e2e_mape), _fmt_s(d.e2e_median_abs_error_s),
                     f"{_fmt_pct(d.ttft_hindsight_agreement)} of {d.num_pairs}"])
    if not rows:
        return "(no predictions to score)"
    lines = _render(["policy", "scored", "TTFT MAPE", "TTFT median |err| ms", "E2E MAPE", "E2E median |err| s",
                     "hindsight agreement (pairs)"], rows)
    for run in runs:
        c = run.sidecar_checks
        if c is not None and (c.e2e_count or c.ttft_count):
            lines.append(f"{run.policy}, checked by the sidecars themselves (admission to first token / to "
                         f"release): TTFT MAPE {_fmt_pct(c.ttft_mape)} over {c.ttft_count}, E2E MAPE "
                         f"{_fmt_pct(c.e2e_mape)} over {c.e2e_count}; step-time model calibrated online on "
                         f"{c.num_calibrated} of {c.num_sidecars} sidecars (error on measured steps "
                         f"{_fmt_pct(c.residual)})")
    lines.append("scored: decisions with a prediction of the chosen instance joined with a successful result "
                 "(fallback decisions have none); the chosen instance's predicted TTFT/E2E at decision time against "
                 "the client's measurement (which adds Envoy's and the router's few ms: TTFTs of a few tens of ms "
                 "make the MAPE large while the median error stays small); hindsight agreement: of pairs of "
                 "requests sent within 0.5 s to different instances, the share whose predicted TTFTs are ordered as "
                 "the measured ones (0.5 = a coin)")
    return "\n".join(lines)
