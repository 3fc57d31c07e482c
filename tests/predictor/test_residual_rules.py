"""The sidecar's choice of residual rule by length source, and the shipped tagger's error sample and quantiles."""

import math
import shutil

import numpy as np
import pytest

from predictor.residual_rules import (
    LENGTH_SOURCE_EXACT,
    LENGTH_SOURCE_FIXED,
    LENGTH_SOURCE_TAGGER,
    LENGTH_SOURCE_TAGGER_LATER_TURN,
    LENGTH_SOURCE_UNSPECIFIED,
    ResidualRules,
    tagger_source,
)
from predictor.api import pb
from predictor.sim.residual import EmpiricalResidual, ExactLengths, FixedExtraTokens, QuantileResidual
from tagger.errors import LengthErrorModel
from tagger.quantiles import LengthQuantiles, QuantileError
from tagger.serve import SHIPPED_LIGHT_DIR


def test_each_source_gets_its_rule():
    rules = ResidualRules()
    assert rules.length_distribution == "quantiles"
    assert isinstance(rules.for_source(LENGTH_SOURCE_EXACT), ExactLengths)
    fixed = rules.for_source(LENGTH_SOURCE_FIXED)
    # a fixed guess carries no information: every guess gives the same expectation
    assert fixed.expected_output_tokens(10, 0) == fixed.expected_output_tokens(1000, 0)
    assert rules.for_source(LENGTH_SOURCE_UNSPECIFIED) is rules.binned
    assert rules.for_source(99) is rules.binned
    assert isinstance(rules.binned, EmpiricalResidual)


def test_the_constants_are_the_protocols():
    assert (LENGTH_SOURCE_TAGGER, LENGTH_SOURCE_TAGGER_LATER_TURN) == (pb.LENGTH_SOURCE_TAGGER,
                                                                       pb.LENGTH_SOURCE_TAGGER_LATER_TURN)
    assert (tagger_source(False), tagger_source(True)) == (LENGTH_SOURCE_TAGGER, LENGTH_SOURCE_TAGGER_LATER_TURN)


def test_a_taggers_requests_are_priced_by_their_own_distribution_per_kind_of_turn():
    rules, quantiles = ResidualRules(), LengthQuantiles.load(SHIPPED_LIGHT_DIR)
    for source, has_history in ((LENGTH_SOURCE_TAGGER, False), (LENGTH_SOURCE_TAGGER_LATER_TURN, True)):
        rule = rules.for_source(source)
        for predicted, generated, cap in ((40, 0, None), (200, 0, None), (200, 150, None), (200, 600, 1000),
                                          (900, 10, 512)):
            own = QuantileResidual(quantiles.levels, quantiles.quantile_tokens(math.log1p(predicted), has_history))
            assert rule.expected_output_tokens(predicted, generated, cap) == own.expected_output_tokens(
                predicted, generated, cap)
    # the shipped tagger's quantiles differ by turn: the two kinds of turn are priced differently
    first, later = rules.for_source(LENGTH_SOURCE_TAGGER), rules.for_source(LENGTH_SOURCE_TAGGER_LATER_TURN)
    assert any(first.expected_output_tokens(p, g) != later.expected_output_tokens(p, g)
               for p in (30, 100, 300) for g in (0, 100))
    # a longer prediction, a longer expected reply; what has been generated raises it
    assert first.expected_output_tokens(400, 0) > first.expected_output_tokens(40, 0)
    assert first.expected_output_tokens(100, 300) > 300


@pytest.mark.parametrize("length_distribution", ["quantiles", "binned"])
def test_an_estimate_above_the_cap_is_priced_near_the_cap_and_one_at_the_cap_lower(length_distribution):
    """The extproc sends the estimate before the max_tokens cap (extproc/lengths.py): a reply estimated at 300 tokens
    under a cap of 16 almost surely runs to the cap, while an estimate of 16 stands for replies around 16 tokens,
    some shorter. Capping first priced the former as the latter (11 tokens with the shipped quantiles)."""
    rule = ResidualRules(length_distribution=length_distribution).for_source(LENGTH_SOURCE_TAGGER)
    assert rule.expected_output_tokens(300, 0, 16) >= 15
    assert rule.expected_output_tokens(16, 0, 16) < rule.expected_output_tokens(300, 0, 16)


