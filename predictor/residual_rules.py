"""Which residual-length rule (``predictor.sim.residual``) the sidecar applies to a request, by its length source.

The extproc tells the sidecar, with every Predict and Admit, where the request's predicted output length came
from (``LengthSource`` in ``predictor/predictor.proto``):

- TAGGER (a first turn: no earlier assistant reply) and TAGGER_LATER_TURN (a chat request after an earlier
  assistant reply): with ``length_distribution="quantiles"`` (the default) `TaggerQuantileResidual`, the
  request's own predicted distribution, the tagger's calibrated quantiles around its estimate for that kind of
  turn (``quantiles.npz`` of the tagger directory, ``tagger.quantiles``), conditioned on what it has generated
  (past its top quantile, the binned rule below); with ``"binned"`` (or a tagger directory without
  ``quantiles.npz``, with a warning) `EmpiricalResidual` over the tagger's measured held-out (predicted, true)
  pairs (``errors.npz``), the same for both kinds of turn;
- FIXED: `EmpiricalResidual` with one bin (the prediction says nothing; the reply-length distribution of the same
  sample conditions on what was generated);
- EXACT: `ExactLengths`;
- UNSPECIFIED (an older extproc, or phantom requests): the sidecar's default rule (``--residual-lengths``).

The files are read once at start (``tagger.errors.LengthErrorModel`` and ``tagger.quantiles.LengthQuantiles``,
the one readers of ``errors.npz`` and ``quantiles.npz``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from predictor.sim.residual import (
    RESIDUAL_RULES,
    EmpiricalResidual,
    ExactLengths,
    FixedExtraTokens,
    ResidualLengthModel,
    TaggerQuantileResidual,
)

logger = logging.getLogger(__name__)

LENGTH_SOURCE_UNSPECIFIED = 0
LENGTH_SOURCE_TAGGER = 1
LENGTH_SOURCE_FIXED = 2
LENGTH_SOURCE_EXACT = 3
LENGTH_SOURCE_TAGGER_LATER_TURN = 4
"""Values of the ``LengthSource`` enum of ``predictor.proto`` (kept here so that ``predictor.sim`` users and
the ledger need no generated stubs)."""

LENGTH_SOURCE_NAMES = {"tagger": LENGTH_SOURCE_TAGGER, "fixed": LENGTH_SOURCE_FIXED,
                       "oracle": LENGTH_SOURCE_EXACT, "exact": LENGTH_SOURCE_EXACT}
"""The extproc's ``output_length.source`` names -> length source (a tagger's later turns: see `tagger_source`)."""

LENGTH_DISTRIBUTIONS = ("quantiles", "binned")
"""How a tagger's live requests are priced (``--length-distribution``): each one's own predicted distribution, or
the tagger's held-out errors in the bin of its estimate."""


def tagger_source(has_history: bool) -> int:
    """The length source of a tagger's estimate for a request with (True) or without earlier turns."""
    return LENGTH_SOURCE_TAGGER_LATER_TURN if has_history else LENGTH_SOURCE_TAGGER


def default_errors_dir() -> Path:
    """The shipped light tagger's directory (its ``errors.npz``)."""
    from tagger.serve import SHIPPED_LIGHT_DIR  # noqa: PLC0415 (numpy only; keeps the import lazy)

    return SHIPPED_LIGHT_DIR


def _check_prices(quantiles, rules: tuple[ResidualLengthModel, ...], path: Path) -> None:
    """Price a request in every bin of ``quantiles`` (at each bin edge, 1 token and 2**32 tokens), fresh and far
    past its top quantile, with each rule: a file that loads but cannot price (overflowing values) stops the
    sidecar at start instead of failing every request.

    Raises:
        QuantileError: a price is not a finite number of tokens.
    """
    from tagger.quantiles import QuantileError  # noqa: PLC0415

    predicted = {1, 2**32 - 1, *(max(1, min(2**32 - 1, round(math.expm1(e)))) for e in quantiles.bin_edges.flat)}
    for rule in rules:
        for tokens in sorted(predicted):
            try:
                for generated in (0, tokens, 10 * tokens):
                    if not rule.expected_output_tokens(tokens, generated, None) > generated:
                        raise ValueError(f"{generated} tokens generated, priced at or below that")
            except (ValueError, ArithmeticError) as exc:
                raise QuantileError(f"{path}: cannot price a request predicted at {tokens} tokens: {exc}") from exc


