"""The light tagger: ridge regression on hashed word 1-2-grams plus prompt-length features, numpy only.

Owns: fitting (closed-form ridge solved by Jacobi-preconditioned conjugate gradients on the normal equations,
never forming the 2^18-wide matrix), prediction, and the ``light.npz`` file. Imports numpy and
``tagger.features`` only; this is the tagger used when no transformer checkpoint is configured, so it must
load and run without torch.

Model: ``log1p(tokens) ≈ intercept + w_s · hashed_ngrams(prompt) + w_d · standardise(dense(prompt, history))``,
minimising ``||y - ŷ||² + alpha (||w_s||² + ||w_d||²)`` (the intercept is not penalised: targets are centred
before the solve and the intercept is the mean residual after it).
Source: ridge normal equations ``(AᵀA + αI) w = Aᵀy`` (Hoerl & Kennard 1970); CG as in Shewchuk (1994),
"An Introduction to the Conjugate Gradient Method Without the Agonizing Pain", section B3 (preconditioned).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tagger.artifact import TaggerLoadError, log1p_tokens
from tagger.data import Example
from tagger.features import DEFAULT_NUM_BUCKETS, DENSE_NAMES, FeatureBatch, HistoryStats, featurize

logger = logging.getLogger(__name__)

LIGHT_FILE = "light.npz"
DEFAULT_ALPHA = 1.0
"""Ridge penalty; chosen on a 10 % validation cut of the training split (never on the test split)."""

PAIRWISE_EPOCHS = 3
"""Passes of the pairwise ranking refinement after the ridge solve (0: plain ridge). On a 10 % validation cut of
the training split (by conversation) three passes raised Kendall tau from 0.474 to 0.487 on every exchange and
from 0.334 to 0.357 on first exchanges (one to five passes: +0.007..+0.014 and +0.012..+0.023)."""
PAIRWISE_LEARNING_RATE = 0.01
PAIRWISE_BATCH_SIZE = 512
PAIRWISE_L2 = 1e-6

_CG_MAX_ITERS = 500
_CG_REL_TOL = 1e-6


class _Design:
    """The design matrix ``A = [hashed n-grams | standardised dense]`` as two matrix-vector products."""

    def __init__(self, batch: FeatureBatch, dense_mean: np.ndarray, dense_std: np.ndarray) -> None:
        self.batch = batch
        self.rows = batch.row_ids()
        self.dense = (batch.dense - dense_mean) / dense_std
        self.width = batch.num_buckets + self.dense.shape[1]
        self.dense_mean, self.dense_std = dense_mean, dense_std

    def take(self, rows: np.ndarray) -> _Design:
        """The design of the given rows, same standardisation."""
        return _Design(self.batch.take(rows), self.dense_mean, self.dense_std)

    def dot(self, w: np.ndarray) -> np.ndarray:
        """``A w``: shape ``(n,)``."""
        b = self.batch
        sparse = np.bincount(self.rows, weights=b.values * w[b.indices], minlength=b.num_rows)
        return sparse + self.dense @ w[b.num_buckets :]

    def tdot(self, u: np.ndarray) -> np.ndarray:
        """``Aᵀ u``: shape ``(width,)``."""
        b = self.batch
        sparse = np.bincount(b.indices, weights=b.values * u[self.rows], minlength=b.num_buckets)
        return np.concatenate([sparse, self.dense.T @ u])

    def gram_diagonal(self) -> np.ndarray:
        """Diagonal of ``AᵀA`` (the Jacobi preconditioner)."""
        b = self.batch
        sparse = np.bincount(b.indices, weights=b.values**2, minlength=b.num_buckets)
        return np.concatenate([sparse, (self.dense**2).sum(axis=0)])


def solve_ridge(design: _Design, y: np.ndarray, alpha: float) -> np.ndarray:
    """Solve ``(AᵀA + αI) w = Aᵀy`` by preconditioned CG; returns ``w`` of shape ``(design.width,)``."""
    rhs = design.tdot(y)
    inv_diag = 1.0 / (design.gram_diagonal() + alpha)
    w = np.zeros(design.width)
    r = rhs.copy()
    z = inv_diag * r
    p = z.copy()
    rz = float(r @ z)
    rhs_norm = float(np.linalg.norm(rhs)) or 1.0
    for iteration in range(_CG_MAX_ITERS):
        q = design.tdot(design.dot(p)) + alpha * p
        step = rz / float(p @ q)
        w += step * p
        r -= step * q
        if np.linalg.norm(r) <= _CG_REL_TOL * rhs_norm:
            logger.debug("ridge CG converged after %d iterations", iteration + 1)
            break
        z = inv_diag * r
        rz_next = float(r @ z)
        p = z + (rz_next / rz) * p
        rz = rz_next
    else:
        logger.warning("ridge CG stopped at %d iterations (relative residual %.2e)", _CG_MAX_ITERS,
                       np.linalg.norm(r) / rhs_norm)
    return w


def featurize_examples(examples: Sequence[Example], num_buckets: int = DEFAULT_NUM_BUCKETS) -> FeatureBatch:
    """Features of examples: each one's prompt and conversation so far."""
    return featurize([e.prompt for e in examples], num_buckets, [HistoryStats.of(e.history) for e in examples])


