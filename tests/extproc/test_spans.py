"""The request span over a real grpc.aio ext_proc stream, with a real sidecar and emulator in process.

Spans go to the SDK's in-memory exporter (one provider for every component here); the real-process chain with a
real OTLP receiver and real Envoy is ``tests/integration/test_tracing_e2e.py``.
"""

import asyncio
import json

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from astrolabe.tracing import setup_tracing
from bench.emulator.server import EmulatorConfig, start_emulator
from astrolabe.procs import free_port
from extproc import spans as attr
from extproc import wire
from extproc.config import parse_config
from extproc.server import ExtprocServer
from predictor.server import Sidecar, SidecarConfig
from predictor.sim import EngineConfig
from tests.extproc.test_stream import body_msg, headers_msg

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
CLIENT_TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"
PROXY_TRACE_ID = "1bf7651916cd43dd8448eb211c80319d"
PROXY_SPAN_ID = "c7ad6b7169203332"
PROXY_TRACEPARENT = f"00-{PROXY_TRACE_ID}-{PROXY_SPAN_ID}-01"
ENGINE = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=512)
BODY = json.dumps({"model": "llama-2-7b", "messages": [{"role": "user", "content": "hello"}],
                   "max_tokens": 7}).encode()


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def trace_id(span) -> str:
    return _hex(span.context.trace_id, 32)


def span_id(span) -> str:
    return _hex(span.context.span_id, 16)


def parent_id(span) -> str:
    return "" if span.parent is None else _hex(span.parent.span_id, 16)


class Traced:
    """The components, one tracing provider, the in-memory exporter."""

    def __init__(self, exporter, tracing, server, stub, sidecar, emulator):
        self.exporter, self.tracing, self.server, self.stub = exporter, tracing, server, stub
        self.sidecar, self.emulator = sidecar, emulator

    async def finished(self):
        """Every finished span, once the fire-and-forget Admit calls have been answered."""
        await asyncio.gather(*list(self.server.predictors._tasks), return_exceptions=True)
        self.tracing.provider.force_flush()
        return list(self.exporter.get_finished_spans())

    async def named(self, name):
        return [s for s in await self.finished() if s.name == name]


async def _start(tracing, endpoints_of, mode: str = "predict"):
    """Emulator + sidecar + extproc, traced. Predict mode by default: these tests follow a request's trace into the
    sidecars (test_local_predictions_are_spans_of_the_route covers the default watch mode)."""
    emulator = await start_emulator(EmulatorConfig(port=0, engine=ENGINE, time_scale=20.0), tracing)
    sidecar = Sidecar(SidecarConfig(backend=f"127.0.0.1:{emulator.port}", listen="127.0.0.1:0", engine=ENGINE,
                                    time_scale=20.0), tracing)
    sidecar_port = await sidecar.start()
    while sidecar.last_reconciled_s is None:  # a fresh state: predictions are not stale
        await asyncio.sleep(0.02)
    config = parse_config({"listen": "127.0.0.1:0", "policy": "astrolabe", "seed": 1, "drain_delay_s": 0,
                           "health_check": {"enabled": False},
                           "predictor_client": {"predict_timeout_s": 1.0, "mode": mode},
                           "endpoints": endpoints_of(f"127.0.0.1:{emulator.port}", f"127.0.0.1:{sidecar_port}")})
    server = ExtprocServer(config, tracing=tracing)
    port = await server.start()
    return emulator, sidecar, server, port


@pytest.fixture
async def traced():
    exporter = InMemorySpanExporter()
    tracing = setup_tracing("astrolabe-test", environ={}, exporter=exporter)
    emulator, sidecar, server, port = await _start(
        tracing, lambda backend, predictor: [{"address": backend, "models": ["llama-2-7b"], "predictor": predictor}])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield Traced(exporter, tracing, server, pb_grpc.ExternalProcessorStub(channel), sidecar, emulator)
    await channel.close()
    await server.stop()
    await sidecar.stop()
    await emulator.stop()
    tracing.shutdown()


async def route(stub, headers=(), metadata=None, body=BODY):
    """One buffered request like Envoy sends it; returns the headers the answer sets on the upstream request."""
    call = stub.Process(metadata=metadata)
    await call.write(headers_msg(path="/v1/chat/completions", extra=headers))
    await call.read()  # headers: CONTINUE
    await call.write(body_msg(body))
    answer = await call.read()
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    if answer.WhichOneof("response") == "immediate_response":
        return answer
    mutation = answer.request_body.response.header_mutation.set_headers
    return {o.header.key: o.header.raw_value.decode() for o in mutation}


