"""The emulator continues the request's traceparent with one ``llm_request`` span per request, as vLLM does."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from astrolabe.logs import build_handler
from astrolabe.tracing import setup_tracing
from bench.emulator import server as server_module
from bench.emulator.server import EmulatorConfig, _parse_args, start_emulator
from predictor.sim import EngineConfig

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


@pytest.fixture
async def traced():
    exporter = InMemorySpanExporter()
    tracing = setup_tracing("astrolabe-emulator", environ={}, exporter=exporter)
    server = await start_emulator(EmulatorConfig(port=0, engine=EngineConfig(), time_scale=5.0), tracing)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30.0) as client:
        yield client, exporter, tracing
    await server.stop()
    tracing.shutdown()


def _spans(tracing, exporter):
    tracing.provider.force_flush()
    return exporter.get_finished_spans()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_request_span_continues_the_traceparent(traced, stream):
    client, exporter, tracing = traced
    body = {"model": "llama-2-7b", "prompt": "hello world", "max_tokens": 6, "ignore_eos": True, "stream": stream}
    reply = await client.post("/v1/completions", json=body, headers={"traceparent": TRACEPARENT,
                                                                    "x-request-id": "abc"})
    assert reply.status_code == 200
    (span,) = _spans(tracing, exporter)
    assert span.name == "llm_request" and span.kind == SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == TRACE_ID and format(span.parent.span_id, "016x") == PARENT_SPAN_ID
    a = span.attributes
    assert a["gen_ai.request.id"] == "cmpl-abc-0" and a["gen_ai.response.model"] == "llama-2-7b"
    assert a["gen_ai.usage.completion_tokens"] == 6 and a["gen_ai.usage.prompt_tokens"] >= 1
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.response.finish_reasons"] == ("length",)
    assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] \
        <= a["gen_ai.latency.e2e"]
    assert span.end_time - span.start_time == pytest.approx(a["gen_ai.latency.e2e"] * 1e9, abs=2e6)


async def test_without_or_with_a_bad_traceparent_the_span_is_a_root(traced):
    client, exporter, tracing = traced
    for headers in ({}, {"traceparent": "00-zz-yy-01"}):
        body = {"model": "llama-2-7b", "prompt": "x", "max_tokens": 2, "ignore_eos": True}
        assert (await client.post("/v1/completions", json=body, headers=headers)).status_code == 200
    assert [s.parent for s in _spans(tracing, exporter)] == [None, None]


async def test_an_error_before_admission_records_no_span(traced):
    client, exporter, tracing = traced
    reply = await client.post("/v1/completions", json={"model": "other", "prompt": "x"},
                              headers={"traceparent": TRACEPARENT})
    assert reply.status_code == 404 and not _spans(tracing, exporter)


def test_the_otlp_flag_is_vllms():
    config, _ = _parse_args(["--otlp-traces-endpoint", "127.0.0.1:4317"])
    assert config.otlp_traces_endpoint == "127.0.0.1:4317"
    with pytest.raises(SystemExit):
        _parse_args(["--otlp-traces-endpoint", "nowhere"])


async def test_a_client_that_goes_away_leaves_an_aborted_span(traced):
    client, exporter, tracing = traced
    body = {"model": "llama-2-7b", "prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body, headers={"traceparent": TRACEPARENT}) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: "):
                break  # first token seen; leaving the block drops the connection mid-stream
    for _ in range(200):  # the server notices the disconnect on its next write
        if _spans(tracing, exporter):
            break
        await asyncio.sleep(0.01)
    (span,) = _spans(tracing, exporter)
    assert span.attributes["error.type"] == "abort" and span.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert 1 <= span.attributes["gen_ai.usage.completion_tokens"] < 2000


async def test_a_line_logged_while_a_request_is_handled_names_it_and_its_trace(traced, monkeypatch):
    client, _, _ = traced
    buffer, logger = io.StringIO(), logging.getLogger("tests.emulator.handling")
    logger.propagate, logger.level = False, logging.INFO
    logger.addHandler(build_handler("json", buffer))
    real_parse = server_module.parse_request

    def parse_and_log(body, is_chat):  # a line from inside the request's handler
        logger.info("parsing")
        return real_parse(body, is_chat)

    monkeypatch.setattr(server_module, "parse_request", parse_and_log)
    try:
        body = {"model": "llama-2-7b", "prompt": "x", "max_tokens": 2, "ignore_eos": True}
        for headers in ({"traceparent": TRACEPARENT, "x-request-id": "abc"}, {}):
            assert (await client.post("/v1/completions", json=body, headers=headers)).status_code == 200
    finally:
        logger.handlers.clear()
    traced_line, plain_line = (json.loads(line) for line in buffer.getvalue().splitlines())
    assert (traced_line["request_id"], traced_line["trace_id"]) == ("abc", TRACE_ID)
    assert plain_line["request_id"].startswith("cmpl-") and "trace_id" not in plain_line  # the engine's id
