"""Expected output length of a live request, given its predicted length and what it has generated so far.

A sidecar predicts from requests whose true lengths it does not know: it has each one's *predicted* output length
(a tagger's guess, a fixed figure, or an exact length) and the tokens generated so far. How many tokens are left
decides when a busy instance frees a slot, so it decides predicted TTFT on a full instance. This module owns the
rules that turn (predicted, generated, max_tokens) into an expected total output length:

- `FixedExtraTokens`: the predicted length until it is reached, then ``generated + 10``. Source: the reference
  system's predictor (AKafakA/Astrolabe: "a request that has already generated more than predicted is assumed
  to need 10 more tokens"). With a tagger that under-predicts long replies, busy instances look about to drain.
- `ExactLengths`: the predicted length is the true one (oracle lengths, ``ignore_eos`` with a known
  ``max_tokens``); past it (a late Release), one more token.
- `EmpiricalResidual`: ``E[min(L, max_tokens) | L > generated, predicted in the same bin]`` over a measured
  sample of (predicted, true) pairs of the tagger in use (its held-out errors, ``tagger/weights/*/errors.npz``):
  the expected remaining length conditioned on what the request has already generated. With ``generated = 0``
  it is the tagger's calibrated mean for that bin, not the raw guess.
- `QuantileResidual`: the same conditional mean under ONE request's own predicted distribution, given as
  quantiles of its length (``tagger.quantiles``): a log-uniform density between consecutive quantiles.
- `TaggerQuantileResidual`: a tagger's rule for its requests: each one's `QuantileResidual` from the tagger's
  calibrated quantiles around its estimate, for a first or a later turn (``tagger.quantiles.LengthQuantiles``).

NOTE: every rule returns an expected TOTAL output length in tokens, strictly greater than ``generated`` (a live
request has not finished) and at most ``max_tokens`` when given and larger than ``generated``. Pure numpy +
standard library, as the rest of ``predictor.sim``; loading a sample from disk is the caller's job
(``tagger.errors.LengthErrorModel``).
"""

from __future__ import annotations

import abc
import bisect
import logging
import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

logger = logging.getLogger(__name__)

NUM_EXTRA_TOKENS_PAPER = 10
"""Tokens the reference system assumes are left once a request reaches its predicted length (AKafakA/Astrolabe)."""

DEFAULT_NUM_BINS = 8
"""Bins of equal count by predicted length in `EmpiricalResidual` (the shipped light tagger's 12,536 held-out
pairs: ~1,570 per bin)."""

MAX_TOP_FACTOR = 1e3
"""`QuantileResidual`'s end point lies at most this factor past the last quantile."""

MIN_SAMPLES_PER_ESTIMATE = 20
"""Fewer samples than this past ``generated`` in a request's bin: the estimate pools every bin."""


class ResidualLengthModel(abc.ABC):
    """(predicted output tokens, generated tokens, max_tokens) -> expected total output tokens."""

    name: str

    @abc.abstractmethod
    def expected_output_tokens(self, num_predicted_tokens: int, num_generated_tokens: int,
                               max_tokens: int | None = None) -> int:
        """Expected total output length of a live request, tokens.

        Args:
            num_predicted_tokens: the length predicted at admission, tokens (>= 1).
            num_generated_tokens: output tokens generated so far (>= 0).
            max_tokens: the request's cap, tokens, or None when unknown.

        Returns:
            An integer > ``num_generated_tokens``; <= ``max_tokens`` when ``max_tokens > num_generated_tokens``.
        """


def capped_tokens(num_tokens: int, max_tokens: int | None) -> int:
    """``num_tokens`` capped by ``max_tokens`` (None or 0: none given, as in the sidecar protocol), tokens: the
    extproc sends its length estimate before the cap (``extproc/lengths.py``)."""
    return min(num_tokens, max_tokens) if max_tokens else num_tokens


def _cap(total: float, num_generated_tokens: int, max_tokens: int | None) -> int:
    value = max(int(math.ceil(total)), num_generated_tokens + 1)
    if max_tokens is not None and max_tokens > num_generated_tokens:
        value = min(value, int(max_tokens))
    return value


