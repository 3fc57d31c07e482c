"""Fuzzing the ext_proc stream (``extproc.stream.StreamHandler`` behind ``extproc.server.ExtprocServer``) with
Hypothesis: generated sequences of ``ProcessingRequest`` messages, sent over a real grpc.aio channel on loopback.

A script is either the sequence Envoy sends for one request (BUFFERED, FULL_DUPLEX_STREAMED or another body
mode; with or without trailers and response phases), with a fuzzed body (``tests/extproc/fuzz_bodies.py``) and
fuzzed headers (missing or repeated ``:path``, ``:method``, ``content-type``, ``content-length``,
``content-encoding``), or such a sequence damaged: messages swapped, repeated, dropped, or inserted anywhere (body
before headers, trailers twice, request headers twice, response headers before the request ended, a message of
no known kind or with unknown fields, bytes that are no ProcessingRequest, anything after ``end_of_stream``),
``protocol_config`` on a later message, a subset hint of any type, or the client cancelling midway.

Properties of every stream (each example bounded by ``asyncio.timeout``: a hang fails it):
- it ends with gRPC OK, or with a non-OK status that carries a message;
- every answer is a known ``ProcessingResponse`` kind; an ``immediate_response`` has a 4xx/5xx status,
  ``content-type: application/json`` and the body ``{"error": {"message", "type", "param", "code"}}``
  (``extproc.errors``), and nothing follows it; at most one answer routes, to endpoints of the pool, with the
  header and the ``envoy.lb`` metadata equal;
- the pool's in-flight counts are back to zero once the stream has ended;
- nothing is logged at ERROR (the handler logs a bug as "internal error", a 500);
- for an undamaged script, the answers are exactly those the module docstring of ``extproc.stream`` lists, and
  the outcome is the one ``parse_body`` (``opaque_body_request`` for a ``content-type`` other than JSON,
  ``bodiless_request`` for headers that end the stream: the oracle) and
  the pool imply: routed, or the 400/404/413 with the parser's message.

Memory per stream is checked beside them with tracemalloc: a body over ``max_body_bytes`` is refused as soon as
it passes the limit and later chunks are not kept; a routed stream does not keep its body.

Longer runs: ``ASTROLABE_FUZZ_EXAMPLES=N`` raises ``max_examples``; ``python -m tests.extproc.fuzz --minutes 10``
runs every fuzz property for a stated time (``tests/extproc/fuzz.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import math
import tracemalloc
from typing import Self

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from hypothesis import given
from hypothesis import strategies as st

from extproc import wire
from extproc.config import parse_config
from extproc.errors import ErrorCode, RoutingError
from extproc.request import MAX_DECODED_FACTOR, bodiless_request, is_json_media_type, opaque_body_request, parse_body
from extproc.server import ExtprocServer
from extproc.stream import StreamHandler
from tests.extproc.fuzz_bodies import (
    CODINGS,
    PATHS,
    WRONG_CODINGS,
    any_bodies,
    assert_openai_error,
    encode,
    encoded_bodies,
    fuzz_settings,
    well_typed_requests,
)

Mode = processing_mode_pb2.ProcessingMode
PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
MODEL = "m"
ENDPOINTS = ("127.0.0.1:18001", "127.0.0.1:18002")
MAX_BODY_BYTES = 64 * 1024
STREAM_TIMEOUT_S = 20.0
"""Bound of one example's stream: far above what one takes (milliseconds); reaching it is a hang."""

CONFIGS = {
    # Protocol-level: a policy without I/O, a destination list (fallback_endpoints), a small body limit.
    "round-robin": {"policy": "round-robin", "fallback_endpoints": 1,
                    "endpoints": [{"address": a, "models": [MODEL]} for a in ENDPOINTS]},
    # The default policy: prompt tokens and the light tagger run on every fuzzed prompt; the sidecar is dead
    # (port 1 refuses), so each request falls back after a failed Predict.
    "astrolabe": {"policy": "astrolabe",
                  "endpoints": [{"address": a, "models": [MODEL], "predictor": "127.0.0.1:1"} for a in ENDPOINTS]},
}


