"""Tests for bench/emulator/server.py over real HTTP on loopback (in-process aiohttp server, httpx client)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.emulator.server import INSTANCE_HEADER, EmulatorConfig, start_emulator
from predictor.sim import EngineConfig
from tagger.tokenizer import count_tokens

MODEL = "llama-2-7b"


@contextlib.asynccontextmanager
async def emulator(engine: EngineConfig | None = None, **overrides: object) -> AsyncIterator[httpx.AsyncClient]:
    """A running instance on a free port and a client for it; both closed on exit."""
    config = dataclasses.replace(EmulatorConfig(port=0), engine=engine or EngineConfig(), **overrides)
    server = await start_emulator(config)
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30.0) as client:
            yield client
    finally:
        await server.stop()


def metric_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text -> {(sample name, labels): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of samples named ``name`` whose labels include ``labels``."""
    return sum(v for (n, lbl), v in metric_samples(text).items() if n == name and set(labels.items()) <= lbl)


def sse_events(body: str) -> list[str]:
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")
    assert events[-1] == ""
    assert all(e.startswith("data: ") for e in events[:-1])
    return [e[len("data: "):] for e in events[:-1]]


async def test_health_models_and_instance_header() -> None:
    async with emulator() as client:
        health = await client.get("/health")
        assert health.status_code == 200 and health.content == b""
        assert health.headers[INSTANCE_HEADER] == f"{client.base_url.host}:{client.base_url.port}"
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["object"] == "model"


async def test_completion_json_with_ignore_eos() -> None:
    async with emulator() as client:
        resp = await client.post("/v1/completions",
                                 json={"model": MODEL, "prompt": "hello world", "max_tokens": 7, "ignore_eos": True})
        assert resp.status_code == 200
        body = resp.json()
        assert body["object"] == "text_completion"
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length" and len(choice["text"].split()) == 7
        prompt_tokens = count_tokens("hello world")
        assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 7,
                                 "total_tokens": prompt_tokens + 7}


async def test_token_id_prompt_and_default_max_tokens() -> None:
    async with emulator() as client:
        body = (await client.post("/v1/completions",
                                  json={"model": MODEL, "prompt": [[5] * 33], "ignore_eos": True})).json()
        assert body["usage"]["prompt_tokens"] == 33 and body["usage"]["completion_tokens"] == 16


async def test_output_length_draw_and_stop_reason() -> None:
    # sigma 0: every draw equals the median, so lengths are exact.
    async with emulator(output_len_median_tokens=5.0, output_len_sigma=0.0) as client:
        short = (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 50})).json()
        assert short["usage"]["completion_tokens"] == 5 and short["choices"][0]["finish_reason"] == "stop"
        capped = (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})).json()
        assert capped["usage"]["completion_tokens"] == 3 and capped["choices"][0]["finish_reason"] == "length"
        chat = (await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})).json()
        assert chat["object"] == "chat.completion"
        assert chat["choices"][0]["message"]["role"] == "assistant"
        assert chat["usage"]["completion_tokens"] == 5 and chat["choices"][0]["finish_reason"] == "stop"
        assert chat["usage"]["prompt_tokens"] == count_tokens("user: hi\nassistant:")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"], ids=["completions", "chat"])
async def test_streaming_shape(path: str) -> None:
    is_chat = "chat" in path
    request = {"model": MODEL, "max_tokens": 6, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}
    request.update({"messages": [{"role": "user", "content": "hi"}]} if is_chat else {"prompt": "hi"})
    async with emulator() as client:
        resp = await client.post(path, json=request)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        # vLLM with include_usage: the last chunk has no choices and carries usage
        usage_chunk, chunks = chunks[-1], chunks[:-1]
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all("usage" not in c for c in chunks)
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        if is_chat:
            assert chunks[0]["object"] == "chat.completion.chunk"
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
            text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        else:
            text = "".join(c["choices"][0]["text"] for c in chunks)
        assert len(text.split()) == 6


async def test_no_usage_chunk_without_include_usage_and_model_is_optional() -> None:
    async with emulator() as client:
        resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True})
        events = sse_events(resp.text)
        assert events[-1] == "[DONE]" and all("usage" not in json.loads(e) for e in events[:-1])
        assert json.loads(events[-2])["model"] == MODEL


async def test_stream_interval_coalesces_events() -> None:
    num_tokens, interval = 21, 5
    # A slow clock (20x an H200) so the handler is always ready before the next step ends.
    async with emulator(stream_interval=interval, time_scale=20.0) as client:
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": num_tokens,
                                                          "ignore_eos": True, "stream": True})
        chunks = [json.loads(e) for e in sse_events(resp.text)[:-1]]
        counts = [len(c["choices"][0]["text"].split()) for c in chunks]
        assert sum(counts) == num_tokens
        assert counts[0] == 1  # the first token is sent on its own, at once
        assert all(n >= interval for n in counts[1:-1])
        assert len(chunks) <= 1 + (num_tokens - 1) // interval + 1


