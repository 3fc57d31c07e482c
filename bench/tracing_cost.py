"""`astrolabe bench tracing`: what tracing costs a routing decision, tracing off against on, in the same run.

Setup, all real processes on loopback: 2 emulated instances, each with its predictor sidecar (tracing on with
``OTEL_TRACES_SAMPLER=parentbased_always_off``: a sidecar records exactly the traces a sampled caller sends it), an
OTLP/gRPC receiver process (``bench.otlp_receiver``, spans to a file), and two extproc processes (astrolabe policy,
k = 2, the shipped light tagger) identical but for their ``tracing:`` section: one off, one exporting every trace
(``sampler_ratio: 1``) to the receiver. The bench is the ext_proc client, as Envoy is: a decision is one
``Process`` stream in BUFFERED mode (headers, then a chat body), timed from sending the headers to receiving the
routing answer; the stream is then closed (the request's Release). Rounds alternate an off block and an on block
of the same requests in the same order, so the two modes pair by position and the machine's drift cancels.

Figures, per mode: p50 / p99 decision latency (client side, ms), the extproc's own routing time (its decision
log's ``routing_s``: headers to decision), CPU per decision of the extproc process (user + system from /proc over
its blocks, ms), and spans received per decision; then the on/off ratio of each, the p50 ratio with its 95% paired
moving-block bootstrap interval (`bench.stats`). Last, the cost of the tracing hooks while off, timed in process
(the stream's calls on the no-op span, per decision, µs). Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import tempfile
import time
import timeit
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from astrolabe.cli import HelpFormatter
from astrolabe.logs import setup_logging
from bench import otlp_receiver
from bench.decisions import read_decisions
from bench.demo_fleet import cpu_seconds, wait_grpc_ready
from bench.procs import ManagedProcess, ProcessGroup, free_port
from bench.stats import p50, p99, paired_ratio_ci

logger = logging.getLogger(__name__)

MODEL = "llama-2-7b"
_WORDS = ("the", "model", "router", "trace", "span", "token", "request", "latency", "queue", "instance", "explain",
          "why", "how", "write", "story", "about", "a", "long", "short", "list")
_START_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ModeResult:
    """One mode's decisions, pooled over its blocks (position order within each block, blocks in order).

    Attributes:
        latency_s: client-side decision latency per decision, seconds.
        routing_s: the extproc's headers-to-decision time per decision (its decision log), seconds.
        cpu_s: the extproc process's CPU over its blocks, seconds.
        num_spans: spans received in the traces of this mode's decisions (the extproc's and the sidecars').
    """

    latency_s: list[float]
    routing_s: list[float]
    cpu_s: float
    num_spans: int


def prompts(num_requests: int, seed: int) -> list[bytes]:
    """``num_requests`` chat bodies of 40-200 words (seeded), ``max_tokens`` 256."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(num_requests):
        text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(40, 200)))
        bodies.append(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}],
                                  "max_tokens": 256}).encode())
    return bodies


def _messages(request_id: str, body: bytes):
    from envoy.config.core.v3 import base_pb2  # noqa: PLC0415 (Envoy's protos load only when the bench runs)
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2  # noqa: PLC0415
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: PLC0415

    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), ("x-request-id", request_id),
               ("content-type", "application/json")]
    return (pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])),
        protocol_config=pb.ProtocolConfiguration(
            request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED)),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))


async def _decide(stub, request_id: str, body: bytes) -> float:
    """One ext_proc stream as Envoy drives it; returns headers-sent to routing-answer, seconds.

    Raises:
        RuntimeError: the extproc answered with an error instead of a route.
    """
    headers, body_message = _messages(request_id, body)
    call = stub.Process()
    start_s = time.perf_counter()
    await call.write(headers)
    await call.read()
    await call.write(body_message)
    answer = await call.read()
    latency_s = time.perf_counter() - start_s
    await call.done_writing()
    await call.read()
    if answer.WhichOneof("response") != "request_body":
        raise RuntimeError(f"not routed: {answer}")
    return latency_s


async def _block(address: str, bodies: list[bytes], tag: str, concurrency: int) -> list[float]:
    import grpc  # noqa: PLC0415
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc  # noqa: PLC0415

    latencies = [0.0] * len(bodies)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        next_index = iter(range(len(bodies)))

        async def worker() -> None:
            for i in next_index:
                latencies[i] = await _decide(stub, f"{tag}-{i}", bodies[i])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


