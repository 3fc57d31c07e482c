"""``astrolabe demo``: replay one ShareGPT trace through the real Envoy + extproc for each dispatch policy.

Owns the orchestration only: load pairs, build ONE seeded trace, start N emulated vLLM instances, then per policy
start the extproc and Envoy, replay the trace (``bench.loadgen``), stop them and wait until the instances are
idle; finally print one comparison table (``bench.report``) on stdout. Every process lives in a
``bench.procs.ProcessGroup``, so errors and Ctrl-C stop them all. Nothing imports this module but the CLI.

NOTE: the defaults are sized for a 2-core machine on which Python and Envoy carry ~1,000 SSE events/s in total:
an output cap of 512 tokens (53 of the 300 default requests hit it), one SSE event per 4 tokens, max_num_seqs=8
and a time scale of 1.75 make the fleet's capacity ~10.6 requests/s, so the default trace (300 requests at
0.85 x capacity, ~9 req/s, ~590 SSE events/s, ~34 s of arrivals) queues visibly and three policies finish in
~130 s (measured: 127 s, E2E p99 6-7 s). The arrival rate is ``load`` x the fleet capacity that
``predictor.sim`` measures on the trace itself.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import yaml

from bench.loadgen import RequestResult, replay
from bench.procs import ManagedProcess, ProcessGroup, ProcessStartError, free_port
from bench.report import ControlPlaneCost, format_comparison, format_costs, format_table, summarize
from bench.workloads import TraceRequest, build_trace, filter_pairs, load_sharegpt_pairs
from predictor.backend_metrics import MetricsFormatError, parse_vllm_metrics
from tagger.tokenizer import TOKENIZER_NAME

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
MODEL = "llama-2-7b"
"""Served model name, and the ``predictor.sim`` batch-time model the emulators follow (H200 profile)."""

_BODY_MODES = ("full-duplex", "buffered")
_START_TIMEOUT_S = 60.0
_IDLE_TIMEOUT_S = 60.0
_POLL_INTERVAL_S = 0.1


@dataclasses.dataclass(frozen=True, slots=True)
class DemoConfig:
    """Demo settings (CLI flags of the same names). Token counts use ``tagger.tokenizer``."""

    num_instances: int
    policies: tuple[str, ...]
    num_requests: int
    load: float
    rate_qps: float | None
    time_scale: float
    stream_interval: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_gpu_blocks: int
    block_size: int
    max_output_tokens: int
    max_model_len: int
    body_mode: str
    seed: int
    request_timeout_s: float
    log_dir: Path | None
    progress: bool
    astrolabe_k: int = 2
    astrolabe_metric: str = "e2e"
    output_length_source: str = "tagger"
    predict_timeout_s: float = 0.02
    backend: str = "emulator"


@dataclasses.dataclass(frozen=True, slots=True)
class TracePlan:
    """The trace and how its rate was chosen. ``capacity_qps`` is fleet wall-clock capacity (None if not measured)."""

    trace: list[TraceRequest]
    rate_qps: float
    capacity_qps: float | None
    instance_capacity_virtual_qps: float | None


def _parse_args(argv: Sequence[str]) -> DemoConfig:
    p = argparse.ArgumentParser(prog="astrolabe demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num-instances", type=int, default=4, help="emulated vLLM instances")
    p.add_argument("--policies", default="astrolabe,round-robin,least-requests",
                   help="comma-separated policy names (also: random); the first baselines are compared to astrolabe")
    p.add_argument("--num-requests", type=int, default=300, help="requests in the trace (same trace per policy)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--load", type=float, default=0.85, help="arrival rate as a fraction of estimated capacity")
    rate.add_argument("--rate-qps", type=float, default=None, help="explicit arrival rate, requests/s")
    p.add_argument("--time-scale", type=float, default=1.75, help="emulator step time = H200 step time x this")
    p.add_argument("--stream-interval", type=int, default=4, help="tokens per SSE event from the emulators")
    p.add_argument("--max-num-seqs", type=int, default=8, help="vLLM max_num_seqs of each instance")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="vLLM max_num_batched_tokens (tokens)")
    p.add_argument("--num-gpu-blocks", type=int, default=1024, help="KV blocks per instance")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-output-tokens", type=int, default=512, help="cap on a request's output tokens")
    p.add_argument("--max-model-len", type=int, default=4096, help="drop pairs with prompt+output above this")
    p.add_argument("--body-mode", choices=_BODY_MODES, default="full-duplex", help="Envoy ext_proc body mode")
    p.add_argument("--seed", type=int, default=0, help="seeds the trace, the emulators and the policies")
    p.add_argument("--request-timeout-s", type=float, default=60.0, help="limit per request, seconds")
    p.add_argument("--log-dir", type=Path, default=None, help="process logs and configs (default: a temp dir)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bars")
    p.add_argument("--astrolabe-k", type=int, default=2, help="astrolabe: instances probed per request")
    p.add_argument("--astrolabe-metric", choices=("e2e", "ttft"), default="e2e", help="astrolabe: compared figure")
    p.add_argument("--output-length-source", choices=("fixed", "oracle", "tagger"), default="tagger",
                   help="predicted output tokens sent to sidecars (extproc output_length.source)")
    p.add_argument("--predict-timeout-s", type=float, default=0.02, help="deadline of one Predict call")
    p.add_argument("--backend", choices=("emulator", "vllm"), default="emulator",
                   help="vllm: at most 2 real vLLM servers (tiny model on CPU; make install-vllm), bench/demo_vllm.py")
    ns = p.parse_args(list(argv))
    policies = tuple(x.strip() for x in ns.policies.split(",") if x.strip())
    if not policies:
        p.error("--policies is empty")
    for name in ("num_instances", "num_requests", "stream_interval", "max_output_tokens"):
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if ns.time_scale <= 0 or ns.load <= 0 or (ns.rate_qps is not None and ns.rate_qps <= 0):
        p.error("--time-scale, --load and --rate-qps must be > 0")
    return DemoConfig(**{**vars(ns), "policies": policies})


def plan_trace(cfg: DemoConfig) -> TracePlan:
    """Load and filter the pairs, build the trace and set its rate.

    The trace is built at 1 req/s and its offsets divided by the chosen rate, so the same seed gives the same
    requests in the same order whatever the rate. Capacity = ``num_instances`` x ``measure_capacity_qps`` on the
    trace's own (prompt, capped output) lengths / ``time_scale``.

    Raises:
        ValueError: the engine settings cannot serve some request of the trace.
    """
    if cfg.backend == "vllm":
        from bench import demo_vllm

        trace, rate_qps = demo_vllm.plan_trace(cfg.num_requests, cfg.rate_qps, cfg.max_output_tokens, cfg.seed)
        return TracePlan(trace, rate_qps, None, None)
    pairs = filter_pairs(load_sharegpt_pairs(), max_model_len=cfg.max_model_len)
    unit = build_trace(pairs, cfg.num_requests, 1.0, random.Random(cfg.seed), max_output_tokens=cfg.max_output_tokens)
    capacity_qps = instance_qps = None
    rate_qps = cfg.rate_qps
    if rate_qps is None:
        from predictor.sim.batch_time import LinearBatchTimeModel
        from predictor.sim.engine import measure_capacity_qps
        from predictor.sim.scheduler import EngineConfig

        engine = EngineConfig(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            block_size=cfg.block_size, num_gpu_blocks=cfg.num_gpu_blocks,
        )
        lengths = [(r.num_prompt_tokens, r.num_output_tokens) for r in unit]
        instance_qps = measure_capacity_qps(
            engine, LinearBatchTimeModel.default(MODEL), lengths, num_requests=max(len(lengths), 500)
        )
        capacity_qps = cfg.num_instances * instance_qps / cfg.time_scale
        rate_qps = cfg.load * capacity_qps
    trace = [dataclasses.replace(r, arrival_offset_s=r.arrival_offset_s / rate_qps) for r in unit]
    return TracePlan(trace, rate_qps, capacity_qps, instance_qps)


def start_emulators(procs: ProcessGroup, cfg: DemoConfig, log_dir: Path) -> list[str]:
    """Start ``num_instances`` emulators on free ports and wait for ``/health``; returns their ``ip:port``.

    Raises:
        ProcessStartError: an emulator exited or was not healthy within the start timeout.
    """
    started: list[tuple[ManagedProcess, str]] = []
    for i in range(cfg.num_instances):
        port = free_port(HOST)
        cmd = [
            sys.executable, "-m", "astrolabe", "emulator", "--host", HOST, "--port", str(port),
            "--served-model-name", MODEL, "--max-num-seqs", str(cfg.max_num_seqs),
            "--max-num-batched-tokens", str(cfg.max_num_batched_tokens), "--num-gpu-blocks", str(cfg.num_gpu_blocks),
            "--block-size", str(cfg.block_size), "--time-scale", str(cfg.time_scale),
            "--stream-interval", str(cfg.stream_interval), "--seed", str(cfg.seed + i),
        ]
        proc = procs.start(cmd, name=f"emulator-{i}", log_path=log_dir / f"emulator-{i}.log")
        started.append((proc, f"{HOST}:{port}"))
    # Started all at once above, waited for here: their imports overlap.
    for proc, address in started:
        proc.wait_http(f"http://{address}/health", _START_TIMEOUT_S)
    return [address for _, address in started]


def start_sidecars(procs: ProcessGroup, cfg: DemoConfig, instances: Sequence[str], log_dir: Path) -> dict[str, str]:
    """Start one predictor sidecar per instance (same engine limits and time scale); returns instance -> sidecar.

    Raises:
        ProcessStartError: a sidecar exited or did not listen within the start timeout.
    """
    started: list[tuple[ManagedProcess, str, str]] = []
    for i, instance in enumerate(instances):
        port = free_port(HOST)
        cmd = [
            sys.executable, "-m", "astrolabe", "predictor", "serve", "--backend", instance,
            "--listen", f"{HOST}:{port}", "--batch-time-model", MODEL, "--time-scale", str(cfg.time_scale),
            "--max-num-seqs", str(cfg.max_num_seqs), "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
            "--num-gpu-blocks", str(cfg.num_gpu_blocks), "--block-size", str(cfg.block_size),
        ]
        proc = procs.start(cmd, name=f"sidecar-{i}", log_path=log_dir / f"sidecar-{i}.log")
        started.append((proc, instance, f"{HOST}:{port}"))
    for proc, _, address in started:
        proc.wait_tcp(HOST, int(address.rsplit(":", 1)[1]), _START_TIMEOUT_S)
    return {instance: address for _, instance, address in started}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far, seconds (Linux /proc); 0.0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_grpc_ready(proc: ManagedProcess, address: str, timeout_s: float) -> None:
    """Wait until the extproc's gRPC health service reports ``readiness`` SERVING.

    Raises:
        ProcessStartError: the process exited, or it was not ready within ``timeout_s``.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline_s = time.monotonic() + timeout_s
    request = health_pb2.HealthCheckRequest(service="readiness")
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if not proc.is_running():
                raise ProcessStartError(f"{proc.name} exited with {proc.returncode}; log:\n{proc.log_tail()}")
            try:
                if stub.Check(request, timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet
            if time.monotonic() >= deadline_s:
                raise ProcessStartError(f"{proc.name} not ready within {timeout_s} s; log:\n{proc.log_tail()}")
            time.sleep(_POLL_INTERVAL_S)


def start_router(
    procs: ProcessGroup, cfg: DemoConfig, policy: str, instances: Sequence[str], log_dir: Path,
    sidecars: dict[str, str] | None = None,
) -> tuple[list[ManagedProcess], str, str]:
    """Start the extproc for ``policy`` and an Envoy in front of it.

    Returns:
        The two processes (extproc first), Envoy's base URL, and the extproc's Prometheus /metrics URL.

    Raises:
        ProcessStartError: either process exited or was not ready within the start timeout.
    """
    extproc_address = f"{HOST}:{free_port(HOST)}"
    metrics_address = f"{HOST}:{free_port(HOST)}"
    sidecars = sidecars or {}
    config = {
        "listen": extproc_address,
        "metrics_listen": metrics_address,
        "policy": policy,
        "seed": cfg.seed,
        **({"policy_params": {"k": cfg.astrolabe_k, "metric": cfg.astrolabe_metric},
            "output_length": {"source": cfg.output_length_source},
            "predictor_client": {"predict_timeout_s": cfg.predict_timeout_s}} if policy == "astrolabe" else {}),
        "endpoints": [{"address": a, "models": [_model(cfg)], **({"predictor": sidecars[a]} if a in sidecars else {})}
                      for a in instances],
    }
    config_path = log_dir / f"extproc-{policy}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    extproc = procs.start(
        [sys.executable, "-m", "astrolabe", "extproc", "--config", str(config_path)],
        name=f"extproc-{policy}", log_path=log_dir / f"extproc-{policy}.log",
    )
    started = [extproc]
    # Envoy answers 500 to requests that reach it before the processor listens: wait first.
    _wait_grpc_ready(extproc, extproc_address, _START_TIMEOUT_S)
    listen_port, admin_port = free_port(HOST), free_port(HOST)
    envoy = procs.start(
        [
            sys.executable, "-m", "astrolabe", "envoy", "--mode", cfg.body_mode, "--listen-port", str(listen_port),
            "--admin-port", str(admin_port), "--extproc", extproc_address,
        ],
        name=f"envoy-{policy}", log_path=log_dir / f"envoy-{policy}.log",
    )
    started.append(envoy)
    envoy.wait_http(f"http://{HOST}:{admin_port}/ready", _START_TIMEOUT_S)
    return started, f"http://{HOST}:{listen_port}", f"http://{metrics_address}/metrics"


