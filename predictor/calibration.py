"""Online calibration of the batch execution-time model from the steps the engine actually ran.

`StepTimeCalibrator` keeps the last ``window`` observed steps (batch shape + measured duration, from the vLLM
plugin's or the emulator's state file: `StepSample`) and refits `LinearBatchTimeModel` from them every
``refit_interval_s``. The shipped model it starts from (the prior) was measured on an idle H200 with CUDA graphs;
a real engine adds its own per-step CPU work, and another GPU, model or load moves every coefficient. The fit is
the shipped one's (`predictor.sim.batch_time.fit_linear`: least squares on relative error) with a ridge term that
pulls the coefficients toward the prior scaled by the window's total measured time over the prior's, so a window of steps
that all look alike (a steady batch of 8 decodes makes the fixed and the per-sequence cost inseparable) keeps the
prior's shape, uniformly scaled, in the directions it cannot identify, and moves only those it can.

Guards (each counted in `CalibrationStatus`):
  - minimum sample size: no refit before ``min_samples`` steps (cold start = the prior);
  - outlier rejection: after a first fit, steps whose relative residual is more than ``outlier_k`` robust
    standard deviations (1.4826 × MAD) from the median are dropped and the fit is repeated;
  - bounded rate of change: one refit changes the model's predicted time of any recent step by at most a factor
    ``max_change`` (the new coefficients are blended with the old until that holds);
  - floor: no coefficient falls below `COEFFICIENT_FLOOR` (a quarter) of the prior's, scaled by the window's total
    measured/prior ratio (noisy steps once priced a prefill 20x below the truth);
  - fallback: a refit whose error on the most recent quarter of the window (held out of the fit) is not lower
    than the current model's is rejected, and the last good model stays.

An idle engine runs no steps, so it adds no samples and never moves the model.
The confidence reported in every Predict answer, in ``State`` and in the metrics is `CalibrationStatus`: samples
in the window, the current model's mean absolute relative error on them (the residual), refits accepted and
rejected. Imports only the standard library, numpy and `predictor.sim`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from predictor.sim.batch_time import LinearBatchTimeModel

MIN_STEP_S = 1e-6
"""Shortest step duration taken, seconds."""
MAX_STEP_S = 600.0
"""Longest step duration taken, seconds."""
MAX_REGRESSOR = 1 << 24
"""Largest token, sequence or context count taken for one step (16.7 M)."""

_COEFFS = ("c0_s", "c1_s_per_token", "c2_s_per_token2", "c3_s_per_token", "c4_s_per_seq")


@dataclass(frozen=True, slots=True)
class StepSample:
    """One engine step as the engine ran it.

    Attributes:
        num_tokens: tokens scheduled in the step (prefill chunks + decodes).
        prefill_attention_work: Σ over prefill chunks of chunk_len × (context before + chunk_len), tokens².
        decode_context_tokens: Σ over decodes of their context length (incl. the new token), tokens.
        num_seqs: requests in the step (>= 1).
        duration_s: measured wall time of the step's iteration, seconds (> 0).
    """

    num_tokens: int
    prefill_attention_work: int
    decode_context_tokens: int
    num_seqs: int
    duration_s: float

    def features(self) -> tuple[float, float, float, float, float]:
        """[1, num_tokens, prefill_attention_work, decode_context_tokens, num_seqs]: the model's regressors."""
        return (1.0, float(self.num_tokens), float(self.prefill_attention_work),
                float(self.decode_context_tokens), float(self.num_seqs))


@dataclass(frozen=True, slots=True)
class CalibrationStatus:
    """How sure the sidecar is of its step-time model.

    Attributes:
        source: "prior" (the shipped model, not refitted yet) or "online" (refitted from this engine's steps).
        num_samples: steps in the window now.
        num_samples_total: steps ever observed.
        residual: the current model's mean absolute relative error over the window's steps (0.1 = 10%);
            NaN with no samples.
        prior_residual: the prior's error over the same steps (what calibration gained), NaN with no samples.
        num_refits: refits accepted. num_rejected: refits rejected by the fallback guard.
        num_outliers: steps dropped as outliers by the last refit.
        scale_vs_prior: the current model's predicted time over the prior's, median over the window's steps
            (1.0 before any refit).
    """

    source: str
    num_samples: int
    num_samples_total: int
    residual: float
    prior_residual: float
    num_refits: int
    num_rejected: int
    num_outliers: int
    scale_vs_prior: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_REFERENCE_STEP = np.array([1.0, 256.0, 256.0 * 256.0, 16 * 1024.0, 16.0])
