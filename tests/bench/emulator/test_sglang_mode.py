"""The emulator as an SGLang server (``--api sglang``) over real HTTP: native routes, metrics, health, errors."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from bench.emulator import sglang_api
from bench.emulator.server import EmulatorConfig, start_emulator
from predictor.backend_metrics import parse_backend_metrics
from predictor.server import sglang_engine_limits
from predictor.sim import EngineConfig

ENGINE = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=512)


@contextlib.asynccontextmanager
async def sglang(**overrides: object) -> AsyncIterator[httpx.AsyncClient]:
    config = dataclasses.replace(EmulatorConfig(port=0, engine=ENGINE, api="sglang"), **overrides)
    server = await start_emulator(config)
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30.0) as client:
            yield client
    finally:
        await server.stop()


async def test_generate_answers_sglang_s_native_shape():
    async with sglang() as client:
        r = await client.post("/generate", json={"text": "hello there", "rid": "abc",
                                                  "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
        assert r.status_code == 200
        body = r.json()
        assert body["meta_info"]["id"] == "abc"
        assert body["meta_info"]["completion_tokens"] == 5
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
        assert body["meta_info"]["prompt_tokens"] >= 1 and body["text"]
        # Without max_new_tokens SGLang caps at 128
        r = await client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"ignore_eos": True}})
        assert r.json()["meta_info"]["completion_tokens"] == sglang_api.DEFAULT_MAX_NEW_TOKENS
        assert r.json()["meta_info"]["prompt_tokens"] == 3


async def test_zero_new_tokens_is_answered_at_once_with_none():
    async with sglang() as client:
        r = await client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 0}})
        assert r.status_code == 200 and r.json()["text"] == "" and r.json()["meta_info"]["completion_tokens"] == 0


async def test_generate_streams_the_whole_text_so_far_then_done():
    async with sglang() as client:
        async with client.stream("POST", "/generate", json={"text": "hi", "stream": True,
                                                            "sampling_params": {"max_new_tokens": 4,
                                                                                "ignore_eos": True}}) as r:
            events = [line[len("data: "):] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4]
    assert all(later["text"].startswith(earlier["text"]) for earlier, later in zip(chunks, chunks[1:]))
    assert [c["meta_info"]["finish_reason"] for c in chunks][-1] == {"type": "length", "length": 4}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


@pytest.mark.parametrize("body", [{}, {"text": None}, {"text": ["a", "b"]},
                                  {"text": "x", "sampling_params": {"max_new_tokens": -1}},
                                  {"text": "x", "sampling_params": {"n": 2}}, {"input_ids": []}, [1]])
async def test_bad_generate_bodies_get_sglang_s_400(body):
    async with sglang() as client:
        r = await client.post("/generate", json=body)
        assert r.status_code == 400 and set(r.json()) == {"error"} and r.json()["error"]["message"]


async def test_metrics_under_sglang_names_and_server_info_state_the_engine_limits():
    async with sglang() as client:
        await client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}})
        text = (await client.get("/metrics")).text
        assert "vllm:" not in text
        observation = parse_backend_metrics(text)
        assert (observation.engine, observation.num_gpu_blocks, observation.block_size) == ("sglang", 512, 16)
        info = (await client.get("/get_server_info")).json()
        assert (info["max_running_requests"], info["chunked_prefill_size"], info["page_size"],
                info["max_total_num_tokens"]) == (8, 256, 16, 512 * 16)
        assert sglang_engine_limits(info, EngineConfig()) == ENGINE
        assert (await client.get("/get_model_info")).json()["is_generation"] is True
        # The OpenAI routes stay
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        assert (await client.get("/v1/models")).json()["data"][0]["owned_by"] == "sglang"


async def test_health_takes_sglang_s_poll_interval():
    async with sglang() as client:
        for path in ("/health", "/health_generate"):
            start_s = time.monotonic()
            assert (await client.get(path)).status_code == 200
            assert time.monotonic() - start_s >= sglang_api.HEALTH_POLL_S * 0.95


def test_an_unknown_api_is_refused():
    with pytest.raises(ValueError, match="api must be one of vllm, sglang"):
        EmulatorConfig(api="tgi")
