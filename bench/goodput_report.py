"""Goodput under latency objectives, from per-request arrays: what ``astrolabe bench goodput`` (simulated) and
``astrolabe demo --objectives`` (through Envoy) both print.

Owns the router label syntax both take (`parse_label`: ``LABEL[+RULE[=S][@W]][/priority]``), the per-request class
draw (`draw_classes`), reducing one (router, multiple)'s requests to a table row (`pooled_row`: goodput with its
block-bootstrap interval, attainment, P99 TTFT and refusals per class), the ratio tables (`format_ratios`: paired
intervals to a reference router and to the router's own goodput at 1x) and the CSV (`write_csv`). Pure functions
over numpy arrays (a request's TTFT is NaN when it was refused or failed: it meets nothing); no I/O but the CSV;
imports only ``bench.stats``.

Goodput = the share of arrivals that met their TTFT objective x the offered rate (requests per second of arrivals),
so a refused request and a failed one count as missed.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from bench import stats

CRITICAL, SHEDDABLE = "critical", "sheddable"
"""The two request classes: critical (priority 0, the tight TTFT objective) and sheddable (priority -1)."""
CLASSES = (CRITICAL, SHEDDABLE)
CRITICAL_FRAC = 0.4
"""Default share of critical requests."""
CLASS_SEED_OFFSET = 7
"""The class draw of trace seed S uses ``random.Random(S + CLASS_SEED_OFFSET)`` (`class_rng`): its own stream, not
the trace's."""
ENGINE_PRIORITY_SUFFIX = "priority"
"""What may follow ``/`` in a label: the router's engines run vLLM's ``--scheduling-policy priority``."""


@dataclasses.dataclass(frozen=True, slots=True)
class RouterLabel:
    """A parsed ``LABEL[+RULE[=S][@W]][/priority]``.

    Attributes:
        label: the whole label, as given.
        base: the router (a policy label of the benchmark that takes it).
        rule: the ``extproc.admission`` rule after ``+`` (``slo`` or ``headroom``), None without ``+``.
        bound_s: the headroom rule's bound after ``=``, seconds; None = the default.
        window_s: the critical-pressure window after ``@``, seconds; None = the default.
        engine_priority: ``/priority``: the engines schedule by each request's priority.
    """

    label: str
    base: str
    rule: str | None = None
    bound_s: float | None = None
    window_s: float | None = None
    engine_priority: bool = False


def parse_label(label: str, rules: Sequence[str] = ("none", "slo", "headroom")) -> RouterLabel:
    """``LABEL[+RULE[=S][@W]][/priority]`` -> its parts. ``rules``: the admission rules ``RULE`` may name.

    Raises:
        ValueError: an empty router, an unknown rule or engine policy, a bound on a rule other than headroom, a
            bound or window that is not a number.
    """
    head, slash, engine_policy = label.partition("/")
    if slash and engine_policy != ENGINE_PRIORITY_SUFFIX:
        raise ValueError(f"{label!r}: the engine policy after '/' must be {ENGINE_PRIORITY_SUFFIX!r}, "
                         f"got {engine_policy!r}")
    base, plus, rule = head.partition("+")
    if not base:
        raise ValueError(f"{label!r}: no router before '+' or '/'")
    if not plus:
        return RouterLabel(label, base, engine_priority=bool(slash))
    rule, at, window = rule.partition("@")
    rule, eq, bound = rule.partition("=")
    if rule not in rules:
        raise ValueError(f"{label!r}: admission rule must be one of {tuple(rules)}, got {rule!r}")
    if eq and rule != "headroom":
        raise ValueError(f"{label!r}: only the headroom rule takes a bound")
    try:
        bound_s = float(bound) if eq else None
        window_s = float(window) if at else None
    except ValueError:
        raise ValueError(f"{label!r}: the bound after '=' and the window after '@' must be numbers") from None
    return RouterLabel(label, base, rule, bound_s, window_s, bool(slash))


def class_rng(seed: int) -> random.Random:
    """The class draw's generator for trace seed ``seed``."""
    return random.Random(seed + CLASS_SEED_OFFSET)


def draw_classes(num_requests: int, rng: random.Random, critical_frac: float = CRITICAL_FRAC) -> list[str]:
    """One class per request, in order: `CRITICAL` with probability ``critical_frac``, else `SHEDDABLE`."""
    return [CRITICAL if rng.random() < critical_frac else SHEDDABLE for _ in range(num_requests)]