@dataclasses.dataclass
class Script:
    """One stream's messages, serialised (bytes), or `CANCEL` (the client cancels there).

    ``oracle`` is set for an undamaged Envoy sequence: what the stream must answer (`_expected`)."""

    steps: list
    oracle: dict | None = None
    undecodable: bool = False


CANCEL = "cancel"


# --- messages -------------------------------------------------------------------------------------------------

def _header_map(pairs, use_value: bool = False) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, value=v.decode("latin-1")) if use_value
        else base_pb2.HeaderValue(key=k, raw_value=v) for k, v in pairs])


def headers_request(pairs, *, eos: bool, mode: int | None = None, response_mode: int = Mode.NONE,
                    use_value: bool = False, hint: struct_pb2.Value | None = None) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_header_map(pairs, use_value),
                                                                  end_of_stream=eos))
    if mode is not None:
        message.protocol_config.request_body_mode = mode
        message.protocol_config.response_body_mode = response_mode
    if hint is not None:
        message.metadata_context.filter_metadata[wire.SUBSET_HINT_NAMESPACE].fields[
            wire.DESTINATION_SUBSET_HEADER].CopyFrom(hint)
    return message


def body_request(data: bytes, *, eos: bool, response: bool = False) -> pb.ProcessingRequest:
    body = pb.HttpBody(body=data, end_of_stream=eos)
    return pb.ProcessingRequest(response_body=body) if response else pb.ProcessingRequest(request_body=body)


def response_headers_request(served: str | None) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest(response_headers=pb.HttpHeaders(
        headers=_header_map([(":status", b"200")])))
    if served is not None:
        message.metadata_context.filter_metadata[wire.LB_METADATA_NAMESPACE].fields[
            wire.DESTINATION_SERVED_KEY].string_value = served
    return message


_MODES = [Mode.BUFFERED, Mode.FULL_DUPLEX_STREAMED]
_OTHER_MODES = [Mode.NONE, Mode.STREAMED, Mode.BUFFERED_PARTIAL, 99]
_RESPONSE_MODES = [Mode.NONE, Mode.FULL_DUPLEX_STREAMED, Mode.STREAMED, Mode.BUFFERED]
hints = st.one_of(
    st.lists(st.sampled_from([*ENDPOINTS, "127.0.0.1", "[::1]:1", "nope", "", "10.0.0.1:80"]), max_size=3).map(
        lambda xs: struct_pb2.Value(list_value=struct_pb2.ListValue(
            values=[struct_pb2.Value(string_value=x) for x in xs]))),
    st.text(max_size=30).map(lambda s: struct_pb2.Value(string_value=s)),
    st.floats(allow_nan=False).map(lambda f: struct_pb2.Value(number_value=f)),
    st.just(struct_pb2.Value(null_value=0)),
)
_header_values = st.one_of(st.binary(max_size=20), st.sampled_from([b"", b"\xff\xfe", b"a" * 5000, b"\x00"]))
_extra_headers = st.lists(st.one_of(
    st.tuples(st.sampled_from([":path", ":method", "content-type", "content-length", "content-encoding",
                               "x-request-id", ":authority", "traceparent", wire.DESTINATION_HEADER,
                               wire.DESTINATION_SUBSET_HEADER]), _header_values),
    st.tuples(st.text(min_size=1, max_size=10), _header_values),
), max_size=4)
"""Headers a script adds after the regular ones: repeats (the last wins) and junk."""