def _start_fleet(procs: ProcessGroup, tmp: Path,
                 otlp_endpoint: str | None) -> tuple[dict[str, str], list[ManagedProcess]]:
    """2 emulators and their sidecars (tracing on, following the caller's sampling, unless ``otlp_endpoint`` is
    None): backend -> sidecar, and the sidecar processes."""
    sidecar_env = ({"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_TRACES_EXPORTER": ""} if otlp_endpoint is None else
                   {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint, "OTEL_TRACES_SAMPLER": "parentbased_always_off"})
    fleet, sidecars = {}, []
    for i in range(2):
        port, sidecar_port = free_port(), free_port()
        emulator = procs.start([sys.executable, "-m", "astrolabe", "emulator", "--port", str(port),
                                "--time-scale", "2"], name=f"emulator-{i}", log_path=tmp / f"emulator-{i}.log")
        emulator.wait_http(f"http://127.0.0.1:{port}/health", _START_TIMEOUT_S)
        sidecar = procs.start([sys.executable, "-m", "astrolabe", "predictor", "serve", "--backend",
                               f"127.0.0.1:{port}", "--listen", f"127.0.0.1:{sidecar_port}", "--time-scale", "2"],
                              name=f"sidecar-{i}", log_path=tmp / f"sidecar-{i}.log", env=sidecar_env)
        sidecar.wait_tcp("127.0.0.1", sidecar_port, _START_TIMEOUT_S)
        fleet[f"127.0.0.1:{port}"] = f"127.0.0.1:{sidecar_port}"
        sidecars.append(sidecar)
    return fleet, sidecars


def _start_extproc(procs: ProcessGroup, tmp: Path, name: str, fleet: dict[str, str],
                   tracing: dict | None) -> tuple[ManagedProcess, str, Path]:
    port = free_port()
    log = tmp / f"{name}-decisions.jsonl"
    config = {"listen": f"127.0.0.1:{port}", "policy": "astrolabe", "policy_params": {"k": 2}, "seed": 0,
              "decision_log_path": str(log), "health_check": {"interval_s": 0.5}, "drain_delay_s": 0,
              "predictor_client": {"predict_timeout_s": 0.2},
              "endpoints": [{"address": a, "models": [MODEL], "predictor": p} for a, p in fleet.items()]}
    if tracing is not None:
        config["tracing"] = tracing
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(config))
    # No OTEL_* variables reach the extprocs: their config file alone decides (the bench's own env is cleared).
    proc = procs.start([sys.executable, "-m", "astrolabe", "extproc", "--config", str(path),
                        "--log-level", "WARNING"],
                       name=name, log_path=tmp / f"{name}.log",
                       env={"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_TRACES_EXPORTER": ""})
    wait_grpc_ready(proc, f"127.0.0.1:{port}", _START_TIMEOUT_S)
    return proc, f"127.0.0.1:{port}", log


def spans_per_mode(spans_file: Path) -> Counter:
    """Spans of each mode's traces in the receiver's file: a trace belongs to the mode its route span's request id
    starts with (``off-`` / ``on-``; warm-up traces and traces without a route span are not counted)."""
    records = [json.loads(line) for line in spans_file.read_text(encoding="utf-8").splitlines() if line]
    mode_of_trace = {r["trace_id"]: r["attributes"].get("astrolabe.request_id", "").split("-", 1)[0]
                     for r in records if r["name"] == "astrolabe.route"}
    return Counter(mode_of_trace.get(r["trace_id"]) for r in records)


def run(num_requests: int, num_rounds: int, concurrency: int, seed: int, trace_sidecars: bool = True,
        sampler_ratio: float = 1.0, control: bool = False) -> tuple[ModeResult, ModeResult]:
    """Runs the A/B (module docstring); returns (off, on). ``trace_sidecars`` False leaves the sidecars untraced
    (only the extproc's own cost is compared); ``sampler_ratio`` is the traced extproc's ``tracing.sampler_ratio``;
    ``control`` leaves the "on" extproc untraced too (an A/A run: the set-up's own noise).

    Raises:
        bench.procs.ProcessStartError: a process did not start.
        RuntimeError: a decision was answered with an error.
    """
    bodies = prompts(num_requests, seed)
    with tempfile.TemporaryDirectory(prefix="astrolabe-tracing-cost-") as folder, ProcessGroup() as procs:
        tmp = Path(folder)
        spans_file = tmp / "spans.jsonl"
        endpoint = "http://" + otlp_receiver.start_process(procs, spans_file, tmp / "receiver.log", _START_TIMEOUT_S)
        fleet, sidecars = _start_fleet(procs, tmp, endpoint if trace_sidecars else None)
        extprocs = {"off": _start_extproc(procs, tmp, "extproc-off", fleet, None),
                    "on": _start_extproc(procs, tmp, "extproc-on", fleet,
                                         None if control else {"endpoint": endpoint, "sampler_ratio": sampler_ratio})}
        asyncio.run(_block(extprocs["off"][1], bodies[:8], "warm-off", 1))  # connections, tokenizer, first refit
        asyncio.run(_block(extprocs["on"][1], bodies[:8], "warm-on", 1))
        latency = {"off": [], "on": []}
        cpu_s = {"off": 0.0, "on": 0.0}
        for round_index in range(num_rounds):
            for mode in ("off", "on"):
                proc, address, _ = extprocs[mode]
                cpu_before_s = cpu_seconds(proc.pid)
                latency[mode] += asyncio.run(_block(address, bodies, f"{mode}-{round_index}", concurrency))
                cpu_s[mode] += cpu_seconds(proc.pid) - cpu_before_s
        for proc in [p for p, _, _ in extprocs.values()] + sidecars:
            proc.stop()  # SIGTERM: decision logs flushed, queued spans exported
        time.sleep(0.5)  # the receiver writes the last exports
        routing = {mode: [r["routing_s"] for r in read_decisions([log]) if not r["request_id"].startswith("warm")]
                   for mode, (_, _, log) in extprocs.items()}
        spans = spans_per_mode(spans_file)
    return tuple(ModeResult(latency[m], routing[m], cpu_s[m], spans[m]) for m in ("off", "on"))


