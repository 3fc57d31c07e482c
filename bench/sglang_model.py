"""`astrolabe bench sglang-model`: what predicting an SGLang instance with the vLLM V1 scheduler model costs.

One simulated SGLang instance (``predictor.sim.Engine`` with ``EngineConfig.scheduling="sglang"``, virtual time,
the shipped Llama-2-7B H200 step-time model ``LinearBatchTimeModel.default("llama-2-7b")``) serves ShareGPT
first exchanges (``tagger.sharegpt``, prompt + reply <= 4,094 tokens) arriving as a Poisson process at fractions of
its capacity (``measure_capacity_qps`` under the SGLang rules: a burst of requests at t=0, completed / elapsed).
For a sample of arrivals it takes the instance's state just before the arrival (``InstanceSnapshot.from_scheduler``,
plus the requests that arrived earlier but are not admitted yet) and predicts the newcomer's TTFT and E2E with
(a) the vLLM V1 model (the same snapshot and limits, ``scheduling="vllm-v1"``: the event-driven fast path) and
(b) the SGLang model (stepping the scheduler), both with the TRUE output lengths of every request, so that only
the scheduler model differs. It prints, per load, the median and P90 absolute percentage error of each model
against the request's TTFT and E2E in the run, and the p50 time of one prediction on each path.

Two client behaviours (``--caps``), because SGLang reserves KV for each running request's output cap:
- ``unset`` (the sidecar's usual case, OpenAI clients that send no ``max_tokens``): SGLang then takes the cap from
  what the KV pool allows (``Scheduler.sglang_max_new_tokens``), so each running request reserves
  ``min(cap - generated, 4096) x new_token_ratio`` tokens;
- ``true``: clients send ``max_tokens`` = the reply's true length (SGLang's ``bench_serving`` style); reservations
  are then close to what requests really use.

Defaults and why (printed with the results): SGLang's defaults for an H200 where they matter: ``page_size`` 1,
``chunked_prefill_size`` 8,192 (server_args.py: < 160 GB GPUs), ``max_running_requests`` 4,096 (model_runner.py:
min(clamp(tokens / context_len x 512, 2048, 4096), tokens / 2)); a KV pool of 32,768 tokens (``--kv-tokens``; a real
H200 holds ~200 k tokens of Llama-2-7B, but a smaller pool lets KV admission matter at loads a short run reaches, as
in ``astrolabe bench predictor``); loads 50 / 80 / 95 % of capacity; 4,000 requests per load, the first 20 % a
warm-up, 400 sampled arrivals per load.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from astrolabe.cli import HelpFormatter
from bench.workloads import arrival_offsets_s, filter_pairs
from predictor.sim.batch_time import LinearBatchTimeModel
from predictor.sim.engine import Engine, measure_capacity_qps
from predictor.sim.predict import FAST_PREDICT_IMPLEMENTATION, predict
from predictor.sim.request import RequestStatus, SimRequest
from predictor.sim.scheduler import EngineConfig
from predictor.sim.snapshot import InstanceSnapshot, RequestState
from tagger.sharegpt import load_sharegpt_pairs

logger = logging.getLogger(__name__)

MAX_MODEL_LEN_TOKENS = 4094
"""Longest prompt + reply kept, tokens: Llama-2's 4,096-token context less SGLang's reserve (max_req_len =
context_len - 1; max_new_tokens <= max_req_len - prompt - 1)."""
DEFAULT_LOADS = (0.5, 0.8, 0.95)
CAP_MODES = ("unset", "true")


@dataclass(slots=True)
class LoadResult:
    """Errors and prediction times at one load.

    Attributes:
        load_frac: Arrival rate / capacity, in (0, 1).
        rate_qps: Arrival rate, requests per virtual second.
        ttft_ape: Model name -> absolute percentage errors of the predicted TTFT, one per sampled arrival, percent.
        e2e_ape: Same for E2E, percent.
        predict_ms: Model name -> wall-clock time of each prediction, milliseconds.
        actual_ttft_s: The sampled requests' TTFT in the run, seconds.
    """

    load_frac: float
    rate_qps: float
    ttft_ape: dict[str, list[float]] = field(default_factory=lambda: {"vllm-v1": [], "sglang": []})
    e2e_ape: dict[str, list[float]] = field(default_factory=lambda: {"vllm-v1": [], "sglang": []})
    predict_ms: dict[str, list[float]] = field(default_factory=lambda: {"vllm-v1": [], "sglang": []})
    actual_ttft_s: list[float] = field(default_factory=list)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]; values non-empty."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def cap_of(pair: tuple[int, int], caps: str) -> int | None:
    """The request's ``max_new_tokens`` under client behaviour ``caps`` ("unset": None, "true": its reply length)."""
    return None if caps == "unset" else pair[1]


