"""Tests for the SGLang rules of predictor.sim.scheduler (EngineConfig.scheduling="sglang") and their prediction.

Scripted scenarios check each rule against the upstream behaviour it mirrors (prefill-only and decode-only steps,
reservation of running requests' output caps, batch_is_full, retraction to the back of the queue, the
new_token_ratio's decay, re-estimate and idle reset); Hypothesis checks the invariants over random workloads and
that `predict` (which skips pure-decode runs) equals `predict_by_stepping` on random SGLang states.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from predictor.engine_flags import add_engine_arguments, engine_from_args
from predictor.sim.batch_time import LinearBatchTimeModel
from predictor.sim.engine import Engine
from predictor.sim.kv_blocks import blocks_for_tokens
from predictor.sim.predict import predict, predict_by_stepping
from predictor.sim.request import RequestStatus, SimRequest
from predictor.sim.scheduler import (
    SGLANG_INIT_NEW_TOKEN_RATIO,
    SGLANG_MIN_NEW_TOKEN_RATIO,
    SGLANG_NEW_TOKEN_RATIO_DECAY,
    SGLANG_RETRACT_DECODE_STEPS,
    EngineConfig,
    ScheduledBatch,
    Scheduler,
    SGLangState,
)
from predictor.sim.snapshot import (
    NUM_EXTRA_OUTPUT_TOKENS_WHEN_OVERDUE,
    InstanceSnapshot,
    RequestState,
)
from tests.predictor.sim.test_predict import _assert_same

LLAMA = LinearBatchTimeModel.default("llama-2-7b")


def _sglang(**kwargs) -> EngineConfig:
    return EngineConfig(scheduling="sglang", **kwargs)


def _run(scheduler: Scheduler, now_s: float = 0.0) -> tuple[ScheduledBatch, list[str]]:
    """One step: (batch, ids of the requests that finished)."""
    batch = scheduler.schedule()
    output = scheduler.update_after_step(batch, now_s)
    return batch, [r.request_id for r in output.finished]


# ---- configuration --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"scheduling": "sglang-v2"}, "scheduling must be one of"),
    ({"scheduling": "sglang", "long_prefill_token_threshold": 8}, "long_prefill_token_threshold"),
    ({"scheduling": "sglang", "block_size": 16, "max_num_batched_tokens": 40}, "multiple of block_size"),
    ({"scheduling": "vllm-v1", "max_num_seqs": 64, "max_num_batched_tokens": 32}, "as vLLM requires"),
], ids=["unknown-style", "threshold-is-vllm-only", "chunk-not-page-aligned", "vllm-keeps-its-budget-rule"])
def test_engine_config_validates_the_style(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_sglang_limits_that_vllm_rejects_are_accepted() -> None:
    # SGLang's max_running_requests is far above chunked_prefill_size by default; with chunked prefill off the
    # page alignment is not required either.
    assert _sglang(max_num_seqs=4096, max_num_batched_tokens=2048, block_size=1).max_num_seqs == 4096
    assert _sglang(max_num_batched_tokens=40, enable_chunked_prefill=False).max_num_batched_tokens == 40
    assert EngineConfig().scheduling == "vllm-v1"


@pytest.mark.parametrize(("argv", "expected"), [
    ([], "vllm-v1"), (["--scheduling", "sglang", "--block-size", "1"], "sglang"),
], ids=["default", "sglang"])
def test_engine_flag_selects_the_rules(argv, expected) -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_from_args(parser.parse_args(argv)).scheduling == expected


def test_engine_flag_rejects_unknown_rules() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling", "tgi"])


def test_sglang_state_validation() -> None:
    with pytest.raises(ValueError, match="new_token_ratio"):
        SGLangState(new_token_ratio=0.0)
    with pytest.raises(ValueError, match="stale_reserved_tokens"):
        SGLangState(stale_reserved_tokens=(-1,))
    with pytest.raises(ValueError, match="scheduling='sglang'"):
        Scheduler(EngineConfig()).restore_sglang_state(SGLangState())
    assert Scheduler(EngineConfig()).sglang_state is None


def test_max_new_tokens_validation() -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        SimRequest("a", 4, 4, 0.0, max_new_tokens=0)


# ---- scripted rules ----------------------------------------------------------------------------------------


def test_prefill_steps_are_never_mixed_with_decodes() -> None:
    """A newcomer's prefill stalls the running decodes for a step (vLLM V1 would run both in one step)."""
    scheduler = Scheduler(_sglang(max_num_seqs=8, max_num_batched_tokens=64, block_size=1, num_gpu_blocks=10_000))
    scheduler.add_request(SimRequest("a", 10, 3, 0.0))
    scheduler.add_request(SimRequest("b", 10, 3, 0.0))
    assert _run(scheduler)[0].num_scheduled_tokens == {"a": 10, "b": 10}
    scheduler.add_request(SimRequest("c", 5, 2, 0.0))
    batch, _ = _run(scheduler)
    assert batch.num_scheduled_tokens == {"c": 5} and batch.num_decode_seqs == 0
    batch, finished = _run(scheduler)
    assert batch.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1} and batch.num_prefill_tokens == 0
    assert finished == ["c"]
    assert _run(scheduler) == (ScheduledBatch({"a": 1, "b": 1}, num_decode_seqs=2, decode_context_tokens=24),
                               ["a", "b"])
    vllm = Scheduler(EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=1, num_gpu_blocks=10_000))
    for request in (SimRequest("a", 10, 3, 0.0), SimRequest("b", 10, 3, 0.0)):
        vllm.add_request(request)
    _run(vllm)
    vllm.add_request(SimRequest("c", 5, 2, 0.0))
    assert _run(vllm)[0].num_scheduled_tokens == {"a": 1, "b": 1, "c": 5}


