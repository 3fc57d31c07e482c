"""The ext_proc stream over a real grpc.aio channel, driven the way Envoy drives it."""

import asyncio
import contextlib
import json

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc import wire
from extproc.config import parse_config
from extproc.server import ExtprocServer

Mode = processing_mode_pb2.ProcessingMode
ENDPOINTS = [{"address": "127.0.0.1:18001", "models": ["m"]}, {"address": "127.0.0.1:18002", "models": ["m"]}]


@contextlib.asynccontextmanager
async def running_server(raw: dict):
    """An `ExtprocServer` of the config ``raw`` on a free port, and a stub of its ExternalProcessor service."""
    srv = ExtprocServer(parse_config({"listen": "127.0.0.1:0", **raw}))
    port = await srv.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield srv, pb_grpc.ExternalProcessorStub(channel)
    finally:
        await channel.close()
        await srv.stop()


@pytest.fixture
async def server():
    async with running_server({"policy": "round-robin", "seed": 1, "max_body_bytes": 300_000,
                               "health_check": {"enabled": False}, "endpoints": ENDPOINTS}) as running:
        yield running


def headers_msg(method="POST", path="/v1/completions", eos=False, mode=Mode.BUFFERED, extra=()):
    hs = [(":method", method), (":path", path), ("x-request-id", "abc"), *extra]
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]),
            end_of_stream=eos),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode))


def body_msg(data: bytes, eos=True):
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def destination_of(common: pb.CommonResponse) -> str:
    (option,) = common.header_mutation.set_headers
    assert option.header.key == wire.DESTINATION_HEADER and not option.header.value
    assert option.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert common.clear_route_cache
    return option.header.raw_value.decode()


def metadata_of(response: pb.ProcessingResponse) -> str:
    return response.dynamic_metadata.fields[wire.LB_METADATA_NAMESPACE].struct_value.fields[
        wire.DESTINATION_HEADER].string_value


BODY = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 5}).encode()


async def test_buffered_routes_on_body(server):
    srv, stub = server
    call = stub.Process()
    await call.write(headers_msg())
    first = await call.read()
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.header_mutation.set_headers
    await call.write(body_msg(BODY))
    second = await call.read()
    dest = destination_of(second.request_body.response)
    assert dest in {e["address"] for e in ENDPOINTS} and metadata_of(second) == dest
    assert srv.pool.in_flight(dest) == 1
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    assert srv.pool.in_flight(dest) == 0


async def test_get_routes_on_headers_without_body(server):
    _, stub = server
    call = stub.Process()
    await call.write(headers_msg(method="GET", path="/v1/models", eos=True, mode=Mode.FULL_DUPLEX_STREAMED))
    response = await call.read()
    assert destination_of(response.request_headers.response) == metadata_of(response)
    await call.done_writing()