def met_objectives(ttfts_s: np.ndarray, ttft_objectives_s: np.ndarray) -> np.ndarray:
    """Per request: 1.0 when it was served within its TTFT objective (inf = none), else 0.0 (NaN TTFT: refused or
    failed, met nothing)."""
    ttfts = np.asarray(ttfts_s, dtype=float)
    return np.where(np.isnan(ttfts), 0.0, (ttfts <= np.asarray(ttft_objectives_s, dtype=float)).astype(float))


@dataclasses.dataclass(frozen=True, slots=True)
class GoodputRow:
    """One (router, multiple) pooled over seeds. Rates in requests per second; latencies in seconds.

    ``num_shed_unprobed_met`` (refused requests with an unprobed instance predicted to meet their objective) is
    known only to the simulation, ``num_errors`` (failures other than a refusal) only to a real replay: None where
    unknown (the column is then left out)."""

    policy: str
    multiple: float
    rate_qps: float
    goodput: stats.Interval
    attainment: dict[str, float]
    ttft_p99_s: dict[str, stats.Interval]
    shed_frac: dict[str, float]
    num_shed: int
    num_critical_shed: int
    num_shed_unprobed_met: int | None = None
    num_errors: int | None = None


_NAN_INTERVAL = stats.Interval(math.nan, math.nan, math.nan)


def pooled_row(policy: str, multiple: float, rate_qps: float, ttfts_s: np.ndarray, ttft_objectives_s: np.ndarray,
               critical: np.ndarray, groups: np.ndarray, refused: np.ndarray, *,
               num_shed_unprobed_met: int | None = None, num_errors: int | None = None) -> GoodputRow:
    """One row from per-request arrays (seed then trace order; every array one entry per request).

    Args:
        policy: the router's label.
        multiple: the rate as a multiple of the capacity.
        rate_qps: the offered rate, requests per second (goodput = attainment x this).
        ttfts_s: TTFT of each request, seconds; NaN when refused or failed.
        ttft_objectives_s: each request's TTFT objective, seconds (inf = none).
        critical: True for a critical request.
        groups: the trace (seed) of each request: bootstrap blocks never span two.
        refused: True for a request the router refused (a failure is neither served nor refused).
        num_shed_unprobed_met, num_errors: see `GoodputRow`.
    """
    ttfts = np.asarray(ttfts_s, dtype=float)
    critical = np.asarray(critical, dtype=bool)
    groups = np.asarray(groups)
    refused = np.asarray(refused, dtype=bool)
    met = met_objectives(ttfts, ttft_objectives_s)
    attainment_ci = stats.summary_ci(met, stats.mean, groups=groups)
    goodput = stats.Interval(*(v * rate_qps for v in (attainment_ci.value, attainment_ci.low, attainment_ci.high)))
    attainment, ttft_p99_s, shed_frac = {}, {}, {}
    served = ~np.isnan(ttfts)
    for name, mask in ((CRITICAL, critical), (SHEDDABLE, ~critical)):
        attainment[name] = float(met[mask].mean()) if mask.any() else math.nan
        kept = mask & served
        ttft_p99_s[name] = (stats.summary_ci(ttfts[kept], stats.p99, groups=groups[kept]) if kept.any()
                            else _NAN_INTERVAL)
        shed_frac[name] = float(refused[mask].mean()) if mask.any() else math.nan
    return GoodputRow(policy, multiple, rate_qps, goodput, attainment, ttft_p99_s, shed_frac, int(refused.sum()),
                      int((refused & critical).sum()), num_shed_unprobed_met, num_errors)


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def format_interval(interval: stats.Interval, digits: int = 2) -> str:
    """``value [low, high]``, ``-`` for NaN."""
    return f"{_f(interval.value, digits)} [{_f(interval.low, digits)}, {_f(interval.high, digits)}]"


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1%}"


def format_rows(rows: Sequence[GoodputRow]) -> str:
    """The per-(router, multiple) table; the shed columns give the share refused and, in parentheses, how many."""
    with_unprobed = any(r.num_shed_unprobed_met is not None for r in rows)
    with_errors = any(r.num_errors is not None for r in rows)
    header = ["router", "x cap", "req/s", "goodput req/s [95% CI]", "critical met", "sheddable met",
              "critical P99 TTFT s", "sheddable P99 TTFT s", "shed critical", "shed sheddable",
              *(["shed, unprobed met"] if with_unprobed else []), *(["errors"] if with_errors else [])]
    lines = [header]
    for r in rows:
        lines.append([r.policy, f"{r.multiple:g}", f"{r.rate_qps:.0f}" if r.rate_qps >= 100 else f"{r.rate_qps:.1f}",
                      format_interval(r.goodput, 1), _pct(r.attainment[CRITICAL]), _pct(r.attainment[SHEDDABLE]),
                      format_interval(r.ttft_p99_s[CRITICAL]), format_interval(r.ttft_p99_s[SHEDDABLE]),
                      f"{_pct(r.shed_frac[CRITICAL])} ({r.num_critical_shed})",
                      f"{_pct(r.shed_frac[SHEDDABLE])} ({r.num_shed - r.num_critical_shed})",
                      *([f"{r.num_shed_unprobed_met}/{r.num_shed}" if r.num_shed and r.num_shed_unprobed_met is not None
                         else "-"] if with_unprobed else []),
                      *([str(r.num_errors) if r.num_errors is not None else "-"] if with_errors else [])])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def higher_verdict(ratio: stats.Interval) -> str:
    """For a figure where higher is better (goodput): "higher" when the whole interval of A/B is above 1, "lower"
    when below, else "no difference"."""
    if ratio.low > 1:
        return "higher"
    if ratio.high < 1:
        return "lower"
    return "no difference"


