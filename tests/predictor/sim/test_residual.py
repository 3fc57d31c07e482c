"""Residual output lengths: the paper's rule, exact lengths, and the empirical conditional mean."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from predictor.sim.residual import (
    MIN_SAMPLES_PER_ESTIMATE,
    EmpiricalResidual,
    ExactLengths,
    FixedExtraTokens,
)

RNG = np.random.default_rng(0)
TRUE = np.maximum(1, np.round(RNG.lognormal(5.3, 0.9, size=2000)))
PRED = np.maximum(1, np.round(TRUE * np.exp(RNG.normal(0, 0.8, size=2000))))
MODEL = EmpiricalResidual(PRED, TRUE)


@pytest.mark.parametrize("predicted, generated, cap, expected", [
    (100, 0, None, 100), (100, 99, None, 100), (100, 100, None, 110), (100, 250, None, 260),
    (100, 250, 255, 255), (100, 0, 50, 50),
], ids=["fresh", "one-left", "reached", "overdue", "overdue-capped", "capped"])
def test_paper_rule(predicted, generated, cap, expected):
    assert FixedExtraTokens().expected_output_tokens(predicted, generated, cap) == expected


@pytest.mark.parametrize("predicted, generated, expected", [(100, 0, 100), (100, 99, 100), (100, 100, 101),
                                                            (100, 400, 401)])
def test_exact_lengths(predicted, generated, expected):
    assert ExactLengths().expected_output_tokens(predicted, generated) == expected


def brute_force(predicted, generated, cap):
    edges = MODEL.bin_edges_tokens
    in_bin = np.searchsorted(edges, PRED, side="right") == np.searchsorted(edges, predicted, side="right")
    for pool in (TRUE[in_bin], TRUE):
        alive = pool[pool > generated]
        if len(alive) >= MIN_SAMPLES_PER_ESTIMATE:
            return float(np.mean(np.minimum(alive, cap) if cap else alive))
    return None


@given(st.integers(1, 3000), st.integers(0, 5000), st.one_of(st.none(), st.integers(1, 4000)))
def test_empirical_is_the_conditional_mean_within_bounds(predicted, generated, cap):
    value = MODEL.expected_output_tokens(predicted, generated, cap)
    assert value > generated
    if cap is not None and cap > generated:
        assert value <= cap
    effective_cap = cap if cap is not None and cap > generated else None
    reference = brute_force(predicted, generated, effective_cap)
    if reference is not None:
        assert value == max(math.ceil(reference - 1e-9), generated + 1) or abs(value - reference) <= 1


def test_empirical_conditions_on_the_prediction_and_on_progress():
    short, long = MODEL.expected_output_tokens(20, 0), MODEL.expected_output_tokens(2000, 0)
    assert short < long  # a longer guess means a longer expected reply
    remaining = [MODEL.expected_output_tokens(200, g) - g for g in (0, 300, 1000)]
    assert remaining[1] > 10 and remaining[2] > 10  # past the guess it is not "about to finish"


def test_empirical_tail_beyond_every_sample():
    value = MODEL.expected_output_tokens(200, int(TRUE.max()) + 100)
    assert value > TRUE.max() + 100 + 10


@pytest.mark.parametrize("pred, true, bins", [([], [], 8), ([1, 2], [1], 8), ([0], [1], 8), ([1], [1], 0)])
def test_empirical_rejects_bad_samples(pred, true, bins):
    with pytest.raises(ValueError):
        EmpiricalResidual(pred, true, num_bins=bins)


def test_paper_rule_rejects_bad_extra():
    with pytest.raises(ValueError):
        FixedExtraTokens(0)
