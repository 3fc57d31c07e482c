"""Confidence intervals for latency figures and their ratios: a paired moving-block bootstrap over one trace.

Owns `summary_ci` (one policy's figure with its interval), `paired_ratio_ci` (the ratio of two policies' figures
on the same requests, with its interval) and `verdict`. Pure numpy; no I/O.

Why blocks, and why paired. A tail percentile of a queueing system is set by a few bursts: neighbouring
requests share a queue, so their latencies are not independent, and resampling single requests would give
intervals that are far too narrow. Resampling contiguous blocks of requests (in arrival order) keeps each burst
together (Künsch 1989, "The jackknife and the bootstrap for general stationary observations"; Politis & Romano
1994 for the choice of block length). Every policy replays the same trace, so a resample picks the same blocks
for both policies of a ratio: the trace's own luck (a burst, a run of long prompts) cancels in the ratio, and
the interval measures the policies' difference, not the trace's variance. Blocks never span two traces
(``groups``: seeds), so several seeds pool into one interval.

A failed request counts as infinitely slow (it is never better than a slow success); a figure that comes out
infinite is reported as such.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_NUM_RESAMPLES = 2000
DEFAULT_CONFIDENCE = 0.95
DEFAULT_BLOCK_LEN = 50
"""Requests per bootstrap block: at the demo's ~20 req/s, 2.5 s of arrivals, longer than a queueing episode."""

Statistic = Callable[[np.ndarray], float]


def _percentile(values: np.ndarray, q: float) -> float:
    """numpy's linear-interpolation percentile, with inf (failed requests) ranked last and reported as inf when
    it takes part (numpy alone would give nan for inf - inf)."""
    ordered = np.sort(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo, hi = int(math.floor(rank)), int(math.ceil(rank))
    a, b = float(ordered[lo]), float(ordered[hi])
    if math.isinf(b) or math.isinf(a):
        return b if hi == lo or rank > lo else a
    return a + (b - a) * (rank - lo)


def p99(values: np.ndarray) -> float:
    """99th percentile (numpy's linear interpolation, as ``bench.report``); inf when failures reach the top 1%."""
    return _percentile(values, 99)


def p50(values: np.ndarray) -> float:
    return _percentile(values, 50)


def mean(values: np.ndarray) -> float:
    return float(np.mean(values))


STATISTICS: dict[str, Statistic] = {"mean": mean, "p50": p50, "p99": p99}


@dataclass(frozen=True, slots=True)
class Interval:
    """A figure and its bootstrap confidence interval (same unit as the figure)."""

    value: float
    low: float
    high: float


def _blocks(groups: np.ndarray, block_len: int) -> list[np.ndarray]:
    """Index arrays of contiguous blocks of at most ``block_len`` requests, never spanning two groups."""
    blocks = []
    for group in dict.fromkeys(groups.tolist()):
        idx = np.flatnonzero(groups == group)
        blocks.extend(idx[i:i + block_len] for i in range(0, len(idx), block_len))
    return blocks


def _resample_indices(blocks: list[np.ndarray], num_resamples: int, rng: np.random.Generator):
    n = len(blocks)
    for _ in range(num_resamples):
        yield np.concatenate([blocks[j] for j in rng.integers(0, n, size=n)])


def _as_array(values: Sequence[float]) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    return np.where(np.isnan(array), np.inf, array)


def _quantiles(samples: list[float], confidence: float) -> tuple[float, float]:
    values = np.asarray(samples, dtype=float)
    alpha = (1.0 - confidence) / 2
    return _percentile(values, 100 * alpha), _percentile(values, 100 * (1 - alpha))


def _check(n: int, groups: Sequence[int] | None, block_len: int, num_resamples: int, confidence: float) -> np.ndarray:
    if n == 0:
        raise ValueError("need at least one value")
    if isinstance(block_len, bool) or not isinstance(block_len, int) or block_len < 1:
        raise ValueError(f"block_len must be an integer >= 1, got {block_len!r}")
    if isinstance(num_resamples, bool) or not isinstance(num_resamples, int) or num_resamples < 1:
        raise ValueError(f"num_resamples must be an integer >= 1, got {num_resamples!r}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    group_array = np.zeros(n, dtype=int) if groups is None else np.asarray(groups)
    if group_array.shape != (n,):
        raise ValueError(f"groups must give one group per value: {group_array.shape} for {n} values")
    return group_array


def summary_ci(values: Sequence[float], statistic: Statistic, *, groups: Sequence[int] | None = None,
               block_len: int = DEFAULT_BLOCK_LEN, num_resamples: int = DEFAULT_NUM_RESAMPLES,
               confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> Interval:
    """``statistic`` of ``values`` with a moving-block bootstrap interval.

    Args:
        values: per-request figures in trace order (NaN = failed = inf).
        statistic: e.g. `p99`.
        groups: trace (seed) of each request; None = one trace.
        block_len: requests per block (>= 1).
        num_resamples: bootstrap resamples (>= 1).
        confidence: two-sided level in (0, 1).
        seed: seeds the resampling.

    Raises:
        ValueError: no values, or bad parameters.
    """
    array = _as_array(values)
    group_array = _check(len(array), groups, block_len, num_resamples, confidence)
    rng = np.random.default_rng(seed)
    samples = [statistic(array[idx]) for idx in _resample_indices(_blocks(group_array, block_len), num_resamples, rng)]
    low, high = _quantiles(samples, confidence)
    return Interval(statistic(array), low, high)


def paired_ratio_ci(values_a: Sequence[float], values_b: Sequence[float], statistic: Statistic, *,
                    groups: Sequence[int] | None = None, block_len: int = DEFAULT_BLOCK_LEN,
                    num_resamples: int = DEFAULT_NUM_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
                    seed: int = 0) -> Interval:
    """``statistic(a) / statistic(b)`` over the same requests, with a paired moving-block bootstrap interval.

    Args:
        values_a: per-request figures of policy A, trace order (NaN = failed).
        values_b: policy B's figures for the same requests, same order and length.
        statistic, groups, block_len, num_resamples, confidence, seed: as `summary_ci`.

    Returns:
        The ratio and its interval (< 1: A is lower). A zero denominator gives inf (or nan for 0/0).

    Raises:
        ValueError: lengths differ, or as `summary_ci`.
    """
    a, b = _as_array(values_a), _as_array(values_b)
    if a.shape != b.shape:
        raise ValueError(f"paired figures need the same requests: {a.shape} vs {b.shape}")
    group_array = _check(len(a), groups, block_len, num_resamples, confidence)
    rng = np.random.default_rng(seed)
    samples = []
    for idx in _resample_indices(_blocks(group_array, block_len), num_resamples, rng):
        samples.append(_ratio(statistic(a[idx]), statistic(b[idx])))
    finite = [s for s in samples if not math.isnan(s)]
    low, high = _quantiles(finite, confidence) if finite else (math.nan, math.nan)
    return Interval(_ratio(statistic(a), statistic(b)), low, high)


def _ratio(numerator: float, denominator: float) -> float:
    if denominator == 0:
        return math.nan if numerator == 0 else math.inf
    if math.isinf(numerator) and math.isinf(denominator):
        return math.nan
    return numerator / denominator


def verdict(ratio: Interval) -> str:
    """"better" when the whole interval of A/B is below 1, "worse" when above, else "no difference"."""
    if ratio.high < 1:
        return "better"
    if ratio.low > 1:
        return "worse"
    return "no difference"
