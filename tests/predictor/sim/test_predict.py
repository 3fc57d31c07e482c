"""Tests for predictor.sim.predict, predictor.sim.fast_predict and predictor.sim.snapshot.

The guard of the fast path: `predict` (event-driven re-implementation of the scheduler in
`predictor.sim.fast_predict`) must equal `predict_by_stepping` (the real `Scheduler`, one step at a time) on
every generated state; snapshots are copies. Where `fast_predict` is compiled (mypyc), the pure-Python source
must give identical predictions (==) as well.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import random
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from predictor.sim.batch_time import LinearBatchTimeModel
from predictor.sim.engine import Engine
from predictor.sim.kv_blocks import blocks_for_tokens
from predictor.sim.predict import Prediction, predict, predict_by_stepping
from predictor.sim.request import RequestStatus, SimRequest
from predictor.sim.scheduler import EngineConfig, ScheduledBatch, Scheduler
from predictor.sim.snapshot import NUM_EXTRA_OUTPUT_TOKENS_WHEN_OVERDUE, InstanceSnapshot, RequestState

predict_module = importlib.import_module("predictor.sim.predict")  # the package re-exports the function as `predict`
LLAMA = LinearBatchTimeModel.default("llama-2-7b")
COMPILED = predict_module.FAST_PREDICT_IMPLEMENTATION == "mypyc"
MARGIN_TOKENS = NUM_EXTRA_OUTPUT_TOKENS_WHEN_OVERDUE  # room for the overdue rule's extra tokens


def _assert_same(fast: Prediction, slow: Prediction) -> None:
    assert math.isclose(fast.ttft_s, slow.ttft_s, rel_tol=1e-9), (fast, slow)
    assert math.isclose(fast.e2e_s, slow.e2e_s, rel_tol=1e-9), (fast, slow)
    assert fast.num_steps == slow.num_steps
    assert fast.num_preemptions == slow.num_preemptions
    assert fast.num_steps_simulated <= slow.num_steps_simulated == slow.num_steps


# ---- random states: a real engine driven to a random point -------------------------------------------------


@st.composite
def configs(draw: st.DrawFn) -> EngineConfig:
    max_num_seqs = draw(st.integers(1, 8))
    return EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max(max_num_seqs, 8), 96)),
        block_size=draw(st.sampled_from([1, 2, 4, 16])),
        # Resized below so the largest request fits; small values give tight caches and preemptions.
        num_gpu_blocks=draw(st.integers(1, 80)),
        enable_chunked_prefill=draw(st.booleans()),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 17, 40])),
    )


def _clamp(config: EngineConfig, num_prompt_tokens: int, num_output_tokens: int) -> tuple[int, int]:
    """Lengths valid for config even after the overdue rule adds tokens (chunked prefill off bounds them)."""
    if not config.enable_chunked_prefill:
        num_output_tokens = min(num_output_tokens, config.max_num_batched_tokens - MARGIN_TOKENS)
        num_output_tokens = max(1, num_output_tokens)
        num_max_prompt_tokens = config.max_num_batched_tokens + 1 - num_output_tokens - MARGIN_TOKENS
        num_prompt_tokens = min(num_prompt_tokens, num_max_prompt_tokens)
        num_prompt_tokens = max(1, num_prompt_tokens)
    return num_prompt_tokens, num_output_tokens


@st.composite
def states(draw: st.DrawFn, by_priority: bool = False) -> tuple[InstanceSnapshot, RequestState]:
    """A live state and a new request; ``by_priority``: under vLLM's "priority" policy, with priorities 0-2."""
    config = draw(configs())
    if by_priority:
        config = dataclasses.replace(config, scheduling_policy="priority")
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < 2 * MARGIN_TOKENS:
        config = dataclasses.replace(config, max_num_batched_tokens=2 * MARGIN_TOKENS)
    lengths = [
        _clamp(config, draw(st.integers(1, 90)), draw(st.integers(1, 60)))
        for _ in range(draw(st.integers(0, 14)))
    ]
    target_lengths = _clamp(config, draw(st.integers(1, 90)), draw(st.integers(1, 60)))
    num_max_tokens = max(p + o + MARGIN_TOKENS for p, o in [*lengths, target_lengths])
    num_min_blocks = blocks_for_tokens(num_max_tokens, config.block_size)
    config = dataclasses.replace(config, num_gpu_blocks=max(config.num_gpu_blocks, num_min_blocks))
    engine = Engine(config, LLAMA, now_s=draw(st.sampled_from([0.0, 12.5, 1000.0])))
    for i, (num_prompt_tokens, num_output_tokens) in enumerate(lengths):
        for _ in range(draw(st.integers(0, 4))):
            engine.step()
        priority = draw(st.integers(0, 2)) if by_priority else 0
        engine.add_request(SimRequest(f"r{i}", num_prompt_tokens, num_output_tokens, engine.now_s, priority=priority))
    for _ in range(draw(st.integers(0, 12))):
        engine.step()
    snapshot = InstanceSnapshot.from_scheduler(engine.scheduler, engine.now_s)
    # Some requests are overdue: their expected length is at or below what they have generated.
    overdue = draw(st.lists(st.booleans(), min_size=len(snapshot.running), max_size=len(snapshot.running)))
    running = tuple(
        dataclasses.replace(s, num_output_tokens=max(1, s.num_generated_tokens)) if late else s
        for s, late in zip(snapshot.running, overdue)
    )
    # Some running requests hold extra blocks (a live vLLM snapshot may), while free blocks allow.
    num_free_blocks = snapshot.num_free_blocks if draw(st.booleans()) else 0
    padded = []
    for state in running:
        num_extra_blocks = min(num_free_blocks, draw(st.sampled_from([0, 0, 1, 3, 20])))
        num_free_blocks -= num_extra_blocks
        if num_extra_blocks:
            num_held = blocks_for_tokens(state.num_computed_tokens, config.block_size) + num_extra_blocks
            state = dataclasses.replace(state, num_blocks_held=num_held)
        padded.append(state)
    # Any running order is a valid live snapshot; shuffled orders put prefills before decodes, so the budget can
    # run out before later decodes (never the case in states the scheduler reaches by itself).
    if draw(st.booleans()):
        padded = draw(st.permutations(padded))
    snapshot = dataclasses.replace(snapshot, running=tuple(padded))
    priority = draw(st.integers(0, 2)) if by_priority else 0
    target = RequestState("target", *target_lengths, arrival_time_s=snapshot.now_s, priority=priority)
    return snapshot, target