def _scrape_counter(url: str, series_prefix: str) -> float:
    """Sum of the samples of ``url`` (Prometheus text) whose line starts with ``series_prefix``; 0 if none."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=2.0) as resp:
        lines = resp.read().decode("utf-8", errors="replace").splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(series_prefix))


def _scrape_queue(address: str) -> int:
    """Running plus waiting requests on ``/metrics`` of ``address`` (``predictor.backend_metrics``).

    Raises:
        OSError: the instance cannot be reached.
        MetricsFormatError: its /metrics lacks vLLM's queue gauges.
    """
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{address}/metrics", timeout=2.0) as resp:
        observed = parse_vllm_metrics(resp.read().decode("utf-8", errors="replace"))
    return observed.num_running + observed.num_waiting


def wait_idle(instances: Sequence[str], timeout_s: float = _IDLE_TIMEOUT_S) -> bool:
    """Wait until every instance reports no running and no waiting request; False on timeout."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        try:
            busy = [a for a in instances if _scrape_queue(a) > 0]
        except (OSError, MetricsFormatError) as exc:
            busy = [f"unreadable ({exc})"]
        if not busy:
            return True
        if time.monotonic() >= deadline_s:
            logger.warning("instances still busy after %s s: %s", timeout_s, busy)
            return False
        time.sleep(_POLL_INTERVAL_S)