def stray_messages() -> st.SearchStrategy:
    """One message of any kind, in any phase: what a damaged script inserts."""
    return st.one_of(
        st.builds(lambda b, eos: body_request(b, eos=eos), st.binary(max_size=40), st.booleans()),
        st.builds(lambda b, eos: body_request(b, eos=eos, response=True), st.binary(max_size=40), st.booleans()),
        st.just(pb.ProcessingRequest(request_trailers=pb.HttpTrailers())),
        st.just(pb.ProcessingRequest(response_trailers=pb.HttpTrailers())),
        st.builds(response_headers_request, st.sampled_from([None, *ENDPOINTS, "10.0.0.9:1", "garbage"])),
        st.builds(lambda eos, mode: headers_request([(":method", b"POST"), (":path", b"/v1/completions")],
                                                    eos=eos, mode=mode),
                  st.booleans(), st.sampled_from([None, *_MODES, *_OTHER_MODES])),
        st.just(pb.ProcessingRequest()),  # no kind at all
        st.builds(lambda mode: pb.ProcessingRequest(protocol_config=pb.ProtocolConfiguration(
            request_body_mode=mode)), st.sampled_from([*_MODES, *_OTHER_MODES])),
    ).map(lambda m: m.SerializeToString())


_UNKNOWN_FIELD = b"\xa0\x06\x01"  # field 100, varint 1: a kind from a newer Envoy
_UNDECODABLE = [b"\xff\xff\xff", b"\x0a\xff", b"\x0a\x05\x0a", b"\x12\x80\x80\x80\x80\x10"]