def capacity_qps(config: EngineConfig, model: LinearBatchTimeModel, lengths: Sequence[tuple[int, int]], caps: str,
                 num_requests: int) -> float:
    """Saturation throughput of one SGLang instance, requests per virtual second.

    ``measure_capacity_qps`` for unset caps; with true caps the same procedure (every request at t=0, completed /
    elapsed) with each request's cap set, which ``measure_capacity_qps`` cannot pass.
    """
    if caps == "unset":
        return measure_capacity_qps(config, model, lengths, num_requests)
    engine = Engine(config, model)
    for i in range(num_requests):
        pair = lengths[i % len(lengths)]
        engine.add_request(SimRequest(f"cap-{i}", *pair, arrival_time_s=0.0, max_new_tokens=cap_of(pair, caps)))
    num_completed = sum(len(step.output.finished) for step in engine.run_until_idle())
    return num_completed / engine.now_s


def _snapshot_before(engine: Engine, requests: Sequence[SimRequest], index: int) -> InstanceSnapshot:
    """The state the newcomer ``requests[index]`` meets: the scheduler between steps, plus earlier arrivals the
    engine holds back until its next step (they are ahead of the newcomer in the queue)."""
    snapshot = InstanceSnapshot.from_scheduler(engine.scheduler, engine.now_s)
    scheduler = engine.scheduler
    held = tuple(RequestState.from_sim_request(r) for r in requests[:index]
                 if r.status == RequestStatus.WAITING and scheduler.get_request(r.request_id) is None)
    return dataclasses.replace(snapshot, waiting=snapshot.waiting + held) if held else snapshot


