"""The light tagger: ridge regression on hashed word 1-2-grams plus prompt-length features, numpy only.

Owns: fitting (closed-form ridge solved by Jacobi-preconditioned conjugate gradients on the normal equations,
never forming the 2^18-wide matrix), prediction, and the ``light.npz`` file. Imports numpy and
``tagger.features`` only; this is the tagger used when no transformer checkpoint is configured, so it must
load and run without torch.

Model: ``log1p(tokens) ≈ intercept + w_s · hashed_ngrams(prompt) + w_d · standardise(dense(prompt))``,
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
from tagger.features import DEFAULT_NUM_BUCKETS, DENSE_NAMES, FeatureBatch, featurize

logger = logging.getLogger(__name__)

LIGHT_FILE = "light.npz"
DEFAULT_ALPHA = 1.0
"""Ridge penalty; chosen on a 10 % validation cut of the training split (never on the test split)."""

_CG_MAX_ITERS = 500
_CG_REL_TOL = 1e-6


class _Design:
    """The design matrix ``A = [hashed n-grams | standardised dense]`` as two matrix-vector products."""

    def __init__(self, batch: FeatureBatch, dense_mean: np.ndarray, dense_std: np.ndarray) -> None:
        self.batch = batch
        self.rows = batch.row_ids()
        self.dense = (batch.dense - dense_mean) / dense_std
        self.width = batch.num_buckets + self.dense.shape[1]

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
        batch = featurize([e.prompt for e in examples], num_buckets)
        y = log1p_tokens([e.num_output_tokens for e in examples])
        dense_mean = batch.dense.mean(axis=0)
        dense_std = np.where(batch.dense.std(axis=0) > 0, batch.dense.std(axis=0), 1.0)
        design = _Design(batch, dense_mean, dense_std)
        w = solve_ridge(design, y - y.mean(), alpha)
        intercept = float(np.mean(y - design.dot(w)))
        return cls(w[:num_buckets], w[num_buckets:], dense_mean, dense_std, intercept, alpha)

    def predict_features(self, batch: FeatureBatch) -> np.ndarray:
        """Predicted ``log1p(tokens)`` for featurised prompts; float64 ``(batch.num_rows,)``."""
        design = _Design(batch, self.dense_mean, self.dense_std)
        return design.dot(self._weights) + self.intercept

    def predict_log1p(self, prompts: Sequence[str]) -> np.ndarray:
        """Predicted ``log1p(num_output_tokens)`` per prompt; float64 ``(len(prompts),)``."""
        return self.predict_features(featurize(prompts, self.num_buckets))

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
