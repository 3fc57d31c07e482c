"""The sidecar's choice of residual rule by length source, and the shipped tagger's error sample."""

import numpy as np
import pytest

from predictor.residual_rules import (
    LENGTH_SOURCE_EXACT,
    LENGTH_SOURCE_FIXED,
    LENGTH_SOURCE_TAGGER,
    LENGTH_SOURCE_UNSPECIFIED,
    ResidualRules,
)
from predictor.sim.residual import EmpiricalResidual, ExactLengths, FixedExtraTokens
from tagger.errors import LengthErrorModel


def test_each_source_gets_its_rule():
    rules = ResidualRules()
    assert isinstance(rules.for_source(LENGTH_SOURCE_TAGGER), EmpiricalResidual)
    assert isinstance(rules.for_source(LENGTH_SOURCE_EXACT), ExactLengths)
    fixed = rules.for_source(LENGTH_SOURCE_FIXED)
    # a fixed guess carries no information: every guess gives the same expectation
    assert fixed.expected_output_tokens(10, 0) == fixed.expected_output_tokens(1000, 0)
    assert rules.for_source(LENGTH_SOURCE_UNSPECIFIED) is rules.tagger
    assert rules.for_source(99) is rules.tagger


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
    assert rules.tagger.num_samples == 12536  # the light tagger's held-out exchanges (tagger/README.md)
