"""Tests of bench/workloads.py: filters, arrival processes and traces.

The ShareGPT reader's tests are in tests/tagger/test_sharegpt.py.
"""

from __future__ import annotations

import random
import statistics

import pytest

from bench.workloads import (
    SharedPrefixShape,
    WorkloadError,
    arrival_offsets_s,
    build_trace,
    filter_pairs,
    pseudo_token_ids,
    session_turns,
    shared_prefix_turns,
)
from predictor.sim.block_hash import block_keys
from tagger.sharegpt import SharegptConversation, SharegptPair


PAIRS = [
    SharegptPair("empty-prompt", "", 0, 10),
    SharegptPair("empty-reply", "q", 5, 0),
    SharegptPair("fits", "q", 100, 3996),
    SharegptPair("too-long", "q", 100, 3997),
    SharegptPair("small", "q", 1, 1),
]


@pytest.mark.parametrize(
    "kwargs,expected_ids",
    [
        ({}, ["fits", "small"]),
        ({"max_model_len": 2}, ["small"]),
        ({"min_prompt_tokens": 0, "min_output_tokens": 0}, ["empty-prompt", "empty-reply", "fits", "small"]),
        ({"min_prompt_tokens": 2}, ["fits"]),
    ],
    ids=["defaults", "short-context", "keep-empty", "min-prompt"],
)
def test_filter_pairs(kwargs: dict, expected_ids: list[str]) -> None:
    assert [p.id for p in filter_pairs(PAIRS, **kwargs)] == expected_ids


MANY_PAIRS = [SharegptPair(f"p{i}", f"prompt {i}", 10 + i, 1 + i * 7) for i in range(50)]


def test_trace_is_deterministic_per_seed() -> None:
    first = build_trace(MANY_PAIRS, 30, 2.0, random.Random(7))
    assert first == build_trace(MANY_PAIRS, 30, 2.0, random.Random(7))
    assert first != build_trace(MANY_PAIRS, 30, 2.0, random.Random(8))
    offsets = [r.arrival_offset_s for r in first]
    assert offsets == sorted(offsets) and offsets[0] > 0
    assert len({r.id for r in first}) == 30
    # num_requests <= len(pairs): sampled without replacement.
    assert len({r.prompt for r in first}) == 30


def test_trace_samples_with_replacement_when_short_of_pairs() -> None:
    trace = build_trace(MANY_PAIRS[:3], 10, 1.0, random.Random(0))
    assert len(trace) == 10 and {r.prompt for r in trace} <= {p.prompt for p in MANY_PAIRS[:3]}
    assert len({r.id for r in trace}) == 10


def test_trace_caps_output_tokens() -> None:
    trace = build_trace(MANY_PAIRS, 50, 1.0, random.Random(0), max_output_tokens=100)
    by_prompt = {p.prompt: p for p in MANY_PAIRS}
    for r in trace:
        assert r.num_output_tokens == min(100, by_prompt[r.prompt].num_output_tokens)
        assert r.num_prompt_tokens == by_prompt[r.prompt].num_prompt_tokens
    assert max(r.num_output_tokens for r in trace) == 100


@pytest.mark.parametrize("rate_qps", [0.5, 5.0, 80.0], ids=["0.5qps", "5qps", "80qps"])
def test_poisson_arrivals_have_the_requested_mean_rate(rate_qps: float) -> None:
    offsets = arrival_offsets_s(20000, rate_qps, random.Random(3))
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets)]
    # Mean gap of 20,000 exponential gaps: relative standard error 1/sqrt(20000) = 0.7%; allow 3%.
    assert statistics.fmean(gaps) == pytest.approx(1 / rate_qps, rel=0.03)
    # Exponential: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(1 / rate_qps, rel=0.05)


def test_uniform_arrivals() -> None:
    assert arrival_offsets_s(4, 2.0, random.Random(0), "uniform") == [0.0, 0.5, 1.0, 1.5]


