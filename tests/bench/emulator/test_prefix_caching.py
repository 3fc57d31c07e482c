"""The emulator's prefix caching over real HTTP: cached-token counts per request, vLLM's prefix-cache counters,
replies cached for the next chat turn, and ``--no-enable-prefix-caching``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bench.emulator.tokens import prompt_token_ids
from predictor.sim import EngineConfig
from tests.bench.emulator.prefix_sequence import BLOCK_SIZE, run_sequence, steps
from tests.bench.emulator.test_server import MODEL, emulator, metric, sse_events

VLLM_TIER_ENGINE = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, block_size=BLOCK_SIZE, num_gpu_blocks=31)
"""The vLLM tier's engine (deploy/vllm/launch.py: 1 MiB of KV = 32 blocks of 32 tokens, less vLLM's null block)."""


def _counters(text: str) -> tuple[float, float]:
    return (metric(text, "vllm:prefix_cache_queries_total", model_name=MODEL, engine="0"),
            metric(text, "vllm:prefix_cache_hits_total", model_name=MODEL, engine="0"))


@pytest.mark.parametrize("eviction", [False, True], ids=["fits", "evicts"])
async def test_cached_tokens_and_counters_follow_vllms_lookup_rule(eviction: bool) -> None:
    sequence = steps(eviction=eviction)
    async with emulator(VLLM_TIER_ENGINE, max_model_len=256, enable_prompt_tokens_details=True) as client:
        assert _counters((await client.get("/metrics")).text) == (0, 0)
        usages = await run_sequence(client, MODEL, sequence)
        text = (await client.get("/metrics")).text
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached == [s.expected_cached_tokens for s in sequence], list(zip([s.name for s in sequence], cached))
    assert _counters(text) == (sum(u["prompt_tokens"] for u in usages), sum(cached))
    assert 'enable_prefix_caching="True"' in text
    for step, usage in zip(sequence, usages):
        details = usage["prompt_tokens_details"]
        if step.messages is None:
            assert details == {"cached_tokens": step.expected_cached_tokens, "created_cache_tokens": None,
                               "multimodal_tokens": None}
        else:  # chat: also the prompt tokens it wrote into the cache (its full prompt blocks less the hit)
            full = usage["prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE
            assert details == {"cached_tokens": step.expected_cached_tokens,
                               "created_cache_tokens": full - step.expected_cached_tokens, "multimodal_tokens": None}


async def test_no_enable_prefix_caching_never_hits_and_counts_nothing() -> None:
    sequence = steps()
    async with emulator(VLLM_TIER_ENGINE, max_model_len=256, enable_prompt_tokens_details=True,
                        enable_prefix_caching=False) as client:
        usages = await run_sequence(client, MODEL, sequence)
        text = (await client.get("/metrics")).text
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0] * len(sequence)
    assert _counters(text) == (0, 0) and 'enable_prefix_caching="False"' in text


async def test_prompt_tokens_details_only_when_enabled_also_in_the_streamed_usage() -> None:
    body = {"model": MODEL, "prompt": "the same prompt " * 20, "max_tokens": 3, "ignore_eos": True}
    async with emulator(enable_prompt_tokens_details=False) as client:
        assert "prompt_tokens_details" not in (await client.post("/v1/completions", json=body)).json()["usage"]
    async with emulator(enable_prompt_tokens_details=True) as client:
        first = (await client.post("/v1/completions", json=body)).json()["usage"]
        streamed = await client.post("/v1/completions", json={**body, "stream": True,
                                                               "stream_options": {"include_usage": True}})
        usage = json.loads(sse_events(streamed.text)[-2])["usage"]
    num_tokens = first["prompt_tokens"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["prompt_tokens_details"] == {"cached_tokens": (num_tokens - 1) // 16 * 16}  # block_size 16


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_next_chat_turn_that_resends_the_reply_hits_the_reply_too(stream: bool) -> None:
    """The reply's text tokenizes back to its ids, so turn 2's prompt starts with turn 1's prompt and reply, and
    the blocks turn 1 filled with reply tokens are hit (all but the last reply token were computed)."""
    first = [{"role": "system", "content": "you are a helpful assistant " * 10},
             {"role": "user", "content": "write me a long poem about the sea"}]
    async with emulator(enable_prompt_tokens_details=True) as client:
        turn1 = (await client.post("/v1/chat/completions", json={"model": MODEL, "messages": first,
                                                                 "max_tokens": 70, "ignore_eos": True})).json()
        reply = turn1["choices"][0]["message"]["content"]
        if stream:  # the same reply, streamed in pieces
            events = sse_events((await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": first, "max_tokens": 70, "ignore_eos": True, "stream": True})).text)
            pieces = [json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]]
            assert "".join(pieces) == reply
        second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "now shorter"}]
        turn2 = (await client.post("/v1/chat/completions", json={"model": MODEL, "messages": second,
                                                                 "max_tokens": 5, "ignore_eos": True})).json()
    prompt1 = prompt_token_ids("system: " + first[0]["content"] + "\nuser: " + first[1]["content"] + "\nassistant:")
    assert turn1["usage"]["prompt_tokens"] == len(prompt1)
    num_computed = len(prompt1) + 70 - 1  # the last sampled token's KV is never computed
    expected = min(num_computed // 16, (turn2["usage"]["prompt_tokens"] - 1) // 16) * 16
    assert expected > len(prompt1)  # reply blocks among the hits
    assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] == expected


async def test_a_repeated_prompt_prefills_only_its_uncached_tokens() -> None:
    """The hit shortens the modelled prefill: the second identical long prompt computes one block, not 60."""
    body = {"model": MODEL, "prompt": "a long shared document " * 240, "max_tokens": 1, "ignore_eos": True}
    async with emulator(dataclasses.replace(EngineConfig(), max_num_batched_tokens=2048),
                        enable_prompt_tokens_details=True, max_model_len=4096) as client:
        await client.post("/v1/completions", json=body)
        before = metric((await client.get("/metrics")).text, "vllm:iteration_tokens_total_sum")
        second = (await client.post("/v1/completions", json=body)).json()["usage"]
        after = metric((await client.get("/metrics")).text, "vllm:iteration_tokens_total_sum")
    assert second["prompt_tokens_details"]["cached_tokens"] == (second["prompt_tokens"] - 1) // 16 * 16
    assert after - before == second["prompt_tokens"] - second["prompt_tokens_details"]["cached_tokens"]


async def test_a_recorded_reply_is_answered_token_for_token_and_hit_by_the_next_turn() -> None:
    """A replay of a recorded conversation names each turn's recorded reply (`emulator_reply_text`): the emulator
    answers exactly that text, ends there, and the next turn, which resends it, hits its blocks."""
    recorded = ("Of course! Here is what I found:\n\n1. The tide tables (2026) list high water at 06:12.\n"
                "2. Winds: 12-15 kn from the south-west.\nHope that helps - ask me anything else!") * 2
    first = [{"role": "user", "content": "when is high water tomorrow and how windy will it be?"}]
    async with emulator(enable_prompt_tokens_details=True) as client:
        turn1 = (await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": first, "max_tokens": 500, "emulator_reply_text": recorded})).json()
        assert turn1["choices"][0]["message"]["content"] == recorded
        assert turn1["choices"][0]["finish_reason"] == "stop"
        assert turn1["usage"]["completion_tokens"] == len(prompt_token_ids(recorded))
        second = [*first, {"role": "assistant", "content": recorded}, {"role": "user", "content": "thanks"}]
        turn2 = (await client.post("/v1/chat/completions", json={"model": MODEL, "messages": second,
                                                                 "max_tokens": 5})).json()
        bad = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": first,
                                                              "emulator_reply_text": 7})
    num_computed = turn1["usage"]["prompt_tokens"] + turn1["usage"]["completion_tokens"] - 1
    expected = min(num_computed // 16, (turn2["usage"]["prompt_tokens"] - 1) // 16) * 16
    assert expected > turn1["usage"]["prompt_tokens"]
    assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] == expected
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "emulator_reply_text"
