"""Drive an extproc over the real ext_proc gRPC protocol, as Envoy does, and start the fleet behind it.

Shared by the benchmarks that measure the extproc itself (`bench.tracing_cost`, `bench.extproc_bench`): chat
bodies, the ext_proc messages of one BUFFERED request, one decision timed client side, a block of decisions at a
fixed concurrency, emulated instances with their predictor sidecars, and an extproc process configured for
them. All processes run on loopback inside a ``astrolabe.procs.ProcessGroup``. Nothing in production imports this.

NOTE: a decision is one ``Process`` stream: request headers (answered CONTINUE), the whole body in one message
(answered with the destination header mutation), then the stream is closed, which the extproc takes as the end
of the request (its Release). Latency is timed from sending the headers to receiving the routing answer.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.demo_fleet import wait_grpc_ready
from astrolabe.procs import ManagedProcess, ProcessGroup, ProcessStartError, free_port

MODEL = "llama-2-7b"
START_TIMEOUT_S = 60.0
"""Longest wait for one process to become ready, seconds."""
DESTINATION_HEADER = "x-gateway-destination-endpoint"
_WORDS = ("the", "model", "router", "trace", "span", "token", "request", "latency", "queue", "instance", "explain",
          "why", "how", "write", "story", "about", "a", "long", "short", "list")


def prompts(num_requests: int, seed: int, min_words: int = 40, max_words: int = 200,
            max_tokens: int = 256) -> list[bytes]:
    """``num_requests`` chat bodies (one user message of ``min_words``-``max_words`` words, seeded), as UTF-8 JSON
    bytes, with ``max_tokens``. About 5.5 bytes per word (200 KB of prompt is ~37,000 words)."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(num_requests):
        text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words)))
        bodies.append(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}],
                                  "max_tokens": max_tokens}).encode())
    return bodies


def processing_messages(request_id: str, body: bytes):
    """The two ``ProcessingRequest`` messages of one BUFFERED ``POST /v1/chat/completions``: headers, body."""
    from envoy.config.core.v3 import base_pb2  # noqa: PLC0415 (Envoy's protos load only when a bench runs)
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


def destination_of(answer) -> str | None:
    """The destination header a routing answer (a body ``ProcessingResponse``) sets, or None."""
    mutation = answer.request_body.response.header_mutation
    for option in mutation.set_headers:
        if option.header.key == DESTINATION_HEADER:
            return (option.header.raw_value or option.header.value.encode()).decode()
    return None


async def decide(stub, request_id: str, body: bytes) -> float:
    """One ext_proc stream as Envoy drives it (module NOTE); returns headers-sent to routing-answer, seconds.

    Raises:
        RuntimeError: the extproc answered with an error, or with no destination header.
    """
    headers, body_message = processing_messages(request_id, body)
    call = stub.Process()
    start_s = time.perf_counter()
    await call.write(headers)
    await call.read()
    await call.write(body_message)
    answer = await call.read()
    latency_s = time.perf_counter() - start_s
    await call.done_writing()
    await call.read()
    if answer.WhichOneof("response") != "request_body" or not destination_of(answer):
        raise RuntimeError(f"not routed: {answer}")
    return latency_s


async def drive(address: str, bodies: Sequence[bytes], tag: str, concurrency: int,
                num_connections: int = 1) -> list[float]:
    """Decisions for ``bodies`` over ``num_connections`` channels (one connection each; stream ``i`` of the
    ``concurrency`` in flight at once uses channel ``i % num_connections``; closed loop); returns each decision's
    latency, seconds, in ``bodies`` order. Request ids are ``<tag>-<index>``. Several connections reach several
    workers of one extproc (``extproc.workers``: the kernel gives each connection to one of them).

    Raises:
        RuntimeError: a decision was not routed (`decide`).
    """
    import grpc  # noqa: PLC0415
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc  # noqa: PLC0415

    latencies = [0.0] * len(bodies)
    # A channel of its own subchannel pool opens its own connection (else channels to one address share one).
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(num_connections)]
    try:
        stubs = [pb_grpc.ExternalProcessorStub(channel) for channel in channels]
        next_index = iter(range(len(bodies)))

        async def worker(stub) -> None:
            for i in next_index:
                latencies[i] = await decide(stub, f"{tag}-{i}", bodies[i])

        await asyncio.gather(*(worker(stubs[k % num_connections]) for k in range(concurrency)))
    finally:
        for channel in channels:
            await channel.close()
    return latencies


def drive_block(address: str, bodies: Sequence[bytes], tag: str, concurrency: int,
                num_connections: int = 1) -> list[float]:
    """`drive` on a fresh event loop (a block of its own)."""
    return asyncio.run(drive(address, bodies, tag, concurrency, num_connections))


FAST_BACKEND_ENGINE_ARGS = ("--num-gpu-blocks", "16384", "--max-num-batched-tokens", "8192")
"""Sidecar engine flags for `bench.fast_backend` instances: a KV cache that holds a 200 KB prompt (~45,000
tokens) and vLLM's chunked-prefill budget for large GPUs (8,192 tokens per step)."""