# Hand-made edge cases: tight cache with a preemption of a decoding request, and an overdue request.
_TIGHT = InstanceSnapshot(
    EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=2, num_gpu_blocks=14),
    now_s=0.0,
    waiting=(RequestState("w", 5, 3),),
    running=(RequestState("a", 6, 20, num_computed_tokens=8, num_generated_tokens=3),
             RequestState("b", 4, 9, num_computed_tokens=4, num_generated_tokens=1)),
)
_OVERDUE = InstanceSnapshot(
    EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, block_size=4, num_gpu_blocks=30,
                 enable_chunked_prefill=False),
    now_s=5.0,
    running=(RequestState("a", 6, 4, num_computed_tokens=10, num_generated_tokens=5),),
)


# Decodes behind two threshold-capped prefills get no budget in the first steps.
_STARVED = InstanceSnapshot(
    EngineConfig(max_num_seqs=6, max_num_batched_tokens=20, block_size=4, num_gpu_blocks=60,
                 long_prefill_token_threshold=10),
    now_s=0.0,
    running=(RequestState("d0", 8, 30, num_computed_tokens=9, num_generated_tokens=2),
             RequestState("p0", 60, 5, num_computed_tokens=20),
             RequestState("p1", 70, 5, num_computed_tokens=10),
             RequestState("d1", 5, 40, num_computed_tokens=7, num_generated_tokens=3),
             RequestState("d2", 5, 40, num_computed_tokens=8, num_generated_tokens=4)),
    waiting=(RequestState("w0", 20, 10),),
)
# The budget runs out among the decodes behind a long chunk: later prefills and decodes get nothing.
_STARVED_PREFILLS = InstanceSnapshot(
    EngineConfig(max_num_seqs=6, max_num_batched_tokens=12, block_size=4, num_gpu_blocks=80,
                 long_prefill_token_threshold=10),
    now_s=0.0,
    running=(RequestState("p0", 40, 5, num_computed_tokens=8),
             RequestState("d0", 6, 20, num_computed_tokens=7, num_generated_tokens=2),
             RequestState("d1", 6, 20, num_computed_tokens=8, num_generated_tokens=3),
             RequestState("p1", 30, 4, num_computed_tokens=4),
             RequestState("p2", 25, 4, num_computed_tokens=4),
             RequestState("d2", 3, 15, num_computed_tokens=4, num_generated_tokens=2)),
)
_STARVED_TAIL = InstanceSnapshot(
    EngineConfig(max_num_seqs=4, max_num_batched_tokens=12, block_size=4, num_gpu_blocks=80,
                 long_prefill_token_threshold=10),
    now_s=0.0,
    running=(RequestState("p0", 40, 5, num_computed_tokens=8),
             RequestState("d0", 6, 20, num_computed_tokens=7, num_generated_tokens=2),
             RequestState("d1", 6, 20, num_computed_tokens=8, num_generated_tokens=3),
             RequestState("d2", 3, 15, num_computed_tokens=4, num_generated_tokens=2)),
)
# A recomputation (computed >= prompt) cut to one token by the budget counts as a decode in the batch.
_RECOMPUTE_ONE = InstanceSnapshot(
    EngineConfig(max_num_seqs=3, max_num_batched_tokens=3, block_size=2, num_gpu_blocks=40),
    now_s=0.0,
    running=(RequestState("d0", 4, 9, num_computed_tokens=5, num_generated_tokens=2),
             RequestState("d1", 3, 9, num_computed_tokens=3, num_generated_tokens=1),
             RequestState("r", 5, 12, num_computed_tokens=8, num_generated_tokens=6, num_preemptions=1)),
)
# Chunked prefill off: the head's whole prompt does not fit beside the decodes, so it waits for completions.
_NO_ROOM_UNCHUNKED = InstanceSnapshot(
    EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_gpu_blocks=60,
                 enable_chunked_prefill=False),
    now_s=1.0,
    running=(RequestState("d0", 4, 6, num_computed_tokens=5, num_generated_tokens=2),
             RequestState("d1", 3, 9, num_computed_tokens=3, num_generated_tokens=1)),
    waiting=(RequestState("w", 31, 1),),
)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states())
@example((_TIGHT, RequestState("target", 3, 4)))
@example((_OVERDUE, RequestState("target", 7, 12)))
@example((_STARVED, RequestState("target", 9, 6)))
@example((_STARVED_PREFILLS, RequestState("target", 5, 6)))
@example((_STARVED_TAIL, RequestState("target", 5, 6)))
@example((_RECOMPUTE_ONE, RequestState("target", 2, 3)))
@example((_NO_ROOM_UNCHUNKED, RequestState("target", 2, 2)))
def test_predict_equals_stepping_and_leaves_state_unchanged(case: tuple[InstanceSnapshot, RequestState]) -> None:
    snapshot, target = case
    before = dataclasses.replace(snapshot)
    fast = predict(snapshot, target, LLAMA)
    slow = predict_by_stepping(snapshot, target, LLAMA)
    _assert_same(fast, slow)
    if COMPILED:
        assert predict(snapshot, target, LLAMA, compiled=False) == fast
    assert snapshot == before
    event(f"preemptions: {min(slow.num_preemptions, 3)}")
    event(f"skipped: {fast.num_steps_simulated < fast.num_steps}")
    event(f"extra blocks held: {any(s.num_blocks_held for s in snapshot.running)}")


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states(by_priority=True))
def test_priority_policy_predict_equals_stepping(case: tuple[InstanceSnapshot, RequestState]) -> None:
    """vLLM's "priority" policy: the event walk (or its fallback to stepping when a preemption's victim is not the
    last running request) equals stepping the Scheduler."""
    snapshot, target = case
    fast = predict(snapshot, target, LLAMA)
    _assert_same(fast, predict_by_stepping(snapshot, target, LLAMA))
    if COMPILED:
        assert predict(snapshot, target, LLAMA, compiled=False) == fast
    event(f"preemptions: {min(fast.num_preemptions, 3)}")
    event(f"mixed priorities: {len({s.priority for s in (*snapshot.running, *snapshot.waiting, target)}) > 1}")


