"""A trained tagger's directory: its metadata file, the tagger interface, and the target transform.

Owns: the on-disk layout shared by training (writes) and serving (reads) and the ``log1p`` target transform.
Imports only the stdlib, numpy and ``tagger.features``; must not import torch.

Directory layout (``astrolabe tagger train -o DIR``)::

    DIR/tagger.json   metadata: kind ("light" | "transformer"), target, split seed, training time, ...
    DIR/light.npz     light tagger weights (kind "light")
    DIR/model/        transformers ``save_pretrained`` model + tokenizer (kind "transformer")
    DIR/errors.npz    measured held-out errors (see ``tagger.errors``)
    DIR/eval.json     the held-out eval table (see ``tagger.evaluate``)

Target: every tagger predicts ``log1p(num_output_tokens)``. Reply lengths are right-skewed (ShareGPT first
replies: median 252, p99 966 tokens); in log space the squared loss weighs a 2x error the same for short and
long replies, which is what ranking requests by length needs, and ``expm1`` of the mean log is a median-like
estimate, which keeps MAE low on the skewed labels.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tagger.features import HistoryStats

MODEL_SUBDIR = "model"
"""Sub-directory of a transformer tagger directory holding its encoder and tokenizer (``save_pretrained``)."""

logger = logging.getLogger(__name__)

META_FILE = "tagger.json"
ERRORS_FILE = "errors.npz"
EVAL_FILE = "eval.json"
KINDS = ("light", "transformer")


class TaggerLoadError(RuntimeError):
    """A tagger directory is missing, incomplete, or of an unknown kind."""


class LengthTagger(Protocol):
    """What serving and evaluation need from any tagger."""

    kind: str

    def predict_log1p(self, prompts: Sequence[str], histories: Sequence[HistoryStats] | None = None) -> np.ndarray:
        """Predicted ``log1p(num_output_tokens)`` per prompt; float64 array of shape ``(len(prompts),)``.

        ``prompts`` are a chat request's last user message; ``histories`` (same order, None = first turns) what
        came before it (``tagger.features.HistoryStats``; a tagger that does not read them ignores them)."""
        ...


def log1p_tokens(num_tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """The training target: ``log1p`` of token counts, float64 array."""
    return np.log1p(np.asarray(num_tokens, dtype=np.float64))


def tokens_from_log1p(log1p_values: np.ndarray) -> np.ndarray:
    """Inverse of :func:`log1p_tokens`, rounded to whole tokens and at least 1; int64 array."""
    return np.maximum(1, np.rint(np.expm1(np.asarray(log1p_values, dtype=np.float64)))).astype(np.int64)


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    """Write ``DIR/tagger.json`` (creating DIR); ``meta["kind"]`` must be one of :data:`KINDS`.

    Raises:
        ValueError: unknown kind.
    """
    if meta.get("kind") not in KINDS:
        raise ValueError(f"tagger kind must be one of {KINDS}, got {meta.get('kind')!r}")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def read_meta(directory: Path) -> dict[str, Any]:
    """Read ``DIR/tagger.json``.

    Raises:
        TaggerLoadError: the file is missing, unreadable, or names an unknown kind.
    """
    path = Path(directory) / META_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TaggerLoadError(f"cannot read tagger metadata {path}: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("kind") not in KINDS:
        raise TaggerLoadError(f"{path}: kind must be one of {KINDS}")
    return meta