def off_hook_cost_us(repeats: int = 20000) -> float:
    """The stream's tracing calls while off (`extproc.spans.NO_SPAN`), per decision, microseconds (in process)."""
    from extproc.decision import Decision  # noqa: PLC0415
    from extproc.request import RoutingRequest  # noqa: PLC0415
    from extproc.spans import NO_SPAN  # noqa: PLC0415

    headers = {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": "x"}
    request, decision = RoutingRequest("x", "POST", "/v1/chat/completions"), Decision("127.0.0.1:1", "astrolabe")

    def hooks() -> None:
        NO_SPAN.start(headers, "x")
        NO_SPAN.request(request)
        with NO_SPAN.activated():
            pass
        NO_SPAN.decision(decision, "astrolabe")
        NO_SPAN.upstream_headers()
        NO_SPAN.end("abandoned")

    return min(timeit.repeat(hooks, number=repeats, repeat=5)) / repeats * 1e6


def format_report(off: ModeResult, on: ModeResult, hooks_us: float) -> str:
    """The table of the module docstring, as text."""
    n = len(off.latency_s)
    rows = []
    for name, result in (("off", off), ("on", on)):
        lat, routing = np.array(result.latency_s), np.array(result.routing_s)
        rows.append(f"{name:<12} {n:>9} {p50(lat) * 1e3:>14.3f} {p99(lat) * 1e3:>14.3f} "
                    f"{p50(routing) * 1e3:>15.3f} {result.cpu_s / n * 1e3:>13.3f} {result.num_spans / n:>10.2f}")
    ratio = paired_ratio_ci(on.latency_s, off.latency_s, p50)
    lines = [
        f"{'tracing':<12} {'decisions':>9} {'decision p50':>14} {'decision p99':>14} {'routing_s p50':>15} "
        f"{'CPU ms/dec':>13} {'spans/dec':>10}",
        *rows,
        f"on / off: decision p50 {ratio.value:.3f} [95% interval {ratio.low:.3f}, {ratio.high:.3f}], "
        f"p99 {p99(np.array(on.latency_s)) / p99(np.array(off.latency_s)):.3f}, "
        f"routing_s p50 {p50(np.array(on.routing_s)) / p50(np.array(off.routing_s)):.3f}, "
        f"CPU per decision {on.cpu_s / off.cpu_s:.3f}",
        f"tracing off: the stream's no-op span calls cost {hooks_us:.2f} us per decision (in process)",
        "decision = ext_proc headers sent -> routing answer received (ms, client side, as Envoy sees it); routing_s = "
        "the extproc's own headers-to-decision time (decision log); CPU = the extproc process's user+system time "
        "over its blocks; spans/dec = spans the OTLP receiver got per decision (extproc, sidecars)",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Entry point of `astrolabe bench tracing`; prints the report; returns 0."""
    parser = argparse.ArgumentParser(prog="astrolabe bench tracing", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--num-requests", type=int, default=200, help="decisions per block (default 200)")
    parser.add_argument("--rounds", type=int, default=5, help="off/on block pairs (default 5)")
    parser.add_argument("--concurrency", type=int, default=1, help="streams in flight at once (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts (default 0)")
    parser.add_argument("--untraced-sidecars", action="store_true",
                        help="sidecars without tracing: compare the extproc's own cost only (default: traced)")
    parser.add_argument("--sampler-ratio", type=float, default=1.0,
                        help="the traced extproc's tracing.sampler_ratio (default 1.0: every trace)")
    parser.add_argument("--control", action="store_true",
                        help="A/A: the second extproc untraced too, to see the set-up's own noise (default: off)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 20 decisions (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.rounds = 20, 2
    if args.num_requests < 8 or args.rounds < 1 or args.concurrency < 1 or not 0 <= args.sampler_ratio <= 1:
        parser.error("--num-requests must be >= 8, --rounds and --concurrency >= 1, --sampler-ratio in [0, 1]")
    setup_logging("WARNING")
    off, on = run(args.num_requests, args.rounds, args.concurrency, args.seed, not args.untraced_sidecars,
                  args.sampler_ratio, args.control)
    print(f"tracing cost: {args.rounds} rounds x {args.num_requests} decisions per mode, concurrency "
          f"{args.concurrency}, astrolabe k=2 over 2 emulated instances with sidecars "
          f"({'untraced' if args.untraced_sidecars else 'traced, following the extproc'}); "
          + ("CONTROL: both extprocs untraced" if args.control else
             f"on = traces sampled at ratio {args.sampler_ratio:g}, exported over OTLP/gRPC to a local receiver"))
    print(format_report(off, on, off_hook_cost_us()))
    return 0
