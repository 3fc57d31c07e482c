"""Fidelity of the emulator's prefix cache against real vLLM: one sequence of requests with shared prefixes
(tests/bench/emulator/prefix_sequence.py: a prompt, it again, it plus a suffix, a new one, a prompt of exactly two
blocks twice, a prompt extended by its own reply, two chats sharing a system prompt, then requests that fill the KV
cache and repeat earlier prompts), sent to one real vLLM server of the tier (prefix caching on,
``--enable-prompt-tokens-details``) and to an emulator with the same engine settings. Each request's
``usage.prompt_tokens_details`` and the growth of ``vllm:prefix_cache_queries_total`` /
``vllm:prefix_cache_hits_total`` must be equal on both.

The server may have served other tests first: their cached blocks are older than the sequence's, so vLLM takes them
(like unused blocks) before any of the sequence's, and the counts are those of a fresh server.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest

from bench.emulator.server import EmulatorConfig, start_emulator
from deploy.vllm.launch import SERVED_MODEL_NAME, VllmSettings
from predictor.sim import EngineConfig
from predictor.state_source import parse_plugin_state
from tests.bench.emulator.prefix_sequence import (
    BLOCK_SIZE,
    NUM_FITTING,
    run_sequence,
    steps,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

logger = logging.getLogger(__name__)

COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


async def _counters(client: httpx.AsyncClient) -> tuple[float, ...]:
    text = (await client.get("/metrics")).text
    return tuple(sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))
                 for name in COUNTERS)


async def _run(client: httpx.AsyncClient, sequence) -> tuple[list[dict], tuple[float, ...]]:
    """Each step's usage, and how much the two counters grew over the sequence (read until they stop moving:
    vLLM's stats logger may record the last step just after its response)."""
    before = await _counters(client)
    usages = await run_sequence(client, SERVED_MODEL_NAME, sequence)
    after = await _counters(client)
    for _ in range(20):
        await asyncio.sleep(0.1)
        latest = await _counters(client)
        if latest == after:
            break
        after = latest
    return usages, tuple(a - b for a, b in zip(after, before))


async def _both(server) -> dict[str, Any]:
    state = parse_plugin_state(server.state_path.read_text())
    settings = VllmSettings()
    assert state.engine.block_size == BLOCK_SIZE == settings.block_size
    sequence = steps(eviction=True)
    async with httpx.AsyncClient(base_url=f"http://{server.address}", timeout=120.0) as client:
        vllm_usages, vllm_growth = await _run(client, sequence)
    logger.info("vLLM usages: %s", json.dumps(vllm_usages))
    engine = EngineConfig(max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
                          block_size=settings.block_size, num_gpu_blocks=state.engine.num_gpu_blocks)
    emulator = await start_emulator(EmulatorConfig(
        port=0, engine=engine, served_model_name=SERVED_MODEL_NAME, max_model_len=settings.max_model_len,
        enable_prompt_tokens_details=True))
    try:
        async with httpx.AsyncClient(base_url=emulator.base_url, timeout=60.0) as client:
            emulator_usages, emulator_growth = await _run(client, sequence)
    finally:
        await emulator.stop()
    return {"sequence": sequence, "vllm": vllm_usages, "emulator": emulator_usages, "vllm_growth": vllm_growth,
            "emulator_growth": emulator_growth}


@pytest.fixture(scope="module")
def runs(vllm_stack) -> dict[str, Any]:
    """The sequence on vLLM server 0, then on a fresh emulator with its engine settings."""
    return asyncio.run(_both(vllm_stack.vllm[0]))


def _cached(usages: list[dict]) -> list[int]:
    return [u["prompt_tokens_details"]["cached_tokens"] for u in usages]


def test_the_emulators_cached_tokens_equal_vllms_while_nothing_is_evicted(runs):
    sequence, ours, theirs = runs["sequence"][:NUM_FITTING], runs["emulator"], runs["vllm"]
    assert [u["prompt_tokens"] for u in ours] == [u["prompt_tokens"] for u in theirs]
    assert _cached(theirs)[:NUM_FITTING] == [s.expected_cached_tokens for s in sequence]
    for step, mine, vllms in zip(sequence, ours, theirs):  # chat: also created_cache_tokens; the same shape
        assert mine["prompt_tokens_details"] == vllms["prompt_tokens_details"], step.name


def test_vllm_reuses_unhashed_blocks_before_evicting_cached_ones(runs):
    """What the eviction steps' expected counts assume of vLLM 0.32 (prefix_sequence.steps)."""
    tail = runs["sequence"][NUM_FITTING:]
    assert _cached(runs["vllm"])[NUM_FITTING:] == [s.expected_cached_tokens for s in tail], [s.name for s in tail]


def test_the_emulator_evicts_what_vllm_evicts(runs):
    assert _cached(runs["emulator"]) == _cached(runs["vllm"])
    assert runs["emulator_growth"] == runs["vllm_growth"]
