"""Residual output lengths: the paper's rule, exact lengths, the empirical conditional mean, and one request's own
quantiles."""

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
    QuantileResidual,
    TaggerQuantileResidual,
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


LEVELS = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)
LOGNORMAL = np.exp(np.random.default_rng(1).normal(5.0, 0.8, 400_000))
OWN = QuantileResidual(LEVELS, np.quantile(LOGNORMAL, LEVELS))


@pytest.mark.parametrize("generated, cap", [(0, None), (50, None), (150, None), (400, None), (0, 300), (150, 300)])
def test_quantiles_give_the_conditional_mean_of_the_distribution_they_describe(generated, cap):
    alive = LOGNORMAL[LOGNORMAL > generated]
    reference = float(np.mean(np.minimum(alive, cap) if cap else alive))
    assert OWN.expected_output_tokens(0, generated, cap) == pytest.approx(reference, rel=0.03)


@given(st.integers(0, 20_000), st.one_of(st.none(), st.integers(1, 5000)))
def test_quantiles_stay_within_bounds_and_grow_with_progress(generated, cap):
    value = OWN.expected_output_tokens(7, generated, cap)
    assert value > generated
    if cap is not None and cap > generated:
        assert value <= cap
    assert OWN.expected_output_tokens(7, generated + 100, None) >= OWN.expected_output_tokens(7, generated, None)


def test_quantiles_of_a_point_mass_and_of_a_wider_request():
    point = QuantileResidual((0.1, 0.5, 0.9), (200, 200, 200))
    # 90 % of the mass at 200 tokens, the lowest 10 % log-uniform from 1 token up to it
    assert 170 < point.expected_output_tokens(0, 0) < 200 and point.expected_output_tokens(0, 199) == 200
    assert point.expected_output_tokens(0, 200) == 210  # past every quantile: the tail excess (>= 10 tokens)
    narrow = QuantileResidual((0.1, 0.5, 0.9), (150, 200, 260))
    wide = QuantileResidual((0.1, 0.5, 0.9), (40, 200, 1000))
    assert wide.expected_output_tokens(0, 0) > narrow.expected_output_tokens(0, 0)  # same median, longer tail
    assert wide.expected_output_tokens(0, 300) > narrow.expected_output_tokens(0, 300)


@pytest.mark.parametrize("levels, quantiles", [((0.5,), (10, 20)), ((0.5, 0.1), (10, 20)), ((0.0, 0.5), (1, 2)),
                                               ((0.1, 0.5), (0.5, 2)), ((0.1, 0.5), (30, 20)), ((), ()),
                                               ((0.5, 1.5), (100, 200)), ((0.5, 1.0), (100, 200)),
                                               ((0.1, 0.5), (1, math.inf))],
                         ids=["lengths", "levels-order", "level-0", "below-1-token", "decreasing", "empty",
                              "level-above-1", "level-1", "infinite"])
def test_quantiles_reject_bad_input(levels, quantiles):
    with pytest.raises(ValueError):
        QuantileResidual(levels, quantiles)


class _Quantiles:  # the shape of tagger.quantiles.LengthQuantiles: a fixed spread around the estimate per turn kind
    levels = (0.1, 0.5, 0.9)

    def quantile_tokens(self, estimate_log1p, has_history):
        median = math.expm1(estimate_log1p)
        spread = 2.0 if has_history else 4.0
        return (max(1.0, median / spread), median, median * spread)


@given(st.integers(1, 5000), st.integers(0, 8000), st.one_of(st.none(), st.integers(1, 5000)), st.booleans())
def test_a_taggers_rule_is_each_requests_own_distribution(predicted, generated, cap, has_history):
    rule = TaggerQuantileResidual(_Quantiles(), has_history)
    own = QuantileResidual(_Quantiles.levels, _Quantiles().quantile_tokens(math.log1p(predicted), has_history))
    assert rule.expected_output_tokens(predicted, generated, cap) == own.expected_output_tokens(0, generated, cap)
    assert rule.distribution(predicted) is rule.distribution(predicted)  # memoised


def test_a_taggers_rule_forgets_when_full(monkeypatch):
    monkeypatch.setattr("predictor.sim.residual.MAX_DISTRIBUTIONS_CACHED", 3)
    rule = TaggerQuantileResidual(_Quantiles(), False)
    for predicted in range(1, 8):
        rule.distribution(predicted)
    assert len(rule._by_predicted) <= 3
    assert rule.distribution(0) is rule.distribution(1)  # below one token is one token


def test_past_its_top_quantile_a_request_is_priced_by_the_rule_beyond():
    beyond = EmpiricalResidual(PRED, TRUE)
    rule = TaggerQuantileResidual(_Quantiles(), False, beyond)
    own = TaggerQuantileResidual(_Quantiles(), False)
    top = _Quantiles().quantile_tokens(math.log1p(20), False)[-1]  # 80 tokens
    assert rule.expected_output_tokens(20, 10) == own.expected_output_tokens(20, 10)  # inside: its own
    for generated in (math.ceil(top), 300):
        assert rule.expected_output_tokens(20, generated) == beyond.expected_output_tokens(20, generated)
    # the held-out replies' heavy tail keeps an overdue request long; its own distribution adds the top excess only
    assert rule.expected_output_tokens(20, 300) > own.expected_output_tokens(20, 300)