def run_load(config: EngineConfig, model: LinearBatchTimeModel, lengths: Sequence[tuple[int, int]], caps: str,
             load_frac: float, capacity: float, *, num_requests: int, num_samples: int,
             rng: random.Random) -> LoadResult:
    """One Poisson trace at ``load_frac`` of ``capacity``: predictions for sampled arrivals and their errors."""
    rate_qps = load_frac * capacity
    result = LoadResult(load_frac, rate_qps)
    offsets_s = arrival_offsets_s(num_requests, rate_qps, rng)
    pairs = [rng.choice(lengths) for _ in range(num_requests)]
    requests = [SimRequest(f"q{i}", *pair, arrival_time_s=t_s, max_new_tokens=cap_of(pair, caps))
                for i, (pair, t_s) in enumerate(zip(pairs, offsets_s))]
    engine = Engine(config, model)
    for request in requests:
        engine.add_request(request)
    warmup = num_requests // 5
    step = max(1, (num_requests - warmup) // num_samples)
    sampled = list(range(warmup, num_requests, step))[:num_samples]
    v1_config = dataclasses.replace(config, scheduling="vllm-v1")
    predicted: dict[int, dict[str, tuple[float, float]]] = {}
    for index in sampled:
        request = requests[index]
        engine.advance_to(request.arrival_time_s)
        snapshot = _snapshot_before(engine, requests, index)
        wait_s = engine.now_s - request.arrival_time_s  # it cannot start before the step in progress ends
        target = RequestState(request.request_id, request.num_prompt_tokens, request.num_output_tokens,
                              engine.now_s, max_new_tokens=request.max_new_tokens)
        predicted[index] = {}
        for name, state in (("vllm-v1", dataclasses.replace(snapshot, config=v1_config)), ("sglang", snapshot)):
            start_s = time.perf_counter()
            prediction = predict(state, target, model)
            result.predict_ms[name].append((time.perf_counter() - start_s) * 1000.0)
            predicted[index][name] = (wait_s + prediction.ttft_s, wait_s + prediction.e2e_s)
    engine.run_until_idle()
    for index, by_model in predicted.items():
        request = requests[index]
        assert request.first_token_time_s is not None and request.finish_time_s is not None
        ttft_s = request.first_token_time_s - request.arrival_time_s
        e2e_s = request.finish_time_s - request.arrival_time_s
        result.actual_ttft_s.append(ttft_s)
        for name, (pred_ttft_s, pred_e2e_s) in by_model.items():
            result.ttft_ape[name].append(abs(pred_ttft_s - ttft_s) / ttft_s * 100.0)
            result.e2e_ape[name].append(abs(pred_e2e_s - e2e_s) / e2e_s * 100.0)
    return result


def format_table(results: Sequence[LoadResult]) -> str:
    """The printed table, one row per load: APE median / P90 (percent) per model, prediction p50 ms."""
    header = (f"{'load':>5} {'qps':>6} {'n':>4} {'TTFT p50/p90 s':>15} | {'TTFT APE % med/p90':^31} | "
              f"{'E2E APE % med/p90':^31} | {'predict ms p50':^17}")
    sub = (f"{'':>33} | {'vllm-v1':^15} {'sglang':^15} | {'vllm-v1':^15} {'sglang':^15} | "
           f"{'vllm-v1':>8} {'sglang':>8}")
    lines = [header, sub, "-" * len(header)]
    for r in results:
        cells = []
        for errors in (r.ttft_ape, r.e2e_ape):
            cells.append(" ".join(f"{percentile(errors[m], 50):>6.1f}/{percentile(errors[m], 90):<8.1f}"
                                  for m in ("vllm-v1", "sglang")))
        lines.append(
            f"{r.load_frac:>5.0%} {r.rate_qps:>6.2f} {len(r.actual_ttft_s):>4} "
            f"{statistics.median(r.actual_ttft_s):>7.3f}/{percentile(r.actual_ttft_s, 90):<7.3f} | {cells[0]} | "
            f"{cells[1]} | "
            f"{percentile(r.predict_ms['vllm-v1'], 50):>8.3f} {percentile(r.predict_ms['sglang'], 50):>8.3f}"
        )
    return "\n".join(lines)


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="astrolabe bench sglang-model", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--loads", type=float, nargs="+", default=list(DEFAULT_LOADS),
                   help="arrival rates as fractions of the instance's capacity, each in (0, 1)")
    p.add_argument("--caps", choices=(*CAP_MODES, "both"), default="both",
                   help="client max_tokens: unset (SGLang derives it from the KV pool), true (= the reply length), "
                        "or both, one table each")
    p.add_argument("--requests", type=int, default=4000, help="requests per load (the first 20%% a warm-up)")
    p.add_argument("--samples", type=int, default=400, help="sampled arrivals predicted per load")
    p.add_argument("--capacity-requests", type=int, default=1000, help="burst size of the capacity measurement")
    p.add_argument("--kv-tokens", type=int, default=32768, help="KV pool (SGLang max_total_num_tokens), tokens")
    p.add_argument("--max-running-requests", type=int, default=4096, help="SGLang --max-running-requests")
    p.add_argument("--chunked-prefill-size", type=int, default=8192, help="SGLang --chunked-prefill-size, tokens")
    p.add_argument("--model", default="llama-2-7b", help="shipped batch-time model name")
    p.add_argument("--seed", type=int, default=0, help="seeds the traces")
    p.add_argument("--quick", action="store_true", help="a few hundred requests and samples (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.samples, args.capacity_requests = 200, 12, 200
    if not all(0 < x < 1 for x in args.loads) or min(args.requests, args.samples, args.capacity_requests) < 1:
        p.error("--loads must lie in (0, 1) and --requests, --samples, --capacity-requests be >= 1")
    return args


def main(argv: list[str]) -> int:
    """Entry point of `astrolabe bench sglang-model`; prints one table per client behaviour; returns 0 (2 on bad
    arguments)."""
    args = _parse_args(argv)
    try:
        config = EngineConfig(max_num_seqs=args.max_running_requests, max_num_batched_tokens=args.chunked_prefill_size,
                              block_size=1, num_gpu_blocks=args.kv_tokens, scheduling="sglang")
    except ValueError as exc:
        print(f"astrolabe bench sglang-model: {exc}")
        return 2
    model = LinearBatchTimeModel.default(args.model)
    lengths = [(p.num_prompt_tokens, p.num_output_tokens) for p in
               filter_pairs(load_sharegpt_pairs(), max_model_len=MAX_MODEL_LEN_TOKENS)]
    print(f"SGLang instance: {args.model} step times, {config}; ShareGPT lengths ({len(lengths)} pairs); "
          f"{args.requests} requests per load, {args.samples} sampled; "
          f"V1 path: fast_predict {FAST_PREDICT_IMPLEMENTATION}")
    modes = CAP_MODES if args.caps == "both" else (args.caps,)
    for caps in modes:
        start_s = time.perf_counter()
        rng = random.Random(args.seed)
        capacity = capacity_qps(config, model, lengths, caps, args.capacity_requests)
        results = [run_load(config, model, lengths, caps, load, capacity, num_requests=args.requests,
                            num_samples=args.samples, rng=rng) for load in args.loads]
        print(f"\ncaps {caps}: capacity {capacity:.2f} req/s ({time.perf_counter() - start_s:.0f} s)")
        print(format_table(results))
    return 0
