"""Execution time of one engine step, as a function of the `ScheduledBatch`.

Owns the `BatchTimeModel` protocol, the fitted `LinearBatchTimeModel` (JSON files shipped beside this module,
one per model shape) and the code that fits it on profiling data. Imports only the standard library, numpy
and `predictor.sim`; file I/O only in the explicit load/save functions.

Provenance of `h200_iteration_profile.csv` (a copy of /work/shared/data/h200_iteration_profile.csv; its
README is /work/shared/data/README.md): execution time of one serving iteration (one forward pass of a
continuous-batching engine) measured on one NVIDIA H200 (141 GB HBM3e, driver 580.159, torch 2.11.0+cu130,
bf16) on 2026-11-30: 81 batch shapes for each of `llama-2-7b` and `qwen2-7b`, 86 for `llama-3-8b` (which adds
decode at 8k and 16k context). Method (Vidur-style, op level): per decoder layer the kernels a vLLM-like engine
runs (RMSNorm, fused QKV GEMM, rotary, attention as causal SDPA for prefill and SDPA over a contiguous KV cache
for decode, output GEMM, RMSNorm, fused gate/up GEMM, SiLU·mul, down GEMM), then the LM head for one row per
sequence; random bf16 weights and activations. Each shape was captured in a CUDA graph and replayed (`graph_ms`,
median of 3-15 replays), so Python and kernel-launch overhead are excluded; a real engine adds its own
per-iteration CPU overhead on top. Rows are `prefill` (prompt tokens only, no earlier context), `decode` (one
token per running sequence) or `mixed` (one chunked-prefill chunk beside decodes).

The model, per the data README: t = c0 + c1·batch_tokens + c2·Σ prefill_len² + c3·decode_ctx_sum + c4·num_seqs,
fitted by least squares weighted by 1/t (minimising relative error). Fitted on the whole CSV, the shipped JSON
files reach a MAPE of 5.65% (llama-2-7b), 5.76% (qwen2-7b) and 5.10% (llama-3-8b) over all rows of each model
(llama-2-7b by kind: prefill 8.5%, decode 4.5%, mixed 2.7%); the README reports ~5.7%. c4 comes out slightly
negative (about -1 µs per sequence), which is harmless beside c0 (about 5.7 ms).
Regenerate them with `write_shipped_models()`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from predictor.sim.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)

SIM_DIR = Path(__file__).resolve().parent
"""Folder of this package: the shipped JSON models and the profile CSV live here."""
PROFILE_CSV_PATH = SIM_DIR / "h200_iteration_profile.csv"
"""The shipped copy of the H200 iteration profile (see the module docstring)."""


class BatchTimeModel(Protocol):
    """Maps a scheduled batch to its execution time."""

    def step_time_s(self, batch: ScheduledBatch) -> float:
        """Execution time of one engine step running `batch`, in seconds (> 0 for a non-empty batch)."""
        ...


@dataclass(frozen=True, slots=True)
class ProfileRow:
    """One measured batch shape of the profile CSV (see the module docstring for the columns).

    Attributes:
        model: Model shape name, e.g. "llama-2-7b".
        kind: "prefill", "decode" or "mixed".
        prefill_seqs: Prefill sequences in the batch.
        prefill_len: Tokens of each prefill (no earlier context).
        decode_seqs: Decoding sequences in the batch.
        decode_ctx_sum: Sum of the decodes' KV context lengths, tokens.
        batch_tokens: prefill_seqs·prefill_len + decode_seqs, tokens.
        time_s: Measured iteration time (CUDA-graph replay median), seconds.
    """

    model: str
    kind: str
    prefill_seqs: int
    prefill_len: int
    decode_seqs: int
    decode_ctx_sum: int
    batch_tokens: int
    time_s: float

    def to_batch(self) -> ScheduledBatch:
        """The equivalent `ScheduledBatch` (request ids are synthetic)."""
        num_scheduled_tokens = {f"p{i}": self.prefill_len for i in range(self.prefill_seqs)}
        num_scheduled_tokens.update({f"d{i}": 1 for i in range(self.decode_seqs)})
        return ScheduledBatch(
            num_scheduled_tokens=num_scheduled_tokens,
            num_prefill_tokens=self.prefill_seqs * self.prefill_len,
            prefill_attention_work=self.prefill_seqs * self.prefill_len**2,
            num_decode_seqs=self.decode_seqs,
            decode_context_tokens=self.decode_ctx_sum,
        )


@dataclass(frozen=True, slots=True)
class LinearBatchTimeModel:
    """t = c0 + c1·batch_tokens + c2·prefill_attention_work + c3·decode_context_tokens + c4·num_seqs (seconds).

    Attributes:
        model: Model shape the coefficients were fitted for.
        c0_s: Fixed cost of a step, seconds.
        c1_s_per_token: Cost per scheduled token (GEMMs), seconds/token.
        c2_s_per_token2: Cost per unit of prefill attention work, seconds/token².
        c3_s_per_token: Cost per decode context token (KV reads), seconds/token.
        c4_s_per_seq: Cost per sequence (LM head, per-sequence kernels), seconds/sequence.
    """

    model: str
    c0_s: float
    c1_s_per_token: float
    c2_s_per_token2: float
    c3_s_per_token: float
    c4_s_per_seq: float

    def step_time_s(self, batch: ScheduledBatch) -> float:
        """Execution time of `batch`, seconds; 0.0 for an empty batch (nothing runs)."""
        if not batch.num_scheduled_tokens:
            return 0.0
        return self.step_time_from_counts_s(
            batch.total_num_scheduled_tokens, batch.prefill_attention_work, batch.decode_context_tokens, batch.num_seqs
        )

    def step_time_from_counts_s(
        self, num_tokens: int, prefill_attention_work: int, decode_context_tokens: int, num_seqs: int
    ) -> float:
        """Execution time of a non-empty step given its `ScheduledBatch` totals, seconds.

        The one place the formula is evaluated (`step_time_s` and the fast predictor,
        `predictor.sim.fast_predict`, both call it), so both give bit-identical times.

        Args:
            num_tokens: Scheduled tokens (`total_num_scheduled_tokens`).
            prefill_attention_work: `ScheduledBatch.prefill_attention_work`, tokens².
            decode_context_tokens: `ScheduledBatch.decode_context_tokens`, tokens.
            num_seqs: Requests in the step (`ScheduledBatch.num_seqs`), >= 1.
        """
        return (
            self.c0_s
            + self.c1_s_per_token * num_tokens
            + self.c2_s_per_token2 * prefill_attention_work
            + self.c3_s_per_token * decode_context_tokens
            + self.c4_s_per_seq * num_seqs
        )

    def decode_run_time_s(self, batch: ScheduledBatch, num_steps: int) -> float:
        """Total time of `batch` (decodes only) and the num_steps - 1 steps after it in which the same requests
        decode again, each step adding one context token per sequence, seconds.

        Closed form of Σ_{j<k} step_time(batch with decode context + j·n) = k·t₁ + c3·n·k(k-1)/2 (k = num_steps,
        n = decodes, t₁ = step_time_s(batch)), exact because the model is linear in decode context.

        Raises:
            ValueError: If num_steps < 1 or the batch holds prefill tokens.
        """
        if num_steps < 1 or batch.num_prefill_tokens:
            raise ValueError("decode_run_time_s needs num_steps >= 1 and a decode-only batch")
        return self.decode_run_time_from_counts_s(batch.num_decode_seqs, batch.decode_context_tokens, num_steps)

    def decode_run_time_from_counts_s(self, num_decode_seqs: int, decode_context_tokens: int, num_steps: int) -> float:
        """`decode_run_time_s` from counts: num_steps steps of num_decode_seqs decodes (>= 1), the first with
        decode_context_tokens context tokens, each later one with num_decode_seqs more, seconds.

        Same closed form as `decode_run_time_s` (k·t₁ + c3·n·k(k-1)/2); num_steps >= 1 is not checked here.
        """
        first_s = self.step_time_from_counts_s(num_decode_seqs, 0, decode_context_tokens, num_decode_seqs)
        growth_s = self.c3_s_per_token * num_decode_seqs * (num_steps * (num_steps - 1) // 2)
        return num_steps * first_s + growth_s

    def scaled(self, factor: float) -> LinearBatchTimeModel:
        """The same model with every step ``factor`` times as long (an emulator's time scale, a slower GPU).

        Raises:
            ValueError: ``factor`` is not > 0.
        """
        if not factor > 0:
            raise ValueError(f"time scale must be > 0, got {factor}")
        return dataclasses.replace(self, c0_s=self.c0_s * factor, c1_s_per_token=self.c1_s_per_token * factor,
                                   c2_s_per_token2=self.c2_s_per_token2 * factor,
                                   c3_s_per_token=self.c3_s_per_token * factor,
                                   c4_s_per_seq=self.c4_s_per_seq * factor)

    def to_json(self, path: str | Path) -> None:
        """Write the coefficients to a JSON file (one object, the attribute names as keys).

        Raises:
            OSError: If the file cannot be written.
        """
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, path: str | Path) -> LinearBatchTimeModel:
        """Read a model written by `to_json`.

        Raises:
            OSError: If the file cannot be read.
            ValueError: If it is not JSON, or keys are missing/unknown, or a coefficient is not a finite number.
        """
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, dict) or set(data) != set(names):
            raise ValueError(f"{path}: expected a JSON object with exactly the keys {names}")
        if not isinstance(data["model"], str):
            raise ValueError(f"{path}: model must be a string")
        for name in names[1:]:
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{path}: {name} must be a finite number, got {value!r}")
        return cls(**{name: (data[name] if name == "model" else float(data[name])) for name in names})

    @classmethod
    def default(cls, model: str = "llama-2-7b") -> LinearBatchTimeModel:
        """The shipped model fitted on the H200 profile for `model`.

        Raises:
            ValueError: If no shipped model has that name (the message lists the known ones).
        """
        known = known_models()
        if model not in known:
            raise ValueError(f"unknown batch-time model {model!r}; known models: {', '.join(known)}")
        return cls.from_json(SIM_DIR / f"{model}.json")


def known_models() -> list[str]:
    """Names of the shipped batch-time models (the JSON files beside this module), sorted."""
    return sorted(p.stem for p in SIM_DIR.glob("*.json"))


def load_profile(csv_path: str | Path, model: str) -> list[ProfileRow]:
    """Rows of a profile CSV (format of /work/shared/data/h200_iteration_profile.csv) for one model.

    Uses `graph_ms`, converted to seconds here.

    Raises:
        OSError: If the file cannot be read.
        ValueError: If a column is missing or malformed, or no row has that model.
    """
    rows: list[ProfileRow] = []
    with open(csv_path, newline="", encoding="utf-8") as f:
        for line_no, rec in enumerate(csv.DictReader(f), start=2):
            if rec.get("model") != model:
                continue
            try:
                rows.append(
                    ProfileRow(
                        model=model,
                        kind=rec["kind"],
                        prefill_seqs=int(rec["prefill_seqs"]),
                        prefill_len=int(rec["prefill_len"]),
                        decode_seqs=int(rec["decode_seqs"]),
                        decode_ctx_sum=int(rec["decode_ctx_sum"]),
                        batch_tokens=int(rec["batch_tokens"]),
                        time_s=float(rec["graph_ms"]) / 1000.0,
                    )
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{csv_path}:{line_no}: malformed row: {exc}") from exc
    if not rows:
        raise ValueError(f"{csv_path}: no rows for model {model!r}")
    return rows


def _design_matrix(rows: Sequence[ProfileRow]) -> np.ndarray:
    """Features [1, batch_tokens, Σ prefill_len², decode_ctx_sum, num_seqs], shape (len(rows), 5)."""
    return np.array(
        [
            [
                1.0,
                r.batch_tokens,
                r.prefill_seqs * r.prefill_len**2,
                r.decode_ctx_sum,
                r.prefill_seqs + r.decode_seqs,
            ]
            for r in rows
        ],
        dtype=np.float64,
    )


def fit_linear(rows: Sequence[ProfileRow]) -> LinearBatchTimeModel:
    """Least-squares fit of `LinearBatchTimeModel`, weighted by 1/time (minimises squared relative error).

    Args:
        rows: Profile rows of one model, at least 5.

    Returns:
        The fitted model (named after the rows' model).

    Raises:
        ValueError: If rows are fewer than 5, mix models, or have non-positive times.
    """
    if len(rows) < 5:
        raise ValueError(f"need at least 5 rows to fit 5 coefficients, got {len(rows)}")
    models = {r.model for r in rows}
    if len(models) != 1:
        raise ValueError(f"rows mix models: {sorted(models)}")
    times_s = np.array([r.time_s for r in rows], dtype=np.float64)
    if np.any(times_s <= 0):
        raise ValueError("every row's time must be > 0")
    # Dividing each equation by its time makes the residual a relative error.
    features = _design_matrix(rows) / times_s[:, None]
    coeffs, *_ = np.linalg.lstsq(features, np.ones_like(times_s), rcond=None)
    c0, c1, c2, c3, c4 = (float(c) for c in coeffs)
    return LinearBatchTimeModel(models.pop(), c0, c1, c2, c3, c4)


def mape(model: BatchTimeModel, rows: Sequence[ProfileRow]) -> float:
    """Mean absolute percentage error of `model` over `rows`, as a fraction (0.057 = 5.7%).

    Raises:
        ValueError: If rows is empty.
    """
    if not rows:
        raise ValueError("rows is empty")
    errors = [abs(model.step_time_s(r.to_batch()) - r.time_s) / r.time_s for r in rows]
    return float(np.mean(errors))


HOLDOUT_EVERY = 5
"""Every HOLDOUT_EVERY-th shape of each kind is held out of the fit (see `split_holdout`)."""


def split_holdout(rows: Sequence[ProfileRow]) -> tuple[list[ProfileRow], list[ProfileRow]]:
    """Fixed train / held-out split of profile rows: 1 shape in `HOLDOUT_EVERY` of each kind is held out.

    Within each kind (prefill, decode, mixed), rows are sorted by shape (prefill_seqs, prefill_len, decode_seqs,
    decode_ctx_sum) and those at positions 2, 7, 12, ... are held out. Why: stratifying by kind keeps every
    kind in both sets; a stable shape order makes the split independent of CSV row order; starting at 2 keeps
    the smallest and largest shapes of each kind in the training set, so held-out error measures
    interpolation between profiled shapes, which is how the model is used (no extrapolation claims).

    Returns:
        (train rows, held-out rows), each in that sorted order, kinds in the order prefill, decode, mixed,
        then any other kind alphabetically.
    """
    order = {"prefill": 0, "decode": 1, "mixed": 2}
    kinds = sorted({r.kind for r in rows}, key=lambda kind: (order.get(kind, len(order)), kind))
    train: list[ProfileRow] = []
    heldout: list[ProfileRow] = []
    for kind in kinds:
        shapes = sorted(
            (r for r in rows if r.kind == kind),
            key=lambda r: (r.prefill_seqs, r.prefill_len, r.decode_seqs, r.decode_ctx_sum, r.time_s),
        )
        for index, row in enumerate(shapes):
            (heldout if index % HOLDOUT_EVERY == 2 else train).append(row)
    return train, heldout


def write_shipped_models(
    csv_path: str | Path = PROFILE_CSV_PATH, out_dir: str | Path = SIM_DIR, models: Sequence[str] | None = None
) -> dict[str, float]:
    """Fit one model per model name on the whole CSV and write `<out_dir>/<model>.json` for each.

    Args:
        csv_path: Profile CSV.
        out_dir: Folder to write the JSON files to.
        models: Model names to fit; None = every model in the CSV.

    Returns:
        model name -> MAPE (fraction) of its fit on all its rows.

    Raises:
        OSError, ValueError: As `load_profile`, `fit_linear` and `LinearBatchTimeModel.to_json`.
    """
    if models is None:
        with open(csv_path, newline="", encoding="utf-8") as f:
            models = sorted({rec["model"] for rec in csv.DictReader(f)})
    mapes: dict[str, float] = {}
    for name in models:
        rows = load_profile(csv_path, name)
        fitted = fit_linear(rows)
        fitted.to_json(Path(out_dir) / f"{name}.json")
        mapes[name] = mape(fitted, rows)
        logger.info("fitted %s on %d rows: MAPE %.2f%%", name, len(rows), 100 * mapes[name])
    return mapes