# ---- skip-ahead specifics -----------------------------------------------------------------------------------


def test_long_decode_run_is_skipped_not_stepped() -> None:
    snapshot = InstanceSnapshot(
        EngineConfig(num_gpu_blocks=4096),
        now_s=0.0,
        running=tuple(
            RequestState(f"d{i}", 100, 500 + 10 * i, num_computed_tokens=100 + i, num_generated_tokens=i + 1)
            for i in range(20)
        ),
    )
    target = RequestState("t", 200, 300)
    fast = predict(snapshot, target, LLAMA)
    slow = predict_by_stepping(snapshot, target, LLAMA)
    _assert_same(fast, slow)
    assert fast.num_steps >= 300
    assert fast.num_steps_simulated < fast.num_steps // 5


def _busy_snapshot(num_requests: int, num_gpu_blocks: int, seed: int) -> InstanceSnapshot:
    """A full instance with the benchmark's limits: long queue, mixed progress, tight cache (preemptions)."""
    import random

    rng = random.Random(seed)
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=num_gpu_blocks)
    engine = Engine(config, LLAMA)
    for i in range(num_requests):
        engine.add_request(SimRequest(f"r{i}", rng.randint(1, 600), rng.randint(1, 300), 0.0))
    for _ in range(rng.randint(20, 200)):
        engine.step()
    return InstanceSnapshot.from_scheduler(engine.scheduler, engine.now_s)


