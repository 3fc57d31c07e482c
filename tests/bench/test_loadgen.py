"""Tests of bench/loadgen.py against a real in-process aiohttp server that speaks OpenAI-style SSE.

The server's behaviour is chosen by the prompt: "ok" streams ``max_tokens`` tokens, "short" reports one token
too few in ``usage``, "http500" answers 500, "break" ends the stream without ``[DONE]``, "hang" never answers,
"shed" answers 429 as the extproc's admission does (``x-astrolabe-drop-reason``, ``retry-after``), "http429" a 429
without a drop reason.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from bench.loadgen import DROP_REASON_HEADER, INSTANCE_HEADER, chat_body, replay
from bench.workloads import TraceRequest

INSTANCE = "127.0.0.1:4242"
BODIES = web.AppKey("bodies", list)


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[BODIES].append(body)
    prompt, max_tokens = body["messages"][0]["content"], body["max_tokens"]
    if prompt == "http500":
        return web.Response(status=500, text="engine exploded")
    if prompt == "shed":
        return web.Response(status=429, text="refused", headers={DROP_REASON_HEADER: "headroom", "retry-after": "1"})
    if prompt == "http429":
        return web.Response(status=429, text="rate limited")
    if prompt == "hang":
        await asyncio.sleep(3600)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", INSTANCE_HEADER: INSTANCE})
    await resp.prepare(request)
    # Like vLLM: a role-only first chunk, then content chunks of 2 tokens, then a usage chunk.
    await resp.write(_event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
    for start in range(0, max_tokens, 2):
        text = "tok " * min(2, max_tokens - start)
        await resp.write(_event({"choices": [{"index": 0, "delta": {"content": text}}]}))
        if prompt == "break":
            return resp
    completion_tokens = max_tokens - 1 if prompt == "short" else max_tokens
    await resp.write(_event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": completion_tokens}}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.fixture
async def base_url():
    app = web.Application()
    app[BODIES] = []
    app.router.add_post("/v1/chat/completions", _chat)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # port 0: ask the bound socket
    try:
        yield f"http://127.0.0.1:{port}", app[BODIES]
    finally:
        await runner.cleanup()


def _req(i: int, prompt: str, num_output_tokens: int = 5, offset_s: float = 0.0) -> TraceRequest:
    return TraceRequest(offset_s, prompt, 3, num_output_tokens, f"{i}:{prompt}")


def test_chat_body_matches_the_openai_streaming_request() -> None:
    assert chat_body("m", _req(0, "hello", 7)) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 7,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def test_successful_requests_are_timed_and_attributed(base_url) -> None:
    url, bodies = base_url
    trace = [_req(i, "ok", 1 + i, offset_s=0.01 * i) for i in range(6)]
    results = await replay(url, trace, model="llama-2-7b", progress=False)
    assert [r.id for r in results] == [t.id for t in trace]
    for r, t in zip(results, trace):
        assert r.ok, r.error
        assert r.status == 200 and r.instance == INSTANCE
        assert r.num_completion_tokens == t.num_output_tokens == r.max_tokens
        assert 0 < r.ttft_s <= r.e2e_s
    assert sorted(b["max_tokens"] for b in bodies) == [1, 2, 3, 4, 5, 6]
    assert all(b["model"] == "llama-2-7b" and b["stream"] for b in bodies)


@pytest.mark.parametrize(
    "prompt,status,error_start",
    [
        ("http500", 500, "HTTP 500: engine exploded"),
        ("break", 200, "stream ended before [DONE]"),
        ("short", 200, "usage.completion_tokens=4, expected 5"),
    ],
    ids=["http-error", "broken-stream", "wrong-token-count"],
)
async def test_failures_are_errors(base_url, prompt: str, status: int, error_start: str) -> None:
    url, _ = base_url
    (result,) = await replay(url, [_req(0, prompt)], model="m", progress=False)
    assert not result.ok
    assert result.status == status
    assert result.error.startswith(error_start)


async def test_a_refusal_by_admission_is_no_error_but_another_429_is(base_url) -> None:
    url, _ = base_url
    refused, limited = await replay(url, [_req(0, "shed"), _req(1, "http429")], model="m", progress=False)
    assert refused.refused and refused.drop_reason == "headroom" and refused.status == 429
    assert refused.error is None and not refused.ok and refused.ttft_s is None
    assert not limited.refused and limited.error.startswith("HTTP 429: rate limited")


async def test_per_request_timeout(base_url) -> None:
    url, _ = base_url
    results = await replay(url, [_req(0, "hang"), _req(1, "ok")], model="m", request_timeout_s=0.3, progress=False)
    assert results[0].error == "timed out after 0.3 s" and results[0].status is None
    assert results[1].ok


async def test_overall_timeout_cancels_open_and_skips_unsent_requests(base_url) -> None:
    url, _ = base_url
    trace = [_req(0, "ok"), _req(1, "hang"), _req(2, "ok", offset_s=3600.0)]
    results = await replay(url, trace, model="m", request_timeout_s=3600, overall_timeout_s=0.5, progress=False)
    assert results[0].ok
    assert results[1].error.startswith("cancelled at the overall timeout")
    assert results[2].error.startswith("not sent")


async def test_unreachable_server_is_an_error() -> None:
    from astrolabe.procs import free_port

    url = f"http://127.0.0.1:{free_port()}"
    (result,) = await replay(url, [_req(0, "ok")], model="m", progress=False)
    assert result.status is None and result.error.startswith("ClientConnectorError")
