"""Which residual-length rule (``predictor.sim.residual``) the sidecar applies to a request, by its length source.

The extproc tells the sidecar, with every Predict and Admit, where the request's predicted output length came
from (``LengthSource`` in ``predictor/predictor.proto``):

- TAGGER: `EmpiricalResidual` over the tagger's measured held-out (predicted, true) pairs (``errors.npz`` of the
  tagger directory; the shipped light tagger's by default): the expected remaining length given the bin of the
  prediction and what the request has generated;
- FIXED: `EmpiricalResidual` with one bin (the prediction says nothing; the reply-length distribution of the same
  sample conditions on what was generated);
- EXACT: `ExactLengths`;
- UNSPECIFIED (an older extproc, or phantom requests): the sidecar's default rule (``--residual-lengths``).

The sample is read once at start (``tagger.errors.LengthErrorModel``, the one reader of ``errors.npz``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from predictor.sim.residual import (
    RESIDUAL_RULES,
    EmpiricalResidual,
    ExactLengths,
    FixedExtraTokens,
    ResidualLengthModel,
)

logger = logging.getLogger(__name__)

LENGTH_SOURCE_UNSPECIFIED = 0
LENGTH_SOURCE_TAGGER = 1
LENGTH_SOURCE_FIXED = 2
LENGTH_SOURCE_EXACT = 3
"""Values of the ``LengthSource`` enum of ``predictor.proto`` (kept here so that ``predictor.sim`` users and
the ledger need no generated stubs)."""

LENGTH_SOURCE_NAMES = {"tagger": LENGTH_SOURCE_TAGGER, "fixed": LENGTH_SOURCE_FIXED,
                       "oracle": LENGTH_SOURCE_EXACT, "exact": LENGTH_SOURCE_EXACT}
"""The extproc's ``output_length.source`` names -> length source."""


def default_errors_dir() -> Path:
    """The shipped light tagger's directory (its ``errors.npz``)."""
    from tagger.serve import SHIPPED_LIGHT_DIR  # noqa: PLC0415 (numpy only; keeps the import lazy)

    return SHIPPED_LIGHT_DIR


class ResidualRules:
    """The residual rule per length source.

    Args:
        default: rule for UNSPECIFIED requests: one of ``predictor.sim.residual.RESIDUAL_RULES``.
        errors_path: a tagger directory or its ``errors.npz`` (None = the shipped light tagger's).

    Raises:
        ValueError: unknown default rule, or a sample without the (predicted, true) pairs.
        tagger.errors.ErrorModelError: the sample cannot be read.
    """

    def __init__(self, default: str = "empirical", errors_path: str | Path | None = None) -> None:
        if default not in RESIDUAL_RULES:
            raise ValueError(f"residual rule must be one of {', '.join(RESIDUAL_RULES)}, got {default!r}")
        from tagger.errors import LengthErrorModel  # noqa: PLC0415

        sample = LengthErrorModel.load(Path(errors_path) if errors_path else default_errors_dir())
        if sample.predicted_tokens is None or sample.true_tokens is None:
            raise ValueError(f"the error sample {errors_path or default_errors_dir()} has no (predicted, true) "
                             "pairs; re-run `astrolabe tagger eval` to record them")
        self.tagger = EmpiricalResidual(sample.predicted_tokens, sample.true_tokens)
        self.fixed = EmpiricalResidual(np.ones_like(sample.true_tokens), sample.true_tokens, num_bins=1)
        self.exact = ExactLengths()
        self.default_name = default
        self.default: ResidualLengthModel = {"empirical": self.tagger, "paper": FixedExtraTokens(),
                                             "exact": self.exact}[default]

    def for_source(self, length_source: int) -> ResidualLengthModel:
        """The rule for a request whose predicted length has source ``length_source`` (unknown = default)."""
        if length_source == LENGTH_SOURCE_TAGGER:
            return self.tagger
        if length_source == LENGTH_SOURCE_FIXED:
            return self.fixed
        if length_source == LENGTH_SOURCE_EXACT:
            return self.exact
        return self.default
