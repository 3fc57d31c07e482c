"""`astrolabe bench tagger`: per-request latency of the in-process tagger service on this CPU.

For each tagger (the light one, and the transformer one when torch is installed) and each concurrency level
(default 1 and 16), it sends ``--num-requests`` distinct held-out ShareGPT prompts through
``tagger.serve.TaggerService`` (the path the extproc uses; cache disabled so every request runs the model) from
``concurrency`` concurrent callers, times each ``await estimate(...)`` with ``time.perf_counter``, and prints p50 /
p99 / mean milliseconds, the process CPU time per request (``time.process_time``: the event loop, the worker
thread and the model together, i.e. what a decision pays on this CPU), the requests tagged inline, batches run,
and requests per second. The light tagger runs twice: as the extproc serves it (``tagger.serve.load_service``:
prompts up to ``LIGHT_INLINE_MAX_CHARS`` characters tagged inline on the caller's thread, longer ones batched on
the worker thread) and batched only (every prompt through the worker thread and the 1 ms batching window).

The transformer row uses ``--transformer DIR`` (a trained tagger directory; default ``.cache/tagger/minilm``
when it exists) or, without one, a fresh regression head on all-MiniLM-L6-v2 (same cost per request).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from astrolabe.cli import HelpFormatter
from astrolabe.logs import setup_logging
from bench.workloads import REPO_ROOT

logger = logging.getLogger(__name__)

DEFAULT_TRANSFORMER_DIR = REPO_ROOT / ".cache" / "tagger" / "minilm"


@dataclass(frozen=True, slots=True)
class LatencyRow:
    """Latency of one (tagger, concurrency) run; times in seconds."""

    tagger: str
    concurrency: int
    num_requests: int
    p50_s: float
    p99_s: float
    mean_s: float
    num_batches: int
    throughput_qps: float
    cpu_per_request_s: float = 0.0
    num_inline: int = 0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by linear interpolation (numpy's default method)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


async def measure(service, prompts: Sequence[str], concurrency: int, name: str) -> LatencyRow:
    """Send every prompt once from ``concurrency`` concurrent callers; returns the latency row."""
    latencies_s: list[float] = []
    queue = list(reversed(prompts))
    batches_before, inline_before = service.num_batches, service.num_inline

    async def caller() -> None:
        while queue:
            prompt = queue.pop()
            start_s = time.perf_counter()
            await service.estimate(prompt, None, None)
            latencies_s.append(time.perf_counter() - start_s)

    start_s, start_cpu_s = time.perf_counter(), time.process_time()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    elapsed_s, cpu_s = time.perf_counter() - start_s, time.process_time() - start_cpu_s
    return LatencyRow(name, concurrency, len(latencies_s), percentile(latencies_s, 0.5),
                      percentile(latencies_s, 0.99), statistics.fmean(latencies_s),
                      service.num_batches - batches_before, len(latencies_s) / elapsed_s,
                      cpu_s / max(len(latencies_s), 1), service.num_inline - inline_before)


def _services(args: argparse.Namespace) -> list[tuple[str, object]]:
    from tagger.serve import TaggerService, load_length_fallback, load_service, load_tagger

    services: list[tuple[str, object]] = []
    if "light" in args.kinds:
        services.append(("light (as served)", load_service(None, cache_size=0)))
        services.append(("light (batched only)", TaggerService(load_tagger(None), cache_size=0)))
    if "transformer" not in args.kinds:
        return services
    try:
        import torch

        torch.set_num_threads(args.threads)
        from tagger.model import TransformerTagger
    except ImportError as exc:
        logger.warning("no transformer row: %s (make install-tagger)", exc)
        return services
    directory = args.transformer or (DEFAULT_TRANSFORMER_DIR if DEFAULT_TRANSFORMER_DIR.exists() else None)
    if directory is not None:
        tagger, name = load_tagger(directory), f"transformer ({directory})"
        fallback = load_length_fallback(directory)
    else:
        tagger, name, fallback = TransformerTagger.from_checkpoint(), "transformer (MiniLM, untrained head)", None
    services.append((name, TaggerService(tagger, length_fallback=fallback, cache_size=0)))
    return services


def format_rows(rows: Sequence[LatencyRow]) -> str:
    """The latency table as Markdown."""
    lines = ["| tagger | concurrency | requests | p50 ms | p99 ms | mean ms | CPU ms/req | inline | batches | req/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r.tagger} | {r.concurrency} | {r.num_requests} | {r.p50_s * 1e3:.2f} | {r.p99_s * 1e3:.2f} | "
              f"{r.mean_s * 1e3:.2f} | {r.cpu_per_request_s * 1e3:.2f} | {r.num_inline} | {r.num_batches} | "
              f"{r.throughput_qps:.0f} |" for r in rows]
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> list[LatencyRow]:
    """Measure every (tagger, concurrency) pair; prompts come from the held-out split, in split order."""
    from tagger.data import load_split

    prompts = [e.prompt for e in load_split().test_first[: args.num_requests]]
    rows = []
    for name, service in _services(args):
        try:
            await service.estimate(prompts[0], None, None)  # warm-up: first-call allocations, thread start
            for concurrency in args.concurrency:
                rows.append(await measure(service, prompts, concurrency, name))
        finally:
            service.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``astrolabe bench tagger``; prints the table, returns 0."""
    parser = argparse.ArgumentParser(prog="astrolabe bench tagger", description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--num-requests", type=int, default=200, help="distinct held-out prompts per run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16],
                        help="concurrent callers, one run per value")
    parser.add_argument("--transformer", type=Path, default=None,
                        help="trained transformer tagger directory; default: .cache/tagger/minilm when it exists, "
                             "else a fresh head on all-MiniLM-L6-v2 (same cost per request)")
    parser.add_argument("--kinds", nargs="+", choices=("light", "transformer"), default=["light", "transformer"],
                        help="taggers to time (transformer: when torch is installed)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the transformer tagger")
    args = parser.parse_args(argv)
    setup_logging("INFO")
    rows = asyncio.run(run(args))
    print(format_rows(rows))
    return 0
