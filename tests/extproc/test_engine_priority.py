"""objectives.engine_priority: the request's priority written into the body vLLM reads (extproc/engine_priority.py),
and the stream answers that carry it (over a real grpc.aio channel, driven the way Envoy drives it)."""

import gzip
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.engine_priority import body_with_priority
from tests.extproc.test_stream import Mode, body_msg, headers_msg, running_server

ENDPOINTS = [{"address": "127.0.0.1:18001", "models": ["m"]}]
OBJECTIVES = {"named": {"critical": {"priority": 0, "ttft_ms": 1000}, "batch": {"priority": -1, "ttft_ms": 5000},
                        "vip": {"priority": 3}},
              "admission": "none", "engine_priority": True}


@pytest.mark.parametrize("body, expected", [
    (b'{"model":"m","prompt":"x"}', b'{"model":"m","prompt":"x","priority":1}'),
    (b'  {"model": "m"} \n', b'  {"model": "m","priority":1} \n'),
    (b"{}", b'{"priority":1}'),
    (b"{ \n }", b'{ \n "priority":1}'),
])
def test_a_body_without_the_field_keeps_its_bytes_and_gets_it_appended(body, expected):
    assert body_with_priority(body, 1) == expected
    assert json.loads(expected)["priority"] == 1


@pytest.mark.parametrize("body", [
    b'{"model":"m","priority":-7,"prompt":"x"}',              # the client's own: replaced, not duplicated
    b'{"model":"m","\\u0070riority":-7}',                     # an escaped key that spells it
    b'{"messages":[{"role":"user","content":"my \\"priority\\" is high"}]}',  # the word inside a string
    b'{"prompt":"caf\\u00e9 \xc3\xa9"}',                       # escapes and non-ASCII kept readable
])
def test_a_body_that_may_name_the_field_is_rewritten_with_it_replaced(body):
    out = body_with_priority(body, 2)
    parsed = json.loads(out)
    assert parsed == {**json.loads(body), "priority": 2}
    assert out.count(b'"priority"') == 1


@pytest.mark.parametrize("body", [b"[1, 2]", b'"x"', b"", b"{"])
def test_what_is_not_a_json_object_raises(body):
    with pytest.raises(ValueError):
        body_with_priority(body, 0)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                           max_leaves=10)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(), json_values, max_size=5), st.integers(-(2 ** 31) + 1, 2 ** 31 - 1),
       st.sampled_from([{}, {"indent": 2}, {"ensure_ascii": False}, {"separators": (",", ":")}]))
def test_the_body_reads_as_the_clients_object_with_the_priority_set(obj, priority, style):
    body = json.dumps(obj, **style).encode()
    assert json.loads(body_with_priority(body, priority)) == {**obj, "priority": priority}


@pytest.fixture
async def server():
    async with running_server({"policy": "round-robin", "seed": 1, "health_check": {"enabled": False},
                               "endpoints": ENDPOINTS, "objectives": OBJECTIVES}) as running:
        yield running


def _headers(response) -> dict[str, str]:
    return {o.header.key: o.header.raw_value.decode() for o in response.header_mutation.set_headers}


BODY = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 5, "priority": -100}).encode()


@pytest.mark.parametrize("objective, engine_priority", [("critical", 0), ("batch", 1), ("vip", -3), (None, 0)])
async def test_buffered_answer_replaces_the_body_and_its_content_length(server, objective, engine_priority):
    srv, stub = server
    call = stub.Process()
    extra = (("x-gateway-inference-objective", objective),) if objective else ()
    await call.write(headers_msg(extra=extra))
    await call.read()
    await call.write(body_msg(BODY))
    answer = (await call.read()).request_body.response
    body = answer.body_mutation.body
    assert json.loads(body) == {**json.loads(BODY), "priority": engine_priority}
    assert _headers(answer)["content-length"] == str(len(body))
    await call.done_writing()
    assert srv.router.metrics.engine_priority_bodies.labels("written")._value.get() == 1


async def test_full_duplex_resends_the_rewritten_body_after_headers_with_its_length(server):
    srv, stub = server
    call = stub.Process()
    await call.write(headers_msg(mode=Mode.FULL_DUPLEX_STREAMED, extra=(("x-gateway-inference-objective", "batch"),)))
    await call.write(body_msg(BODY[:10], eos=False))
    await call.write(body_msg(BODY[10:], eos=True))
    headers = await call.read()
    chunks = []
    while True:
        message = await call.read()
        chunk = message.request_body.response.body_mutation.streamed_response
        chunks.append(chunk.body)
        if chunk.end_of_stream:
            break
    body = b"".join(chunks)
    assert json.loads(body)["priority"] == 1
    assert _headers(headers.request_headers.response)["content-length"] == str(len(body))
    await call.done_writing()


async def test_a_compressed_body_and_other_routes_go_on_unchanged(server):
    srv, stub = server
    call = stub.Process()
    await call.write(headers_msg(extra=(("content-encoding", "gzip"), ("x-gateway-inference-objective", "batch"))))
    await call.read()
    await call.write(body_msg(gzip.compress(BODY)))
    answer = (await call.read()).request_body.response
    assert not answer.HasField("body_mutation") and "content-length" not in _headers(answer)
    assert srv.router.metrics.engine_priority_bodies.labels("encoded")._value.get() == 1
    await call.done_writing()
    call = stub.Process()
    await call.write(headers_msg(path="/v1/embeddings"))
    await call.read()
    await call.write(body_msg(json.dumps({"model": "m", "input": "x"}).encode()))
    answer = (await call.read()).request_body.response
    assert not answer.HasField("body_mutation")
    await call.done_writing()


async def test_off_by_default_the_clients_body_goes_on_unchanged():
    async with running_server({"policy": "round-robin", "seed": 1, "health_check": {"enabled": False},
                               "endpoints": ENDPOINTS}) as (srv, stub):
        call = stub.Process()
        await call.write(headers_msg())
        await call.read()
        await call.write(body_msg(BODY))
        answer = (await call.read()).request_body.response
        assert not answer.HasField("body_mutation")
        await call.done_writing()


@pytest.mark.parametrize("named, warned", [({"batch": {"priority": -1}}, False), ({"chat": {"priority": 0}}, True),
                                           ({}, True)])
async def test_engine_priority_without_a_nonzero_priority_warns_at_start(caplog, named, warned):
    from extproc.config import parse_config
    from extproc.server import ExtprocServer

    caplog.set_level("WARNING", logger="extproc.server")
    ExtprocServer(parse_config({"listen": "127.0.0.1:0", "policy": "round-robin", "endpoints": ENDPOINTS,
                                "objectives": {"named": named, "engine_priority": True}}))
    assert ("every configured objective has priority 0" in caplog.text) == warned