def test_chunked_prefill_continues_before_new_requests_and_stalls_decodes() -> None:
    scheduler = Scheduler(_sglang(max_num_seqs=8, max_num_batched_tokens=16, block_size=4, num_gpu_blocks=1000))
    scheduler.add_request(SimRequest("d", 4, 10, 0.0, max_new_tokens=10))  # small caps: no reservation limit
    _run(scheduler)
    scheduler.add_request(SimRequest("long", 40, 2, 0.0, max_new_tokens=2))
    scheduler.add_request(SimRequest("short", 3, 2, 0.0, max_new_tokens=2))
    steps = [_run(scheduler)[0].num_scheduled_tokens for _ in range(4)]
    # 16-token chunks (a multiple of the page); the short one follows the last chunk in the same prefill step.
    assert steps == [{"long": 16}, {"long": 16}, {"long": 8, "short": 3}, {"d": 1, "long": 1, "short": 1}]


def test_reservation_of_running_output_caps_keeps_a_request_waiting() -> None:
    """b would fit the free KV (vLLM V1 admits it at once) but not beside a's reserved output cap."""
    config = _sglang(max_num_seqs=8, max_num_batched_tokens=64, block_size=1, num_gpu_blocks=200)
    scheduler = Scheduler(config)
    scheduler.add_request(SimRequest("a", 20, 50, 0.0, max_new_tokens=150))
    scheduler.add_request(SimRequest("b", 20, 5, 0.0, max_new_tokens=150))
    batch, _ = _run(scheduler)
    # a: 20 + min(150, CLIP) + 1 page = 171 tokens reserved; b needs 171 more of the 29 left.
    assert batch.num_scheduled_tokens == {"a": 20}
    first_b_step = None
    for step in range(2, 60):
        batch, _ = _run(scheduler)
        if "b" in batch.num_scheduled_tokens:
            first_b_step = step
            break
        assert batch.num_scheduled_tokens == {"a": 1}
        assert scheduler.num_free_blocks >= 25  # room for b all along
    assert first_b_step == 51  # a's 50th token ends step 50
    vllm = Scheduler(dataclasses.replace(config, scheduling="vllm-v1"))
    vllm.add_request(SimRequest("a", 20, 50, 0.0, max_new_tokens=150))
    vllm.add_request(SimRequest("b", 20, 5, 0.0, max_new_tokens=150))
    assert _run(vllm)[0].num_scheduled_tokens == {"a": 20, "b": 20}


