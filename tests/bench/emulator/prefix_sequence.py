"""One sequence of requests with shared prefixes, and the cached-token counts a vLLM V1 engine reports for it.

Shared by the emulator's test (tests/bench/emulator/test_prefix_caching.py) and the real-vLLM fidelity test
(tests/vllm/test_prefix_cache_fidelity.py), which holds the emulator's counts equal to vLLM's. Sized for the
vLLM tier's servers (deploy/vllm/launch.py: ``--block-size 32``, 31 usable KV blocks, ``--max-model-len 256``):
the first ten requests hold 27 blocks, so nothing is evicted and their counts follow from the lookup rule alone;
with ``eviction`` six more fill the cache and repeat earlier prompts, whose counts depend on the free queue's order
(`steps`).

Prompts are words of the emulator's reply vocabulary, one token each under the shipped tokenizer (which the tiny
vLLM model uses too), so a prompt of N words is N tokens on both servers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import httpx

from bench.emulator.tokens import reply_vocabulary

BLOCK_SIZE = 32
"""Tokens per KV block of the servers the sequence runs on."""
MAX_TOKENS = 4
"""Output tokens of every request but the one whose reply the next request extends."""
REPLY_TOKENS = 40
"""Output tokens of that request."""
NUM_FITTING = 10
"""Steps of the sequence before its eviction tail."""


def words(rng: random.Random, n: int) -> str:
    """``n`` words, one token each."""
    return " ".join(rng.choices(reply_vocabulary()[1], k=n))


@dataclass(frozen=True, slots=True)
class Step:
    """One request of the sequence: a completion of ``prompt`` (text), or of the previous step's prompt ids and
    output ids (``extend_previous``), or a chat of ``messages``; with the cached-token count expected (the rule:
    the longest run of cached full blocks, at most prompt - 1 tokens; generated tokens' blocks cached too)."""

    name: str
    expected_cached_tokens: int
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    extend_previous: bool = False
    max_tokens: int = MAX_TOKENS


def steps(seed: int = 0, eviction: bool = False) -> list[Step]:
    """The sequence; ``eviction`` appends requests that fill the KV cache and repeat earlier prompts, whose hits
    depend on which blocks an allocation takes: vLLM 0.32 puts a freed block without a hash at the HEAD of the free
    queue (reused first) and a cached one at the tail (vllm/v1/core/block_pool.py ``BlockPool.free_blocks``:
    ``prepend_n`` / ``append_n``), so every unhashed block is taken before any cached one is evicted. The expected
    counts of those steps follow that rule (after the first ten steps 18 blocks are cached, 13 unhashed)."""
    rng = random.Random(seed)
    a, b, c, d = words(rng, 150), words(rng, 150), words(rng, 64), words(rng, 70)
    system = words(rng, 60)
    e, f = words(rng, 200), words(rng, 200)
    tail = [
        Step("E (200, new): 7 blocks, no eviction: 13 unhashed blocks are free", 0, prompt=e),
        Step("A again: 4 blocks", 128, prompt=a),
        Step("F (200, new): the last 7 unhashed blocks", 0, prompt=f),
        Step("B again: 4 blocks (nothing of it evicted)", 128, prompt=b),
        Step("C again: 1 block (its decode block evicts the least recently freed cached block)", 32, prompt=c),
        Step("E again: 6 blocks", 192, prompt=e),
    ] if eviction else []
    return [
        Step("A (150 tokens)", 0, prompt=a),
        Step("A again: 4 of its 4 full blocks", 128, prompt=a),
        Step("A + 40 tokens: A's 4 blocks", 128, prompt=a + " " + words(rng, 40)),
        Step("B (150, new)", 0, prompt=b),
        Step("C (64 = 2 blocks)", 0, prompt=c),
        Step("C again: capped at 63 tokens -> 1 block", 32, prompt=c),
        Step("D (70) with a 40-token reply", 0, prompt=d, max_tokens=REPLY_TOKENS),
        Step("D + its reply (110): 3 blocks, the third holding reply tokens", 96, extend_previous=True),
        Step("chat: system (60) + q1", 0, messages=(("system", system), ("user", words(rng, 5)))),
        Step("chat: same system + q2: 2 blocks", 64, messages=(("system", system), ("user", words(rng, 6)))),
        *tail,
    ]


async def run_sequence(client: httpx.AsyncClient, model: str, sequence: list[Step]) -> list[dict[str, Any]]:
    """Sends the steps one after the other (each after the previous one's reply); returns each response's
    ``usage``.

    Args:
        client: a client with the server's base URL.
        model: the served model name.
        sequence: the steps (an extending step reads the previous reply's ids: ``return_token_ids``).
    """
    usages: list[dict[str, Any]] = []
    previous_ids: list[int] = []
    for step in sequence:
        if step.messages is not None:
            body = {"model": model, "max_tokens": step.max_tokens, "ignore_eos": True,
                    "messages": [{"role": role, "content": content} for role, content in step.messages]}
            resp = await client.post("/v1/chat/completions", json=body)
        else:
            prompt: str | list[int] = previous_ids if step.extend_previous else step.prompt
            body = {"model": model, "prompt": prompt, "max_tokens": step.max_tokens, "ignore_eos": True,
                    "return_token_ids": True}
            resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 200, (step.name, resp.text)
        answer = resp.json()
        if step.messages is None:
            choice = answer["choices"][0]
            previous_ids = [*choice["prompt_token_ids"], *choice["token_ids"]]
        usages.append(answer["usage"])
    return usages
