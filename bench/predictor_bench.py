"""`astrolabe bench predictor`: latency of one prediction (`predictor.sim.predict`) versus instance size.

For each size (requests waiting + running on the instance) it builds realistic instance states, times `predict`
many times (`time.perf_counter`) and `predict_by_stepping` fewer times as the baseline in the same run, and
prints a table: size, p50 / p99 milliseconds, mean simulated steps, for both, the p50 speed-up, and p50 / p99 of
`predict`'s CPU time (`time.thread_time`; on a shared machine wall-clock percentiles include time spent waiting
for a core, CPU time does not). Every baseline call is checked to give the same result as `predict`. The first
line names the `predictor.sim.fast_predict` that ran ("mypyc" where the compiled module is built, else "python");
`--python` times the pure-Python one even where the compiled one is loaded.

States: a Llama-2-7B (H200 profile) instance with the paper's limits (max_num_seqs 48, max_num_batched_tokens
512, block size 16) and a 2,048-block KV cache (32 k tokens, so long requests also contend for blocks), driven in
virtual time by `Engine` from a burst of requests; every request that finishes is replaced at once so the
instance always holds `size` requests; the state is taken after a random number of steps (so the queue holds
waiting, prefilling, decoding and preempted requests at mixed progress). Lengths: ShareGPT first exchanges
(`tagger.sharegpt` cache, prompt + output <= 4,096 tokens) when the cache file exists, else a seeded
log-normal (prompt median 160 tokens, output median 200 tokens, sigma 1.0, similar to ShareGPT), capped alike.

`--shared-prefix TOKENS` gives every request (in the states and the new ones) prefix-cache block keys
(`predictor.sim.block_hash.block_keys`): its prompt starts with none, the first half or all of one system prompt
of TOKENS tokens (a third each, cut to the prompt's length), the rest of its tokens its own; the rows then time
predictions that track KV block identities (the prefix-cache pool). The states also carry the blocks that
finished requests left cached and free (`InstanceSnapshot.cached_block_keys`: a few to ~600 per state at 256 requests,
some of them the system prompt's, which new requests hit).
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from astrolabe.cli import HelpFormatter
from predictor.sim.batch_time import LinearBatchTimeModel
from predictor.sim.block_hash import block_keys
from predictor.sim.engine import Engine
from predictor.sim.predict import FAST_PREDICT_IMPLEMENTATION, Prediction, predict, predict_by_stepping
from predictor.sim.request import SimRequest
from predictor.sim.scheduler import EngineConfig
from predictor.sim.snapshot import InstanceSnapshot, RequestState

logger = logging.getLogger(__name__)

BENCH_CONFIG = EngineConfig(max_num_seqs=48, max_num_batched_tokens=512, block_size=16, num_gpu_blocks=2048)
"""Engine limits as in the Astrolabe paper's Llama-2-7B setup; KV cache of 2,048 blocks x 16 tokens."""
MAX_MODEL_LEN_TOKENS = 4096
"""Longest prompt + output kept (Llama-2's context)."""
DEFAULT_SIZES = (16, 64, 256, 512)


@dataclass(frozen=True, slots=True)
class SizeResult:
    """Measurements for one instance size.

    Attributes:
        num_requests: Requests on the instance (waiting + running) before the new one.
        predict_ms: Latencies of `predict`, milliseconds.
        predict_steps: Mean `schedule()` calls per `predict`.
        stepping_ms: Latencies of `predict_by_stepping`, milliseconds.
        stepping_steps: Mean steps per `predict_by_stepping`.
        predict_cpu_ms: CPU time of each `predict` call (`time.thread_time`), milliseconds.
    """

    num_requests: int
    predict_ms: list[float]
    predict_steps: float
    stepping_ms: list[float]
    stepping_steps: float
    predict_cpu_ms: list[float] = field(default_factory=list)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]; values non-empty."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def load_lengths(rng: random.Random, use_sharegpt: bool = True) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) pairs, ShareGPT if its cache exists and use_sharegpt, else log-normal."""
    if use_sharegpt:
        try:
            from tagger import sharegpt

            if sharegpt.DEFAULT_CACHE_PATH.exists():
                pairs = sharegpt.load_sharegpt_pairs()
                lengths = [
                    (p.num_prompt_tokens, p.num_output_tokens)
                    for p in pairs
                    if p.num_prompt_tokens >= 1
                    and p.num_output_tokens >= 1
                    and p.num_prompt_tokens + p.num_output_tokens <= MAX_MODEL_LEN_TOKENS
                ]
                if lengths:
                    logger.info("using %d ShareGPT length pairs", len(lengths))
                    return lengths
        except (ImportError, OSError, ValueError) as exc:
            logger.warning("ShareGPT lengths unavailable (%s); using log-normal lengths", exc)
    lengths = []
    while len(lengths) < 5000:
        num_prompt_tokens = max(1, round(rng.lognormvariate(math.log(160), 1.0)))
        num_output_tokens = max(1, round(rng.lognormvariate(math.log(200), 1.0)))
        if num_prompt_tokens + num_output_tokens <= MAX_MODEL_LEN_TOKENS:
            lengths.append((num_prompt_tokens, num_output_tokens))
    return lengths