def test_batch_is_full_blocks_retries_until_a_request_leaves() -> None:
    """Once refused, b is not reconsidered while a decodes, even after the decaying reservation would admit it."""
    config = _sglang(max_num_seqs=8, max_num_batched_tokens=512, block_size=1, num_gpu_blocks=8000)
    scheduler = Scheduler(config)
    scheduler.add_request(SimRequest("a", 10, 400, 0.0))
    scheduler.add_request(SimRequest("b", 2000, 5, 0.0))
    _run(scheduler)  # a's prefill; b refused
    admissible_at = None
    for step in range(2, 401):
        batch, finished = _run(scheduler)
        assert batch.num_scheduled_tokens == {"a": 1}, step
        state = scheduler.sglang_state
        assert state is not None and state.batch_is_full
        if admissible_at is None:
            probe = InstanceSnapshot.from_scheduler(scheduler, 0.0)
            probe = dataclasses.replace(probe, sglang=dataclasses.replace(state, batch_is_full=False))
            if "b" in probe.to_scheduler().schedule().num_scheduled_tokens:
                admissible_at = step
    assert finished == ["a"]
    assert admissible_at is not None and 250 < admissible_at < 400
    batch, _ = _run(scheduler)  # a is filtered out; the idle iteration tries again at once
    assert batch.num_scheduled_tokens == {"b": 512}


def test_a_completion_is_seen_one_decode_step_later() -> None:
    """A request finishing in a decode step stays in SGLang's running batch (full mark, reservation) until the
    next decode step filters it; only then is the queue tried again."""
    config = _sglang(max_num_seqs=8, max_num_batched_tokens=64, block_size=1, num_gpu_blocks=300)
    scheduler = Scheduler(config)
    scheduler.add_request(SimRequest("a", 10, 30, 0.0, max_new_tokens=100))
    scheduler.add_request(SimRequest("short", 10, 3, 0.0, max_new_tokens=20))
    scheduler.add_request(SimRequest("w", 10, 5, 0.0, max_new_tokens=200))
    assert _run(scheduler)[0].num_scheduled_tokens == {"a": 10, "short": 10}
    steps = [_run(scheduler) for _ in range(4)]
    assert [b.num_scheduled_tokens for b, _ in steps] == [{"a": 1, "short": 1}] * 2 + [{"a": 1}, {"w": 10}]
    assert steps[1][1] == ["short"]
    state = scheduler.sglang_state
    assert state is not None and state.stale_reserved_tokens == () and not state.batch_is_full


def test_retraction_takes_the_fewest_outputs_to_the_back_of_the_queue_and_re_estimates_the_ratio() -> None:
    config = _sglang(max_num_seqs=8, max_num_batched_tokens=64, block_size=1, num_gpu_blocks=100)
    scheduler = Scheduler(config)
    scheduler.add_request(SimRequest("a", 10, 45, 0.0, max_new_tokens=45))
    scheduler.add_request(SimRequest("b", 10, 45, 0.0, max_new_tokens=45))
    scheduler.add_request(SimRequest("c", 10, 45, 0.0, max_new_tokens=45))
    assert _run(scheduler)[0].num_scheduled_tokens == {"a": 10}
    assert _run(scheduler)[0].num_scheduled_tokens == {"b": 10}
    while True:
        batch = scheduler.schedule()
        if batch.preempted_request_ids:
            break
        scheduler.update_after_step(batch, 0.0)
    a, b = scheduler.get_request("a"), scheduler.get_request("b")
    assert a is not None and b is not None
    assert batch.preempted_request_ids == ["b"] and batch.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert [r.request_id for r in scheduler.waiting] == ["c", "b"]  # the back: vLLM V1 puts it at the front
    expected_ratio = min(1.0, (a.num_generated_tokens + SGLANG_RETRACT_DECODE_STEPS) / (45 + 1))
    state = scheduler.sglang_state
    assert state is not None and state.new_token_ratio == expected_ratio > SGLANG_INIT_NEW_TOKEN_RATIO
    assert scheduler.num_preemptions_total == 1
    scheduler.update_after_step(batch, 0.0)
    engine = Engine(config, LLAMA)
    engine.scheduler = scheduler
    finished = [r for step in engine.run_until_idle() for r in step.output.finished]
    assert sorted(r.request_id for r in finished) == ["a", "b", "c"]
    assert all(r.num_generated_tokens == 45 for r in finished)


