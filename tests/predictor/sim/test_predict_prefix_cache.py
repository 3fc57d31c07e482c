"""Tests for predictions of states with prefix caching (requests with block keys): fast_predict models prompt keys
and equals stepping; keys past the prompt are refused there and `predict` steps the `Scheduler` instead, equal to
stepping too; snapshots keep keys and rebuild shared blocks."""

from __future__ import annotations

import importlib
import math
from dataclasses import replace

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from predictor.sim.batch_time import LinearBatchTimeModel
from predictor.sim.block_hash import block_keys
from predictor.sim.predict import predict, predict_by_stepping
from predictor.sim.request import RequestStatus, SimRequest
from predictor.sim.scheduler import EngineConfig, Scheduler
from predictor.sim.snapshot import InstanceSnapshot, RequestState

predict_module = importlib.import_module("predictor.sim.predict")
LLAMA = LinearBatchTimeModel.default("llama-2-7b")
BS = 16
SYSTEM_PROMPT = list(range(1000, 1000 + 20 * BS))  # 320 shared tokens


def _keyed_state(request_id: str, tokens: list[int], num_output_tokens: int) -> RequestState:
    return RequestState(request_id, len(tokens), num_output_tokens, block_keys=block_keys(tokens, BS))


def _live_scheduler(num_steps: int) -> Scheduler:
    """Two running requests that share the system prompt (the second hit the first's blocks)."""
    scheduler = Scheduler(EngineConfig(block_size=BS, num_gpu_blocks=512, max_num_batched_tokens=512))
    for index, question in enumerate(([1, 2, 3] * 10, [4, 5] * 20)):
        tokens = SYSTEM_PROMPT + question
        scheduler.add_request(SimRequest(f"r{index}", len(tokens), 200, arrival_time_s=0.0,
                                         block_keys=block_keys(tokens, BS)))
        batch = scheduler.schedule()
        scheduler.update_after_step(batch, float(index))
    for step in range(num_steps):
        scheduler.update_after_step(scheduler.schedule(), 2.0 + step)
    return scheduler


def _fast_modules() -> list:
    """The pure-Python fast_predict, and the compiled one where it is built and current."""
    python = predict_module._load_python_fast_predict()
    return [python] if predict_module._FAST_PREDICT is python else [python, predict_module._FAST_PREDICT]


def test_fast_predict_models_prompt_keys_equal_to_stepping():
    snapshot = InstanceSnapshot.from_scheduler(_live_scheduler(5), now_s=10.0)
    target = _keyed_state("new", SYSTEM_PROMPT + [9] * 7, 50)
    slow = predict_by_stepping(snapshot, target, LLAMA)
    for module in _fast_modules():
        fast = module.simulate_until_finished(snapshot, target, LLAMA)
        assert math.isclose(fast.ttft_s, slow.ttft_s, rel_tol=1e-9)
        assert math.isclose(fast.e2e_s, slow.e2e_s, rel_tol=1e-9)
        assert fast.num_steps == slow.num_steps and fast.num_steps_simulated < fast.num_steps


def test_keys_past_the_prompt_are_refused_by_fast_predict_and_predicted_by_stepping():
    live = _live_scheduler(5)
    snapshot = InstanceSnapshot.from_scheduler(live, now_s=10.0)
    tokens = SYSTEM_PROMPT + [9] * 7  # 327 tokens: 20 full blocks; 2 more keys name output blocks
    target = RequestState("new", len(tokens), 50, block_keys=block_keys(tokens + [1] * 40, BS))
    for module in _fast_modules():
        with pytest.raises(module.PrefixCacheNotModelled):
            module.simulate_until_finished(snapshot, target, LLAMA)
    fast, slow = predict(snapshot, target, LLAMA), predict_by_stepping(snapshot, target, LLAMA)
    assert math.isclose(fast.ttft_s, slow.ttft_s, rel_tol=1e-9) and math.isclose(fast.e2e_s, slow.e2e_s, rel_tol=1e-9)
    assert fast.num_steps == slow.num_steps
    assert fast.num_steps_simulated < fast.num_steps  # the Scheduler path still skips decode runs