@st.composite
def scripts(draw, max_body_bytes: int = MAX_BODY_BYTES) -> Script:
    """An Envoy sequence for one request (`Script.oracle` set), or a damaged one."""
    method = draw(st.sampled_from(["POST", "POST", "GET", "PUT", ""]))
    path = draw(st.sampled_from(PATHS))
    kind = draw(st.sampled_from(["well-typed", "well-typed", "fuzzed", "fuzzed", "fuzzed", "large"]))
    if kind == "large":  # a large valid body, or one over the limit
        size = draw(st.sampled_from([max_body_bytes - 30, max_body_bytes + 1, 3 * max_body_bytes]))
        body, encoding = json.dumps({"model": MODEL, "prompt": "x" * size}).encode(), None
    elif kind == "well-typed":
        path, obj, _ = draw(well_typed_requests())
        if draw(st.integers(0, 3)):
            obj["model"] = MODEL
        codings = draw(st.lists(st.sampled_from(CODINGS), max_size=2))
        body, encoding = encode(json.dumps(obj).encode(), codings), ", ".join(codings) or None
    else:
        body, encoding = draw(encoded_bodies(any_bodies))
    mode = draw(st.sampled_from([*_MODES, *_MODES, *_MODES, *_OTHER_MODES, None]))
    response_mode = draw(st.sampled_from(_RESPONSE_MODES))
    pairs = [(":method", method.encode()), (":path", path.encode()), ("x-request-id", b"fuzz")]
    content_type = None
    if draw(st.booleans()):
        content_type = draw(st.sampled_from([b"application/json", b"text/plain", b"", b"\xff",
                                             b"multipart/form-data; boundary=x"]))
        pairs.append(("content-type", content_type))
    if draw(st.booleans()):
        pairs.append(("content-length", draw(st.sampled_from([str(len(body)).encode(), b"-1", b"x", b"9" * 30]))))
    encodings = [encoding] if encoding is not None else []
    if draw(st.integers(0, 4)) == 0:  # content-encoding twice: both codings apply (RFC 9110 5.3)
        encodings.append(draw(st.sampled_from([*CODINGS, *WRONG_CODINGS])))
    pairs += [("content-encoding", e.encode("latin-1")) for e in encodings]
    drop = draw(st.sampled_from([None, None, None, ":path", ":method"]))
    pairs = [p for p in pairs if p[0] != drop]
    extra = draw(_extra_headers) if draw(st.integers(0, 4)) == 0 else []
    headers_eos = not body and draw(st.booleans())
    hint = draw(st.one_of(st.none(), st.none(), st.none(), hints))
    first = headers_request(pairs + extra, eos=headers_eos, mode=mode, response_mode=response_mode,
                            use_value=draw(st.booleans()), hint=hint)
    steps = [first]
    trailers = False
    if not headers_eos:
        if mode in (Mode.BUFFERED, None):  # None: no protocol_config, BUFFERED by default
            steps.append(body_request(body, eos=True))
        else:
            num_chunks = draw(st.integers(1, 4))
            cuts = sorted(draw(st.lists(st.integers(0, len(body)), min_size=num_chunks - 1,
                                        max_size=num_chunks - 1)))
            chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]
            trailers = draw(st.booleans())
            steps += [body_request(c, eos=not trailers and i == len(chunks) - 1) for i, c in enumerate(chunks)]
            if trailers:
                steps.append(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    num_request_steps = len(steps)
    if draw(st.booleans()):  # the response phases, as a gateway that asks for them sends them
        steps.append(response_headers_request(draw(st.sampled_from([None, None, *ENDPOINTS]))))
        for i in range(draw(st.integers(0, 2))):
            steps.append(body_request(draw(st.binary(max_size=30)), eos=False, response=True))
        steps.append(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    oracle = {"method": method, "path": path if drop != ":path" else "", "body": body,
              "content_type": None if content_type is None else content_type.decode("latin-1"),
              "encoding": ", ".join(encodings) or None, "mode": mode, "response_mode": response_mode,
              "headers_eos": headers_eos, "trailers": trailers, "hint": hint, "extra": extra,
              "num_request_steps": num_request_steps, "steps": list(steps), "max_body_bytes": max_body_bytes}
    serialized = [m.SerializeToString() for m in steps]
    if draw(st.integers(0, 2)) != 0:
        return Script(serialized, oracle if not extra and hint is None else None)
    undecodable = False
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["swap", "repeat", "drop", "insert", "insert", "append", "unknown-field",
                                   "undecodable", "cancel", "later-config"]))
        where = draw(st.integers(0, max(len(serialized) - 1, 0)))
        if op == "swap" and len(serialized) > 1:
            other = draw(st.integers(0, len(serialized) - 1))
            serialized[where], serialized[other] = serialized[other], serialized[where]
        elif op == "repeat" and serialized and serialized[where] != CANCEL:
            serialized.insert(where, serialized[where])
        elif op == "drop" and serialized:
            del serialized[where]
        elif op == "insert":
            serialized.insert(where, draw(stray_messages()))
        elif op == "append":
            serialized.append(draw(stray_messages()))
        elif op == "unknown-field" and serialized and serialized[where] != CANCEL:
            serialized[where] += _UNKNOWN_FIELD
        elif op == "undecodable":
            serialized.insert(where, draw(st.sampled_from(_UNDECODABLE)))
            undecodable = True
        elif op == "cancel":
            serialized.insert(where, CANCEL)
        elif op == "later-config" and serialized:
            config = pb.ProcessingRequest(protocol_config=pb.ProtocolConfiguration(
                request_body_mode=draw(st.sampled_from([*_MODES, *_OTHER_MODES])),
                response_body_mode=draw(st.sampled_from(_RESPONSE_MODES))))
            serialized.insert(where + 1, config.SerializeToString() + draw(stray_messages()))
    return Script(serialized, None, undecodable)


# --- the oracle -----------------------------------------------------------------------------------------------