"""Regressors of a typical busy step ([1, tokens, prefill attention work, decode context, sequences]: a 256-token
prefill chunk beside 16 decodes of 1,024-token context): the floor of each term's unit in `_ridge_fit`."""


def _predict(coeffs: np.ndarray, features: np.ndarray) -> np.ndarray:
    return features @ coeffs


def _coeffs(model: LinearBatchTimeModel) -> np.ndarray:
    return np.array([getattr(model, name) for name in _COEFFS], dtype=np.float64)


class StepTimeCalibrator:
    """Refits the step-time model from observed steps (see the module docstring).

    Args:
        prior: the model to start from (shipped shape, already scaled by the sidecar's time scale).
        window: steps kept (the newest), >= 16.
        min_samples: steps needed before the first refit (and in the window for any refit).
        refit_interval_s: least time between refits, seconds.
        max_change: largest factor by which one refit may change a step's predicted time (> 1).
        ridge: strength of the pull toward the current coefficients, relative to one step's squared error.
        outlier_k: robust standard deviations beyond which a step's residual is an outlier.

    Raises:
        ValueError: a parameter out of range.
    """

    def __init__(self, prior: LinearBatchTimeModel, *, window: int = 512, min_samples: int = 64,
                 refit_interval_s: float = 1.0, max_change: float = 1.5, ridge: float = 1.0,
                 outlier_k: float = 4.0) -> None:
        if window < 16 or not 1 <= min_samples <= window:
            raise ValueError(f"need window >= 16 and 1 <= min_samples <= window, got {window}, {min_samples}")
        if not max_change > 1 or not ridge >= 0 or not outlier_k > 0 or not refit_interval_s >= 0:
            raise ValueError("need max_change > 1, ridge >= 0, outlier_k > 0, refit_interval_s >= 0")
        self.prior = prior
        self.model = prior
        self.window = window
        self.min_samples = min_samples
        self.refit_interval_s = refit_interval_s
        self.max_change = max_change
        self.ridge = ridge
        self.outlier_k = outlier_k
        self._samples: collections.deque[StepSample] = collections.deque(maxlen=window)
        self._last_refit_s = -math.inf
        self.num_samples_total = 0
        self._samples_at_refit = -1
        self.num_refits = 0
        self.num_rejected = 0
        self.num_outliers = 0

    def observe(self, samples) -> None:
        """Add observed steps (an iterable of `StepSample`); steps with no sequence or no token, a duration
        outside [`MIN_STEP_S`, `MAX_STEP_S`] or a regressor beyond `MAX_REGRESSOR` (its square for the
        attention work) are ignored: no engine step looks like that, and they would overflow the fit."""
        for sample in samples:
            if (sample.num_seqs >= 1 and sample.num_tokens >= 1
                    and MIN_STEP_S <= sample.duration_s <= MAX_STEP_S
                    and max(sample.num_tokens, sample.num_seqs, sample.decode_context_tokens) <= MAX_REGRESSOR
                    and sample.prefill_attention_work <= MAX_REGRESSOR**2):
                self._samples.append(sample)
                self.num_samples_total += 1

    def maybe_refit(self, now_s: float) -> bool:
        """Refit if due (``refit_interval_s`` since the last, ``min_samples`` in the window, new steps since the
        last refit); True if the model changed. ``now_s``: seconds on any monotonic clock."""
        if (len(self._samples) < self.min_samples or now_s - self._last_refit_s < self.refit_interval_s
                or self.num_samples_total == self._samples_at_refit):  # nothing new (an idle engine)
            return False
        self._last_refit_s = now_s
        self._samples_at_refit = self.num_samples_total
        return self.refit()

    def refit(self) -> bool:
        """Refit now from the window (guards in the module docstring); True if the new model was accepted.
        Never raises: a fit numpy cannot solve counts as rejected."""
        try:
            with np.errstate(all="ignore"):
                return self._refit()
        except (np.linalg.LinAlgError, ValueError, FloatingPointError):
            self.num_rejected += 1
            return False

    def _refit(self) -> bool:
        samples = list(self._samples)
        if len(samples) < self.min_samples:
            return False
        features = np.array([s.features() for s in samples], dtype=np.float64)
        times = np.array([s.duration_s for s in samples], dtype=np.float64)
        n_recent = max(len(samples) // 4, 1)
        train = slice(0, max(len(samples) - n_recent, min(len(samples), 5)))
        old = _coeffs(self.model)
        # The ridge pulls toward the prior scaled by the window's median ratio of measured to prior times, not
        # toward the current model: in directions the window cannot identify (every step with the same number
        # of sequences makes c0 and c4 collinear) the answer stays the prior's shape, uniformly slower or
        # faster, which is what a slower GPU, a loaded CPU or another model size mostly is.
        # The scale is the ratio of the window's total measured time to the prior's total for the same steps, not a
        # median of per-step ratios: an engine that runs late and catches up (the emulator on a loaded CPU, a
        # host that stalls) scatters single steps widely while their sum stays right, and a window of catch-up
        # steps once put the median at 1/20 of the truth.
        prior = _coeffs(self.prior)
        predicted = float(np.sum(_predict(prior, features)))
        ratio = float(np.sum(times)) / predicted if predicted > 0 else 1.0
        around = prior * (ratio if math.isfinite(ratio) and ratio > 0 else 1.0)
        fitted, outliers = self._fit(features[train], times[train], around)
        if fitted is None:
            self.num_rejected += 1
            return False
        new = _floored(self._bounded(old, fitted, features), around)
        if not np.all(np.isfinite(new)):
            self.num_rejected += 1
            return False
        recent = slice(len(samples) - n_recent, len(samples))
        if _error(new, features[recent], times[recent]) >= _error(old, features[recent], times[recent]):
            self.num_rejected += 1
            return False
        # Accepted: refit on the whole window (the held-out quarter included), with the same guards.
        refit_all, outliers = self._fit(features, times, around)
        if refit_all is not None and np.all(np.isfinite(
                candidate := _floored(self._bounded(old, refit_all, features), around))):
            new = candidate
        self.num_outliers = outliers
        self.model = LinearBatchTimeModel(self.prior.model, *(float(c) for c in new))
        self.num_refits += 1
        return True

    def _fit(self, features: np.ndarray, times: np.ndarray, around: np.ndarray) -> tuple[np.ndarray | None, int]:
        keep = np.ones(len(times), dtype=bool)
        coeffs = None
        for _ in range(2):  # fit, drop outliers, fit again
            coeffs = _ridge_fit(features[keep], times[keep], around, self.ridge)
            if coeffs is None:
                return None, 0
            rel = _predict(coeffs, features) / times - 1.0
            median = float(np.median(rel[keep]))
            sigma = 1.4826 * float(np.median(np.abs(rel[keep] - median)))
            new_keep = np.abs(rel - median) <= self.outlier_k * max(sigma, 0.02)
            if new_keep.sum() < max(self.min_samples // 2, 5) or np.array_equal(new_keep, keep):
                break
            keep = new_keep
        return coeffs, int((~keep).sum())

    def _bounded(self, old: np.ndarray, new: np.ndarray, features: np.ndarray) -> np.ndarray:
        """Blend ``new`` toward ``old`` until no step's predicted time changes by more than ``max_change``."""
        old_t = _predict(old, features)
        for alpha in (1.0, 0.75, 0.5, 0.35, 0.25, 0.15, 0.1, 0.05):
            candidate = old + alpha * (new - old)
            ratio = _predict(candidate, features) / old_t
            if np.all(ratio > 0) and np.all(np.maximum(ratio, 1.0 / ratio) <= self.max_change):
                return candidate
        # Even a small step overshoots somewhere: a uniform rescale by the bounded median ratio is always safe.
        ratio = float(np.median(_predict(new, features) / old_t))
        return old * min(max(ratio if ratio > 0 else 1.0, 1.0 / self.max_change), self.max_change)

    def status(self) -> CalibrationStatus:
        """The confidence figures (see `CalibrationStatus`)."""
        samples = list(self._samples)
        if samples:
            features = np.array([s.features() for s in samples], dtype=np.float64)
            times = np.array([s.duration_s for s in samples], dtype=np.float64)
            current, prior = _coeffs(self.model), _coeffs(self.prior)
            residual, prior_residual = _error(current, features, times), _error(prior, features, times)
            scale = float(np.median(_predict(current, features) / _predict(prior, features)))
        else:
            residual = prior_residual = math.nan
            scale = 1.0
        return CalibrationStatus(source="online" if self.num_refits else "prior", num_samples=len(samples),
                                 num_samples_total=self.num_samples_total, residual=residual,
                                 prior_residual=prior_residual, num_refits=self.num_refits,
                                 num_rejected=self.num_rejected, num_outliers=self.num_outliers,
                                 scale_vs_prior=scale)


COEFFICIENT_FLOOR = 0.25
"""No fitted coefficient falls below this fraction of the prior's (scaled by the window's total measured/prior
ratio): a window of noisy steps must not make a step's cost vanish. Measured through Envoy on a loaded 2-core
machine: emulator steps measured at 0.6-9 ms where the model says 6 ms, and a refit that priced a 69-token
prefill at 0.34 ms (20x below the others), whose sidecar then drew 15 of a 64-request burst over 8 instances."""


def _floored(coeffs: np.ndarray, around: np.ndarray) -> np.ndarray:
    """``coeffs`` with each coefficient at least `COEFFICIENT_FLOOR` x its (non-negative) value in ``around``."""
    return np.maximum(coeffs, COEFFICIENT_FLOOR * np.maximum(around, 0.0))


def _error(coeffs: np.ndarray, features: np.ndarray, times: np.ndarray) -> float:
    """Mean absolute relative error of the model ``coeffs`` on these steps."""
    return float(np.mean(np.abs(_predict(coeffs, features) / times - 1.0)))


def _ridge_fit(features: np.ndarray, times: np.ndarray, around: np.ndarray, ridge: float) -> np.ndarray | None:
    """Least squares on relative error (as `predictor.sim.batch_time.fit_linear`) plus a ridge pull toward ``around``,
    under the constraints that keep every batch's time positive, not only the observed ones'.

    Solved in unit-free variables: x_j = c_j · m_j / T (m_j: the larger of regressor j's mean over these steps and
    its value in `_REFERENCE_STEP`; T: their median time), i.e. each term's share of a typical step, so the penalty ridge · Σ (x_j − x_j(around))² weighs
    every coefficient alike. A regressor that is zero on every step (prefill attention on a decode-only window)
    cannot be identified and keeps its value from ``around``. Constraints: c0 > 0 and c1, c2, c3 >= 0 (a
    coefficient that comes out below its bound is fixed there and the rest refitted), then c4 >= −c1 (every
    sequence schedules at least one token, so c1·tokens + c4·seqs >= 0). Returns None if the solution is not
    finite.
    """
    means = features.mean(axis=0)
    median_t = float(np.median(times))
    # Each term's unit is its size in the window or in a reference step, whichever is larger, so a regressor the
    # window barely exercises (5-token prefills) cannot swing its coefficient to whatever fits the noise.
    scale = np.maximum(means, _REFERENCE_STEP)
    lower = np.array([1e-3 * median_t, 0.0, 0.0, 0.0, -np.inf])
    coeffs = around.copy()
    free = [j for j in np.flatnonzero(means > 0)]
    for _ in range(len(lower)):
        fixed = [j for j in range(len(lower)) if j not in free]
        cols = np.array(free, dtype=int)
        units = median_t / scale[cols]  # c_j = x_j * units_j
        a = (features[:, cols] / times[:, None]) * units
        target = 1.0 - (features[:, fixed] @ coeffs[fixed]) / times if fixed else np.ones(len(times))
        reg = math.sqrt(ridge) * np.eye(len(cols))
        x, *_ = np.linalg.lstsq(np.vstack([a, reg]), np.concatenate([target, reg @ (around[cols] / units)]),
                                rcond=None)
        coeffs[cols] = x * units
        violated = [j for j in free if coeffs[j] < lower[j]]
        if not violated:
            break
        for j in violated:  # fix at the bound (c0: a small positive floor) and refit the others
            coeffs[j] = max(lower[j], 0.0) if j else lower[j]
            free.remove(j)
    coeffs[4] = max(coeffs[4], -coeffs[1])
    if not np.all(np.isfinite(coeffs)):
        return None
    return coeffs
