"""``astrolabe bench plugin-overhead``: what the vLLM state plugin costs the engine.

Two measurements:

1. **Throughput A/B** on a real vLLM server (tiny model, ``deploy.vllm.launch``): the same closed-loop workload
   (``--concurrency`` clients, each sending ``/v1/completions`` with a fixed random-token prompt and
   ``max_tokens`` with ``ignore_eos``, until ``--num-requests`` are done) against a server with the plugin
   enabled and one with it disabled, alternated ``--rounds`` times (A B A B ...) so that drift in the machine's
   load hits both alike. One server runs at a time. Printed: generated tokens/s per run and the ratio of medians.
2. **Per-publish cost** of `predictor.vllm_plugin.publisher.StatePublisher` on a scheduler-shaped object with
   ``running``/``waiting`` requests (no vLLM needed): microseconds per publish, which bounds the plugin's share
   of each engine step (it publishes at most once per step, and at most every 10 ms unless queues change).
3. **Per-step cost of step times** (the batch shape and duration of every step, for the sidecar's online
   calibration): microseconds per step on the engine thread, for 16 and 256 requests in the step.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from astrolabe.cli import HelpFormatter
from astrolabe.logs import setup_logging
from astrolabe.procs import ProcessGroup
from deploy.vllm.launch import REPO_DIR, SERVED_MODEL_NAME, start_vllm_servers
from predictor.vllm_plugin.publisher import StatePublisher

logger = logging.getLogger(__name__)


async def _closed_loop(address: str, num_requests: int, concurrency: int, prompt_tokens: int,
                       output_tokens: int, rng: random.Random) -> float:
    """Generated tokens per second of a closed-loop run."""
    prompts = [[rng.randrange(1000, 5000) for _ in range(prompt_tokens)] for _ in range(num_requests)]
    queue = list(range(num_requests))
    timeout = aiohttp.ClientTimeout(total=600)

    async def client(session):
        while queue:
            body = {"model": SERVED_MODEL_NAME, "prompt": prompts[queue.pop()], "max_tokens": output_tokens,
                    "ignore_eos": True}
            async with session.post(f"http://{address}/v1/completions", json=body) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"{address} answered {response.status}")

    async with aiohttp.ClientSession(timeout=timeout) as session:
        start_s = time.monotonic()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return num_requests * output_tokens / (time.monotonic() - start_s)


def throughput_ab(args: argparse.Namespace) -> dict[str, list[float]]:
    """Tokens/s per run, keyed ``plugin`` / ``no-plugin``."""
    runs: dict[str, list[float]] = {"plugin": [], "no-plugin": []}
    for round_index in range(args.rounds):
        for plugin in (True, False) if round_index % 2 == 0 else (False, True):
            with ProcessGroup() as procs:
                (server,) = start_vllm_servers(procs, 1, args.work_dir, plugin=plugin)
                # Warm-up (first requests pay one-off costs), then the measured run with the same seed each time.
                asyncio.run(_closed_loop(server.address, 8, 4, args.prompt_tokens, 8, random.Random(99)))
                tokens_per_s = asyncio.run(_closed_loop(server.address, args.num_requests, args.concurrency,
                                                        args.prompt_tokens, args.output_tokens,
                                                        random.Random(args.seed)))
            runs["plugin" if plugin else "no-plugin"].append(tokens_per_s)
            logger.warning("round %d plugin=%s: %.0f tokens/s", round_index, plugin, tokens_per_s)
    return runs


class _Request:
    def __init__(self, i: int) -> None:
        self.request_id = f"cmpl-{i:032x}-0-abcdef12"
        self.num_prompt_tokens = 100 + i
        self.num_computed_tokens = 100 + i if i % 2 else 0
        self.num_output_tokens = i
        self.num_preemptions = 0
        self.sampling_params = type("SP", (), {"max_tokens": 256})()


class _Scheduler:
    def __init__(self, num_running: int, num_waiting: int) -> None:
        self.running = [_Request(i) for i in range(num_running)]
        self.waiting = [_Request(num_running + i) for i in range(num_waiting)]
        self.max_num_running_reqs, self.max_num_scheduled_tokens = 256, 2048
        self.scheduler_config = type("SC", (), {"enable_chunked_prefill": True})()
        self.cache_config = type("CC", (), {"block_size": 16})()
        pool = type("BP", (), {"num_gpu_blocks": 4097, "get_num_free_blocks": lambda self: 100})()
        self.kv_cache_manager = type("KV", (), {"block_pool": pool,
                                                "get_block_ids": lambda self, rid: ([0] * 8,)})()


def publish_cost_us(num_running: int, num_waiting: int, synchronous: bool, folder: str | None,
                    repeats: int = 300) -> float:
    """Median microseconds of one `StatePublisher.maybe_publish` call on the caller's thread for a scheduler of
    that size: with ``synchronous`` the whole publish (copy + encode + write into ``folder``), else what the
    engine thread pays (the copy; the writer thread does the rest)."""
    scheduler = _Scheduler(num_running, num_waiting)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        publisher = StatePublisher(str(Path(tmp) / "state.json"), 0.0, synchronous=synchronous)
        times_us = []
        for i in range(repeats):
            publisher._last_counts = (-1, i)  # force a publish each time  # noqa: SLF001
            start_s = time.perf_counter()
            publisher.maybe_publish(scheduler)
            times_us.append(1e6 * (time.perf_counter() - start_s))
            time.sleep(0.001)  # let the writer thread catch up, as between engine steps
    return statistics.median(times_us)


def step_record_cost_us(num_seqs: int, repeats: int = 300) -> float:
    """Median microseconds the engine thread spends per step on step times (``vllm_step_shape`` over a step of
    ``num_seqs`` scheduled requests, one prefill chunk among them, plus ``record_step``)."""
    from types import SimpleNamespace  # noqa: PLC0415

    from predictor.vllm_plugin.publisher import vllm_step_shape  # noqa: PLC0415

    requests = {f"r{i}": SimpleNamespace(num_prompt_tokens=100, num_computed_tokens=150 if i else 64,
                                         num_output_tokens=50 if i else 0, num_tokens=151 if i else 100)
                for i in range(num_seqs)}
    output = SimpleNamespace(num_scheduled_tokens={rid: 1 if i else 64 for i, rid in enumerate(requests)})
    scheduler = SimpleNamespace(requests=requests)
    publisher = StatePublisher("/dev/null", 0.0, synchronous=True)
    times_us = []
    for _ in range(repeats):
        start_s = time.perf_counter()
        shape, first = vllm_step_shape(scheduler, output)
        publisher.record_step(*shape, 0.01, first, 0.0)
        times_us.append(1e6 * (time.perf_counter() - start_s))
    return statistics.median(times_us)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="astrolabe bench plugin-overhead", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--rounds", type=int, default=2,
                        help="throughput A/B pairs on real vLLM (0 = only the per-publish and per-step costs)")
    parser.add_argument("--num-requests", type=int, default=96, help="requests per throughput run")
    parser.add_argument("--concurrency", type=int, default=16, help="closed-loop clients of a throughput run")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="random prompt of each request, tokens")
    parser.add_argument("--output-tokens", type=int, default=64,
                        help="max_tokens of each request (with ignore_eos), tokens")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    parser.add_argument("--work-dir", type=Path, default=REPO_DIR / ".cache" / "vllm" / "overhead",
                        help="the vLLM servers' logs and state files")
    args = parser.parse_args(argv)
    setup_logging("WARNING")
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    for running, waiting in ((16, 0), (64, 64), (256, 256)):
        print(f"publish cost, {running} running + {waiting} waiting: engine thread "
              f"{publish_cost_us(running, waiting, False, shm):.0f} us; whole publish on tmpfs "
              f"{publish_cost_us(running, waiting, True, shm):.0f} us, on the default temp dir "
              f"{publish_cost_us(running, waiting, True, None):.0f} us")
    for num_seqs in (16, 256):
        print(f"step times (calibration), {num_seqs} requests in the step: engine thread "
              f"{step_record_cost_us(num_seqs):.1f} us per step")
    if args.rounds:
        runs = throughput_ab(args)
        print(f"throughput, {args.num_requests} requests x {args.output_tokens} tokens at concurrency "
              f"{args.concurrency}, prompt {args.prompt_tokens} tokens:")
        for name, values in runs.items():
            print(f"  {name:<10} " + " ".join(f"{v:7.0f}" for v in values) + " tokens/s")
        ratio = statistics.median(runs["plugin"]) / statistics.median(runs["no-plugin"])
        print(f"  plugin / no-plugin (medians): {ratio:.3f}")
    return 0