@pytest.mark.parametrize(
    "args,kwargs",
    [
        ((MANY_PAIRS, 5, 0.0), {}),
        ((MANY_PAIRS, 5, 1.0), {"arrival": "bursty"}),
        ((MANY_PAIRS, -1, 1.0), {}),
        (([], 5, 1.0), {}),
        ((MANY_PAIRS, 5, 1.0), {"max_output_tokens": 0}),
    ],
    ids=["zero-rate", "unknown-arrival", "negative-count", "no-pairs", "zero-cap"],
)
def test_build_trace_rejects_bad_input(args: tuple, kwargs: dict) -> None:
    with pytest.raises(WorkloadError):
        build_trace(*args, rng=random.Random(0), **kwargs)


def test_pseudo_token_ids_are_deterministic_per_message() -> None:
    assert pseudo_token_ids("c/1", 40).tolist() == pseudo_token_ids("c/1", 40).tolist()
    assert pseudo_token_ids("c/1", 40).tolist() != pseudo_token_ids("c/2", 40).tolist()
    assert pseudo_token_ids("c/1", 10).tolist() == pseudo_token_ids("c/1", 40).tolist()[:10]
    assert len(pseudo_token_ids("c/1", 0)) == 0


def test_session_turn_prompts_extend_the_previous_prompt_and_reply() -> None:
    conversation = SharegptConversation("conv", (40, 100, 30, 0, 25, 60, 500, 10))
    turns = session_turns(conversation, block_size=16, max_model_len=400)
    # turn k = everything so far + the next human message; an empty reply counts 1 token; the 4th turn
    # (prompt 197 + 500 + reply 10) would outgrow the context: the session ends before it
    assert [(t.num_prompt_tokens, t.num_output_tokens) for t in turns] == [(40, 100), (170, 1), (196, 60)]
    for turn, following in zip(turns, turns[1:]):
        cached = (turn.num_prompt_tokens + turn.num_output_tokens) // 16
        assert following.block_keys[:cached] == turn.block_keys  # the next prompt hits the prompt and the reply
        assert len(following.block_keys) == (following.num_prompt_tokens + following.num_output_tokens) // 16
    assert session_turns(SharegptConversation("big", (300, 200)), 16, 400) == []
    other = session_turns(SharegptConversation("other", (40, 100)), 16, 400)[0]
    assert other.block_keys[0] != turns[0].block_keys[0]


def test_shared_prefix_requests_share_their_tenant_context_only() -> None:
    shape = SharedPrefixShape(num_tenants=3, context_tokens=64, question_tokens=(5, 20), answer_tokens=(1, 9))
    turns = shared_prefix_turns(shape, 60, random.Random(1), block_size=16)
    assert len(turns) == 60
    firsts = {t.block_keys[0] for t in turns}
    assert len(firsts) == 3  # one context per tenant
    for t in turns:
        assert 69 <= t.num_prompt_tokens <= 84 and 1 <= t.num_output_tokens <= 9
        assert len(t.block_keys) == (t.num_prompt_tokens + t.num_output_tokens) // 16
    by_tenant = {}
    for t in turns:
        by_tenant.setdefault(t.block_keys[0], []).append(t.block_keys)
    for keys in by_tenant.values():
        assert len({k[:4] for k in keys}) == 1  # the 64-token context: 4 shared blocks
        assert len({k[4] for k in keys if len(k) > 4}) == len([k for k in keys if len(k) > 4])  # questions differ
    contexts = {block_keys(pseudo_token_ids(f"tenant/{t}", 64).tolist(), 16) for t in range(3)}
    assert {t.block_keys[:4] for t in turns} == contexts


def test_shared_prefix_working_set_scales_the_tenants() -> None:
    assert SharedPrefixShape.for_working_set(1.0, 196_608, 2048).num_tenants == 96
    assert SharedPrefixShape.for_working_set(0.25, 196_608, 2048).num_tenants == 24
    assert SharedPrefixShape.for_working_set(0.001, 196_608, 2048).num_tenants == 1
    with pytest.raises(WorkloadError):
        SharedPrefixShape.for_working_set(0.0, 196_608)
    with pytest.raises(WorkloadError):
        SharedPrefixShape(2, question_tokens=(10, 5))
