"""The tagger's measured length errors, for simulations that need realistic (not oracle) predictions.

Owns: recording the held-out error sample of a tagger (``DIR/errors.npz``) and sampling predicted lengths
from it. Imports only numpy and ``tagger.artifact``; the cluster benchmark imports this module without torch.

The error of one prediction is ``log(pred / true)``. Errors depend on the true length (short replies are
over-predicted, long ones under-predicted: regression to the mean), so the sample is kept as
(true length, log error) pairs, split into bins of equal count by true length; :meth:`LengthErrorModel.sample`
draws an error from the bin of the given true length.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import zipfile
from pathlib import Path

import numpy as np

from tagger.artifact import ERRORS_FILE

FIRST_ERRORS_FILE = "errors_first.npz"
"""The errors on first exchanges only (single-turn traffic); ``errors.npz`` holds them on every exchange."""

logger = logging.getLogger(__name__)

DEFAULT_NUM_BINS = 10


class ErrorModelError(ValueError):
    """The error sample is empty, malformed, or cannot be read."""


@dataclasses.dataclass(frozen=True)
class LengthErrorModel:
    """Empirical distribution of ``log(pred / true)`` conditioned on the true length.

    Attributes:
        bin_edges_tokens: upper edges (tokens, ascending) of all bins but the last; a true length ``t`` falls
            in bin ``searchsorted(bin_edges_tokens, t, side="right")``.
        log_errors_by_bin: one float64 array of ``log(pred / true)`` per bin (``len(bin_edges_tokens) + 1``).
        predicted_tokens: the raw sample's predicted lengths, tokens, one per pair (None in files written before
            they were recorded); with ``true_tokens`` it gives ``predictor.sim.residual.EmpiricalResidual``.
        true_tokens: the raw sample's true lengths, tokens, same order (or None).
    """

    bin_edges_tokens: np.ndarray
    log_errors_by_bin: tuple[np.ndarray, ...]
    predicted_tokens: np.ndarray | None = None
    true_tokens: np.ndarray | None = None

    @classmethod
    def from_predictions(
        cls, pred_tokens: np.ndarray, true_tokens: np.ndarray, num_bins: int = DEFAULT_NUM_BINS
    ) -> LengthErrorModel:
        """Build from held-out predictions and true lengths (tokens, >= 1, same order).

        Raises:
            ErrorModelError: empty input, shapes differ, a length < 1, or ``num_bins < 1``.
        """
        pred = np.asarray(pred_tokens, dtype=np.float64)
        true = np.asarray(true_tokens, dtype=np.float64)
        if pred.shape != true.shape or pred.ndim != 1 or len(pred) == 0:
            raise ErrorModelError(f"need equal-length non-empty 1-D arrays, got {pred.shape} and {true.shape}")
        if np.any(pred < 1) or np.any(true < 1) or num_bins < 1:
            raise ErrorModelError("lengths must be >= 1 token and num_bins >= 1")
        num_bins = min(num_bins, len(true))
        edges = np.unique(np.quantile(true, np.linspace(0, 1, num_bins + 1)[1:-1]))
        bins = np.searchsorted(edges, true, side="right")
        log_errors = np.log(pred / true)
        return cls(edges, tuple(log_errors[bins == b] for b in range(len(edges) + 1)), pred, true)

    def sample_log_error(self, num_true_tokens: int, rng: random.Random) -> float:
        """One ``log(pred / true)`` drawn from the bin of ``num_true_tokens``; 0.0 if that bin is empty."""
        errors = self.log_errors_by_bin[int(np.searchsorted(self.bin_edges_tokens, num_true_tokens, "right"))]
        if len(errors) == 0:
            return 0.0
        return float(errors[rng.randrange(len(errors))])

    def sample(self, num_true_tokens: int, rng: random.Random, max_tokens: int | None = None) -> int:
        """A realistic predicted length for a request whose true reply has ``num_true_tokens`` tokens.

        Args:
            num_true_tokens: the true reply length, tokens (>= 1).
            rng: seeded source of randomness.
            max_tokens: the request's cap, if any (the tagger's estimate is capped by it too).

        Returns:
            Predicted tokens, >= 1 and <= ``max_tokens`` when given.
        """
        pred = max(1, round(num_true_tokens * float(np.exp(self.sample_log_error(num_true_tokens, rng)))))
        return min(pred, max_tokens) if max_tokens is not None else pred

    def save(self, directory: Path, name: str = ERRORS_FILE) -> Path:
        """Write ``DIR/<name>`` (default ``errors.npz``); returns its path."""
        path = Path(directory) / name
        arrays = {f"bin_{i}": e for i, e in enumerate(self.log_errors_by_bin)}
        if self.predicted_tokens is not None and self.true_tokens is not None:
            arrays.update(predicted_tokens=self.predicted_tokens, true_tokens=self.true_tokens)
        np.savez(path, bin_edges_tokens=self.bin_edges_tokens, **arrays)
        return path

    @classmethod
    def load(cls, path: Path) -> LengthErrorModel:
        """Read an ``errors.npz`` (or the ``errors.npz`` inside a tagger directory).

        Raises:
            ErrorModelError: the file is missing or malformed.
        """
        path = Path(path)
        if path.is_dir():
            path = path / ERRORS_FILE
        try:
            with np.load(path) as data:
                edges = data["bin_edges_tokens"]
                bins = tuple(data[f"bin_{i}"] for i in range(len(edges) + 1))
                pairs = ((data["predicted_tokens"], data["true_tokens"]) if "predicted_tokens" in data.files
                         and "true_tokens" in data.files else (None, None))
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise ErrorModelError(f"cannot read error sample {path}: {exc}") from exc
        return cls(edges, bins, *pairs)

    def quantiles(self, qs: tuple[float, ...] = (0.1, 0.5, 0.9)) -> dict[float, float]:
        """Quantiles of ``pred / true`` over all bins together (for reports)."""
        all_errors = np.concatenate(self.log_errors_by_bin)
        return {q: float(np.exp(np.quantile(all_errors, q))) for q in qs}