async def test_the_route_span_is_a_child_of_the_clients_traceparent(traced):
    upstream = await route(traced.stub, [("traceparent", CLIENT_TRACEPARENT), ("tracestate", "vendor=1")])
    (span,) = await traced.named(attr.SPAN_NAME)
    assert span.kind == SpanKind.SERVER and trace_id(span) == TRACE_ID and parent_id(span) == CLIENT_SPAN_ID
    # the upstream request now names this span: the backend's trace continues it
    assert upstream["traceparent"] == f"00-{TRACE_ID}-{span_id(span)}-01"
    assert upstream["tracestate"] == "vendor=1"
    a = span.attributes
    assert a[attr.GEN_AI_OPERATION_NAME] == "chat" and a[attr.GEN_AI_REQUEST_MODEL] == "llama-2-7b"
    assert a[attr.GEN_AI_REQUEST_MAX_TOKENS] == 7 and a[attr.REQUEST_ID] == "abc"
    assert a[attr.POLICY] == "astrolabe" and a[attr.OUTCOME] == "routed" and a[attr.BASIS] == "prediction"
    assert a[attr.DESTINATION] == upstream[wire.DESTINATION_HEADER] == f"127.0.0.1:{traced.emulator.port}"
    assert (a[attr.SERVER_ADDRESS], a[attr.SERVER_PORT]) == ("127.0.0.1", traced.emulator.port)
    assert a[attr.NUM_PROMPT_TOKENS] > 0 and a[attr.NUM_PREDICTED_OUTPUT_TOKENS] >= 1  # before the max_tokens cap (7)
    assert a[attr.LENGTH_SOURCE] == "tagger" and a[attr.NUM_CANDIDATES] == 1 and a[attr.ROUTING_S] > 0
    (event,) = span.events
    e = event.attributes
    assert event.name == attr.CANDIDATE_EVENT and e[attr.CANDIDATE_CHOSEN] and e[attr.CANDIDATE_ANSWERED]
    assert 0 < e[attr.CANDIDATE_TTFT_S] <= e[attr.CANDIDATE_E2E_S] and 0 <= e[attr.CANDIDATE_STATE_AGE_S] < 2


async def test_local_predictions_are_spans_of_the_route():
    """Watch mode (the default): each candidate predicted in the router is an INTERNAL span below the route, with
    the figures; no Predict call, and Admit still continues the trace into the sidecar."""
    exporter = InMemorySpanExporter()
    tracing = setup_tracing("astrolabe-test", environ={}, exporter=exporter)
    emulator, sidecar, server, port = await _start(tracing, lambda backend, predictor: [
        {"address": backend, "models": ["llama-2-7b"], "predictor": predictor}], mode="watch")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await route(pb_grpc.ExternalProcessorStub(channel), [("traceparent", CLIENT_TRACEPARENT)])
        await asyncio.sleep(0.2)  # Admit's spans end once the sidecar answered
        tracing.provider.force_flush()
        spans = exporter.get_finished_spans()
        (root,) = [s for s in spans if s.name == attr.SPAN_NAME]
        children = {s.name: s for s in spans if parent_id(s) == span_id(root)}
        assert set(children) == {"astrolabe.length_estimate", "astrolabe.predict",
                                 "astrolabe.predictor.v1.Predictor/Admit"}
        local = children["astrolabe.predict"]
        assert local.kind == SpanKind.INTERNAL and local.attributes["astrolabe.predicted_e2e_s"] > 0
        assert local.attributes["server.address"] == "127.0.0.1"
        assert not [s for s in spans if "Predict" in s.name and "Predictor/Admit" not in s.name]
    finally:
        await server.stop()
        await sidecar.stop(0)
        await emulator.stop()


async def test_predict_and_admit_continue_into_the_sidecar(traced):
    await route(traced.stub, [("traceparent", CLIENT_TRACEPARENT)])
    spans = await traced.finished()
    (root,) = [s for s in spans if s.name == attr.SPAN_NAME]
    children = {s.name: s for s in spans if parent_id(s) == span_id(root)}
    assert set(children) == {"astrolabe.length_estimate", "astrolabe.predictor.v1.Predictor/Predict",
                             "astrolabe.predictor.v1.Predictor/Admit"}
    predict = children["astrolabe.predictor.v1.Predictor/Predict"]
    assert predict.kind == SpanKind.CLIENT and predict.attributes["astrolabe.predictor.outcome"] == "ok"
    assert predict.attributes["astrolabe.predicted_e2e_s"] > 0
    (server_span,) = [s for s in spans if s.name == "/astrolabe.predictor.v1.Predictor/Predict"]
    assert server_span.kind == SpanKind.SERVER and parent_id(server_span) == span_id(predict)
    (simulate,) = [s for s in spans if s.name == "astrolabe.simulate"]
    assert parent_id(simulate) == span_id(server_span) and trace_id(simulate) == TRACE_ID
    assert simulate.attributes["astrolabe.state_source"] == "ledger"
    assert simulate.attributes["astrolabe.num_steps_simulated"] > 0
    assert {"astrolabe.num_running", "astrolabe.num_waiting", "astrolabe.state_age_s"} <= set(simulate.attributes)
    (admit_server,) = [s for s in spans if s.name == "/astrolabe.predictor.v1.Predictor/Admit"]
    assert parent_id(admit_server) == span_id(children["astrolabe.predictor.v1.Predictor/Admit"])
    # Release, State and health checks start no trace of their own
    assert not [s for s in spans if "Release" in s.name or "Health" in s.name]
    assert {trace_id(s) for s in spans} == {TRACE_ID}