def test_retraction_with_large_caps_lowers_the_ratio() -> None:
    """With caps far above the outputs (max_tokens unset) the re-estimate falls below the decay floor."""
    config = _sglang(max_num_seqs=8, max_num_batched_tokens=64, block_size=1, num_gpu_blocks=40_000)
    scheduler = Scheduler(config)
    for name in "ab":  # each holds 20,000 tokens: the cache is full and both need one more
        scheduler.restore_running(SimRequest(name, 19_995, 10, 0.0, num_computed_tokens=20_000,
                                             num_generated_tokens=6, status=RequestStatus.RUNNING), 20_000)
    batch = scheduler.schedule()
    assert batch.preempted_request_ids == ["b"]  # equal outputs and prompts: the last in order goes
    assert batch.num_scheduled_tokens == {"a": 1}
    state = scheduler.sglang_state
    limit = 40_000 - 19_995 - 1 - 1  # the KV-pool bound on an unset cap
    assert state is not None and state.new_token_ratio == (6 + SGLANG_RETRACT_DECODE_STEPS) / (limit + 1)
    assert state.new_token_ratio < SGLANG_MIN_NEW_TOKEN_RATIO
    scheduler.update_after_step(batch, 0.0)
    scheduler.schedule()  # the next decode step's decay lifts it to the floor
    state = scheduler.sglang_state
    assert state is not None and state.new_token_ratio == SGLANG_MIN_NEW_TOKEN_RATIO


