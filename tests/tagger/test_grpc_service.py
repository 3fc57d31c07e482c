"""tagger.grpc_service: the gRPC tagger with health, its client, and stub regeneration."""

import os

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tagger import grpc_service
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
