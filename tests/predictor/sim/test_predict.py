"""Tests for predictor.sim.predict and predictor.sim.snapshot: skip-ahead equals stepping, snapshots are copies."""

from __future__ import annotations

import dataclasses
import math

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

LLAMA = LinearBatchTimeModel.default("llama-2-7b")
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
def states(draw: st.DrawFn) -> tuple[InstanceSnapshot, RequestState]:
    config = draw(configs())
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
        engine.add_request(SimRequest(f"r{i}", num_prompt_tokens, num_output_tokens, engine.now_s))
    for _ in range(draw(st.integers(0, 12))):
        engine.step()
    snapshot = InstanceSnapshot.from_scheduler(engine.scheduler, engine.now_s)
    # Some requests are overdue: their expected length is at or below what they have generated.
    overdue = draw(st.lists(st.booleans(), min_size=len(snapshot.running), max_size=len(snapshot.running)))
    running = tuple(
        dataclasses.replace(s, num_output_tokens=max(1, s.num_generated_tokens)) if late else s
        for s, late in zip(snapshot.running, overdue)
    )
    snapshot = dataclasses.replace(snapshot, running=running)
    target = RequestState("target", *target_lengths, arrival_time_s=snapshot.now_s)
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


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states())
@example((_TIGHT, RequestState("target", 3, 4)))
@example((_OVERDUE, RequestState("target", 7, 12)))
def test_predict_equals_stepping_and_leaves_state_unchanged(case: tuple[InstanceSnapshot, RequestState]) -> None:
    snapshot, target = case
    before = dataclasses.replace(snapshot)
    fast = predict(snapshot, target, LLAMA)
    slow = predict_by_stepping(snapshot, target, LLAMA)
    _assert_same(fast, slow)
    assert snapshot == before
    event(f"preemptions: {min(slow.num_preemptions, 3)}")
    event(f"skipped: {fast.num_steps_simulated < fast.num_steps}")


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
