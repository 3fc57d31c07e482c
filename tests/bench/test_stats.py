"""bench.stats: block bootstrap intervals, paired ratios, verdicts, failures as infinitely slow."""

import math

import numpy as np
import pytest

from bench import stats


def test_interval_contains_the_figure_and_blocks_stay_within_groups():
    rng = np.random.default_rng(0)
    values = rng.exponential(1.0, size=2000)
    interval = stats.summary_ci(values, stats.p99, groups=[i // 1000 for i in range(2000)], num_resamples=300)
    assert interval.low <= interval.value <= interval.high
    assert interval.value == pytest.approx(np.percentile(values, 99))
    blocks = stats._blocks(np.array([0, 0, 0, 1, 1]), 2)
    assert [b.tolist() for b in blocks] == [[0, 1], [2], [3, 4]]


def test_paired_ratio_detects_a_real_difference_and_not_a_fake_one():
    rng = np.random.default_rng(1)
    base = rng.exponential(1.0, size=3000)
    same = stats.paired_ratio_ci(base, base, stats.p99, num_resamples=300)
    assert same.value == 1.0 and stats.verdict(same) == "no difference"
    faster = stats.paired_ratio_ci(base * 0.8, base, stats.p99, num_resamples=300)
    assert faster.value == pytest.approx(0.8) and stats.verdict(faster) == "better"
    assert stats.verdict(stats.paired_ratio_ci(base, base * 0.8, stats.mean, num_resamples=300)) == "worse"


def test_bursts_widen_the_interval_compared_with_independent_requests():
    rng = np.random.default_rng(2)
    bursty = np.repeat(rng.exponential(1.0, size=60), 50)  # 60 episodes of 50 identical requests
    blocked = stats.summary_ci(bursty, stats.mean, block_len=50, num_resamples=400)
    single = stats.summary_ci(bursty, stats.mean, block_len=1, num_resamples=400)
    assert blocked.high - blocked.low > 3 * (single.high - single.low)


def test_failures_count_as_infinitely_slow():
    values = np.concatenate([np.ones(98), [np.nan, np.nan]])
    assert stats.p99(stats._as_array(values)) == math.inf
    assert stats.p50(stats._as_array(values)) == 1.0
    ratio = stats.paired_ratio_ci(np.ones(100), values, stats.p99, num_resamples=50)
    assert ratio.value == 0.0 and not math.isnan(ratio.high)


def test_mismatched_pairs_and_bad_parameters_are_errors():
    with pytest.raises(ValueError):
        stats.paired_ratio_ci([1.0, 2.0], [1.0], stats.mean)
    with pytest.raises(ValueError):
        stats.summary_ci([], stats.mean)
    with pytest.raises(ValueError):
        stats.summary_ci([1.0], stats.mean, confidence=1.0)


def test_percentile_matches_numpy_and_keeps_huge_finite_values():
    rng = np.random.default_rng(3)
    for _ in range(200):
        values = rng.exponential(1.0, size=int(rng.integers(1, 40)))
        q = float(rng.uniform(0, 100))
        assert stats._percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert stats.p50(np.array([1e300] * 3)) == 1e300


def test_groups_of_the_wrong_length_and_fractional_blocks_are_errors():
    with pytest.raises(ValueError, match="one group per value"):
        stats.summary_ci(list(range(1, 101)), stats.mean, groups=[0, 1])
    with pytest.raises(ValueError, match="block_len"):
        stats.summary_ci([1.0, 2.0], stats.mean, block_len=2.5)