@pytest.mark.parametrize(
    ("path", "request_body", "status", "err_type", "needle"),
    [
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "NotFoundError", "gpt-4"),
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404,
         "NotFoundError", "nope"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "BadRequestError", "batched"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 3}, 400, "BadRequestError", "n=1"),
        ("/v1/completions", {"model": MODEL, "prompt": [1] * 100, "max_tokens": 200}, 400, "BadRequestError",
         "maximum context length is 256"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x " * 300}]}, 400,
         "BadRequestError", "maximum context length"),
    ],
    ids=["completions-unknown-model", "chat-unknown-model", "batch", "n", "context-length", "chat-context-length"],
)
async def test_error_bodies(path: str, request_body: dict, status: int, err_type: str, needle: str) -> None:
    async with emulator(max_model_len=256) as client:
        resp = await client.post(path, json=request_body)
        assert resp.status_code == status
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == err_type and error["code"] == status and needle in error["message"]


async def test_bad_json_is_400() -> None:
    async with emulator() as client:
        resp = await client.post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"})
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"


async def test_request_that_never_fits_kv_cache_is_400() -> None:
    async with emulator(EngineConfig(num_gpu_blocks=4, block_size=16)) as client:
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 60, "max_tokens": 10})
        assert resp.status_code == 400 and "KV blocks" in resp.json()["error"]["message"]


async def test_queueing_beyond_max_num_seqs_shows_waiting() -> None:
    engine = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64)
    async with emulator(engine, time_scale=5.0) as client:
        burst = [asyncio.create_task(client.post("/v1/completions", json={
            "model": MODEL, "prompt": "hello", "max_tokens": 20, "ignore_eos": True})) for _ in range(6)]
        max_waiting = max_running = 0.0
        while not all(t.done() for t in burst):
            text = (await client.get("/metrics")).text
            max_waiting = max(max_waiting, metric(text, "vllm:num_requests_waiting", model_name=MODEL, engine="0"))
            max_running = max(max_running, metric(text, "vllm:num_requests_running"))
            await asyncio.sleep(0.02)
        results = [t.result().json() for t in burst]
        assert all(r["usage"]["completion_tokens"] == 20 for r in results)
        assert max_waiting > 0 and max_running <= 2
        text = (await client.get("/metrics")).text
        assert metric(text, "vllm:num_requests_waiting") == 0 and metric(text, "vllm:num_requests_running") == 0
        assert metric(text, "vllm:request_success_total", finished_reason="length") == 6
        assert metric(text, "vllm:generation_tokens_total") == 120
        assert metric(text, "vllm:request_queue_time_seconds_count") == 6
        assert metric(text, "vllm:time_to_first_token_seconds_count") == 6
        assert metric(text, "vllm:inter_token_latency_seconds_count") == 6 * 19


async def test_preemptions_grow_with_tiny_kv_cache() -> None:
    # 8 blocks x 16 tokens = 128 tokens of KV for four requests that each grow to ~110 tokens.
    engine = EngineConfig(num_gpu_blocks=8, block_size=16, max_num_batched_tokens=64, max_num_seqs=4)
    async with emulator(engine) as client:
        burst = [client.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 10, "max_tokens": 100,
                                                      "ignore_eos": True}) for _ in range(4)]
        results = [r.json() for r in await asyncio.gather(*burst)]
        assert all(r["usage"]["completion_tokens"] == 100 for r in results)
        text = (await client.get("/metrics")).text
        assert metric(text, "vllm:num_preemptions_total", model_name=MODEL, engine="0") > 0
        assert metric(text, "vllm:kv_cache_usage_perc") == 0.0
        assert metric(text, "vllm:cache_config_info", block_size="16", num_gpu_blocks="8") == 1.0


async def _wait_idle(client: httpx.AsyncClient) -> str:
    """Scrapes /metrics until nothing runs or waits (bounded); returns the last scrape."""
    for _ in range(500):
        text = (await client.get("/metrics")).text
        if metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:num_requests_waiting") == 0:
            return text
        await asyncio.sleep(0.02)
    raise AssertionError("requests never left the engine")


async def test_client_disconnect_mid_stream_aborts() -> None:
    async with emulator(time_scale=5.0) as client:
        async with httpx.AsyncClient(base_url=client.base_url, timeout=30.0) as other:
            async with other.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "hi", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        break
                text = (await client.get("/metrics")).text
                assert metric(text, "vllm:num_requests_running") == 1
        # Leaving both blocks closed the connection after the first event.
        text = await _wait_idle(client)
        assert metric(text, "vllm:request_success_total", finished_reason="abort") == 1
        assert metric(text, "vllm:kv_cache_usage_perc") == 0.0


async def test_client_disconnect_while_waiting_for_json_aborts() -> None:
    async with emulator(time_scale=5.0) as client:
        async with httpx.AsyncClient(base_url=client.base_url, timeout=30.0) as other:
            task = asyncio.create_task(other.post("/v1/completions", json={
                "model": MODEL, "prompt": "hi", "max_tokens": 2000, "ignore_eos": True}))
            for _ in range(500):
                if metric((await client.get("/metrics")).text, "vllm:num_requests_running") == 1:
                    break
                await asyncio.sleep(0.02)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        text = await _wait_idle(client)
        assert metric(text, "vllm:request_success_total", finished_reason="abort") == 1


