"""``astrolabe predictor profile``: measure a live vLLM backend's iteration times with controlled batches.

For each batch shape it sends N concurrent ``/v1/completions`` requests whose prompts are lists of N·P random
token ids (exact lengths, whatever the tokenizer; random so that prefix caching finds nothing) and reads the
time from the backend's own Prometheus histograms, as deltas over the shape's run:

- ``prefill`` rows (N prompts of P tokens, ``max_tokens=1``): ``vllm:request_prefill_time_seconds`` sum/count =
  the mean time of the step that ran each prefill;
- ``decode`` rows (N prompts of P tokens, ``max_tokens=D``, ``ignore_eos``): ``vllm:inter_token_latency_seconds``
  sum/count = the mean decode step time while the N requests decode together; the context is taken at its
  mean over the run (P + D/2 per sequence).

Rows are written in the format of ``predictor/sim/h200_iteration_profile.csv`` (``graph_ms`` = the measured
mean, ``eager_ms`` the same figure, ``spread`` the relative spread of the repeats) so that
``astrolabe predictor fit`` and `predictor.sim.batch_time.fit_linear` read them unchanged.

Known limits: requests that reach the engine in different steps make a prefill row the mean of smaller batches
(so keep N·P within ``max_num_batched_tokens`` and N within ``max_num_seqs``); no ``mixed`` rows are measured.
The histograms include the engine's per-step CPU overhead, which is what the predictor must model.
"""

from __future__ import annotations

import asyncio
import csv
import logging
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from predictor.backend_metrics import histogram_totals
from predictor.sim.batch_time import LinearBatchTimeModel, ProfileRow, _design_matrix, fit_linear

logger = logging.getLogger(__name__)

CSV_COLUMNS = ("gpu", "model", "kind", "prefill_seqs", "prefill_len", "prefill_tokens", "decode_seqs", "decode_ctx",
               "decode_ctx_sum", "batch_tokens", "graph_ms", "eager_ms", "reps", "spread")
"""Columns of ``predictor/sim/h200_iteration_profile.csv``."""

PREFILL_METRIC = "vllm:request_prefill_time_seconds"
DECODE_METRIC = "vllm:inter_token_latency_seconds"
TOKEN_ID_RANGE = (1000, 5000)
"""Random prompt token ids are drawn from this range: ordinary tokens in any vocabulary of >= 5000 entries."""


@dataclass(frozen=True, slots=True)
class Shape:
    """One controlled batch: ``num_seqs`` requests of ``num_prompt_tokens`` each, ``num_output_tokens`` out."""

    kind: str
    num_seqs: int
    num_prompt_tokens: int
    num_output_tokens: int = 1


def parse_shapes(text: str, kind: str, num_output_tokens: int = 1) -> list[Shape]:
    """``"1x16,4x64"`` (requests x prompt tokens) -> shapes.

    Raises:
        ValueError: malformed text or a count < 1.
    """
    shapes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        seqs, _, tokens = item.partition("x")
        shape = Shape(kind, int(seqs), int(tokens), num_output_tokens)
        if shape.num_seqs < 1 or shape.num_prompt_tokens < 1:
            raise ValueError(f"bad shape {item!r}: counts must be >= 1")
        shapes.append(shape)
    return shapes


DEFAULT_PREFILL_SHAPES = "1x16,1x64,1x128,2x32,2x64,4x32,4x64"
DEFAULT_DECODE_SHAPES = "1x32,2x32,4x32,8x32,4x128,8x96"
DEFAULT_DECODE_TOKENS = 32


def default_shapes() -> list[Shape]:
    """The shapes ``astrolabe predictor profile`` measures by default (sized for a 256-token, 16-sequence server)."""
    return (parse_shapes(DEFAULT_PREFILL_SHAPES, "prefill")
            + parse_shapes(DEFAULT_DECODE_SHAPES, "decode", DEFAULT_DECODE_TOKENS))