def format_header(cfg: DemoConfig, plan: TracePlan, instances: Sequence[str]) -> str:
    """Lines stating the fleet, the time scale, the tokenizer and the trace that the table refers to."""
    if cfg.backend == "vllm":
        from bench import demo_vllm

        return demo_vllm.header(len(instances), len(plan.trace), plan.rate_qps, cfg.seed)
    trace = plan.trace
    mean_prompt = statistics.fmean(r.num_prompt_tokens for r in trace)
    mean_output = statistics.fmean(r.num_output_tokens for r in trace)
    num_capped = sum(r.num_output_tokens == cfg.max_output_tokens for r in trace)
    events_per_s = plan.rate_qps * mean_output / cfg.stream_interval
    if plan.capacity_qps is not None:
        rate = (
            f"{plan.rate_qps:.2f} req/s = {cfg.load:.2f} x estimated fleet capacity {plan.capacity_qps:.2f} req/s "
            f"({cfg.num_instances} x {plan.instance_capacity_virtual_qps:.2f} req/s at H200 speed"
            f" / {cfg.time_scale:g}, "
            f"predictor.sim on this trace)"
        )
    else:
        rate = f"{plan.rate_qps:.2f} req/s (set explicitly)"
    return "\n".join([
        f"Astrolabe demo: {len(instances)} emulated vLLM instances serving {MODEL}; each max_num_seqs="
        f"{cfg.max_num_seqs}, max_num_batched_tokens={cfg.max_num_batched_tokens}, num_gpu_blocks="
        f"{cfg.num_gpu_blocks}, block_size={cfg.block_size}, one SSE event per {cfg.stream_interval} tokens",
        f"time: emulated H200 step times x {cfg.time_scale:g}; all times are emulator wall-clock seconds",
        f"tokenizer: {TOKENIZER_NAME}",
        f"trace: {len(trace)} ShareGPT requests (seed {cfg.seed}), Poisson arrivals at {rate}; mean prompt "
        f"{mean_prompt:.0f} tokens, mean output {mean_output:.0f} tokens (output capped at {cfg.max_output_tokens} "
        f"tokens, {num_capped} requests hit the cap; prompt+output <= {cfg.max_model_len})",
        f"path: client -> Envoy ({cfg.body_mode} ext_proc) -> extproc policy -> instance; same trace for every policy",
        f"sizing: small batches, time scale {cfg.time_scale:g}, output cap {cfg.max_output_tokens} and "
        f"{cfg.stream_interval} tokens per SSE event keep traffic near {events_per_s:.0f} SSE events/s (2 CPU cores "
        f"carry ~1,000/s) while the fleet runs near saturation, so queueing shows",
    ])