@pytest.mark.parametrize(
    ("num_requests", "num_gpu_blocks", "seed"),
    [(40, 4096, 0), (40, 200, 1), (60, 120, 2), (30, 80, 3)],
    ids=["roomy-cache", "tight-cache", "very-tight-cache", "thrashing-cache"],
)
def test_busy_instance_equals_stepping(num_requests: int, num_gpu_blocks: int, seed: int) -> None:
    snapshot = _busy_snapshot(num_requests, num_gpu_blocks, seed)
    target = RequestState("t", 150, 120)
    fast = predict(snapshot, target, LLAMA)
    slow = predict_by_stepping(snapshot, target, LLAMA)
    _assert_same(fast, slow)
    assert fast.num_steps_simulated < slow.num_steps_simulated
    if num_gpu_blocks <= 120:
        assert slow.num_preemptions > 0


class _BatchOnlyLinearModel:
    """LLAMA seen only through `step_time_s` and `decode_run_time_s` (no count-based pricing), so `predict`
    takes the Scheduler-based skip-ahead path."""

    def step_time_s(self, batch: ScheduledBatch) -> float:
        return LLAMA.step_time_s(batch)

    def decode_run_time_s(self, batch: ScheduledBatch, num_steps: int) -> float:
        return LLAMA.decode_run_time_s(batch, num_steps)


@pytest.mark.parametrize("seed", [1, 2])
def test_scheduler_path_for_models_without_count_pricing_equals_stepping(seed: int) -> None:
    snapshot = _busy_snapshot(30, 150, seed)
    model = _BatchOnlyLinearModel()
    target = RequestState("t", 80, 60)
    slow = predict_by_stepping(snapshot, target, model)
    _assert_same(predict(snapshot, target, model), slow)
    _assert_same(predict(snapshot, target, LLAMA), slow)  # the event-driven path agrees as well