async def test_metrics_names_and_labels() -> None:
    async with emulator() as client:
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 4,
                                                   "ignore_eos": True})
        resp = await client.get("/metrics")
        assert resp.headers["content-type"].startswith("text/plain")
        names = {name for name, _ in metric_samples(resp.text)}
        for expected in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                         "vllm:cache_config_info", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
                         "vllm:generation_tokens_total", "vllm:request_success_total",
                         "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
                         "vllm:e2e_request_latency_seconds_sum", "vllm:request_queue_time_seconds_count",
                         "vllm:iteration_tokens_total_bucket", "vllm:request_prefill_time_seconds_count",
                         "vllm:request_decode_time_seconds_count"):
            assert expected in names, expected
        assert metric(resp.text, "vllm:prompt_tokens_total", model_name=MODEL, engine="0") == count_tokens("a b c")
        assert metric(resp.text, "vllm:generation_tokens_total") == 4
        assert metric(resp.text, "vllm:e2e_request_latency_seconds_count") == 1


@pytest.mark.parametrize("hint, expected, reason", [("7", 7, "stop"), ("80", 50, "length")], ids=["ends", "capped"])
async def test_reply_length_hook_ends_the_reply_under_the_cap(hint: str, expected: int, reason: str) -> None:
    async with emulator() as client:
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 50},
                                 headers={"x-emulator-output-tokens": hint})
        choice = resp.json()["choices"][0]
        assert (resp.json()["usage"]["completion_tokens"], choice["finish_reason"]) == (expected, reason)


@pytest.mark.parametrize("hint", ["0", "x", "-3", "9" * 5000])
async def test_bad_reply_length_hook_is_400(hint: str) -> None:
    async with emulator() as client:
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 5},
                                 headers={"x-emulator-output-tokens": hint})
        assert resp.status_code == 400 and "x-emulator-output-tokens" in resp.json()["error"]["message"]


async def test_loadgen_sends_a_realistic_cap_and_spreads_over_router_replicas() -> None:
    from bench.loadgen import chat_body, replay
    from bench.workloads import TraceRequest

    capped = TraceRequest(0.0, "hi", 1, 9, "r0", max_tokens=64, router=1)
    assert chat_body(MODEL, capped)["max_tokens"] == 64 and "ignore_eos" not in chat_body(MODEL, capped)
    exact = TraceRequest(0.0, "hi", 1, 9, "r1")
    assert chat_body(MODEL, exact)["max_tokens"] == 9 and chat_body(MODEL, exact)["ignore_eos"] is True
    config = dataclasses.replace(EmulatorConfig(port=0), engine=EngineConfig())
    servers = [await start_emulator(config) for _ in range(2)]
    try:
        trace = [TraceRequest(0.01 * i, "hi", 1, 5 + i, f"r{i}", max_tokens=8, router=i % 2) for i in range(6)]
        results = await replay([s.base_url for s in servers], trace, model=MODEL, progress=False)
    finally:
        for server in servers:
            await server.stop()
    assert [r.error for r in results] == [None] * 6
    assert [r.max_tokens for r in results] == [5, 6, 7, 8, 8, 8]  # the reply's length, capped
    assert len({r.instance for r in results}) == 2 and results[0].instance != results[1].instance


async def test_priority_field_follows_the_scheduling_policy() -> None:
    """vLLM's 'priority' body field: refused (400) unless --scheduling-policy priority; with it a later request of
    lower value is served before earlier ones of higher value (the waiting queue by priority, then arrival)."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 20, "ignore_eos": True}
    async with emulator() as client:
        refused = await client.post("/v1/completions", json={**body, "priority": 1})
        assert refused.status_code == 400 and "Priority scheduling is not enabled" in refused.json()["error"]["message"]
        assert (await client.post("/v1/completions", json={**body, "priority": 0})).status_code == 200
        assert (await client.post("/v1/completions", json={**body, "priority": "high"})).status_code == 400
    engine = EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, scheduling_policy="priority")
    async with emulator(engine, time_scale=5.0) as client:
        finished: list[str] = []

        async def send(name: str, priority: int) -> None:
            response = await client.post("/v1/completions", json={**body, "priority": priority})
            assert response.status_code == 200, response.text
            finished.append(name)

        first = asyncio.create_task(send("first", 1))
        while metric((await client.get("/metrics")).text, "vllm:num_requests_running") < 1:
            await asyncio.sleep(0.01)
        queued = [asyncio.create_task(send(f"batch{i}", 1)) for i in range(3)]
        while metric((await client.get("/metrics")).text, "vllm:num_requests_waiting") < 3:
            await asyncio.sleep(0.01)
        urgent = asyncio.create_task(send("urgent", 0))
        await asyncio.gather(first, *queued, urgent)
        assert finished[:2] == ["first", "urgent"], finished