MetByPoint = Mapping[tuple[str, float], tuple[np.ndarray, np.ndarray]]
"""(router label, multiple) -> (met per request over the seeds, seed then trace order (`met_objectives`); the
seed of each). Every router's replays of one multiple are the same requests in the same order."""


def format_ratios(met: MetByPoint, labels: Sequence[str], reference: str, multiples: Sequence[float]) -> str:
    """Goodput ratios with paired intervals: to ``reference`` at each multiple (skipped when ``reference`` did not
    run), and to the router's own at 1x (when 1 is among ``multiples``)."""
    lines = []
    if any((reference, m) in met for m in multiples):
        lines.append(f"goodput / {reference}'s, same requests (paired 95% interval):")
        for label in labels:
            if label == reference:
                continue
            cells = []
            for m in multiples:
                if (label, m) in met and (reference, m) in met:
                    ci = stats.paired_ratio_ci(met[(label, m)][0], met[(reference, m)][0], stats.mean,
                                               groups=met[(label, m)][1])
                    cells.append(f"{m:g}x {format_interval(ci)} {higher_verdict(ci)}")
            lines.append(f"  {label}: " + "; ".join(cells))
    if 1.0 in multiples:
        lines.append("goodput / the router's own goodput at 1x capacity (paired over the same trace, scaled):")
        for label in labels:
            base = met.get((label, 1.0))
            if base is None:
                continue
            cells = []
            for m in multiples:
                if m == 1.0 or (label, m) not in met:
                    continue
                # goodput = attainment x m x capacity: the attainment ratio times m
                ci = stats.paired_ratio_ci(met[(label, m)][0], base[0], stats.mean, groups=base[1])
                cells.append(f"{m:g}x {format_interval(stats.Interval(ci.value * m, ci.low * m, ci.high * m))}")
            lines.append(f"  {label}: " + "; ".join(cells))
    return "\n".join(lines)


def write_csv(path: Path, rows: Sequence[GoodputRow], settings: str) -> Path:
    """One line per row (rates in req/s, times in s, shares as fractions); ``settings`` in every line's last
    field. Unknown counts are empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = ("policy,multiple,rate_qps,goodput_qps,goodput_low,goodput_high,critical_attainment,"
              "sheddable_attainment,critical_ttft_p99_s,critical_ttft_p99_low,critical_ttft_p99_high,"
              "sheddable_ttft_p99_s,critical_shed_frac,sheddable_shed_frac,num_shed,num_shed_unprobed_met,"
              "num_critical_shed,num_errors,settings")
    lines = [header]
    for r in rows:
        c = r.ttft_p99_s[CRITICAL]
        lines.append(",".join(map(str, (
            r.policy, r.multiple, round(r.rate_qps, 3), round(r.goodput.value, 3), round(r.goodput.low, 3),
            round(r.goodput.high, 3), round(r.attainment[CRITICAL], 4), round(r.attainment[SHEDDABLE], 4),
            round(c.value, 4), round(c.low, 4), round(c.high, 4), round(r.ttft_p99_s[SHEDDABLE].value, 4),
            round(r.shed_frac[CRITICAL], 4), round(r.shed_frac[SHEDDABLE], 4), r.num_shed,
            "" if r.num_shed_unprobed_met is None else r.num_shed_unprobed_met, r.num_critical_shed,
            "" if r.num_errors is None else r.num_errors, '"' + settings.replace('"', "'") + '"'))))
    path.write_text("\n".join(lines) + "\n")
    return path


GOODPUT_NOTE = ("goodput = requests that met their TTFT objective per second of arrivals (a refused request meets "
                "nothing); P99 TTFT over served requests; [low, high] = 95% block-bootstrap interval")