async def test_metadata_context_wins_and_the_headers_become_a_link(traced):
    await route(traced.stub, [("traceparent", CLIENT_TRACEPARENT)], metadata=(("traceparent", PROXY_TRACEPARENT),))
    (span,) = await traced.named(attr.SPAN_NAME)
    assert trace_id(span) == PROXY_TRACE_ID and parent_id(span) == PROXY_SPAN_ID
    (link,) = span.links
    assert _hex(link.context.trace_id, 32) == TRACE_ID and _hex(link.context.span_id, 16) == CLIENT_SPAN_ID


async def test_metadata_context_alone_is_honoured(traced):
    upstream = await route(traced.stub, metadata=(("traceparent", PROXY_TRACEPARENT),))
    (span,) = await traced.named(attr.SPAN_NAME)
    assert parent_id(span) == PROXY_SPAN_ID and not span.links
    assert upstream["traceparent"].split("-")[1] == PROXY_TRACE_ID


@pytest.mark.parametrize("headers, metadata", [
    ([("traceparent", "not-a-traceparent"), ("tracestate", "=,==,\x7f")], None),
    ([("traceparent", f"00-{'0' * 32}-{CLIENT_SPAN_ID}-01")], None),
    ([("traceparent", "00-" + "f" * 5000)], (("traceparent", "junk"),)),
], ids=["garbage", "zero-trace-id", "huge-header-junk-metadata"])
async def test_a_bad_traceparent_starts_a_new_root(traced, headers, metadata):
    upstream = await route(traced.stub, headers, metadata=metadata)
    assert upstream[wire.DESTINATION_HEADER]  # routed as if there were no context
    (span,) = await traced.named(attr.SPAN_NAME)
    assert span.parent is None and trace_id(span) != "0" * 32
    assert upstream["traceparent"].startswith(f"00-{trace_id(span)}-{span_id(span)}-")


async def test_an_error_answer_is_recorded_and_ends_the_span(traced):
    answer = await route(traced.stub, [("traceparent", CLIENT_TRACEPARENT)],
                         body=json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode())
    assert answer.immediate_response.status.code == 404
    (span,) = await traced.named(attr.SPAN_NAME)
    assert span.attributes[attr.OUTCOME] == "model_not_found" == span.attributes[attr.ERROR_TYPE]
    assert span.attributes["http.response.status_code"] == 404
    assert span.status.status_code == StatusCode.UNSET  # a client error is not the router's failure


async def test_request_text_in_attributes_is_clipped(traced):
    body = json.dumps({"model": "m" * 100_000, "messages": [{"role": "user", "content": "x"}]}).encode()
    answer = await route(traced.stub, body=body)
    assert answer.immediate_response.status.code == 404
    (span,) = await traced.named(attr.SPAN_NAME)
    model = span.attributes[attr.GEN_AI_REQUEST_MODEL]
    assert len(model) == attr.MAX_REQUEST_TEXT_CHARS and model.endswith("...")


async def test_a_dead_sidecar_shows_as_a_failed_predict_and_a_fallback():
    exporter = InMemorySpanExporter()
    tracing = setup_tracing("astrolabe-test", environ={}, exporter=exporter)
    dead = f"127.0.0.1:{free_port()}"
    emulator, sidecar, server, port = await _start(tracing, lambda backend, predictor: [
        {"address": backend, "models": ["llama-2-7b"], "predictor": dead}])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await route(pb_grpc.ExternalProcessorStub(channel), [("traceparent", CLIENT_TRACEPARENT)])
        tracing.provider.force_flush()
        spans = exporter.get_finished_spans()
        (root,) = [s for s in spans if s.name == attr.SPAN_NAME]
        assert root.attributes[attr.OUTCOME] == "fallback" and root.attributes[attr.BASIS] == "fallback"
        assert root.attributes[attr.FALLBACK_REASON] == "no_prediction"
        assert root.attributes[attr.POLICY] == "least-requests"
        (event,) = root.events
        assert not event.attributes[attr.CANDIDATE_ANSWERED] and attr.CANDIDATE_TTFT_S not in event.attributes
        (predict,) = [s for s in spans if s.name == "astrolabe.predictor.v1.Predictor/Predict"]
        assert predict.attributes["astrolabe.predictor.outcome"] == "down"
        assert predict.status.status_code == StatusCode.ERROR
    finally:
        await server.stop()
        await sidecar.stop()
        await emulator.stop()
        tracing.shutdown()


async def test_tracing_off_leaves_the_request_untouched():
    tracing = setup_tracing("astrolabe-test", environ={})  # nothing configured: off
    emulator, sidecar, server, port = await _start(
        tracing, lambda backend, predictor: [{"address": backend, "models": ["llama-2-7b"], "predictor": predictor}])
    try:
        assert server.router._tracer is None and server.predictors._tracer is None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            upstream = await route(pb_grpc.ExternalProcessorStub(channel), [("traceparent", CLIENT_TRACEPARENT)])
        assert set(upstream) == {wire.DESTINATION_HEADER}  # the client's traceparent travels on unchanged
    finally:
        await server.stop()
        await sidecar.stop()
        await emulator.stop()