def test_step_time_from_counts_equals_step_time() -> None:
    batch = ScheduledBatch({"a": 1, "b": 40, "c": 1}, num_prefill_tokens=40, prefill_attention_work=40 * 90,
                           num_decode_seqs=2, decode_context_tokens=700)
    assert LLAMA.step_time_from_counts_s(42, 40 * 90, 700, 3) == LLAMA.step_time_s(batch)
    decodes = ScheduledBatch({"a": 1, "b": 1}, num_decode_seqs=2, decode_context_tokens=700)
    assert LLAMA.decode_run_time_from_counts_s(2, 700, 9) == LLAMA.decode_run_time_s(decodes, 9)


class _QuadraticDecodeModel:
    """A batch-time model with no closed form for decode runs (exercises the step-by-step pricing)."""

    def step_time_s(self, batch: ScheduledBatch) -> float:
        return 0.004 + 1e-5 * batch.total_num_scheduled_tokens + 1e-11 * batch.decode_context_tokens**2


def test_model_without_closed_form_still_matches() -> None:
    model = _QuadraticDecodeModel()
    fast = predict(_TIGHT, RequestState("t", 5, 10), model)
    slow = predict_by_stepping(_TIGHT, RequestState("t", 5, 10), model)
    _assert_same(fast, slow)


def test_decode_run_time_equals_sum_of_steps() -> None:
    batch = ScheduledBatch({"a": 1, "b": 1, "c": 1}, num_decode_seqs=3, decode_context_tokens=900)
    total_s = 0.0
    for j in range(57):
        step = dataclasses.replace(batch, decode_context_tokens=900 + 3 * j)
        total_s += LLAMA.step_time_s(step)
    assert math.isclose(LLAMA.decode_run_time_s(batch, 57), total_s, rel_tol=1e-12)
    with pytest.raises(ValueError):
        LLAMA.decode_run_time_s(batch, 0)


def test_idle_instance_ttft_is_one_prefill_step() -> None:
    snapshot = InstanceSnapshot(EngineConfig(), now_s=3.0)
    prediction = predict(snapshot, RequestState("t", 100, 1), LLAMA)
    batch = ScheduledBatch({"t": 100}, num_prefill_tokens=100, prefill_attention_work=100 * 100)
    assert math.isclose(prediction.ttft_s, LLAMA.step_time_s(batch), rel_tol=1e-12)
    assert prediction.e2e_s == prediction.ttft_s
    assert prediction.num_steps == 1


def test_new_request_with_progress_is_rejected() -> None:
    with pytest.raises(ValueError, match="no computed or generated"):
        predict(InstanceSnapshot(EngineConfig(), 0.0), RequestState("t", 10, 5, num_generated_tokens=1), LLAMA)


def test_duplicate_target_id_is_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        predict(_TIGHT, RequestState("a", 3, 3), LLAMA)


# ---- snapshots ------------------------------------------------------------------------------------------------


def test_from_scheduler_round_trip_and_source_untouched() -> None:
    engine = Engine(EngineConfig(max_num_seqs=3, max_num_batched_tokens=24, block_size=4, num_gpu_blocks=12), LLAMA)
    for i in range(6):
        engine.add_request(SimRequest(f"r{i}", 10 + 3 * i, 8, 0.0))
    for _ in range(9):
        engine.step()
    scheduler = engine.scheduler
    snapshot = InstanceSnapshot.from_scheduler(scheduler, engine.now_s)
    assert snapshot.num_preemptions_total > 0  # the cache is tight enough to preempt
    predict(snapshot, RequestState("t", 5, 5), LLAMA)
    predict_by_stepping(snapshot, RequestState("t", 5, 5), LLAMA)
    assert InstanceSnapshot.from_scheduler(scheduler, engine.now_s) == snapshot
    rebuilt = snapshot.to_scheduler()
    assert InstanceSnapshot.from_scheduler(rebuilt, engine.now_s) == snapshot
    assert rebuilt.num_free_blocks == scheduler.num_free_blocks == snapshot.num_free_blocks
    assert all(a is not b for a, b in zip(rebuilt.running, scheduler.running))
    preempted = [r for r in rebuilt.waiting if r.num_preemptions]
    assert all(r.status == RequestStatus.PREEMPTED for r in preempted)