def test_a_prompt_that_shares_the_running_prefix_is_predicted_faster():
    snapshot = InstanceSnapshot.from_scheduler(_live_scheduler(3), now_s=10.0)
    tokens = SYSTEM_PROMPT + [9] * 7
    hit = predict(snapshot, _keyed_state("new", tokens, 20), LLAMA)
    cold = predict(snapshot, RequestState("new", len(tokens), 20), LLAMA)
    other = predict(snapshot, _keyed_state("new", [7] + tokens[1:], 20), LLAMA)  # first block differs: no hit
    assert hit.ttft_s < cold.ttft_s
    assert math.isclose(other.ttft_s, cold.ttft_s, rel_tol=1e-12)


def test_a_snapshot_keeps_keys_and_rebuilds_the_shared_blocks():
    live = _live_scheduler(4)
    assert live.num_used_blocks < live.num_blocks_held("r0") + live.num_blocks_held("r1")  # 20 blocks shared
    rebuilt = InstanceSnapshot.from_scheduler(live, now_s=0.0).to_scheduler()
    assert rebuilt.num_used_blocks == live.num_used_blocks
    assert rebuilt.cached_block_ids("r0")[:20] == rebuilt.cached_block_ids("r1")[:20]
    assert rebuilt.get_request("r1").block_keys == live.get_request("r1").block_keys


def _scheduler_with_cached_free_blocks() -> Scheduler:
    """A request that shared the system prompt has finished (its blocks stay cached, free); r1 still runs."""
    scheduler = Scheduler(EngineConfig(block_size=BS, num_gpu_blocks=256, max_num_batched_tokens=512))
    for request_id, question, num_output in (("done", [1, 2, 3] * 10, 3), ("r1", [4, 5] * 20, 300)):
        tokens = SYSTEM_PROMPT + question
        scheduler.add_request(SimRequest(request_id, len(tokens), num_output, 0.0, block_keys=block_keys(tokens, BS)))
    for step in range(6):
        scheduler.update_after_step(scheduler.schedule(), float(step))
    assert [r.request_id for r in scheduler.running] == ["r1"]
    return scheduler


def test_a_snapshot_carries_the_cached_free_blocks_in_eviction_order():
    live = _scheduler_with_cached_free_blocks()
    pool = live.prefix_cache
    snapshot = InstanceSnapshot.from_scheduler(live, now_s=6.0)
    # done's own blocks (after the 20 shared with r1, which r1 still holds) are free and cached, tail first.
    done_keys = block_keys(SYSTEM_PROMPT + [1, 2, 3] * 10, BS)[20:]
    assert snapshot.cached_block_keys == tuple(reversed(done_keys))
    assert snapshot.cached_block_keys == tuple(pool.key_of(b) for b in pool.free_queue() if b is not None)
    rebuilt = snapshot.to_scheduler()
    queue = rebuilt.prefix_cache.free_queue()
    num_anonymous = rebuilt.num_free_blocks - len(done_keys)
    assert queue[:num_anonymous] == [None] * num_anonymous  # anonymous blocks are evicted first
    assert tuple(rebuilt.prefix_cache.key_of(b) for b in queue[num_anonymous:]) == snapshot.cached_block_keys
    assert rebuilt.num_free_blocks == live.num_free_blocks and rebuilt.num_used_blocks == live.num_used_blocks
    assert InstanceSnapshot.from_scheduler(rebuilt, now_s=6.0) == snapshot
    with pytest.raises(ValueError, match="cached free blocks"):
        replace(snapshot, cached_block_keys=(7,) * (live.num_free_blocks + 1)).to_scheduler()
    with pytest.raises(ValueError, match="cached free blocks"):
        predict(replace(snapshot, cached_block_keys=(7,) * (live.num_free_blocks + 1)), RequestState("x", 5, 5), LLAMA)


