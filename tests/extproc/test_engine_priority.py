"""objectives.engine_priority: the request's priority written into the body vLLM reads (extproc/engine_priority.py),
and the stream answers that carry it (over a real grpc.aio channel, driven the way Envoy drives it)."""

import gzip
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc import wire
from extproc.engine_priority import body_with_priority, identity_encoded, writes_priority
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


@pytest.mark.parametrize("body, expected", [
    # the client's own is cut out with its comma, the rest byte for byte (9e15 stays 9e15)
    (b'{"model":"m", "priority": -7 ,"n":9e15}', b'{"model":"m" ,"n":9e15,"priority":2}'),
    (b'{"priority":-7, "model":"m"}', b'{"model":"m","priority":2}'),
    (b'{"priority":1,"priority":{"a":[1]},"x":1,"priority":"s"}', b'{"x":1,"priority":2}'),  # repeated
    (b'{"priority":-7}', b'{"priority":2}'),
    (b'{"model":"m","\\u0070riority":-7}', b'{"model":"m","priority":2}'),  # an escaped key that spells it
    (b'{"messages":[{"role":"user","content":"my \\"priority\\" is high","priority":5}]}',
     b'{"messages":[{"role":"user","content":"my \\"priority\\" is high","priority":5}],"priority":2}'),
    (b'{"prompt":"caf\\u00e9 \xc3\xa9","user":"\\ud800","t":1e400}',  # escapes, lone surrogates, overflow
     b'{"prompt":"caf\\u00e9 \xc3\xa9","user":"\\ud800","t":1e400,"priority":2}'),
])
def test_the_clients_priority_members_are_cut_out_and_the_rest_kept_as_sent(body, expected):
    assert body_with_priority(body, 2) == expected


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le", "utf-32"])
def test_a_body_in_another_unicode_encoding_stays_in_it(encoding):
    body = json.dumps({"model": "m", "priority": -3, "prompt": "é"}, ensure_ascii=False).encode(encoding)
    out = body_with_priority(body, 1)
    assert json.detect_encoding(out) == json.detect_encoding(body)
    assert json.loads(out) == {"model": "m", "prompt": "é", "priority": 1}


@pytest.mark.parametrize("encoding, identity", [(None, True), ("identity", True), ("IDENTITY", True), ("", True),
                                                ("identity, identity", True), (",", True), ("gzip", False),
                                                ("identity, gzip", False), ("br", False)])
def test_only_an_identity_body_is_rewritten(encoding, identity):
    assert identity_encoded(encoding) == identity
    assert writes_priority("/v1/completions") and writes_priority("/v1/responses")
    assert not writes_priority("/generate")  # SGLang's own priority convention


@pytest.mark.parametrize("body", [b"[1, 2]", b'"x"', b"", b"{", b'{"priority" 1}', b'{"priority":1 "b":2}',
                                  b'[{"priority":1}]'])
def test_what_is_not_a_json_object_raises(body):
    with pytest.raises(ValueError):
        body_with_priority(body, 0)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                           max_leaves=10)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(), json_values, max_size=5), st.integers(-(2 ** 31) + 1, 2 ** 31 - 1),
       st.sampled_from([{}, {"indent": 2}, {"ensure_ascii": False}, {"separators": (",", ":")}]),
       st.lists(json_values, max_size=3))
def test_the_body_reads_as_the_clients_object_with_the_priority_set(obj, priority, style, clients):
    body = json.dumps(obj, **style).encode()
    for value in clients:  # the client's own priority members, anywhere in the object, repeated
        cut = body.rindex(b"}")
        body = body[:cut] + (b"," if obj or value is not clients[0] else b"") + b'"priority":' + \
            json.dumps(value).encode() + body[cut:]
        obj = {**obj, "priority": value}
    out = body_with_priority(body, priority)
    assert json.loads(out) == {**obj, "priority": priority}
    assert len(out) <= len(body) + len(f',"priority":{priority}')  # nothing re-encoded


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


async def test_a_compressed_body_and_sglangs_route_go_on_unchanged(server):
    srv, stub = server
    call = stub.Process()
    await call.write(headers_msg(extra=(("content-encoding", "gzip"), ("x-gateway-inference-objective", "batch"))))
    await call.read()
    await call.write(body_msg(gzip.compress(BODY)))
    answer = (await call.read()).request_body.response
    assert not answer.HasField("body_mutation") and "content-length" not in _headers(answer)
    assert srv.router.metrics.engine_priority_bodies.labels("encoded")._value.get() == 1
    await call.done_writing()
    call = stub.Process()  # a list of identity codings is no compression: rewritten
    await call.write(headers_msg(extra=(("content-encoding", "identity, identity"),)))
    await call.read()
    await call.write(body_msg(BODY))
    answer = (await call.read()).request_body.response
    assert json.loads(answer.body_mutation.body)["priority"] == 0
    await call.done_writing()
    call = stub.Process()  # SGLang's /generate keeps its own field
    await call.write(headers_msg(path="/generate"))
    await call.read()
    await call.write(body_msg(json.dumps({"text": "x", "priority": 4}).encode()))
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


async def test_an_audio_upload_is_routed_with_its_multipart_body_untouched(server):
    """vLLM's /v1/audio/transcriptions takes multipart/form-data (a hostile review: refused as invalid JSON). Its
    body is neither parsed nor given a priority: a JSON member appended to a multipart body would corrupt it."""
    srv, stub = server
    body = (b'--xyz\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n--xyz\r\n'
            b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF\x00\x01}\r\n--xyz--\r\n')
    call = stub.Process()
    await call.write(headers_msg(path="/v1/audio/transcriptions", extra=(
        ("content-type", "multipart/form-data; boundary=xyz"), ("x-gateway-inference-objective", "batch"))))
    await call.read()
    await call.write(body_msg(body))
    answer = (await call.read()).request_body.response
    assert _headers(answer)[wire.DESTINATION_HEADER] in {e["address"] for e in ENDPOINTS}
    assert not answer.HasField("body_mutation") and "content-length" not in _headers(answer)
    assert srv.router.metrics.engine_priority_bodies.labels("written")._value.get() == 0
    await call.done_writing()


@pytest.mark.parametrize("content_type", ["text/plain", "multipart/form-data; boundary=xyz"])
async def test_an_inference_route_with_a_body_that_is_not_json_is_400(server, content_type):
    """vLLM reads only a JSON body there (FastAPI does not parse another type as JSON): refused here, clearly."""
    _, stub = server
    call = stub.Process()
    await call.write(headers_msg(extra=(("content-type", content_type),)))
    await call.read()
    await call.write(body_msg(BODY))
    immediate = (await call.read()).immediate_response
    assert immediate.status.code == 400
    assert "takes a JSON body" in json.loads(immediate.body)["error"]["message"]
    await call.done_writing()