class BackendProfiler:
    """Drives one backend (``host:port`` or ``http://host:port``) with controlled batches.

    Args:
        backend: the vLLM server.
        rng: seeded source of the random prompt token ids.
        timeout_s: limit of one request, seconds.
    """

    def __init__(self, backend: str, rng: random.Random, timeout_s: float = 120.0) -> None:
        self.base_url = backend if backend.startswith("http") else f"http://{backend}"
        self.rng = rng
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.model = ""

    async def _model(self, session: aiohttp.ClientSession) -> str:
        async with session.get(f"{self.base_url}/v1/models") as response:
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]

    async def _totals(self, session: aiohttp.ClientSession, name: str) -> tuple[float, float]:
        async with session.get(f"{self.base_url}/metrics") as response:
            response.raise_for_status()
            return histogram_totals(await response.text(), name)

    async def _complete(self, session: aiohttp.ClientSession, shape: Shape) -> None:
        prompt = [self.rng.randrange(*TOKEN_ID_RANGE) for _ in range(shape.num_prompt_tokens)]
        body = {"model": self.model, "prompt": prompt, "max_tokens": shape.num_output_tokens,
                "ignore_eos": True, "temperature": 0.0}
        async with session.post(f"{self.base_url}/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"backend answered {response.status}: {(await response.text())[:200]}")
            await response.read()

    async def measure(self, session: aiohttp.ClientSession, shape: Shape) -> float:
        """Mean step time of one run of ``shape``, seconds.

        Raises:
            RuntimeError: a request failed, or the histogram did not move.
        """
        name = PREFILL_METRIC if shape.kind == "prefill" else DECODE_METRIC
        sum_before, count_before = await self._totals(session, name)
        await asyncio.gather(*(self._complete(session, shape) for _ in range(shape.num_seqs)))
        # vLLM updates its histograms when the engine's output is processed: poll until this run is counted.
        expected = shape.num_seqs * (1 if shape.kind == "prefill" else shape.num_output_tokens - 1)
        for _ in range(50):
            sum_after, count_after = await self._totals(session, name)
            if count_after - count_before >= expected:
                break
            await asyncio.sleep(0.05)
        if count_after <= count_before:
            raise RuntimeError(f"{name} did not change: is {self.base_url} a vLLM server?")
        return (sum_after - sum_before) / (count_after - count_before)

    async def run(self, shapes: list[Shape], repeats: int, device_name: str) -> list[dict]:
        """Measure every shape ``repeats`` times (after one warm-up request); returns CSV rows (dicts)."""
        rows = []
        async with aiohttp.ClientSession(timeout=self.timeout) as session:
            self.model = await self._model(session)
            await self._complete(session, Shape("decode", 1, 8, 4))  # warm-up: first-request costs
            for shape in shapes:
                times_s = [await self.measure(session, shape) for _ in range(repeats)]
                rows.append(_csv_row(shape, times_s, self.model, device_name))
                logger.info("%s %dx%d: %.2f ms", shape.kind, shape.num_seqs, shape.num_prompt_tokens,
                            1000 * statistics.median(times_s))
        return rows


def _csv_row(shape: Shape, times_s: list[float], model: str, device_name: str) -> dict:
    median_ms = 1000 * statistics.median(times_s)
    spread = (max(times_s) - min(times_s)) / statistics.median(times_s) if len(times_s) > 1 else 0.0
    if shape.kind == "prefill":
        counts = dict(prefill_seqs=shape.num_seqs, prefill_len=shape.num_prompt_tokens,
                      prefill_tokens=shape.num_seqs * shape.num_prompt_tokens, decode_seqs=0, decode_ctx=0,
                      decode_ctx_sum=0, batch_tokens=shape.num_seqs * shape.num_prompt_tokens)
    else:
        # Context grows by one token per step: its mean over the run is prompt + half the output.
        ctx = shape.num_prompt_tokens + shape.num_output_tokens // 2
        counts = dict(prefill_seqs=0, prefill_len=0, prefill_tokens=0, decode_seqs=shape.num_seqs, decode_ctx=ctx,
                      decode_ctx_sum=shape.num_seqs * ctx, batch_tokens=shape.num_seqs)
    return dict(gpu=device_name, model=model, kind=shape.kind, **counts, graph_ms=round(median_ms, 4),
                eager_ms=round(median_ms, 4), reps=len(times_s), spread=round(spread, 4))


def write_profile_csv(rows: list[dict], path: Path) -> None:
    """Write rows in the shipped profile's column order.

    Raises:
        OSError: unwritable path.
    """
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def rows_to_profile(rows: list[dict]) -> list[ProfileRow]:
    """The `ProfileRow`s of measured rows (as `predictor.sim.batch_time.load_profile` would read them)."""
    return [ProfileRow(model=r["model"], kind=r["kind"], prefill_seqs=r["prefill_seqs"],
                       prefill_len=r["prefill_len"], decode_seqs=r["decode_seqs"],
                       decode_ctx_sum=r["decode_ctx_sum"], batch_tokens=r["batch_tokens"],
                       time_s=r["graph_ms"] / 1000.0) for r in rows]


def fit_nonnegative(rows: list[ProfileRow]) -> LinearBatchTimeModel:
    """`fit_linear`'s weighted least squares with every coefficient >= 0 (active-set: drop the most negative
    coefficient's feature and refit, until none is negative).

    Why: on noisy, overhead-dominated backends (a tiny model on a shared CPU) the free fit can give negative
    per-token costs, which make long batches predict negative times. Same features and 1/t weighting as
    `predictor.sim.batch_time.fit_linear`.

    Raises:
        ValueError: as `fit_linear` (fewer than 5 rows, mixed models, non-positive times).
    """
    free = fit_linear(rows)  # validates the rows
    names = ("c0_s", "c1_s_per_token", "c2_s_per_token2", "c3_s_per_token", "c4_s_per_seq")
    coeffs = np.array([getattr(free, n) for n in names])
    times_s = np.array([r.time_s for r in rows], dtype=np.float64)
    features = _design_matrix(rows) / times_s[:, None]
    active = list(range(len(names)))
    while (coeffs[active] < 0).any():
        active.remove(min(active, key=lambda i: coeffs[i]))
        coeffs = np.zeros(len(names))
        if active:
            solution, *_ = np.linalg.lstsq(features[:, active], np.ones_like(times_s), rcond=None)
            coeffs[active] = solution
    return LinearBatchTimeModel(free.model, *(float(c) for c in coeffs))