def run_policies(cfg: DemoConfig, plan: TracePlan, log_dir: Path) -> int:
    """Start the fleet, replay the trace once per policy, print header and table; returns the exit status.

    Raises:
        ProcessStartError: a process exited or did not become ready.
    """
    summaries, costs = [], []
    with ProcessGroup() as procs:
        if cfg.backend == "vllm":
            from bench import demo_vllm

            instances, sidecars = demo_vllm.start_fleet(procs, cfg.num_instances, log_dir)
        else:
            instances = start_emulators(procs, cfg, log_dir)
            sidecars = start_sidecars(procs, cfg, instances, log_dir) if "astrolabe" in cfg.policies else {}
        logger.info("instances ready: %s", ", ".join(instances))
        sidecar_pids = [p.pid for p in procs.processes if p.name.startswith("sidecar-")]
        for policy in cfg.policies:
            routers, base_url, metrics_url = start_router(procs, cfg, policy, instances, log_dir, sidecars)
            sidecar_cpu_s = sum(cpu_seconds(pid) for pid in sidecar_pids)
            try:
                duration_s = plan.trace[-1].arrival_offset_s if plan.trace else 0.0
                results = asyncio.run(replay(
                    base_url, plan.trace, model=_model(cfg), request_timeout_s=cfg.request_timeout_s,
                    overall_timeout_s=duration_s + 2 * cfg.request_timeout_s, progress=cfg.progress,
                    progress_desc=f"{policy:>14}",
                ))
                costs.append(ControlPlaneCost(
                    policy, len(results),
                    _scrape_counter(metrics_url, 'astrolabe_extproc_predictions_total'),
                    _scrape_counter(metrics_url, 'astrolabe_extproc_requests_total{outcome="fallback"}'),
                    cpu_seconds(routers[0].pid),
                    sum(cpu_seconds(pid) for pid in sidecar_pids) - sidecar_cpu_s))
            finally:
                for proc in reversed(routers):
                    proc.stop()
            summaries.append(summarize(policy, results))
            _log_errors(policy, results, log_dir)
            wait_idle(instances)
        print(format_header(cfg, plan, instances))
        print()
        print(format_table(summaries, instances))
        print()
        print(format_comparison(summaries, "astrolabe"))
        print()
        print(format_costs(costs))
        print(f"logs: {log_dir}")
    return 1 if any(s.num_errors for s in summaries) else 0