def test_overdue_request_needs_ten_more_tokens() -> None:
    state = RequestState("a", 6, 4, num_computed_tokens=10, num_generated_tokens=5)
    assert state.num_remaining_output_tokens == NUM_EXTRA_OUTPUT_TOKENS_WHEN_OVERDUE
    assert state.to_sim_request(RequestStatus.RUNNING).num_output_tokens == 5 + NUM_EXTRA_OUTPUT_TOKENS_WHEN_OVERDUE
    assert dataclasses.replace(state, num_output_tokens=9).num_remaining_output_tokens == 4


@pytest.mark.parametrize(
    ("snapshot", "message"),
    [
        (InstanceSnapshot(EngineConfig(max_num_seqs=1), 0.0, running=(
            RequestState("a", 4, 4, num_computed_tokens=4, num_generated_tokens=1),
            RequestState("b", 4, 4, num_computed_tokens=4, num_generated_tokens=1))), "running list is full"),
        (InstanceSnapshot(EngineConfig(num_gpu_blocks=1), 0.0, running=(
            RequestState("a", 4, 4, num_computed_tokens=4, num_generated_tokens=1, num_blocks_held=2),)),
         "blocks wanted"),
        (InstanceSnapshot(EngineConfig(), 0.0, running=(
            RequestState("a", 4, 4, num_computed_tokens=4, num_generated_tokens=1, num_blocks_held=0),)),
         "fewer than"),
        (InstanceSnapshot(EngineConfig(), 0.0, waiting=(RequestState("a", 4, 4, num_computed_tokens=2),)),
         "no computed tokens"),
        (InstanceSnapshot(EngineConfig(), 0.0, waiting=(RequestState("a", 4, 4), RequestState("a", 5, 5))),
         "duplicate"),
    ],
    ids=["too-many-running", "blocks-exceed-cache", "holds-too-few-blocks", "waiting-with-kv", "duplicate-id"],
)
def test_invalid_snapshot_is_rejected(snapshot: InstanceSnapshot, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        snapshot.to_scheduler()
    with pytest.raises(ValueError, match=message):
        predict(snapshot, RequestState("t", 5, 5), LLAMA)


def test_advance_decodes_refuses_a_run_that_finishes_a_request() -> None:
    scheduler = InstanceSnapshot(EngineConfig(), 0.0, running=(
        RequestState("a", 4, 5, num_computed_tokens=5, num_generated_tokens=2),)).to_scheduler()
    batch = scheduler.schedule()
    with pytest.raises(ValueError, match="would finish"):
        scheduler.advance_decodes(batch, 3)
    scheduler.advance_decodes(batch, 2)
    request = scheduler.get_request("a")
    assert request is not None and request.num_generated_tokens == 4 and request.num_computed_tokens == 7
    assert scheduler.num_blocks_held("a") == blocks_for_tokens(7, scheduler.config.block_size)


def test_advance_decodes_refuses_a_mixed_batch() -> None:
    scheduler = Scheduler(EngineConfig())
    scheduler.add_request(SimRequest("a", 10, 3, 0.0))
    with pytest.raises(ValueError, match="one decode per running request"):
        scheduler.advance_decodes(scheduler.schedule(), 1)


# ---- instances of the benchmark's size, the compiled module, the pricing ----------------------------------------


def _bench_like_snapshot(num_requests: int, seed: int) -> InstanceSnapshot:
    """An instance as `astrolabe bench predictor` builds it: its limits, `num_requests` always on it (finished ones
    replaced at once), log-normal lengths, taken after a seeded number of steps."""
    rng = random.Random(seed)
    config = EngineConfig(max_num_seqs=48, max_num_batched_tokens=512, block_size=16, num_gpu_blocks=2048)
    engine = Engine(config, LLAMA)
    scheduler = engine.scheduler
    num_added = 0
    for _ in range(rng.randint(100, 400)):
        while len(scheduler.waiting) + len(scheduler.running) < num_requests:
            num_prompt_tokens = min(max(1, round(rng.lognormvariate(math.log(160), 1.0))), 2048)
            num_output_tokens = min(max(1, round(rng.lognormvariate(math.log(200), 1.0))), 2048)
            engine.add_request(SimRequest(f"r{num_added}", num_prompt_tokens, num_output_tokens, engine.now_s))
            num_added += 1
        engine.step()
    return InstanceSnapshot.from_scheduler(scheduler, engine.now_s)


@pytest.mark.parametrize(("num_requests", "seed"), [(16, 0), (64, 1), (256, 2)], ids=["16", "64", "256"])
def test_bench_sized_instances_equal_stepping(num_requests: int, seed: int) -> None:
    snapshot = _bench_like_snapshot(num_requests, seed)
    assert len(snapshot.running) + len(snapshot.waiting) == num_requests
    for i, (num_prompt_tokens, num_output_tokens) in enumerate([(1, 1), (150, 120), (900, 40)]):
        target = RequestState(f"t{i}", num_prompt_tokens, num_output_tokens, snapshot.now_s)
        slow = predict_by_stepping(snapshot, target, LLAMA)
        predictions = [predict(snapshot, target, LLAMA), predict(snapshot, target, LLAMA, compiled=False)]
        _assert_same(predictions[0], slow)
        assert predictions[1] == predictions[0]  # the .py and the compiled module (where built) alike
        if num_requests > LLAMA_BENCH_MAX_NUM_SEQS:
            assert slow.num_steps > 100 and predictions[0].num_steps_simulated < slow.num_steps


LLAMA_BENCH_MAX_NUM_SEQS = 48


@dataclasses.dataclass(frozen=True, slots=True)
class _DoubledPrefill(LinearBatchTimeModel):
    """A subclass that reprices steps: the fast path must call it, not evaluate the base formula itself."""

    def step_time_from_counts_s(
        self, num_tokens: int, prefill_attention_work: int, decode_context_tokens: int, num_seqs: int
    ) -> float:
        # (zero-argument super() fails in a slotted dataclass)
        return LinearBatchTimeModel.step_time_from_counts_s(
            self, num_tokens, 2 * prefill_attention_work, decode_context_tokens, num_seqs
        )


def test_a_subclass_of_the_linear_model_is_priced_by_its_own_methods() -> None:
    model = _DoubledPrefill(**{f.name: getattr(LLAMA, f.name) for f in dataclasses.fields(LLAMA)})
    snapshot = _busy_snapshot(30, 150, 4)
    target = RequestState("t", 300, 50)
    fast = predict(snapshot, target, model)
    _assert_same(fast, predict_by_stepping(snapshot, target, model))
    assert fast.ttft_s != predict(snapshot, target, LLAMA).ttft_s


def test_a_compiled_module_older_than_its_source_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    source = tmp_path / "fast_predict.py"
    source.write_text(Path(predict_module.__file__).with_name("fast_predict.py").read_text())
    extension = tmp_path / "fast_predict.cpython-311-x86_64-linux-gnu.so"
    extension.write_bytes(b"")  # never imported: only its name and age are read
    compiled = ModuleType("predictor.sim.fast_predict")
    compiled.__file__ = str(extension)
    monkeypatch.delitem(sys.modules, predict_module._PYTHON_FAST_PREDICT, raising=False)
    try:
        os.utime(extension, (time.time() - 60, time.time() - 60))
        module, implementation = predict_module._choose_fast_predict(compiled)
        assert implementation.startswith("python") and module.__file__ == str(source)
        assert "older than" in caplog.text
        assert module.simulate_until_finished(_TIGHT, RequestState("t", 3, 4), LLAMA).num_steps == (
            predict_by_stepping(_TIGHT, RequestState("t", 3, 4), LLAMA).num_steps
        )
        os.utime(extension, (time.time() + 60, time.time() + 60))
        assert predict_module._choose_fast_predict(compiled) == (compiled, "mypyc")
    finally:
        sys.modules.pop(predict_module._PYTHON_FAST_PREDICT, None)


def test_a_compiled_block_pool_older_than_its_source_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "prefix_cache.py").write_text("")
    extension = tmp_path / "prefix_cache.cpython-311-x86_64-linux-gnu.so"
    extension.write_bytes(b"")  # never imported: only its name and age are read
    compiled = ModuleType("predictor.sim.prefix_cache")
    compiled.__file__ = str(extension)
    monkeypatch.setattr(predict_module, "_prefix_cache", compiled)
    os.utime(extension, (time.time() + 60, time.time() + 60))
    predict_module._choose_fast_predict()
    assert "prefix_cache" not in caplog.text
    os.utime(extension, (time.time() - 60, time.time() - 60))
    predict_module._choose_fast_predict()
    assert "prefix_cache.cpython-311-x86_64-linux-gnu.so is older than its .py" in caplog.text