def test_a_request_that_hits_cached_free_blocks_gets_the_shorter_prefill():
    snapshot = InstanceSnapshot.from_scheduler(_scheduler_with_cached_free_blocks(), now_s=6.0)
    again = _keyed_state("again", SYSTEM_PROMPT + [1, 2, 3] * 10, 20)  # done's prompt: 21 blocks hit, not 20
    cold = replace(snapshot, cached_block_keys=())
    for module in _fast_modules():
        warm_fast = module.simulate_until_finished(snapshot, again, LLAMA)
        cold_fast = module.simulate_until_finished(cold, again, LLAMA)
        assert warm_fast.ttft_s < cold_fast.ttft_s
    for state in (snapshot, cold):  # as the new request and as a waiting one ahead of it
        slow = predict_by_stepping(state, again, LLAMA)
        fast = predict(state, again, LLAMA)
        assert (fast.ttft_s, fast.num_steps) == pytest.approx((slow.ttft_s, slow.num_steps), rel=1e-9)
        behind = RequestState("behind", 16, 5)
        queued = replace(state, waiting=(again,))
        slow = predict_by_stepping(queued, behind, LLAMA)
        assert predict(queued, behind, LLAMA).e2e_s == pytest.approx(slow.e2e_s, rel=1e-9)
    scheduler = snapshot.to_scheduler()
    scheduler.add_request(again.to_sim_request(RequestStatus.WAITING))
    scheduler.schedule()
    assert scheduler.get_request("again").num_cached_tokens == 21 * BS