def _model(cfg: DemoConfig) -> str:
    """The served model name of the configured backend."""
    return "tiny-llama" if cfg.backend == "vllm" else MODEL


def _log_errors(policy: str, results: Sequence[RequestResult], log_dir: Path) -> None:
    """Write every result as JSON lines and log the first few errors."""
    path = log_dir / f"results-{policy}.jsonl"
    with path.open("w", encoding="utf-8") as fp:
        for r in results:
            fp.write(json.dumps(dataclasses.asdict(r)) + "\n")
    errors = [r for r in results if not r.ok]
    for r in errors[:5]:
        logger.warning("%s: request %s failed: %s", policy, r.id, r.error)
    if errors:
        logger.warning("%s: %d of %d requests failed; all results in %s", policy, len(errors), len(results), path)


def _raise_keyboard_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``astrolabe demo``.

    Returns:
        0 on success; 1 if some request failed (the table is still printed); 2 if the settings are invalid or a
        process failed to start; 130 on Ctrl-C or SIGTERM. The table goes to stdout, logs and bars to stderr.
    """
    cfg = _parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # SIGTERM (e.g. from a test harness or `timeout`) takes the same clean-up path as Ctrl-C; SIGINT is
    # re-armed because a shell starts background jobs with it ignored, and Python keeps an inherited SIG_IGN.
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _run(cfg)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(cfg: DemoConfig) -> int:
    log_dir = cfg.log_dir or Path(tempfile.mkdtemp(prefix="astrolabe-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    logger.info("logs and configs in %s", log_dir)
    start_s = time.monotonic()
    try:
        plan = plan_trace(cfg)
    except ValueError as exc:  # WorkloadError, or EngineConfig rejecting the engine flags
        logger.error("cannot plan the trace: %s", exc)
        return 2
    logger.info("trace ready: %d requests at %.2f req/s", len(plan.trace), plan.rate_qps)
    try:
        status = run_policies(cfg, plan, log_dir)
    except ProcessStartError as exc:
        logger.error("a process failed to start: %s", exc)
        return 2
    except KeyboardInterrupt:
        logger.error("interrupted; every process was stopped")
        return 130
    logger.info("demo finished in %.0f s", time.monotonic() - start_s)
    return status