def refine_pairwise(design: _Design, y: np.ndarray, w: np.ndarray, epochs: int = PAIRWISE_EPOCHS,
                    seed: int = 0) -> np.ndarray:
    """Refine weights ``w`` (shape ``(design.width,)``) for ranking: Adam on the pairwise logistic loss
    ``log(1 + exp(-sign(y_i - y_j) (s_i - s_j)))`` over every pair of a shuffled mini-batch of
    `PAIRWISE_BATCH_SIZE` examples (RankNet: Burges et al. 2005, "Learning to rank using gradient descent", ICML),
    plus ``PAIRWISE_L2 * ||w||^2 / 2``, starting from the ridge solution. Adam: Kingma & Ba 2015. Returns the new
    weights (the scale of ``s`` is no longer ``log1p(tokens)``: the caller recalibrates it)."""
    rng = np.random.default_rng(seed)
    w = w.copy()
    m, v = np.zeros_like(w), np.zeros_like(w)
    step = 0
    for _ in range(epochs):
        order = rng.permutation(len(y))
        for start in range(0, len(y), PAIRWISE_BATCH_SIZE):
            rows = order[start:start + PAIRWISE_BATCH_SIZE]
            sub = design.take(rows)
            s, target = sub.dot(w), y[rows]
            sign = np.sign(target[:, None] - target[None, :])
            # d loss / d (s_i - s_j) = -sign * sigmoid(-sign * (s_i - s_j)); each unordered pair appears twice.
            g = -sign / (1.0 + np.exp(np.clip(sign * (s[:, None] - s[None, :]), -30.0, 30.0)))
            coefficient = (g.sum(axis=1) - g.sum(axis=0)) / max(np.count_nonzero(sign), 1)
            grad = sub.tdot(coefficient) + PAIRWISE_L2 * w
            step += 1
            m = 0.9 * m + 0.1 * grad
            v = 0.999 * v + 0.001 * grad * grad
            w -= PAIRWISE_LEARNING_RATE * (m / (1 - 0.9**step)) / (np.sqrt(v / (1 - 0.999**step)) + 1e-8)
    return w


