"""tagger.grpc_service: the gRPC tagger with health, its client, and stub regeneration."""

import os

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from astrolabe.tracing import LENGTH_ESTIMATE_SPAN, setup_tracing
from tagger import grpc_service
from tagger.features import HistoryStats
from tagger.grpc_service import SERVICE_NAME, TaggerClient, load_stubs, start_server
from tagger.serve import load_service


@pytest.fixture
async def server_port():
    service = load_service(None)
    server, port = await start_server(service, "127.0.0.1:0")
    try:
        yield port
    finally:
        await server.stop(None)
        service.close()


async def test_estimate_and_health_over_grpc(server_port):
    client = TaggerClient(f"127.0.0.1:{server_port}", timeout_s=5.0)
    try:
        assert await client.estimate("Write a long essay about the moon.") > 1
        assert await client.estimate("Write a long essay about the moon.", None, 7) == 7
        assert await client.estimate(None, list(range(100)), None) >= 1
    finally:
        await client.close()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5.0)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_response_names_the_tagger_kind(server_port):
    pb2, pb2_grpc = load_stubs()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server_port}") as channel:
        reply = await pb2_grpc.TaggerStub(channel).Estimate(pb2.EstimateRequest(prompt_text="hi"), timeout=5.0)
    assert reply.tagger_kind == "light" and reply.num_output_tokens >= 1


def test_stale_stubs_are_regenerated():
    stub = grpc_service.GENERATED_DIR / "tagger_pb2.py"
    proto_mtime_ns = grpc_service.PROTO_PATH.stat().st_mtime_ns
    os.utime(stub, ns=(proto_mtime_ns - 10**9, proto_mtime_ns - 10**9))
    assert grpc_service._stubs_stale()
    load_stubs()
    assert not grpc_service._stubs_stale()
    assert stub.stat().st_mtime_ns >= proto_mtime_ns
    assert (grpc_service.GENERATED_DIR / ".gitignore").read_text() == "*\n"


async def test_estimate_continues_the_callers_trace():
    exporter = InMemorySpanExporter()
    tracing = setup_tracing("astrolabe-tagger", environ={}, exporter=exporter)
    service = load_service(None)
    server, port = await start_server(service, "127.0.0.1:0", tracing)
    client = TaggerClient(f"127.0.0.1:{port}", timeout_s=5.0)
    try:
        with tracing.tracer("test").start_as_current_span("caller") as caller:
            num_tokens = await client.estimate("Write a long essay about the moon.", None, 300)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:  # health checks are not traced
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5.0)
    finally:
        await client.close()
        await server.stop(None)
        service.close()
        tracing.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"caller", f"/{SERVICE_NAME}/Estimate", LENGTH_ESTIMATE_SPAN}
    server_span, estimate = spans[f"/{SERVICE_NAME}/Estimate"], spans[LENGTH_ESTIMATE_SPAN]
    assert server_span.kind == SpanKind.SERVER and server_span.parent.span_id == caller.get_span_context().span_id
    assert estimate.parent.span_id == server_span.context.span_id
    assert estimate.attributes["astrolabe.num_predicted_output_tokens"] == num_tokens
    assert estimate.attributes["astrolabe.tagger_kind"] == "light"


async def test_estimates_over_grpc_are_the_taggers_own():
    """The gRPC answer is the model's estimate of that very prompt (a constant or a mixed-up field would pass the
    bounds checks above): equal to the in-process service's, and different for prompts the model tells apart."""
    service = load_service(None)
    server, port = await start_server(service, "127.0.0.1:0")
    client = TaggerClient(f"127.0.0.1:{port}", timeout_s=5.0)
    prompts = ["hi", "Write a long essay about the moon, its phases and its history.",
               "Translate 'cat' into French.", "List every prime below 1000 with a proof for each."]
    try:
        over_grpc = [await client.estimate(p) for p in prompts]
        reference = load_service(None)
        in_process = [await reference.estimate(p) for p in prompts]
        reference.close()
        assert over_grpc == in_process
        assert len(set(over_grpc)) > 1
        # a later turn: the history's roles and sizes travel and change the estimate as in process
        sizes = [("user", 40), ("assistant", 6000)]
        later = await client.estimate(prompts[2], history_sizes=sizes)
        reference = load_service(None)
        assert later == await reference.estimate(prompts[2], history=HistoryStats.from_sizes(sizes))
        reference.close()
        assert later != over_grpc[2]
    finally:
        await client.close()
        await server.stop(None)
        service.close()