class FixedExtraTokens(ResidualLengthModel):
    """The reference system's rule: the prediction, then ``num_extra_tokens`` more once it is reached.

    Args:
        num_extra_tokens: tokens assumed left past the prediction (>= 1; default `NUM_EXTRA_TOKENS_PAPER`).
    """

    name = "paper"

    def __init__(self, num_extra_tokens: int = NUM_EXTRA_TOKENS_PAPER) -> None:
        if num_extra_tokens < 1:
            raise ValueError(f"num_extra_tokens must be >= 1, got {num_extra_tokens}")
        self.num_extra_tokens = num_extra_tokens

    def expected_output_tokens(self, num_predicted_tokens: int, num_generated_tokens: int,
                               max_tokens: int | None = None) -> int:
        if num_generated_tokens < num_predicted_tokens:
            return _cap(num_predicted_tokens, num_generated_tokens, max_tokens)
        return _cap(num_generated_tokens + self.num_extra_tokens, num_generated_tokens, max_tokens)


class ExactLengths(ResidualLengthModel):
    """The predicted length is the true length (one more token once it is reached: the Release is late)."""

    name = "exact"

    def expected_output_tokens(self, num_predicted_tokens: int, num_generated_tokens: int,
                               max_tokens: int | None = None) -> int:
        return _cap(num_predicted_tokens, num_generated_tokens, max_tokens)


class EmpiricalResidual(ResidualLengthModel):
    """``E[min(L, cap) | L > generated, bin(predicted)]`` over a measured sample of (predicted, true) lengths.

    Bins hold equal numbers of pairs by predicted length. An estimate with fewer than
    `MIN_SAMPLES_PER_ESTIMATE` pairs past ``generated`` in its bin uses every bin's pairs; with fewer than that in
    the whole sample (a request longer than nearly every reply seen), the mean excess of the longest
    `MIN_SAMPLES_PER_ESTIMATE` replies over their own start is assumed left (a heavy tail keeps a long request
    long). Each estimate is O(log n): sorted true lengths and prefix sums per bin.

    Args:
        predicted_tokens: predicted lengths of the sample, tokens (>= 1), one per pair.
        true_tokens: the true lengths of the same pairs, tokens (>= 1), same order.
        num_bins: bins by predicted length (>= 1).

    Raises:
        ValueError: empty or mismatched arrays, a length < 1, or ``num_bins < 1``.
    """

    name = "empirical"

    def __init__(self, predicted_tokens: Sequence[float], true_tokens: Sequence[float],
                 num_bins: int = DEFAULT_NUM_BINS) -> None:
        pred = np.asarray(predicted_tokens, dtype=np.float64)
        true = np.asarray(true_tokens, dtype=np.float64)
        if pred.ndim != 1 or pred.shape != true.shape or len(pred) == 0:
            raise ValueError(f"need equal-length non-empty 1-D arrays, got {pred.shape} and {true.shape}")
        if np.any(pred < 1) or np.any(true < 1) or num_bins < 1:
            raise ValueError("lengths must be >= 1 token and num_bins >= 1")
        num_bins = min(num_bins, len(pred))
        self.bin_edges_tokens = np.unique(np.quantile(pred, np.linspace(0, 1, num_bins + 1)[1:-1]))
        bins = np.searchsorted(self.bin_edges_tokens, pred, side="right")
        self._edges = self.bin_edges_tokens.tolist()
        self._bins = [self._table(true[bins == b]) for b in range(len(self.bin_edges_tokens) + 1)]
        self._pooled = self._table(true)
        tail = np.sort(true)[-MIN_SAMPLES_PER_ESTIMATE:]
        self._tail_excess_tokens = max(float(np.mean(tail - tail[0])), float(NUM_EXTRA_TOKENS_PAPER))
        self.num_samples = len(true)

    @staticmethod
    def _table(values: np.ndarray) -> tuple[list[float], list[float]]:
        """Sorted values and their prefix sums, as Python lists: an estimate is a few ``bisect`` calls on them
        (numpy's per-call overhead on one scalar was most of a sidecar's state build; same float64 sums)."""
        ordered = np.sort(values)
        return ordered.tolist(), np.concatenate(([0.0], np.cumsum(ordered))).tolist()

    @staticmethod
    def _conditional_mean(table: tuple[list[float], list[float]], num_generated_tokens: int,
                          max_tokens: int | None) -> tuple[float, int]:
        ordered, prefix = table
        n = len(ordered)
        lo = bisect.bisect_right(ordered, num_generated_tokens)  # first L > generated
        count = n - lo
        if count == 0:
            return math.nan, 0
        if max_tokens is None:
            return (prefix[n] - prefix[lo]) / count, count
        hi = max(bisect.bisect_left(ordered, max_tokens), lo)  # first L >= cap
        return (prefix[hi] - prefix[lo] + (n - hi) * max_tokens) / count, count

    def expected_output_tokens(self, num_predicted_tokens: int, num_generated_tokens: int,
                               max_tokens: int | None = None) -> int:
        cap = max_tokens if max_tokens is not None and max_tokens > num_generated_tokens else None
        table = self._bins[bisect.bisect_right(self._edges, num_predicted_tokens)]
        mean, count = self._conditional_mean(table, num_generated_tokens, cap)
        if count < MIN_SAMPLES_PER_ESTIMATE:
            mean, count = self._conditional_mean(self._pooled, num_generated_tokens, cap)
        if count < MIN_SAMPLES_PER_ESTIMATE:
            mean = num_generated_tokens + self._tail_excess_tokens
        return _cap(mean, num_generated_tokens, cap)