def _expected(oracle: dict) -> tuple[list[str], object]:
    """The answer kinds and the outcome ("routed" or (HTTP status, message)) of an undamaged script."""
    mode, body = oracle["mode"], oracle["body"]
    if mode is None:
        mode = Mode.BUFFERED  # StreamHandler's default without protocol_config
    request_steps = oracle["steps"][:oracle["num_request_steps"]]
    response_steps = oracle["steps"][oracle["num_request_steps"]:]
    reads_body = not oracle["headers_eos"] and mode in _MODES
    outcome: object = "routed"
    if oracle["headers_eos"]:  # no body: a POST to an inference route is refused on its headers
        try:
            bodiless_request("fuzz", oracle["method"], oracle["path"])
        except RoutingError as exc:
            return ["immediate_response"], (exc.http_status, exc.message)
    if reads_body:
        if len(body) > oracle["max_body_bytes"]:
            error = RoutingError(ErrorCode.BODY_TOO_LARGE, f"request body exceeds the limit of "
                                 f"{oracle['max_body_bytes']} bytes")
        else:
            error = None
            try:
                if is_json_media_type(oracle["content_type"]):
                    request = parse_body("fuzz", oracle["method"], oracle["path"], body, oracle["encoding"],
                                         MAX_DECODED_FACTOR * oracle["max_body_bytes"])
                else:  # not JSON: read only off the inference routes, and then not at all
                    request = opaque_body_request("fuzz", oracle["method"], oracle["path"], len(body))
                if request.model is not None and request.model != MODEL:
                    error = RoutingError(ErrorCode.MODEL_NOT_FOUND, f"The model `{request.model}` does not exist.")
            except RoutingError as exc:
                error = exc
        if error is not None:
            outcome = (error.http_status, error.message)
    if outcome != "routed":
        kinds = ["request_headers", "immediate_response"] if mode == Mode.BUFFERED else ["immediate_response"]
        return kinds, outcome
    if not reads_body:
        kinds = ["request_headers"] + [m.WhichOneof("request") for m in request_steps[1:]]
    elif mode == Mode.BUFFERED:
        kinds = ["request_headers", "request_body"]
    else:
        kinds = ["request_headers"] + ["request_body"] * max(1, math.ceil(len(body) / wire.MAX_STREAMED_CHUNK_BYTES))
        kinds += ["request_trailers"] if oracle["trailers"] else []
    return kinds + [m.WhichOneof("request") for m in response_steps], outcome


# --- driving a stream -----------------------------------------------------------------------------------------

class ErrorRecords(logging.Handler):
    """Collects every record at ERROR or above, from any logger."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclasses.dataclass
class Outcome:
    responses: list[pb.ProcessingResponse]
    code: grpc.StatusCode
    details: str
    cancelled: bool


async def drive(channel: grpc.aio.Channel, script: Script) -> Outcome:
    """Sends ``script`` on one Process stream while reading every answer; returns them with the final status."""
    call = channel.stream_stream(PROCESS_METHOD, request_serializer=None,
                                 response_deserializer=pb.ProcessingResponse.FromString)()
    responses: list[pb.ProcessingResponse] = []

    async def read() -> None:
        while (response := await call.read()) is not grpc.aio.EOF:
            responses.append(response)

    reader = asyncio.ensure_future(read())
    cancelled = False
    try:
        for step in script.steps:
            if step == CANCEL:
                cancelled = call.cancel()
                break
            await call.write(step)
        else:
            await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass  # the server ended the call first (an undecodable message): its status is checked below
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
        await reader
    code = await call.code()
    return Outcome(responses, code, await call.details() or "", cancelled)


def check_outcome(outcome: Outcome, script: Script) -> None:
    """The properties every stream has (module docstring); the oracle's answers for an undamaged script."""
    if outcome.cancelled:
        assert outcome.code == grpc.StatusCode.CANCELLED
    elif outcome.code != grpc.StatusCode.OK:
        assert script.undecodable and outcome.details, (outcome.code, outcome.details)
    kinds = [r.WhichOneof("response") for r in outcome.responses]
    assert None not in kinds, outcome.responses
    routes = []
    for i, response in enumerate(outcome.responses):
        if kinds[i] == "immediate_response":
            immediate = response.immediate_response
            assert i == len(kinds) - 1, kinds  # nothing after an immediate response
            (content_type,) = [h.header for h in immediate.headers.set_headers if h.header.key == "content-type"]
            assert content_type.raw_value == wire.CONTENT_TYPE_JSON
            assert_openai_error(immediate.status.code, immediate.body)
            continue
        common = getattr(response, kinds[i]).response if kinds[i] in (
            "request_headers", "request_body", "response_headers", "response_body") else None
        if common is not None and common.header_mutation.set_headers:
            values = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
            destination = values[wire.DESTINATION_HEADER]
            assert set(destination.split(",")) <= set(ENDPOINTS), destination
            metadata = response.dynamic_metadata.fields[wire.LB_METADATA_NAMESPACE].struct_value.fields[
                wire.DESTINATION_HEADER].string_value
            assert metadata == destination
            routes.append(destination)
    assert len(routes) <= 1, routes
    if script.oracle is None or outcome.cancelled:
        return
    expected_kinds, expected_outcome = _expected(script.oracle)
    assert kinds == expected_kinds, (kinds, expected_kinds)
    if expected_outcome == "routed":
        assert routes, kinds
    else:
        status, message = expected_outcome
        error = json.loads(outcome.responses[-1].immediate_response.body)["error"]
        assert (error["code"], error["message"]) == (status, message)