def prompt_block_keys(num_prompt_tokens: int, shared_prefix_tokens: int, rng: random.Random) -> tuple[int, ...] | None:
    """Block keys of a prompt that starts with none, half or all of a `shared_prefix_tokens`-token system prompt
    (one third each), its other tokens random; None if shared_prefix_tokens is 0 (no keys)."""
    if not shared_prefix_tokens:
        return None
    num_shared = min(rng.choice((0, shared_prefix_tokens // 2, shared_prefix_tokens)), num_prompt_tokens)
    token_ids = list(range(num_shared)) + [rng.randrange(1 << 31) for _ in range(num_prompt_tokens - num_shared)]
    return block_keys(token_ids, BENCH_CONFIG.block_size)


def build_state(
    num_requests: int, lengths: Sequence[tuple[int, int]], rng: random.Random, model: LinearBatchTimeModel,
    shared_prefix_tokens: int = 0,
) -> InstanceSnapshot:
    """An instance holding `num_requests` requests at mixed progress (see the module docstring); with block keys
    (`prompt_block_keys`) if shared_prefix_tokens > 0.

    Raises:
        ValueError: If num_requests < 1.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    engine = Engine(BENCH_CONFIG, model)
    next_id = 0

    def top_up() -> None:
        nonlocal next_id
        scheduler = engine.scheduler
        while len(scheduler.waiting) + len(scheduler.running) < num_requests:
            num_prompt_tokens, num_output_tokens = rng.choice(lengths)
            keys = prompt_block_keys(num_prompt_tokens, shared_prefix_tokens, rng)
            engine.add_request(SimRequest(f"r{next_id}", num_prompt_tokens, num_output_tokens, engine.now_s,
                                          block_keys=keys))
            next_id += 1

    top_up()
    for _ in range(rng.randint(100, 600)):
        engine.step()
        top_up()
    return InstanceSnapshot.from_scheduler(engine.scheduler, engine.now_s)


def _timed(
    fn: Callable[[InstanceSnapshot, RequestState, LinearBatchTimeModel], Prediction],
    snapshot: InstanceSnapshot,
    target: RequestState,
    model: LinearBatchTimeModel,
) -> tuple[float, Prediction]:
    """(wall-clock latency in milliseconds, result) of one call."""
    latency_ms, _, prediction = _timed_cpu(fn, snapshot, target, model)
    return latency_ms, prediction


def _timed_cpu(
    fn: Callable[[InstanceSnapshot, RequestState, LinearBatchTimeModel], Prediction],
    snapshot: InstanceSnapshot,
    target: RequestState,
    model: LinearBatchTimeModel,
) -> tuple[float, float, Prediction]:
    """(wall-clock latency in milliseconds, CPU time of this thread in milliseconds, result) of one call."""
    start_s = time.perf_counter()
    start_cpu_s = time.thread_time()
    prediction = fn(snapshot, target, model)
    cpu_ms = (time.thread_time() - start_cpu_s) * 1000.0
    return (time.perf_counter() - start_s) * 1000.0, cpu_ms, prediction


def _same(a: Prediction, b: Prediction) -> bool:
    """Same TTFT and E2E up to float rounding, same step and preemption counts."""
    return (
        math.isclose(a.ttft_s, b.ttft_s, rel_tol=1e-9)
        and math.isclose(a.e2e_s, b.e2e_s, rel_tol=1e-9)
        and a.num_steps == b.num_steps
        and a.num_preemptions == b.num_preemptions
    )


def run_size(
    num_requests: int,
    *,
    num_states: int,
    num_predictions: int,
    num_baseline: int,
    lengths: Sequence[tuple[int, int]],
    rng: random.Random,
    model: LinearBatchTimeModel,
    compiled: bool = True,
    shared_prefix_tokens: int = 0,
) -> SizeResult:
    """Time `predict` num_predictions times and `predict_by_stepping` num_baseline times over num_states states
    (`compiled`: passed on to `predict`; shared_prefix_tokens > 0: requests with block keys, `prompt_block_keys`)."""
    states = [build_state(num_requests, lengths, rng, model, shared_prefix_tokens) for _ in range(num_states)]

    def fast_predict(snapshot: InstanceSnapshot, target: RequestState, model: LinearBatchTimeModel) -> Prediction:
        return predict(snapshot, target, model, compiled=compiled)

    predict_ms: list[float] = []
    predict_cpu_ms: list[float] = []
    predict_steps: list[int] = []
    stepping_ms: list[float] = []
    stepping_steps: list[int] = []
    for i in range(num_predictions):
        snapshot = states[i % num_states]
        num_prompt_tokens, num_output_tokens = rng.choice(lengths)
        target = RequestState(f"new{i}", num_prompt_tokens, num_output_tokens, snapshot.now_s,
                              block_keys=prompt_block_keys(num_prompt_tokens, shared_prefix_tokens, rng))
        latency_ms, cpu_ms, prediction = _timed_cpu(fast_predict, snapshot, target, model)
        predict_ms.append(latency_ms)
        predict_cpu_ms.append(cpu_ms)
        predict_steps.append(prediction.num_steps_simulated)
        if i < num_baseline:
            latency_ms, reference = _timed(predict_by_stepping, snapshot, target, model)
            stepping_ms.append(latency_ms)
            stepping_steps.append(reference.num_steps_simulated)
            if not _same(reference, prediction):
                raise AssertionError(f"predict and predict_by_stepping disagree: {prediction} vs {reference}")
    return SizeResult(
        num_requests,
        predict_ms,
        statistics.fmean(predict_steps),
        stepping_ms,
        statistics.fmean(stepping_steps),
        predict_cpu_ms,
    )


def format_table(results: Sequence[SizeResult]) -> str:
    """The printed table, one row per size."""
    header = (
        f"{'size':>5} | {'predict p50 ms':>14} {'p99 ms':>8} {'steps':>8} | "
        f"{'stepping p50 ms':>15} {'p99 ms':>8} {'steps':>8} | {'speed-up p50':>12} | "
        f"{'predict cpu p50 ms':>18} {'p99 ms':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        p50, p99 = percentile(r.predict_ms, 50), percentile(r.predict_ms, 99)
        s50, s99 = percentile(r.stepping_ms, 50), percentile(r.stepping_ms, 99)
        lines.append(
            f"{r.num_requests:>5} | {p50:>14.3f} {p99:>8.3f} {r.predict_steps:>8.1f} | "
            f"{s50:>15.3f} {s99:>8.3f} {r.stepping_steps:>8.1f} | {s50 / p50:>11.1f}x | "
            f"{_cpu_percentile(r, 50):>18.3f} {_cpu_percentile(r, 99):>8.3f}"
        )
    return "\n".join(lines)


def _cpu_percentile(result: SizeResult, q: float) -> float:
    return percentile(result.predict_cpu_ms, q) if result.predict_cpu_ms else math.nan


def main(argv: list[str]) -> int:
    """Entry point of `astrolabe bench predictor`; prints the latency table; returns 0."""
    parser = argparse.ArgumentParser(prog="astrolabe bench predictor", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES),
                        help="instance sizes, requests waiting + running")
    parser.add_argument("--states", type=int, default=8, help="instance states built per size")
    parser.add_argument("--predictions", type=int, default=400, help="timed predict calls per size")
    parser.add_argument("--baseline", type=int, default=10, help="timed predict_by_stepping calls per size")
    parser.add_argument("--model", default="llama-2-7b", help="shipped batch-time model name")
    parser.add_argument("--seed", type=int, default=0, help="seeds the states and the log-normal lengths")
    parser.add_argument("--lognormal", action="store_true", help="log-normal lengths even if ShareGPT is cached")
    parser.add_argument("--quick", action="store_true", help="few states and calls (a smoke run)")
    parser.add_argument("--python", action="store_true",
                        help="time the pure-Python fast_predict even where the compiled one is loaded")
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                        help="give requests prefix-cache block keys, sharing a system prompt of TOKENS tokens "
                             "(0: no keys)")
    args = parser.parse_args(argv)
    if args.quick:
        args.states, args.predictions, args.baseline = 2, 6, 2
    if args.shared_prefix < 0:
        parser.error("--shared-prefix must be >= 0")
    if min(args.sizes) < 1 or args.states < 1 or args.predictions < 1 or not 1 <= args.baseline <= args.predictions:
        parser.error("sizes, --states and --predictions must be >= 1 and 1 <= --baseline <= --predictions")
    rng = random.Random(args.seed)
    model = LinearBatchTimeModel.default(args.model)
    lengths = load_lengths(rng, use_sharegpt=not args.lognormal)
    results = [
        run_size(
            size,
            num_states=args.states,
            num_predictions=args.predictions,
            num_baseline=args.baseline,
            lengths=lengths,
            rng=rng,
            model=model,
            compiled=not args.python,
            shared_prefix_tokens=args.shared_prefix,
        )
        for size in args.sizes
    ]
    implementation = "python" if args.python else FAST_PREDICT_IMPLEMENTATION
    keys = f", block keys (shared prefix {args.shared_prefix} tokens)" if args.shared_prefix else ""
    print(f"predictor latency, {args.model}, {BENCH_CONFIG}, fast_predict: {implementation}{keys}")
    print(format_table(results))
    return 0
