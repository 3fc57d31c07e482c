"""tagger.ceiling: the label-noise bound on a tagger's Kendall tau."""

import math
import random

import numpy as np
import pytest

from tagger.ceiling import (RepeatedPrompt, ceiling_tau, format_ceiling, is_continuation, measure_ceiling,
                            median_relative_miss, repeated_prompts, two_draw_tau, within_prompt_variance)
from tagger.evaluate import kendall_tau_b


def _record(prompt, reply):
    return {"id": "x", "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]}


def test_repeated_prompts_keep_distinct_replies_and_leave_out_continuations():
    records = [
        _record("Explain X", "a b c"), _record(" Explain X ", "a b c d"), _record("Explain X", "a b c"),  # shared twice
        _record("Only once", "a"),
        _record("continue", "a b"), _record("Continue.", "a b c d e"),  # hidden context
        _record("Same reply", "a b"), _record("Same reply", "a b "),  # one reply, shared
        _record("Blank reply", "a"), _record("Blank reply", "  "),
        {"id": "y", "conversations": [{"from": "gpt", "value": "no human first"}]}, "not a record",
    ]
    found = repeated_prompts(records, lambda texts: [len(t.split()) for t in texts])
    assert found == [RepeatedPrompt("Explain X", (3, 4))]


@pytest.mark.parametrize("prompt", ["continue", "Continue writing please", "please continue!", " go on. "])
def test_continuations(prompt):
    assert is_continuation(prompt)
    assert not is_continuation("continue the story of a dragon who learns to fly")


def test_within_prompt_variance_is_pooled_over_degrees_of_freedom():
    groups = [[math.expm1(1.0), math.expm1(3.0)], [math.expm1(0.0), math.expm1(1.0), math.expm1(2.0)], [5]]
    # sums of squares 2 and 2 over 1 + 2 degrees of freedom; the single reply adds nothing
    assert within_prompt_variance(groups) == pytest.approx(4.0 / 3.0)
    with pytest.raises(ValueError, match="two or more"):
        within_prompt_variance([[3], [4]])


def test_median_relative_miss():
    assert median_relative_miss([[100, 100, 100]]) == 0.0
    assert median_relative_miss([[100, 200]]) == pytest.approx(0.75)  # misses 1.0 and 0.5


def test_ceiling_tau_bounds():
    assert ceiling_tau(0.0, 2.0) == pytest.approx(1.0)
    assert ceiling_tau(2.0, 2.0) == 0.0
    assert ceiling_tau(3.0, 2.0) == 0.0  # noise estimated above the total: nothing to rank
    with pytest.raises(ValueError):
        ceiling_tau(1.0, 0.0)


def test_the_ceiling_is_what_a_perfect_predictor_of_the_mean_reaches():
    """Prompts with log-normal means and noise: the formula's ceiling (noise from repeated prompts, variance from
    single replies) matches the Kendall tau of the true means against single replies, and the normal link
    predicts the two-draw tau."""
    rng = np.random.default_rng(1)
    means = rng.normal(5.0, 1.0, 4000)
    single = np.round(np.expm1(means + rng.normal(0.0, 0.7, means.size))).astype(int)
    repeated = [RepeatedPrompt(f"p{i}", tuple(np.round(np.expm1(m + rng.normal(0.0, 0.7, 4))).astype(int)))
                for i, m in enumerate(means[:400])]
    report = measure_ceiling(repeated, {"view": single}, num_bootstrap=100, seed=3)
    achieved = kendall_tau_b(means, single)
    _, estimate = report.views["view"]
    assert estimate.value == pytest.approx(achieved, abs=0.03)
    assert estimate.low <= estimate.value <= estimate.high
    assert report.within_sd.value == pytest.approx(0.7, abs=0.05)
    assert report.two_draw_tau_link.value == pytest.approx(report.two_draw_tau.value, abs=0.04)
    # a predictor of the mean that is itself noisy ranks worse than the ceiling
    assert kendall_tau_b(means + rng.normal(0.0, 0.7, means.size), single) < estimate.value - 0.05


def test_two_draw_tau_of_noiseless_groups_is_one():
    groups = [[10 * (i + 1)] * 3 for i in range(20)]
    observed, link = two_draw_tau(groups, random.Random(0), num_draws=3)
    assert observed == pytest.approx(1.0) and link == pytest.approx(1.0)


def test_measure_ceiling_rejects_too_little_data_and_formats():
    with pytest.raises(ValueError, match="2 repeated prompts"):
        measure_ceiling([RepeatedPrompt("a", (1, 2))], {"v": [1, 2, 3]})
    repeated = [RepeatedPrompt("a", (10, 20)), RepeatedPrompt("b", (100, 150, 90)), RepeatedPrompt("c", (5, 9))]
    for view in ([1], [7, 7, 7]):
        with pytest.raises(ValueError, match="at least 2 exchanges of different lengths"):
            measure_ceiling(repeated, {"v": view})
    with pytest.raises(ValueError, match="bootstrap resamples"):
        measure_ceiling(repeated, {"v": [1, 2, 3]}, num_bootstrap=5)
    report = measure_ceiling(repeated, {"v": [1, 10, 100, 1000]}, num_bootstrap=100)
    text = format_ceiling(report, {"light (x)": {"v": 0.25}})
    assert "3 prompts with 7 distinct replies" in text and "100 resamples" in text and "seed 0" in text
    assert "| v | 4 |" in text and "0.250 |" in text