@pytest.mark.parametrize(("num_prompt_tokens", "max_new_tokens", "expected"), [
    (10, None, 10_000 - 10 - 1 - 1), (10, 50, 50), (9_999, None, 0), (17, None, 10_000 - 20 - 4 - 1),
], ids=["unset-bounded-by-kv", "set", "prompt-fills-kv", "page-rounded-prompt"])
def test_sglang_max_new_tokens(num_prompt_tokens, max_new_tokens, expected) -> None:
    block_size = 4 if num_prompt_tokens == 17 else 1
    scheduler = Scheduler(_sglang(block_size=block_size, max_num_batched_tokens=64,
                                  num_gpu_blocks=10_000 // block_size))
    request = SimRequest("r", num_prompt_tokens, 1, 0.0, max_new_tokens=max_new_tokens)
    assert scheduler.sglang_max_new_tokens(request) == expected


def test_ratio_decays_per_decode_step_only_floors_and_resets_when_idle() -> None:
    scheduler = Scheduler(_sglang(max_num_seqs=8, max_num_batched_tokens=64, block_size=1, num_gpu_blocks=10_000))
    scheduler.add_request(SimRequest("a", 10, 700, 0.0))

    def ratio() -> float:
        state = scheduler.sglang_state
        assert state is not None
        return state.new_token_ratio

    _run(scheduler)
    assert ratio() == SGLANG_INIT_NEW_TOKEN_RATIO  # a prefill step does not decay
    _run(scheduler)
    assert math.isclose(ratio(), SGLANG_INIT_NEW_TOKEN_RATIO - SGLANG_NEW_TOKEN_RATIO_DECAY)
    for _ in range(650):
        _run(scheduler)
    assert ratio() == SGLANG_MIN_NEW_TOKEN_RATIO
    while scheduler.has_unfinished_requests():
        _run(scheduler)
    assert ratio() == SGLANG_INIT_NEW_TOKEN_RATIO


def test_max_num_seqs_caps_admission_and_marks_the_batch_full() -> None:
    scheduler = Scheduler(_sglang(max_num_seqs=2, max_num_batched_tokens=64, block_size=1, num_gpu_blocks=10_000))
    for name in "abc":
        scheduler.add_request(SimRequest(name, 4, 2, 0.0, max_new_tokens=2))
    assert _run(scheduler)[0].num_scheduled_tokens == {"a": 4, "b": 4}
    batch, finished = _run(scheduler)  # the attempt before this decode step marks the batch full
    assert batch.num_scheduled_tokens == {"a": 1, "b": 1} and finished == ["a", "b"]
    state = scheduler.sglang_state
    assert state is not None and state.batch_is_full and state.stale_reserved_tokens == (0, 0)
    assert _run(scheduler)[0].num_scheduled_tokens == {"c": 4}


def test_unchunked_prefill_admits_the_first_request_whatever_its_length() -> None:
    config = _sglang(max_num_seqs=8, max_num_batched_tokens=16, block_size=1, num_gpu_blocks=1000,
                     enable_chunked_prefill=False)
    scheduler = Scheduler(config)
    scheduler.add_request(SimRequest("long", 40, 2, 0.0, max_new_tokens=2))
    scheduler.add_request(SimRequest("next", 10, 2, 0.0, max_new_tokens=2))
    scheduler.add_request(SimRequest("third", 4, 2, 0.0, max_new_tokens=2))
    assert _run(scheduler)[0].num_scheduled_tokens == {"long": 40}  # max_prefill_tokens binds after the first
    assert _run(scheduler)[0].num_scheduled_tokens == {"next": 10, "third": 4}


def test_snapshot_carries_the_sglang_state_and_caps() -> None:
    config = _sglang(max_num_seqs=8, max_num_batched_tokens=64, block_size=1, num_gpu_blocks=200)
    scheduler = Scheduler(config)
    scheduler.add_request(SimRequest("a", 20, 50, 0.0, max_new_tokens=150))
    scheduler.add_request(SimRequest("b", 20, 5, 0.0, max_new_tokens=150))
    for _ in range(3):
        _run(scheduler)
    snapshot = InstanceSnapshot.from_scheduler(scheduler, 1.0)
    assert snapshot.sglang == scheduler.sglang_state and snapshot.sglang is not None and snapshot.sglang.batch_is_full
    assert [s.max_new_tokens for s in (*snapshot.running, *snapshot.waiting)] == [150, 150]
    copy = snapshot.to_scheduler()
    assert copy.sglang_state == scheduler.sglang_state
    assert InstanceSnapshot.from_scheduler(copy, 1.0) == snapshot
    assert copy.schedule() == scheduler.schedule()


def test_v1_snapshot_state_is_ignored_and_default_style_is_unchanged() -> None:
    snapshot = InstanceSnapshot(EngineConfig(), 0.0, sglang=SGLangState(0.3, True))
    assert snapshot.to_scheduler().sglang_state is None
    assert InstanceSnapshot.from_scheduler(Scheduler(EngineConfig()), 0.0).sglang is None


# ---- properties over random workloads --------------------------------------------------------------------------


@st.composite
def sglang_configs(draw: st.DrawFn) -> EngineConfig:
    block_size = draw(st.sampled_from([1, 1, 2, 4, 16]))
    return _sglang(
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=block_size * draw(st.integers(1, 12)),
        block_size=block_size,
        num_gpu_blocks=draw(st.integers(1, 120)),  # resized so the largest request fits
        enable_chunked_prefill=draw(st.booleans()),
    )


def _fit(config: EngineConfig, lengths: list[tuple[int, int]]) -> EngineConfig:
    num_max_tokens = max(p + o + NUM_EXTRA_OUTPUT_TOKENS_WHEN_OVERDUE for p, o in lengths)
    num_min_blocks = blocks_for_tokens(num_max_tokens, config.block_size)
    return dataclasses.replace(config, num_gpu_blocks=max(config.num_gpu_blocks, num_min_blocks))


_CAPS = st.one_of(st.none(), st.integers(1, 150), st.integers(1, 12))
"""Output caps: unset, generous, or below the output (SGLang then under-reserves and must retract)."""


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=sglang_configs(), data=st.data())
def test_invariants_over_random_workloads(config: EngineConfig, data: st.DataObject) -> None:
    lengths = data.draw(st.lists(st.tuples(st.integers(1, 90), st.integers(1, 60)), min_size=1, max_size=14))
    config = _fit(config, lengths)
    caps = [data.draw(_CAPS) for _ in lengths]
    engine = Engine(config, LLAMA)
    requests = {}
    for i, ((num_prompt_tokens, num_output_tokens), cap) in enumerate(zip(lengths, caps)):
        arrival_s = data.draw(st.sampled_from([0.0, 0.0, 0.05, 0.3]))
        request = SimRequest(f"r{i}", num_prompt_tokens, num_output_tokens, arrival_s, max_new_tokens=cap)
        requests[request.request_id] = request
        engine.add_request(request)
    scheduler = engine.scheduler
    last_now_s = 0.0
    num_retracted = 0
    aborted = set()
    while (result := engine.step()) is not None:
        if scheduler.running and data.draw(st.integers(0, 30)) == 0:
            victim = data.draw(st.sampled_from(scheduler.running)).request_id
            assert scheduler.abort_request(victim) is not None
            aborted.add(victim)
        batch = result.batch
        assert (batch.num_prefill_tokens == 0) != (batch.num_decode_seqs == 0)  # never mixed, never empty
        if batch.num_decode_seqs:
            assert batch.num_decode_seqs == len(batch.num_scheduled_tokens) <= config.max_num_seqs
        elif config.enable_chunked_prefill:
            assert batch.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(scheduler.running) <= config.max_num_seqs
        assert scheduler.num_free_blocks + scheduler.num_used_blocks == config.num_gpu_blocks
        for request in scheduler.running:
            assert scheduler.num_blocks_held(request.request_id) == blocks_for_tokens(
                request.num_computed_tokens, config.block_size)
        state = scheduler.sglang_state
        assert state is not None and 0 < state.new_token_ratio <= 1
        assert all(r.status == RequestStatus.PREEMPTED for r in scheduler.waiting if r.num_preemptions)
        assert engine.now_s >= last_now_s
        last_now_s = engine.now_s
        num_retracted += len(batch.preempted_request_ids)
    assert all(r.status == RequestStatus.ABORTED if r.request_id in aborted else
               r.status == RequestStatus.FINISHED and r.num_generated_tokens == r.num_output_tokens
               for r in requests.values())
    assert scheduler.num_used_blocks == 0 and scheduler.sglang_state == SGLangState()
    event(f"retractions: {min(num_retracted, 3)}")


# ---- predict equals stepping ----------------------------------------------------------------------------------


@st.composite
def sglang_states(draw: st.DrawFn) -> tuple[InstanceSnapshot, RequestState]:
    config = draw(sglang_configs())
    lengths = [(draw(st.integers(1, 90)), draw(st.integers(1, 60))) for _ in range(draw(st.integers(0, 14)))]
    target_lengths = (draw(st.integers(1, 90)), draw(st.integers(1, 60)))
    config = _fit(config, [*lengths, target_lengths])
    engine = Engine(config, LLAMA, now_s=draw(st.sampled_from([0.0, 12.5])))
    for i, (num_prompt_tokens, num_output_tokens) in enumerate(lengths):
        for _ in range(draw(st.integers(0, 4))):
            engine.step()
        engine.add_request(SimRequest(f"r{i}", num_prompt_tokens, num_output_tokens, engine.now_s,
                                      max_new_tokens=draw(_CAPS)))
    for _ in range(draw(st.integers(0, 40))):
        engine.step()
    snapshot = InstanceSnapshot.from_scheduler(engine.scheduler, engine.now_s)
    # Perturb the admission state (a live SGLang's ratio is only estimated) and some expected lengths (overdue).
    state = snapshot.sglang
    assert state is not None
    if draw(st.booleans()):
        state = dataclasses.replace(state, new_token_ratio=draw(st.sampled_from([0.05, 0.098, 0.3, 1.0])))
    if draw(st.booleans()):
        state = dataclasses.replace(state, batch_is_full=not state.batch_is_full)
    overdue = draw(st.lists(st.booleans(), min_size=len(snapshot.running), max_size=len(snapshot.running)))
    running = tuple(dataclasses.replace(s, num_output_tokens=max(1, s.num_generated_tokens)) if late else s
                    for s, late in zip(snapshot.running, overdue))
    snapshot = dataclasses.replace(snapshot, running=running, sglang=state)
    target = RequestState("target", *target_lengths, arrival_time_s=snapshot.now_s, max_new_tokens=draw(_CAPS))
    return snapshot, target


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sglang_states())
def test_sglang_predict_equals_stepping(case: tuple[InstanceSnapshot, RequestState]) -> None:
    snapshot, target = case
    before = dataclasses.replace(snapshot)
    fast = predict(snapshot, target, LLAMA)
    slow = predict_by_stepping(snapshot, target, LLAMA)
    _assert_same(fast, slow)
    assert snapshot == before
    event(f"retractions: {min(slow.num_preemptions, 3)}")
    event(f"skipped: {fast.num_steps_simulated < fast.num_steps}")