class QuantileResidual:
    """``E[min(L, cap) | L > generated]`` under one request's predicted length distribution.

    The distribution is given by quantiles ``q_i`` at levels ``p_i``; between consecutive points (plus ``(0,
    1 token)`` below the first and, above the last, an end point continuing the last segment's slope in log space
    up to level 1) it is log-uniform (the CDF is linear in ``log L``), so both ``P(L > x)`` and ``∫_x^∞ L dF`` have
    closed forms per segment; suffix sums make each estimate O(log segments). Past the last end point, the request
    is assumed to need the mean excess of the top segment (at least `NUM_EXTRA_TOKENS_PAPER`) more.

    Args:
        levels: probability levels, ascending in (0, 1).
        quantile_tokens: the request's length at each level, tokens (>= 1, non-decreasing).

    Attributes:
        last_quantile_tokens: the length at the highest level, tokens.

    Raises:
        ValueError: lengths differ, levels not ascending in (0, 1), or quantiles not non-decreasing and >= 1.
    """

    name = "quantiles"

    def __init__(self, levels: Sequence[float], quantile_tokens: Sequence[float]) -> None:
        levels, qs = [float(x) for x in levels], [float(x) for x in quantile_tokens]
        if len(levels) != len(qs) or not levels or any(b <= a for a, b in zip(levels, levels[1:])) \
                or not (0 < levels[0] and levels[-1] < 1) or not all(map(math.isfinite, qs)) or qs[0] < 1 \
                or any(b < a for a, b in zip(qs, qs[1:])):
            raise ValueError(f"need ascending levels in (0, 1) and non-decreasing quantiles >= 1 token, got "
                             f"{levels} and {qs}")
        # the last segment's log-slope continued to level 1, at most MAX_TOP_FACTOR past the last quantile (close
        # levels would otherwise overflow)
        top = qs[-1] * math.exp(min(math.log(qs[-1] / qs[-2]) * (1 - levels[-1]) / (levels[-1] - levels[-2]),
                                    math.log(MAX_TOP_FACTOR))) if len(qs) > 1 else qs[-1]
        self.last_quantile_tokens = qs[-1]
        points = [1.0, *qs, top]
        masses = [b - a for a, b in zip([0.0, *levels], [*levels, 1.0])]
        self._lo, self._hi, self._mass = points[:-1], points[1:], masses
        # per segment: its mass above its lower end and its integral of L dF (a point mass where lo == hi)
        self._integral = [m * ((hi - lo) / math.log(hi / lo) if hi > lo else lo)
                          for lo, hi, m in zip(self._lo, self._hi, masses)]
        n = len(masses)
        self._suffix_mass = [math.fsum(masses[k:]) for k in range(n + 1)]
        self._suffix_integral = [math.fsum(self._integral[k:]) for k in range(n + 1)]
        self._tail_excess_tokens = max(self._integral[-1] / masses[-1] - self._lo[-1] if masses[-1] > 0 else 0.0,
                                       float(NUM_EXTRA_TOKENS_PAPER))

    def _above(self, x: float) -> tuple[float, float]:
        """``(P(L > x), ∫_{L > x} L dF)``."""
        k = bisect.bisect_right(self._lo, x) - 1  # the segment whose lower end is <= x
        if k < 0:
            return self._suffix_mass[0], self._suffix_integral[0]
        lo, hi, m = self._lo[k], self._hi[k], self._mass[k]
        if x >= hi:
            return self._suffix_mass[k + 1], self._suffix_integral[k + 1]
        share = math.log(hi / x) / math.log(hi / lo)  # hi > x >= lo, so hi > lo
        return (self._suffix_mass[k + 1] + m * share,
                self._suffix_integral[k + 1] + m * (hi - x) / math.log(hi / lo))

    def expected_output_tokens(self, num_predicted_tokens: int, num_generated_tokens: int,
                               max_tokens: int | None = None) -> int:
        """As `ResidualLengthModel.expected_output_tokens`; ``num_predicted_tokens`` is not read (the quantiles
        replace it)."""
        cap = max_tokens if max_tokens is not None and max_tokens > num_generated_tokens else None
        mass, integral = self._above(num_generated_tokens)
        if mass <= 1e-9:
            return _cap(num_generated_tokens + self._tail_excess_tokens, num_generated_tokens, cap)
        if cap is not None:
            mass_cap, integral_cap = self._above(cap)
            integral = integral - integral_cap + cap * mass_cap
        return _cap(integral / mass, num_generated_tokens, cap)