class ResidualRules:
    """The residual rule per length source.

    Args:
        default: rule for UNSPECIFIED requests: one of ``predictor.sim.residual.RESIDUAL_RULES``.
        errors_path: a tagger directory or its ``errors.npz`` (None = the shipped light tagger's); its
            ``quantiles.npz`` is read from the same directory.
        length_distribution: one of `LENGTH_DISTRIBUTIONS`: how the tagger's requests are priced.

    Raises:
        ValueError: unknown default rule or length distribution, or a sample without the (predicted, true) pairs.
        tagger.errors.ErrorModelError: the sample cannot be read.
        tagger.quantiles.QuantileError: ``quantiles.npz`` is there but malformed.
    """

    def __init__(self, default: str = "empirical", errors_path: str | Path | None = None,
                 length_distribution: str = "quantiles") -> None:
        if default not in RESIDUAL_RULES:
            raise ValueError(f"residual rule must be one of {', '.join(RESIDUAL_RULES)}, got {default!r}")
        if length_distribution not in LENGTH_DISTRIBUTIONS:
            raise ValueError(f"length distribution must be one of {', '.join(LENGTH_DISTRIBUTIONS)}, "
                             f"got {length_distribution!r}")
        from tagger.errors import LengthErrorModel  # noqa: PLC0415
        from tagger.quantiles import QUANTILES_FILE, LengthQuantiles  # noqa: PLC0415

        path = Path(errors_path) if errors_path else default_errors_dir()
        sample = LengthErrorModel.load(path)
        if sample.predicted_tokens is None or sample.true_tokens is None:
            raise ValueError(f"the error sample {path} has no (predicted, true) pairs; re-run `astrolabe tagger "
                             "eval` to record them")
        self.binned = EmpiricalResidual(sample.predicted_tokens, sample.true_tokens)
        self.tagger: ResidualLengthModel = self.binned
        self.tagger_later_turn: ResidualLengthModel = self.binned
        directory = path if path.is_dir() else path.parent
        if length_distribution == "quantiles":
            if (directory / QUANTILES_FILE).is_file():
                quantiles = LengthQuantiles.load(directory)
                self.tagger = TaggerQuantileResidual(quantiles, False, beyond=self.binned)
                self.tagger_later_turn = TaggerQuantileResidual(quantiles, True, beyond=self.binned)
                _check_prices(quantiles, (self.tagger, self.tagger_later_turn), directory / QUANTILES_FILE)
            else:
                logger.warning("%s has no %s: a tagger's requests are priced by its binned held-out errors instead "
                               "of their own distributions", directory, QUANTILES_FILE)
                length_distribution = "binned"
        self.length_distribution = length_distribution
        self.fixed = EmpiricalResidual(np.ones_like(sample.true_tokens), sample.true_tokens, num_bins=1)
        self.exact = ExactLengths()
        self.default_name = default
        self.default: ResidualLengthModel = {"empirical": self.binned, "paper": FixedExtraTokens(),
                                             "exact": self.exact}[default]

    def for_source(self, length_source: int, length_distribution: str | None = None) -> ResidualLengthModel:
        """The rule for a request whose predicted length has source ``length_source`` (unknown = default);
        ``length_distribution`` ``"binned"`` prices a tagger's requests by the binned errors whatever these rules
        were built with (a router mirroring a sidecar that says so, ``predictor.instance_state``)."""
        if length_source in (LENGTH_SOURCE_TAGGER, LENGTH_SOURCE_TAGGER_LATER_TURN) \
                and length_distribution not in (None, "quantiles"):  # "binned", or one this version does not know
            return self.binned
        if length_source == LENGTH_SOURCE_TAGGER:
            return self.tagger
        if length_source == LENGTH_SOURCE_TAGGER_LATER_TURN:
            return self.tagger_later_turn
        if length_source == LENGTH_SOURCE_FIXED:
            return self.fixed
        if length_source == LENGTH_SOURCE_EXACT:
            return self.exact
        return self.default