class StreamFuzzer:
    """An `ExtprocServer` of ``CONFIGS[name]`` on loopback, driven from synchronous code (Hypothesis examples)
    through one event loop; `check` runs one script and asserts every property.

    Use as a context manager; it stops the server and restores logging on exit.
    """

    def __init__(self, name: str, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self._raw = {"listen": "127.0.0.1:0", "seed": 1, "max_body_bytes": max_body_bytes,
                     "health_check": {"enabled": False}, "drain_delay_s": 0, "grace_period_s": 1, **CONFIGS[name]}
        self.num_examples = 0

    def __enter__(self) -> Self:
        self._runner = asyncio.Runner()
        self._errors = ErrorRecords()
        logging.getLogger().addHandler(self._errors)
        self.server, self.channel = self._runner.run(self._start())
        return self

    async def _start(self) -> tuple[ExtprocServer, grpc.aio.Channel]:
        server = ExtprocServer(parse_config(self._raw))  # grpc.aio objects belong to the loop they start in
        port = await server.start()
        return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")

    def __exit__(self, *exc) -> None:
        try:
            self._runner.run(self.channel.close())
            self._runner.run(self.server.stop())
        finally:
            self._runner.close()
            logging.getLogger().removeHandler(self._errors)

    def check(self, script: Script) -> Outcome:
        """Runs ``script`` and asserts every property; returns what the stream answered."""
        self.num_examples += 1
        self._errors.records.clear()
        outcome = self._runner.run(self._bounded(script))
        check_outcome(outcome, script)
        # A DecodeError log may come from an earlier example's stream (the server logs after the client has its
        # status), so it is tolerated in every example; nothing else logs one.
        errors = [r for r in self._errors.records if not _is_decode_error(r)]
        assert not errors, [r.getMessage() for r in errors]
        return outcome

    def run(self, script: Script) -> Outcome:
        """Runs ``script`` without the checks (a test asserts on the outcome itself)."""
        self._errors.records.clear()
        return self._runner.run(self._bounded(script))

    @property
    def error_records(self) -> list[logging.LogRecord]:
        """ERROR records of the last script."""
        return list(self._errors.records)

    async def _bounded(self, script: Script) -> Outcome:
        async with asyncio.timeout(STREAM_TIMEOUT_S):
            outcome = await drive(self.channel, script)
            # The server closes its side after the client's status arrives (a cancel: asynchronously): poll.
            while any(self.server.pool.in_flight(a) for a in ENDPOINTS):
                await asyncio.sleep(0.005)
        return outcome


def _is_decode_error(record: logging.LogRecord) -> bool:
    """A log of a ProcessingRequest that does not decode: grpc's ("Unexpected [DecodeError] raised by servicer
    method", "Failed sending error status from server") or asyncio's ("Task exception was never retrieved", the
    server's read task left behind when the stream is cancelled). A bug of extproc/server.py, pinned by
    test_an_undecodable_message_is_invalid_argument, and tolerated by `StreamFuzzer.check`."""
    message = record.getMessage()
    return "DecodeError" in message or (record.name.startswith("grpc") and "Failed sending error status" in message)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_stream_ends_with_a_clear_answer(config):
    with StreamFuzzer(config) as fuzzer:
        @fuzz_settings(300 if config == "round-robin" else 150)
        @given(script=scripts())
        def run(script):
            fuzzer.check(script)

        run()


# --- explicit cases -------------------------------------------------------------------------------------------

def _post(mode=Mode.FULL_DUPLEX_STREAMED, extra=()) -> pb.ProcessingRequest:
    return headers_request([(":method", b"POST"), (":path", b"/v1/completions"), *extra], eos=False, mode=mode)


_BODY = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 3}).encode()