def _busy_sglang_snapshot(num_requests: int, num_gpu_blocks: int, seed: int,
                          caps: tuple[int | None, ...] = (None, 300, 600)) -> InstanceSnapshot:
    import random

    rng = random.Random(seed)
    config = _sglang(max_num_seqs=64, max_num_batched_tokens=512, block_size=1, num_gpu_blocks=num_gpu_blocks)
    engine = Engine(config, LLAMA)
    for i in range(num_requests):
        engine.add_request(SimRequest(f"r{i}", rng.randint(1, 600), rng.randint(1, 300), 0.0,
                                      max_new_tokens=rng.choice(caps)))
    for _ in range(rng.randint(20, 200)):
        engine.step()
    return InstanceSnapshot.from_scheduler(engine.scheduler, engine.now_s)


@pytest.mark.parametrize(("num_requests", "num_gpu_blocks", "seed", "caps"), [
    (40, 60_000, 0, (None, 300, 600)), (40, 6_000, 1, (None, 300, 600)), (60, 3_000, 1, (None, 20, 50)),
], ids=["roomy-cache", "tight-cache", "caps-below-outputs-retract"])
def test_busy_sglang_instance_skips_decode_runs_and_equals_stepping(num_requests, num_gpu_blocks, seed,
                                                                    caps) -> None:
    snapshot = _busy_sglang_snapshot(num_requests, num_gpu_blocks, seed, caps)
    target = RequestState("t", 150, 120, max_new_tokens=200)
    fast = predict(snapshot, target, LLAMA)
    slow = predict_by_stepping(snapshot, target, LLAMA)
    _assert_same(fast, slow)
    assert fast.num_steps_simulated < slow.num_steps_simulated // 5
    if caps[1] == 20:  # caps under the outputs under-reserve: decode runs out of KV
        assert slow.num_preemptions > 0


def test_sglang_and_vllm_predictions_differ_where_the_rules_do() -> None:
    """Same state, same lengths: SGLang keeps the newcomer waiting behind reservations that vLLM V1 ignores."""
    config = _sglang(max_num_seqs=64, max_num_batched_tokens=512, block_size=1, num_gpu_blocks=4000)
    running = tuple(RequestState(f"r{i}", 100, 400, num_computed_tokens=100 + 9, num_generated_tokens=10)
                    for i in range(6))
    snapshot = InstanceSnapshot(config, 0.0, running=running)
    target = RequestState("t", 200, 50)
    sglang = predict(snapshot, target, LLAMA)
    vllm = predict(dataclasses.replace(snapshot, config=dataclasses.replace(config, scheduling="vllm-v1")),
                   target, LLAMA)
    assert sglang.ttft_s > 10 * vllm.ttft_s
    assert math.isclose(sglang.ttft_s, predict_by_stepping(snapshot, target, LLAMA).ttft_s, rel_tol=1e-9)