class LightTagger:
    """Hashed n-gram + length ridge regression predicting ``log1p(num_output_tokens)``.

    Attributes:
        kind: ``"light"``.
        sparse_weights: float64 ``(num_buckets,)``.
        dense_weights: float64 ``(len(DENSE_NAMES),)`` on standardised dense features.
        dense_mean, dense_std: standardisation of the dense features (training statistics).
        intercept: in ``log1p(tokens)``.
        alpha: ridge penalty used.
    """

    kind = "light"

    def __init__(self, sparse_weights: np.ndarray, dense_weights: np.ndarray, dense_mean: np.ndarray,
                 dense_std: np.ndarray, intercept: float, alpha: float) -> None:
        # One vector [sparse | dense] built once (views keep the two names): concatenating the 2^18 weights per
        # request cost ~0.17 ms of the ~0.37 ms a prediction took (astrolabe bench extproc's profile).
        self._weights = np.concatenate([np.asarray(sparse_weights, dtype=np.float64),
                                        np.asarray(dense_weights, dtype=np.float64)])
        self.sparse_weights = self._weights[:len(sparse_weights)]
        self.dense_weights = self._weights[len(sparse_weights):]
        self.dense_mean = np.asarray(dense_mean, dtype=np.float64)
        self.dense_std = np.asarray(dense_std, dtype=np.float64)
        self.intercept = float(intercept)
        self.alpha = float(alpha)

    @property
    def num_buckets(self) -> int:
        return len(self.sparse_weights)

    @classmethod
    def fit(cls, examples: Sequence[Example], alpha: float = DEFAULT_ALPHA,
            num_buckets: int = DEFAULT_NUM_BUCKETS) -> LightTagger:
        """Fit on ``examples`` (a few seconds for ~8,000 examples on one core).

        Raises:
            ValueError: no examples or ``alpha <= 0``.
        """
        if not examples or not alpha > 0:
            raise ValueError(f"need examples and alpha > 0 (got {len(examples)} examples, alpha={alpha})")
        return cls.fit_features(featurize_examples(examples, num_buckets),
                                log1p_tokens([e.num_output_tokens for e in examples]), alpha)

    @classmethod
    def fit_features(cls, batch: FeatureBatch, y: np.ndarray, alpha: float = DEFAULT_ALPHA,
                     pairwise_epochs: int = PAIRWISE_EPOCHS) -> LightTagger:
        """Fit on featurised examples and their targets ``log1p(tokens)`` (float ``(batch.num_rows,)``): the ridge
        solve, then `refine_pairwise` for ``pairwise_epochs`` passes, then a least-squares line from the refined
        score back to ``log1p(tokens)`` (so that predictions stay in tokens; a line keeps the ranking).

        Raises:
            ValueError: no rows, a target count that differs, or ``alpha <= 0``.
        """
        if batch.num_rows == 0 or len(y) != batch.num_rows or not alpha > 0:
            raise ValueError(f"need rows, one target per row and alpha > 0 (got {batch.num_rows} rows, "
                             f"{len(y)} targets, alpha={alpha})")
        num_buckets = batch.num_buckets
        dense_mean = batch.dense.mean(axis=0)
        dense_std = np.where(batch.dense.std(axis=0) > 0, batch.dense.std(axis=0), 1.0)
        design = _Design(batch, dense_mean, dense_std)
        w = solve_ridge(design, y - y.mean(), alpha)
        if pairwise_epochs > 0 and len(y) > 1:
            w = refine_pairwise(design, y, w, pairwise_epochs)
            score = design.dot(w)
            slope = float(np.polyfit(score, y, 1)[0]) if np.ptp(score) > 0 else 1.0
            w *= slope if slope > 0 else 1.0
        intercept = float(np.mean(y - design.dot(w)))
        return cls(w[:num_buckets], w[num_buckets:], dense_mean, dense_std, intercept, alpha)

    def predict_features(self, batch: FeatureBatch) -> np.ndarray:
        """Predicted ``log1p(tokens)`` for featurised prompts; float64 ``(batch.num_rows,)``."""
        design = _Design(batch, self.dense_mean, self.dense_std)
        return design.dot(self._weights) + self.intercept

    def predict_log1p(self, prompts: Sequence[str], histories: Sequence[HistoryStats] | None = None) -> np.ndarray:
        """Predicted ``log1p(num_output_tokens)`` per prompt (a chat request's last user message) given what came
        before it (``histories``, same order; None = first turns); float64 ``(len(prompts),)``."""
        return self.predict_features(featurize(prompts, self.num_buckets, histories))

    def save(self, directory: Path) -> Path:
        """Write ``DIR/light.npz`` (weights as float32: ~1 MiB); returns its path."""
        path = Path(directory) / LIGHT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(
            path, sparse_weights=self.sparse_weights.astype(np.float32), dense_weights=self.dense_weights,
            dense_mean=self.dense_mean, dense_std=self.dense_std, intercept=self.intercept, alpha=self.alpha,
            dense_names=np.array(DENSE_NAMES),
        )
        return path

    @classmethod
    def load(cls, directory: Path) -> LightTagger:
        """Read ``DIR/light.npz``.

        Raises:
            TaggerLoadError: missing or malformed file, or features that differ from ``tagger.features``.
        """
        path = Path(directory) / LIGHT_FILE
        try:
            with np.load(path) as data:
                if tuple(data["dense_names"].tolist()) != DENSE_NAMES:
                    raise TaggerLoadError(f"{path}: dense features differ from tagger.features; retrain it")
                return cls(data["sparse_weights"], data["dense_weights"], data["dense_mean"], data["dense_std"],
                           float(data["intercept"]), float(data["alpha"]))
        except (OSError, KeyError, ValueError) as exc:
            raise TaggerLoadError(f"cannot read light tagger {path}: {exc}") from exc