@pytest.mark.parametrize("steps, expected_kinds", [
    pytest.param([body_request(_BODY, eos=True), _post(Mode.BUFFERED), body_request(_BODY, eos=True)],
                 ["request_body", "request_headers", "request_body"], id="body-before-headers"),
    pytest.param([_post(), body_request(_BODY, eos=False), pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
                  pb.ProcessingRequest(request_trailers=pb.HttpTrailers())],
                 ["request_headers", "request_body", "request_trailers", "request_trailers"], id="trailers-twice"),
    pytest.param([_post(Mode.BUFFERED), _post(Mode.BUFFERED), body_request(_BODY, eos=True)],
                 ["request_headers", "request_headers", "request_body"], id="request-headers-twice"),
    pytest.param([_post(), response_headers_request(None), body_request(_BODY, eos=True)],
                 ["response_headers", "request_headers", "request_body"], id="response-headers-before-the-body"),
    pytest.param([_post(Mode.BUFFERED), body_request(_BODY, eos=True), body_request(b"more", eos=True),
                  body_request(b"", eos=True)],
                 ["request_headers", "request_body", "request_body", "request_body"], id="body-after-end-of-stream"),
    pytest.param([pb.ProcessingRequest()], ["immediate_response"], id="no-kind"),
    # protocol_config is read from the first message only (Envoy sends it there): a later one switching a
    # BUFFERED stream to FULL_DUPLEX_STREAMED made the body answer a second headers answer plus re-sent chunks.
    pytest.param([_post(Mode.BUFFERED),
                  pb.ProcessingRequest(request_body=pb.HttpBody(body=_BODY, end_of_stream=True),
                                       protocol_config=pb.ProtocolConfiguration(
                                           request_body_mode=Mode.FULL_DUPLEX_STREAMED))],
                 ["request_headers", "request_body"], id="protocol-config-on-a-later-message"),
])
def test_out_of_order_messages(steps, expected_kinds):
    with StreamFuzzer("round-robin") as fuzzer:
        outcome = fuzzer.check(Script([m.SerializeToString() for m in steps]))
        assert [r.WhichOneof("response") for r in outcome.responses] == expected_kinds


def test_content_encoding_twice_decodes_both():
    """Two content-encoding headers are one list (RFC 9110 5.3): a body gzipped twice is read, where taking the
    last header alone read it as gzip once and refused it as not JSON."""
    import gzip  # noqa: PLC0415

    steps = [_post(extra=[("content-encoding", b"gzip"), ("content-encoding", b"gzip")]),
             body_request(gzip.compress(gzip.compress(_BODY)), eos=True)]
    with StreamFuzzer("round-robin") as fuzzer:
        outcome = fuzzer.check(Script([m.SerializeToString() for m in steps]))
    assert [r.WhichOneof("response") for r in outcome.responses] == ["request_headers", "request_body"]
    assert outcome.responses[0].request_headers.response.header_mutation.set_headers


def test_an_undecodable_message_is_invalid_argument():
    with StreamFuzzer("round-robin") as fuzzer:
        script = Script([_post().SerializeToString(), b"\xff\xff\xff"], undecodable=True)
        outcome = fuzzer.run(script)
        errors = fuzzer.error_records
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT and outcome.details
    assert not errors, [r.getMessage() for r in errors]


# --- memory per stream ----------------------------------------------------------------------------------------

def _handler(max_body_bytes: int) -> tuple[ExtprocServer, StreamHandler]:
    server = ExtprocServer(parse_config({"listen": "127.0.0.1:0", "policy": "round-robin", "seed": 1,
                                         "max_body_bytes": max_body_bytes, "health_check": {"enabled": False},
                                         "endpoints": [{"address": a, "models": [MODEL]} for a in ENDPOINTS]}))
    return server, StreamHandler(server.router, max_body_bytes)