# ---- the price of one more request (marginal_cost_s) ---------------------------------------------------------


def test_one_more_request_ahead_costs_its_whole_run_when_it_takes_the_only_slot():
    from predictor.sim.predict import marginal_cost_s

    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=512, block_size=16, num_gpu_blocks=1024)
    model = LLAMA
    snapshot = InstanceSnapshot(config=config, now_s=0.0, running=(
        RequestState("a", 100, 60, num_computed_tokens=109, num_generated_tokens=10),))
    new = RequestState("new", 100, 100)
    base = predict(snapshot, new, model)
    ttft_growth_s, e2e_growth_s = marginal_cost_s(snapshot, new, model, base)
    # the twin runs its 100 tokens first: the new request starts about as much later as the twin's own E2E
    twin_alone = predict(InstanceSnapshot(config=config, now_s=0.0), new, model)
    assert ttft_growth_s == pytest.approx(twin_alone.e2e_s, rel=0.1)
    assert e2e_growth_s == pytest.approx(ttft_growth_s, rel=0.1)
    # with room for both, the twin only shares the prefill step: a small fraction of that
    roomy = dataclasses.replace(snapshot, config=dataclasses.replace(config, max_num_seqs=8))
    small_ttft_s, _ = marginal_cost_s(roomy, new, model, predict(roomy, new, model))
    assert 0 <= small_ttft_s < 0.2 * ttft_growth_s
    assert snapshot.waiting == ()  # the snapshot is left as it was