def test_binned_prices_every_turn_by_the_held_out_errors():
    rules = ResidualRules(length_distribution="binned")
    assert rules.for_source(LENGTH_SOURCE_TAGGER) is rules.for_source(LENGTH_SOURCE_TAGGER_LATER_TURN) is rules.binned
    with pytest.raises(ValueError, match="length distribution"):
        ResidualRules(length_distribution="buckets")


def test_a_tagger_without_quantiles_falls_back_to_binned_and_says_so(tmp_path, caplog):
    shutil.copy(SHIPPED_LIGHT_DIR / "errors.npz", tmp_path / "errors.npz")
    rules = ResidualRules(errors_path=tmp_path)
    assert rules.length_distribution == "binned" and rules.for_source(LENGTH_SOURCE_TAGGER) is rules.binned
    assert "no quantiles.npz" in caplog.text


@pytest.mark.parametrize("default, cls", [("paper", FixedExtraTokens), ("exact", ExactLengths),
                                          ("empirical", EmpiricalResidual)])
def test_default_rule(default, cls):
    assert isinstance(ResidualRules(default).for_source(LENGTH_SOURCE_UNSPECIFIED), cls)


def test_unknown_default_and_sample_without_pairs(tmp_path):
    with pytest.raises(ValueError, match="residual rule"):
        ResidualRules("magic")
    old = LengthErrorModel.from_predictions(np.array([10.0, 20.0]), np.array([12.0, 18.0]))
    LengthErrorModel(old.bin_edges_tokens, old.log_errors_by_bin).save(tmp_path)  # no (pred, true) pairs
    with pytest.raises(ValueError, match="pairs"):
        ResidualRules(errors_path=tmp_path)


def test_shipped_sample_has_the_held_out_pairs():
    rules = ResidualRules()
    assert rules.binned.num_samples == 12536  # the light tagger's held-out exchanges (tagger/README.md)


def test_past_its_top_quantile_a_tagged_request_gets_the_binned_rule_and_a_file_path_finds_the_quantiles():
    rules = ResidualRules(errors_path=SHIPPED_LIGHT_DIR / "errors.npz")  # the file: quantiles.npz beside it
    assert rules.length_distribution == "quantiles"
    quantiles = LengthQuantiles.load(SHIPPED_LIGHT_DIR)
    for source, has_history in ((LENGTH_SOURCE_TAGGER, False), (LENGTH_SOURCE_TAGGER_LATER_TURN, True)):
        top = math.ceil(quantiles.quantile_tokens(math.log1p(200), has_history)[-1])
        for generated in (top, top + 500):
            assert rules.for_source(source).expected_output_tokens(200, generated) == \
                rules.binned.expected_output_tokens(200, generated)
        own = QuantileResidual(quantiles.levels, quantiles.quantile_tokens(math.log1p(200), has_history))
        assert rules.for_source(source).expected_output_tokens(200, top - 1) == own.expected_output_tokens(
            200, top - 1)
        # a router mirroring a binned sidecar (its watched state says so) gets the binned rule for every turn
        assert rules.for_source(source, "binned") is rules.binned


def test_quantiles_that_cannot_price_stop_the_rules_at_start(monkeypatch):
    def overflow(self, predicted, generated, max_tokens=None):
        raise OverflowError("math range error")

    monkeypatch.setattr("predictor.sim.residual.TaggerQuantileResidual.expected_output_tokens", overflow)
    with pytest.raises(QuantileError, match="cannot price a request predicted at 1 tokens"):
        ResidualRules()


def test_a_distribution_this_version_does_not_know_is_priced_binned():
    rules = ResidualRules()
    for name in ("binned", "future-kind", ""):
        assert rules.for_source(LENGTH_SOURCE_TAGGER_LATER_TURN, name) is rules.binned
    assert rules.for_source(LENGTH_SOURCE_TAGGER, "quantiles") is rules.for_source(LENGTH_SOURCE_TAGGER) is rules.tagger
    assert rules.for_source(LENGTH_SOURCE_EXACT, "binned") is rules.exact