def start_fleet(procs: ProcessGroup, tmp: Path, otlp_endpoint: str | None = None, *, num_instances: int = 2,
                time_scale: float = 2.0, backend: str = "emulator") -> tuple[dict[str, str], list[ManagedProcess]]:
    """``num_instances`` backends and their predictor sidecars (ledger mode); returns backend -> sidecar, and the
    sidecar processes.

    Args:
        procs: owns the processes.
        tmp: where their logs go.
        otlp_endpoint: the sidecars trace (following the caller's sampling) to this OTLP receiver; None: untraced.
        num_instances: backends (each with one sidecar).
        time_scale: wall seconds per modelled H200 second, for the emulators and the sidecars.
        backend: ``emulator`` (``astrolabe emulator``, default engine flags) or ``fast`` (`bench.fast_backend`,
            answers at once; its sidecars get `FAST_BACKEND_ENGINE_ARGS`).

    Raises:
        astrolabe.procs.ProcessStartError: a process did not start.
    """
    sidecar_env = ({"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_TRACES_EXPORTER": ""} if otlp_endpoint is None else
                   {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint, "OTEL_TRACES_SAMPLER": "parentbased_always_off"})
    fleet, sidecars = {}, []
    for i in range(num_instances):
        port, sidecar_port = free_port(), free_port()
        if backend == "fast":
            cmd, engine_args = [sys.executable, "-m", "bench.fast_backend", "--port", str(port)], FAST_BACKEND_ENGINE_ARGS
        else:
            cmd = [sys.executable, "-m", "astrolabe", "emulator", "--port", str(port), "--time-scale", str(time_scale)]
            engine_args = ()
        instance = procs.start(cmd, name=f"{backend}-{i}", log_path=tmp / f"{backend}-{i}.log")
        instance.wait_http(f"http://127.0.0.1:{port}/health", START_TIMEOUT_S)
        sidecar = procs.start([sys.executable, "-m", "astrolabe", "predictor", "serve", "--backend",
                               f"127.0.0.1:{port}", "--listen", f"127.0.0.1:{sidecar_port}",
                               "--time-scale", str(time_scale), *engine_args],
                              name=f"sidecar-{i}", log_path=tmp / f"sidecar-{i}.log", env=sidecar_env)
        sidecar.wait_tcp("127.0.0.1", sidecar_port, START_TIMEOUT_S)
        fleet[f"127.0.0.1:{port}"] = f"127.0.0.1:{sidecar_port}"
        sidecars.append(sidecar)
    return fleet, sidecars


def start_extproc(procs: ProcessGroup, tmp: Path, name: str, fleet: dict[str, str], extra: dict | None = None, *,
                  policy: str = "astrolabe", policy_params: dict | None = None,
                  launcher: Sequence[str] = ("-m", "astrolabe", "extproc"),
                  workers: int = 1) -> tuple[ManagedProcess, str, Path]:
    """An extproc process routing to ``fleet`` (backend -> sidecar) with its decision log; returns the process,
    its ``ip:port`` and the decision log's path.

    Args:
        procs: owns the process.
        tmp: where its config, log and decision log go.
        name: the process's name (and file names).
        fleet: backend ``ip:port`` -> its sidecar's ``ip:port``.
        extra: more config keys (e.g. ``tracing``), over the defaults.
        policy: the policy's registry name.
        policy_params: its parameters; None: ``{"k": 2}`` for ``astrolabe``, none for others.
        launcher: what the interpreter runs, given ``--config FILE --log-level WARNING`` (a profiling wrapper may
            stand in for ``astrolabe extproc``).
        workers: extproc worker processes (the ``workers`` key, ``extproc.workers``); with more than 1 the
            process returned is their supervisor, the leader of their process group, and this returns once every
            worker serves.

    Raises:
        astrolabe.procs.ProcessStartError: it did not serve gRPC within `START_TIMEOUT_S`.
    """
    port = free_port()
    log = tmp / f"{name}-decisions.jsonl"
    params = policy_params if policy_params is not None else ({"k": 2} if policy == "astrolabe" else {})
    config = {"listen": f"127.0.0.1:{port}", "workers": workers, "policy": policy, "policy_params": params, "seed": 0,
              "decision_log_path": str(log), "health_check": {"interval_s": 0.5}, "drain_delay_s": 0,
              "predictor_client": {"predict_timeout_s": 0.2},
              "endpoints": [{"address": a, "models": [MODEL], "predictor": p} for a, p in fleet.items()],
              **(extra or {})}
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(config))
    # No OTEL_* variables reach the extproc: its config file alone decides (the bench's own env is cleared).
    # INFO for workers: the supervisor's "all N workers ready" line (its workers log nothing per request at INFO).
    proc = procs.start([sys.executable, *launcher, "--config", str(path),
                        "--log-level", "WARNING" if workers == 1 else "INFO"],
                       name=name, log_path=tmp / f"{name}.log",
                       env={"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_TRACES_EXPORTER": ""})
    wait_grpc_ready(proc, f"127.0.0.1:{port}", START_TIMEOUT_S)
    if workers > 1:  # the first ready worker answered; the supervisor says when all are
        deadline_s = time.monotonic() + START_TIMEOUT_S
        while f"all {workers} workers ready" not in proc.log_path.read_text(errors="replace"):
            if not proc.is_running() or time.monotonic() > deadline_s:
                raise ProcessStartError(f"{name}: not all {workers} workers ready within {START_TIMEOUT_S:g} s; "
                                        f"log:\n{proc.log_tail()}")
            time.sleep(0.1)
    return proc, f"127.0.0.1:{port}", log