@pytest.mark.parametrize("compiled", [True, False])
def test_a_priority_victim_before_the_last_running_request_is_walked_not_stepped(compiled) -> None:
    """Sheddable work (vLLM priority 1) admitted before critical work (0) and a KV cache that runs out: the victims
    are the sheddable requests, ahead of the critical ones in the running list. The event walk follows them
    (`fast_predict.reserve_by_priority`) instead of falling back to stepping, and agrees with stepping."""
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, block_size=16, num_gpu_blocks=40,
                          scheduling_policy="priority")
    running = tuple(
        RequestState(f"{kind}{i}", 64, 200, num_computed_tokens=64 + 15, num_generated_tokens=16, priority=priority,
                     arrival_time_s=float(i if priority else 10 + i))
        for i, (kind, priority) in enumerate([("s", 1)] * 4 + [("c", 0)] * 4))
    snapshot = InstanceSnapshot(config, 20.0, running=running)
    target = RequestState("t", 64, 50, priority=0)
    module = importlib.import_module("predictor.sim.predict")
    fast_predict = module._FAST_PREDICT if compiled else module._load_python_fast_predict()
    walked = fast_predict.simulate_until_finished(snapshot, target, LLAMA)  # raises NotModelled if it fell back
    assert walked.num_preemptions > 0
    _assert_same(predict(snapshot, target, LLAMA, compiled=compiled), predict_by_stepping(snapshot, target, LLAMA))