async def test_a_body_over_the_limit_is_refused_at_once_and_not_kept():
    """FULL_DUPLEX_STREAMED chunks past ``max_body_bytes``: the chunk that crosses the limit gets the 413; the
    50 MiB sent after it are answered with nothing and not buffered (traced memory stays near the limit)."""
    limit = 1 << 20
    _, handler = _handler(limit)
    await handler.on_message(_post())
    chunk = b"x" * (256 << 10)
    tracemalloc.start()
    try:
        answers = [await handler.on_message(body_request(chunk, eos=False)) for _ in range(200)]
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    kinds = [[a.WhichOneof("response") for a in batch] for batch in answers]
    assert kinds[:5] == [[], [], [], [], ["immediate_response"]] and all(k == [] for k in kinds[5:])
    assert answers[4][0].immediate_response.status.code == 413
    assert peak_bytes < 3 * limit, peak_bytes
    handler.close()


@pytest.mark.parametrize("mode", [Mode.BUFFERED, Mode.FULL_DUPLEX_STREAMED], ids=["buffered", "full-duplex"])
async def test_a_routed_stream_does_not_keep_its_body(mode):
    """A routed stream lives as long as its HTTP request (a long generation): it must not hold the request body
    (up to ``max_body_bytes`` per stream) all that time."""
    limit = 4 << 20
    server, handler = _handler(limit)
    await handler.on_message(_post(mode))
    gc.collect()
    tracemalloc.start()
    try:
        before_bytes, _ = tracemalloc.get_traced_memory()
        body = json.dumps({"model": MODEL, "prompt": "x" * (3 << 20)}).encode()
        answers = await handler.on_message(body_request(body, eos=True))
        assert handler.routed
        del body, answers
        gc.collect()
        after_bytes, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after_bytes - before_bytes < (1 << 20), after_bytes - before_bytes
    handler.close()
    assert all(server.pool.in_flight(a) == 0 for a in ENDPOINTS)


# --- tracing --------------------------------------------------------------------------------------------------

class _OtlpEncodingExporter:
    """A span exporter that encodes every batch as the OTLP exporters do (``encode_spans``) and keeps the encoded
    attribute keys of each span."""

    def __init__(self) -> None:
        self.encoded_keys: list[set[str]] = []

    def export(self, spans):
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import SpanExportResult  # noqa: PLC0415

        for resource_spans in encode_spans(spans).resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.encoded_keys += [{a.key for a in span.attributes} for span in scope_spans.spans]
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


async def test_a_huge_max_tokens_leaves_an_exportable_span():
    from astrolabe.tracing import setup_tracing  # noqa: PLC0415
    from extproc.spans import GEN_AI_REQUEST_MAX_TOKENS  # noqa: PLC0415

    exporter = _OtlpEncodingExporter()
    errors = ErrorRecords()
    logging.getLogger().addHandler(errors)
    tracing = setup_tracing("astrolabe-fuzz", environ={}, exporter=exporter)
    server = ExtprocServer(parse_config({"listen": "127.0.0.1:0", "policy": "round-robin", "seed": 1,
                                         "health_check": {"enabled": False}, "drain_delay_s": 0,
                                         "endpoints": [{"address": a, "models": [MODEL]} for a in ENDPOINTS]}),
                           tracing=tracing)
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2 ** 70}).encode()
            outcome = await drive(channel, Script([_post(Mode.BUFFERED).SerializeToString(),
                                                   body_request(body, eos=True).SerializeToString()]))
        assert [r.WhichOneof("response") for r in outcome.responses] == ["request_headers", "request_body"]
    finally:
        await server.stop()
        tracing.shutdown()  # exports what is queued
        logging.getLogger().removeHandler(errors)
    assert any(GEN_AI_REQUEST_MAX_TOKENS in keys for keys in exporter.encoded_keys), exporter.encoded_keys
    assert not errors.records, [r.getMessage() for r in errors.records]
