"""tagger.evaluate: rank statistics, metrics, baselines, table."""

import itertools
import math

import numpy as np
import pytest

from tagger.data import Example
from tagger.evaluate import (average_ranks, compute_metrics, format_table, kendall_tau_b, median_baseline,
                             prompt_length_baseline, spearman_rho)


def _tau_b_brute_force(x, y):
    c = d = tx = ty = 0
    for i, j in itertools.combinations(range(len(x)), 2):
        sx, sy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
        c += sx * sy > 0
        d += sx * sy < 0
        tx += sx == 0 and sy != 0
        ty += sy == 0 and sx != 0
    return (c - d) / math.sqrt((c + d + tx) * (c + d + ty))


@pytest.mark.parametrize(
    "x, y, expected",
    [([1, 2, 3, 4], [1, 2, 3, 4], 1.0), ([1, 2, 3, 4], [4, 3, 2, 1], -1.0),
     ([1, 1, 2, 3], [1, 2, 2, 3], 0.8), ([1, 2, 2, 3], [3, 1, 2, 4], 1 / math.sqrt(30))],
    ids=["same", "reversed", "ties-both", "ties-x"],
)
def test_kendall_tau_b_known_values(x, y, expected):
    assert kendall_tau_b(x, y) == pytest.approx(expected)
    assert kendall_tau_b(x, y) == pytest.approx(_tau_b_brute_force(np.array(x), np.array(y)))


def test_kendall_tau_b_matches_brute_force_across_blocks():
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 20, 300), rng.integers(0, 20, 300)  # many ties, more rows than one block
    assert kendall_tau_b(x, y) == pytest.approx(_tau_b_brute_force(x, y))


def test_rank_statistics_of_constant_input_are_nan():
    assert math.isnan(kendall_tau_b([5, 5, 5], [1, 2, 3]))
    assert math.isnan(spearman_rho([5, 5, 5], [1, 2, 3]))


def test_average_ranks_and_spearman():
    assert average_ranks([10, 20, 20, 5]).tolist() == [2.0, 3.5, 3.5, 1.0]
    assert spearman_rho([1, 2, 3, 4], [10, 20, 30, 1000]) == pytest.approx(1.0)
    assert spearman_rho([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_compute_metrics():
    m = compute_metrics("t", np.array([100, 150, 400]), np.array([100, 250, 200]))
    assert m.mae_tokens == pytest.approx(100.0)
    assert m.mape == pytest.approx((0 + 0.4 + 1.0) / 3)
    assert (m.within_50_frac, m.within_100_frac) == (pytest.approx(1 / 3), pytest.approx(2 / 3))
    with pytest.raises(ValueError):
        compute_metrics("t", np.array([1]), np.array([0]))


def test_baselines():
    train = [Example(str(i), "p", p, o) for i, (p, o) in enumerate([(10, 100), (100, 1000), (1, 10)])]
    test = [Example("t", "p", 10, 50)]
    assert median_baseline(train, test).tolist() == [100]
    # log1p(o) = log1p(p) + c roughly: a prompt of 10 tokens predicts about 100
    assert 80 <= prompt_length_baseline(train, test)[0] <= 120


def test_format_table_has_one_row_per_metrics():
    m = compute_metrics("light", np.array([1, 2]), np.array([1, 2]))
    assert format_table([m, m]).count("| light |") == 2


def test_pairwise_accuracy_counts_prediction_ties_half_and_ignores_true_ties():
    from tagger.evaluate import pairwise_accuracy

    assert pairwise_accuracy([1, 2, 3], [10, 20, 30]) == 1.0
    assert pairwise_accuracy([3, 2, 1], [10, 20, 30]) == 0.0
    assert pairwise_accuracy([1, 1, 1], [10, 20, 30]) == 0.5
    # pairs (a, b) true-tied are not counted: (a, c) right, (b, c) wrong
    assert pairwise_accuracy([1, 5, 3], [10, 10, 30]) == 0.5
    assert np.isnan(pairwise_accuracy([1, 2], [7, 7]))
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 20, 600), rng.integers(0, 20, 600)
    brute = [(np.sign(x[i] - x[j]) * np.sign(y[i] - y[j]), x[i] == x[j]) for i in range(600) for j in range(i)
             if y[i] != y[j]]
    assert pairwise_accuracy(x, y) == pytest.approx(sum((s > 0) + 0.5 * t for s, t in brute) / len(brute))