def test_a_keyless_prediction_makes_no_pool_for_cached_free_blocks_and_a_keyed_one_names_only_those_it_has():
    snapshot = InstanceSnapshot.from_scheduler(_scheduler_with_cached_free_blocks(), now_s=6.0)
    keyless = replace(snapshot, running=tuple(replace(r, block_keys=None) for r in snapshot.running))
    assert keyless.cached_block_keys
    for module in _fast_modules():
        sim = module._FastScheduler(keyless.config, LLAMA)
        sim.load(keyless, RequestState("new", 40, 5))
        assert sim.pool is None
        for prompt, num_named in ((SYSTEM_PROMPT + [1, 2, 3] * 10, 1), (SYSTEM_PROMPT, 0)):
            sim = module._FastScheduler(keyless.config, LLAMA)
            sim.load(keyless, _keyed_state("new", prompt, 5))
            # A keyed request makes the pool; only the cached keys some request has get an identity.
            assert sim.pool is not None and sim.pool.num_cached_free_blocks == num_named
            assert sim.pool.num_free_blocks == keyless.num_free_blocks


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 40), st.integers(1, 30), st.integers(1, 300), st.integers(24, 120), st.booleans())
def test_predict_with_keys_equals_stepping(num_steps, prefix_blocks, num_output, num_gpu_blocks, target_keyed):
    config = EngineConfig(max_num_seqs=6, max_num_batched_tokens=128, block_size=BS, num_gpu_blocks=num_gpu_blocks)
    scheduler = Scheduler(config)
    shared = SYSTEM_PROMPT[:prefix_blocks * BS]
    for index in range(5):
        tokens = shared + [index] * (5 + 7 * index)
        if -(-(len(tokens) + num_output + index) // BS) > num_gpu_blocks:
            continue
        keys = block_keys(tokens, BS) if index % 2 == 0 else None
        scheduler.add_request(SimRequest(f"r{index}", len(tokens), num_output + index, arrival_time_s=0.0,
                                         block_keys=keys))
    for step in range(num_steps):
        scheduler.update_after_step(scheduler.schedule(), float(step))
    snapshot = InstanceSnapshot.from_scheduler(scheduler, now_s=float(num_steps))
    tokens = shared + [3] * 9
    if -(-(len(tokens) + 40) // BS) > num_gpu_blocks:
        return
    target = _keyed_state("new", tokens, 40) if target_keyed else RequestState("new", len(tokens), 40)
    fast, slow = predict(snapshot, target, LLAMA), predict_by_stepping(snapshot, target, LLAMA)
    assert math.isclose(fast.ttft_s, slow.ttft_s, rel_tol=1e-9) and math.isclose(fast.e2e_s, slow.e2e_s, rel_tol=1e-9)
    assert (fast.num_steps, fast.num_preemptions) == (slow.num_steps, slow.num_preemptions)
    event(f"preemptions: {min(slow.num_preemptions, 2)}")


@st.composite
def keyed_states(draw, warm: bool = False):
    """A live scheduler's state after some steps of mixed keyed / keyless requests over a few shared prefixes,
    small token budgets and caches (capped chunks, evictions, preemptions, duplicate keys), and a new request.
    warm: keyed requests ran to completion first, so the state has cached free blocks its requests can hit."""
    block_size = draw(st.sampled_from([2, 4]))
    config = EngineConfig(max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.integers(6, 40)),
                          block_size=block_size, num_gpu_blocks=draw(st.integers(12, 60)),
                          long_prefill_token_threshold=draw(st.sampled_from([0, 0, 7])))
    prefixes = [list(range(100, 130)), list(range(200, 216)), [5] * 24]

    def tokens() -> list[int]:
        return draw(st.sampled_from(prefixes))[:draw(st.integers(0, 30))] + draw(
            st.lists(st.integers(0, 3), min_size=1, max_size=8))

    scheduler = Scheduler(config)
    if warm:
        for index in range(draw(st.integers(1, 4))):
            prompt = tokens()
            if -(-(len(prompt) + 12) // block_size) <= config.num_gpu_blocks:
                scheduler.add_request(SimRequest(f"w{index}", len(prompt), draw(st.integers(1, 2)), 0.0,
                                                 block_keys=block_keys(prompt, block_size)))
        while scheduler.has_unfinished_requests():
            scheduler.update_after_step(scheduler.schedule(), 0.0)
    arrivals = []
    for index in range(draw(st.integers(0, 10))):
        prompt, num_output = tokens(), draw(st.integers(1, 30))
        if -(-(len(prompt) + num_output + 10) // block_size) > config.num_gpu_blocks:
            continue
        keys = block_keys(prompt, block_size) if draw(st.booleans()) else None
        arrivals.append((draw(st.integers(0, 15)), SimRequest(f"r{index}", len(prompt), num_output, 0.0,
                                                              block_keys=keys)))
    arrivals.sort(key=lambda item: item[0])
    num_steps = draw(st.integers(0, 30))
    for step in range(num_steps):
        while arrivals and arrivals[0][0] <= step:
            scheduler.add_request(arrivals.pop(0)[1])
        scheduler.update_after_step(scheduler.schedule(), float(step))
    snapshot = InstanceSnapshot.from_scheduler(scheduler, now_s=float(num_steps))
    cached = snapshot.cached_block_keys
    if cached and draw(st.booleans()):  # a sub-sequence (a driver that knows fewer): dropped ones are anonymous
        cached = tuple(draw(st.lists(st.sampled_from(range(len(cached))), unique=True).map(sorted)))
        cached = tuple(snapshot.cached_block_keys[i] for i in cached)
    snapshot = InstanceSnapshot(config, snapshot.now_s, (*snapshot.waiting, *(RequestState.from_sim_request(r)
                                for _, r in arrivals)), snapshot.running, cached_block_keys=cached)
    prompt = tokens()
    num_output = draw(st.integers(1, 40))
    if -(-(len(prompt) + num_output + 10) // block_size) > config.num_gpu_blocks:
        num_output = 1
    keys = block_keys(prompt, block_size) if draw(st.booleans()) else None
    return snapshot, RequestState("new", len(prompt), num_output, block_keys=keys)


@settings(max_examples=600, deadline=None)
@given(keyed_states())
def test_predict_from_keyed_states_equals_stepping(case):
    _check_predict_equals_stepping(*case)


@settings(max_examples=400, deadline=None)
@given(keyed_states(warm=True))
def test_predict_from_states_with_cached_free_blocks_equals_stepping(case):
    _check_predict_equals_stepping(*case)


def _check_predict_equals_stepping(snapshot: InstanceSnapshot, target: RequestState) -> None:
    try:
        slow = predict_by_stepping(snapshot, target, LLAMA)
    except ValueError:
        event("invalid")
        return
    fast = predict(snapshot, target, LLAMA)
    assert math.isclose(fast.ttft_s, slow.ttft_s, rel_tol=1e-9) and math.isclose(fast.e2e_s, slow.e2e_s, rel_tol=1e-9)
    assert (fast.num_steps, fast.num_preemptions) == (slow.num_steps, slow.num_preemptions)
    assert predict(snapshot, target, LLAMA, compiled=False) == fast  # the compiled module, where built, is identical
    event(f"skipped: {fast.num_steps_simulated < fast.num_steps}")
    event(f"preemptions: {min(slow.num_preemptions, 2)}")
    looked_up = {k for r in (*snapshot.waiting, *snapshot.running, target) for k in r.block_keys or ()}
    event(f"cached free blocks a request can hit: {bool(looked_up.intersection(snapshot.cached_block_keys))}")