async def test_full_duplex_holds_headers_then_orders_headers_body_chunks(server):
    _, stub = server
    body = json.dumps({"model": "m", "prompt": "x" * 200_000}).encode()
    call = stub.Process()
    await call.write(headers_msg(mode=Mode.FULL_DUPLEX_STREAMED))
    half = len(body) // 2
    await call.write(body_msg(body[:half], eos=False))
    await call.write(body_msg(body[half:], eos=True))
    responses = [await call.read() for _ in range(1 + -(-len(body) // wire.MAX_STREAMED_CHUNK_BYTES))]
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert responses[0].WhichOneof("response") == "request_headers"
    assert destination_of(responses[0].request_headers.response) == metadata_of(responses[0])
    chunks = [r.request_body.response.body_mutation.streamed_response for r in responses[1:]]
    assert all(len(c.body) <= wire.MAX_STREAMED_CHUNK_BYTES for c in chunks)
    assert b"".join(c.body for c in chunks) == body
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]


async def test_full_duplex_with_trailers(server):
    _, stub = server
    call = stub.Process()
    await call.write(headers_msg(mode=Mode.FULL_DUPLEX_STREAMED))
    await call.write(body_msg(BODY, eos=False))
    await call.write(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    kinds = []
    for _ in range(3):
        kinds.append((await call.read()).WhichOneof("response"))
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    await call.done_writing()


async def _error_of(stub, body, mode=Mode.BUFFERED, path="/v1/completions"):
    call = stub.Process()
    await call.write(headers_msg(mode=mode, path=path))
    if mode == Mode.BUFFERED:
        await call.read()
    await call.write(body_msg(body))
    response = await call.read()
    await call.done_writing()
    immediate = response.immediate_response
    assert immediate.headers.set_headers[0].header.raw_value == b"application/json"
    return immediate.status.code, json.loads(immediate.body)


@pytest.mark.parametrize("mode", [Mode.BUFFERED, Mode.FULL_DUPLEX_STREAMED], ids=["buffered", "full-duplex"])
@pytest.mark.parametrize(
    "body, status",
    [(b"nope", 400), (b"[1]", 400), (b'{"model": "m"}', 400), (b'{"prompt": 1}', 400),
     (b'{"model": "other", "prompt": "x"}', 404), (b'{"prompt": "' + b"x" * 300_001 + b'"}', 413)],
    ids=["not-json", "not-object", "no-prompt", "bad-type", "unknown-model", "too-large"],
)
async def test_errors(server, body, status, mode):
    srv, stub = server
    code, payload = await _error_of(stub, body, mode)
    assert code == status and payload["error"]["code"] == status and payload["error"]["message"]
    assert all(srv.pool.in_flight(e["address"]) == 0 for e in ENDPOINTS)


async def test_no_healthy_endpoint_is_503(server):
    srv, stub = server
    for e in ENDPOINTS:
        srv.pool.set_healthy(e["address"], False)
    code, payload = await _error_of(stub, BODY)
    assert code == 503 and "no healthy endpoint" in payload["error"]["message"]


async def test_too_large_is_refused_before_the_body_ends(server):
    _, stub = server
    call = stub.Process()
    await call.write(headers_msg(mode=Mode.FULL_DUPLEX_STREAMED))
    await call.write(body_msg(b"x" * 300_001, eos=False))
    response = await call.read()
    assert response.immediate_response.status.code == 413
    await call.done_writing()


async def test_cancelled_stream_releases_in_flight(server):
    srv, stub = server
    call = stub.Process()
    await call.write(headers_msg(mode=Mode.FULL_DUPLEX_STREAMED))
    await call.write(body_msg(BODY))
    response = await call.read()
    dest = destination_of(response.request_headers.response)
    assert srv.pool.in_flight(dest) == 1
    call.cancel()
    for _ in range(500):  # the server sees the cancellation asynchronously
        if srv.pool.in_flight(dest) == 0:
            break
        await asyncio.sleep(0.01)
    assert srv.pool.in_flight(dest) == 0


async def test_a_gzip_body_is_decoded_for_routing_and_sent_on_unchanged(server):
    """content-encoding gzip (a fresh-user report: refused as invalid JSON): the extproc reads the decoded body;
    in full-duplex mode the body it re-sends to Envoy is the compressed one it received."""
    import gzip  # noqa: PLC0415

    srv, stub = server
    compressed = gzip.compress(BODY)
    call = stub.Process()
    await call.write(headers_msg(mode=Mode.FULL_DUPLEX_STREAMED, extra=[("content-encoding", "gzip")]))
    await call.write(body_msg(compressed))
    headers = await call.read()
    assert destination_of(headers.request_headers.response) in {e["address"] for e in ENDPOINTS}
    chunk = await call.read()
    assert chunk.request_body.response.body_mutation.streamed_response.body == compressed
    await call.done_writing()


@pytest.mark.parametrize("extra, routed", [(0, True), (1, False)], ids=["at-the-limit", "one-byte-over"])
async def test_a_body_at_max_body_bytes_is_routed_and_one_byte_more_is_413(server, extra, routed):
    """The limit is inclusive (a mutation check: `>` vs `>=` survived every test)."""
    srv, stub = server
    limit = srv.config.max_body_bytes
    shell = json.dumps({"model": "m", "prompt": ""}).encode()
    body = json.dumps({"model": "m", "prompt": "x" * (limit - len(shell) + extra)}).encode()
    assert len(body) == limit + extra
    call = stub.Process()
    await call.write(headers_msg())
    await call.read()
    await call.write(body_msg(body))
    answer = await call.read()
    if routed:
        assert destination_of(answer.request_body.response) in {e["address"] for e in ENDPOINTS}
    else:
        assert answer.immediate_response.status.code == 413
    await call.done_writing()


@pytest.mark.parametrize("mode", [Mode.BUFFERED, Mode.FULL_DUPLEX_STREAMED], ids=["buffered", "full-duplex"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate", "/v1/%63ompletions?x=1"])
async def test_a_post_without_a_body_to_an_inference_route_is_400(server, path, mode):
    """Headers that end the stream (an empty body): nothing to route on, the backend would refuse it."""
    srv, stub = server
    call = stub.Process()
    await call.write(headers_msg(path=path, eos=True, mode=mode))
    response = await call.read()
    await call.done_writing()
    immediate = response.immediate_response
    assert immediate.status.code == 400 and immediate.headers.set_headers[0].header.raw_value == b"application/json"
    error = json.loads(immediate.body)["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and "body is empty" in error["message"]
    assert all(srv.pool.in_flight(e["address"]) == 0 for e in ENDPOINTS)


@pytest.mark.parametrize("method, path", [("POST", "/v1/embeddings"), ("POST", "/tokenize"), ("GET", "/v1/completions"),
                                          ("DELETE", "/v1/chat/completions")])
async def test_a_bodiless_request_elsewhere_is_routed_on_its_headers(server, method, path):
    _, stub = server
    call = stub.Process()
    await call.write(headers_msg(method=method, path=path, eos=True, mode=Mode.FULL_DUPLEX_STREAMED))
    response = await call.read()
    await call.done_writing()
    assert destination_of(response.request_headers.response) in {e["address"] for e in ENDPOINTS}