class RequestQuantiles(Protocol):
    """What `TaggerQuantileResidual` reads of a tagger's quantiles (``tagger.quantiles.LengthQuantiles``)."""

    levels: tuple[float, ...]

    def quantile_tokens(self, estimate_log1p: float, has_history: bool) -> tuple[float, ...]: ...


MAX_DISTRIBUTIONS_CACHED = 4096
"""Predicted lengths whose distribution a `TaggerQuantileResidual` keeps (then it starts over)."""


class TaggerQuantileResidual(ResidualLengthModel):
    """A tagger's requests priced by each one's own predicted distribution: the `QuantileResidual` of the
    tagger's calibrated quantiles around the request's estimate (``quantiles.quantile_tokens(log1p(predicted),
    has_history)``, split-conformal offsets per bin of the estimate and first / later turn: ``tagger/quantiles.py``).

    A request that has generated its top quantile's length (q99 for the shipped taggers: it has outlived 99% of
    the distribution it was given, so that distribution was wrong for it) is priced by ``beyond`` instead, when
    given: the tagger's held-out replies that ran that long (`EmpiricalResidual`), whose heavy tail keeps a long
    request long, where the request's own distribution would only add its top segment's excess.

    The quantiles depend on the request only through (predicted tokens, first or later turn), so one rule per
    turn kind serves every request and its distributions are memoised per predicted length.

    Args:
        quantiles: the tagger's quantiles (``tagger.quantiles.LengthQuantiles``).
        has_history: True for requests with earlier turns (a chat's second message on), False for first turns.
        beyond: the rule past the top quantile (None = the request's own distribution there too).
    """

    name = "quantiles"

    def __init__(self, quantiles: RequestQuantiles, has_history: bool,
                 beyond: ResidualLengthModel | None = None) -> None:
        self.quantiles, self.has_history, self.beyond = quantiles, has_history, beyond
        self._by_predicted: dict[int, QuantileResidual] = {}

    def distribution(self, num_predicted_tokens: int) -> QuantileResidual:
        """The distribution of a request predicted at ``num_predicted_tokens`` (>= 1, smaller is taken as 1)."""
        key = max(int(num_predicted_tokens), 1)
        found = self._by_predicted.get(key)
        if found is None:
            if len(self._by_predicted) >= MAX_DISTRIBUTIONS_CACHED:
                self._by_predicted.clear()
            found = self._by_predicted[key] = QuantileResidual(
                self.quantiles.levels, self.quantiles.quantile_tokens(math.log1p(key), self.has_history))
        return found

    def expected_output_tokens(self, num_predicted_tokens: int, num_generated_tokens: int,
                               max_tokens: int | None = None) -> int:
        own = self.distribution(num_predicted_tokens)
        if self.beyond is not None and num_generated_tokens >= own.last_quantile_tokens:
            return self.beyond.expected_output_tokens(num_predicted_tokens, num_generated_tokens, max_tokens)
        return own.expected_output_tokens(num_predicted_tokens, num_generated_tokens, max_tokens)


RESIDUAL_RULES = ("empirical", "paper", "exact")
"""Names of the rules (``--residual-lengths`` of the sidecar and the cluster benchmark)."""
