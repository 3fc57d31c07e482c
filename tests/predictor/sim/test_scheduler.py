"""Tests for predictor.sim.scheduler: vLLM V1 scheduling semantics, table-driven, plus Hypothesis properties."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from predictor.sim.kv_blocks import BlockPool, blocks_for_tokens
from predictor.sim.request import RequestStatus, SimRequest
from predictor.sim.scheduler import EngineConfig, Scheduler


def _req(request_id: str, num_prompt_tokens: int, num_output_tokens: int) -> SimRequest:
    return SimRequest(request_id, num_prompt_tokens, num_output_tokens, arrival_time_s=0.0)


# ---- scripted scenarios: per step, the exact schedule and preemptions -------------------------------------


@dataclass(frozen=True)
class Scenario:
    config: EngineConfig
    requests: list[tuple[str, int, int]]  # (id, prompt tokens, output tokens), arrival order
    steps: list[tuple[dict[str, int], list[str]]]  # per step: num_scheduled_tokens, preempted ids
    finished_after: dict[str, int]  # request id -> 1-based step index at whose end it finishes


SCENARIOS = {
    "single-request-prefill-then-decodes": Scenario(
        EngineConfig(),
        [("a", 10, 3)],
        [({"a": 10}, []), ({"a": 1}, []), ({"a": 1}, [])],
        {"a": 3},
    ),
    "chunked-prefill-continues-over-steps": Scenario(
        EngineConfig(max_num_seqs=4, max_num_batched_tokens=16),
        [("a", 40, 2)],
        [({"a": 16}, []), ({"a": 16}, []), ({"a": 8}, []), ({"a": 1}, [])],
        {"a": 4},
    ),
    "budget-splits-second-prefill": Scenario(
        EngineConfig(max_num_seqs=4, max_num_batched_tokens=16),
        [("a", 10, 2), ("b", 10, 2)],
        [({"a": 10, "b": 6}, []), ({"a": 1, "b": 4}, []), ({"b": 1}, [])],
        {"a": 2, "b": 3},
    ),
    "max-num-seqs-caps-admission": Scenario(
        EngineConfig(max_num_seqs=2, max_num_batched_tokens=64),
        [("a", 4, 2), ("b", 4, 2), ("c", 4, 1)],
        [({"a": 4, "b": 4}, []), ({"a": 1, "b": 1}, []), ({"c": 4}, [])],
        {"a": 2, "b": 2, "c": 3},
    ),
    "strict-fcfs-no-jumping-on-blocks": Scenario(
        # a takes 7 of 10 blocks; b needs 5 and blocks the smaller c behind it.
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, block_size=16, num_gpu_blocks=10),
        [("a", 100, 2), ("b", 80, 1), ("c", 16, 1)],
        [({"a": 100}, []), ({"a": 1}, []), ({"b": 80, "c": 16}, [])],
        {"a": 2, "b": 3, "c": 3},
    ),
    "preempt-last-when-blocks-run-out-then-recompute": Scenario(
        # 4 blocks of 4 tokens. At step 6 a needs a 3rd block: b (last) is preempted, then recomputes
        # its 4 prompt + 5 generated tokens as one prefill and samples its last token.
        EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_gpu_blocks=4),
        [("a", 4, 6), ("b", 4, 6)],
        [({"a": 4, "b": 4}, [])] + [({"a": 1, "b": 1}, [])] * 4 + [({"a": 1}, ["b"]), ({"b": 9}, [])],
        {"a": 6, "b": 7},
    ),
    "last-request-preempts-itself": Scenario(
        # At step 3, b (the last running request) needs a 2nd block and none is free.
        EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_gpu_blocks=4),
        [("a", 8, 3), ("b", 3, 5)],
        [({"a": 8, "b": 3}, []), ({"a": 1, "b": 1}, []), ({"a": 1}, ["b"])]
        + [({"b": 5}, [])]
        + [({"b": 1}, [])] * 2,
        {"a": 3, "b": 6},
    ),
    "chunked-prefill-off-stops-admission": Scenario(
        EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, enable_chunked_prefill=False),
        [("a", 10, 2), ("b", 10, 1), ("c", 2, 1)],
        [({"a": 10}, []), ({"a": 1, "b": 10, "c": 2}, [])],
        {"a": 2, "b": 2, "c": 2},
    ),
    "long-prefill-threshold-caps-chunks": Scenario(
        EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, long_prefill_token_threshold=8),
        [("a", 20, 1), ("b", 4, 3)],
        [({"a": 8, "b": 4}, []), ({"a": 8, "b": 1}, []), ({"a": 4, "b": 1}, [])],
        {"a": 3, "b": 3},
    ),
}


@pytest.mark.parametrize("scenario", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_scripted_schedule(scenario: Scenario) -> None:
    scheduler = Scheduler(scenario.config)
    requests = {rid: _req(rid, p, o) for rid, p, o in scenario.requests}
    for request in requests.values():
        scheduler.add_request(request)
    for step, (expected_tokens, expected_preempted) in enumerate(scenario.steps, start=1):
        batch = scheduler.schedule()
        assert (step, batch.num_scheduled_tokens) == (step, expected_tokens)
        assert list(batch.num_scheduled_tokens) == list(expected_tokens), "schedule order"
        assert batch.preempted_request_ids == expected_preempted
        output = scheduler.update_after_step(batch, now_s=float(step))
        assert sorted(r.request_id for r in output.finished) == sorted(
            rid for rid, s in scenario.finished_after.items() if s == step
        )
        _assert_block_invariants(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_used_blocks == 0
    assert scheduler.schedule().num_scheduled_tokens == {}
    for rid, request in requests.items():
        assert request.status == RequestStatus.FINISHED
        assert request.num_generated_tokens == request.num_output_tokens
        assert request.finish_time_s == float(scenario.finished_after[rid])
    expected_preemptions = sum(len(p) for _, p in scenario.steps)
    assert scheduler.num_preemptions_total == expected_preemptions


def test_batch_accounting_of_prefill_chunks_and_decodes() -> None:
    scheduler = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=16))
    scheduler.add_request(_req("a", 40, 3))
    first = scheduler.schedule()
    assert (first.num_prefill_tokens, first.prefill_attention_work) == (16, 16 * 16)
    scheduler.update_after_step(first, 1.0)
    second = scheduler.schedule()
    # A continuing chunk attends to its earlier context: 16 * (16 + 16).
    assert (second.num_prefill_tokens, second.prefill_attention_work) == (16, 16 * 32)
    scheduler.update_after_step(second, 2.0)
    third = scheduler.schedule()
    out = scheduler.update_after_step(third, 3.0)
    assert (third.prefill_attention_work, third.num_decode_seqs) == (8 * 40, 0)
    assert out.new_token_request_ids == ["a"] and out.first_token_request_ids == ["a"]
    fourth = scheduler.schedule()
    assert (fourth.num_decode_seqs, fourth.decode_context_tokens, fourth.num_prefill_tokens) == (1, 41, 0)
    assert (fourth.total_num_scheduled_tokens, fourth.num_seqs) == (1, 1)
    out = scheduler.update_after_step(fourth, 4.0)
    assert out.first_token_request_ids == [] and out.new_token_request_ids == ["a"]
    request = scheduler.get_request("a")
    assert request is not None and request.first_token_time_s == 3.0 and request.num_tokens == 42


def test_preempted_request_goes_to_front_of_waiting_and_keeps_first_token_time() -> None:
    scheduler = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_gpu_blocks=4))
    a, b, c = _req("a", 4, 6), _req("b", 4, 6), _req("c", 4, 1)
    for step in range(1, 6):
        if step == 1:
            scheduler.add_request(a)
            scheduler.add_request(b)
        if step == 2:
            scheduler.add_request(c)  # cannot get blocks: waits behind nobody but the full cache
        scheduler.update_after_step(scheduler.schedule(), float(step))
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    batch = scheduler.schedule()
    assert batch.preempted_request_ids == ["b"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert b.first_token_time_s == 1.0
    assert scheduler.num_blocks_held("b") == 0
    out = scheduler.update_after_step(batch, 6.0)
    assert [r.request_id for r in out.finished] == ["a"]
    batch = scheduler.schedule()
    assert batch.num_scheduled_tokens == {"b": 9, "c": 4}
    out = scheduler.update_after_step(batch, 7.0)
    assert out.first_token_request_ids == ["c"] and b.first_token_time_s == 1.0


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "c"), ("priority", "s")])
def test_priority_policy_orders_the_queue_and_preempts_the_lowest_priority(policy, victim) -> None:
    """vLLM's --scheduling-policy priority: the waiting queue by (priority, arrival), and the victim of a preemption
    the largest (priority, arrival) even when it runs first; FCFS preempts the last running request."""
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_gpu_blocks=4,
                          scheduling_policy=policy)
    queue = Scheduler(config)
    for request_id, priority, arrival_s in (("late", 1, 0.0), ("early-critical", 0, 2.0), ("first-critical", 0, 1.0)):
        queue.add_request(SimRequest(request_id, 4, 1, arrival_s, priority=priority))
    expected = ["first-critical", "early-critical", "late"] if policy == "priority" else [
        "late", "early-critical", "first-critical"]
    assert [r.request_id for r in queue.waiting] == expected

    scheduler = Scheduler(config)
    s = SimRequest("s", 4, 6, 0.0, priority=1)  # sheddable (vLLM: larger = later), admitted first
    c = SimRequest("c", 4, 6, 0.5, priority=0)
    scheduler.add_request(s)
    scheduler.add_request(c)
    preempted: list[str] = []
    for step in range(1, 12):
        batch = scheduler.schedule()
        assert batch.num_scheduled_tokens, "a step with unfinished work scheduled nothing"
        preempted += batch.preempted_request_ids
        scheduler.update_after_step(batch, float(step))
        if preempted:
            break
    assert preempted == [victim]
    # the other one kept running in the same batch (a priority victim that ran first left the step to it)
    assert list(batch.num_scheduled_tokens) == ["s" if victim == "c" else "c"]
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="priority"):
        EngineConfig(scheduling="sglang", scheduling_policy="priority")


def test_abort_frees_blocks_and_forgets_request() -> None:
    scheduler = Scheduler(EngineConfig(block_size=16, num_gpu_blocks=100))
    scheduler.add_request(_req("a", 100, 5))
    scheduler.add_request(_req("b", 30, 5))
    scheduler.update_after_step(scheduler.schedule(), 1.0)
    assert scheduler.num_used_blocks == blocks_for_tokens(100, 16) + blocks_for_tokens(30, 16)
    scheduler.add_request(_req("w", 10, 5))
    aborted = scheduler.abort_request("a")
    assert aborted is not None and aborted.status == RequestStatus.ABORTED
    assert scheduler.num_used_blocks == blocks_for_tokens(30, 16)
    assert scheduler.num_free_blocks == 100 - blocks_for_tokens(30, 16)
    assert scheduler.get_request("a") is None and scheduler.abort_request("a") is None
    assert scheduler.abort_request("w") is not None and not scheduler.waiting
    assert scheduler.abort_request("unknown") is None
    # Aborted between schedule() and update_after_step(): the step skips it.
    batch = scheduler.schedule()
    scheduler.abort_request("b")
    out = scheduler.update_after_step(batch, 2.0)
    assert out.new_token_request_ids == [] and scheduler.num_used_blocks == 0
    assert not scheduler.has_unfinished_requests()
    scheduler.add_request(_req("a", 10, 1))  # the id is free again


@pytest.mark.parametrize(
    ("config", "request_args", "message"),
    [
        (EngineConfig(block_size=16, num_gpu_blocks=4), ("big", 60, 5), "KV blocks"),
        (
            EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, enable_chunked_prefill=False),
            ("long", 10, 8),
            "prefill",
        ),
    ],
    ids=["never-fits-kv-cache", "prefill-over-budget-without-chunking"],
)
def test_add_request_rejects_requests_that_can_never_run(config, request_args, message) -> None:
    scheduler = Scheduler(config)
    with pytest.raises(ValueError, match=message):
        scheduler.add_request(_req(*request_args))
    assert not scheduler.has_unfinished_requests()


def test_add_request_boundaries_and_duplicates() -> None:
    config = EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=16, block_size=16, num_gpu_blocks=4, enable_chunked_prefill=False
    )
    scheduler = Scheduler(config)
    scheduler.add_request(_req("fits", 10, 7))  # 17 tokens <= 16 + 1 and 17 tokens -> 2 blocks
    with pytest.raises(ValueError, match="duplicate"):
        scheduler.add_request(_req("fits", 1, 1))
    running = _req("r", 4, 2)
    running.status = RequestStatus.RUNNING
    with pytest.raises(ValueError, match="WAITING or PREEMPTED"):
        scheduler.add_request(running)
    done = _req("done", 4, 2)
    done.num_generated_tokens = 2
    with pytest.raises(ValueError, match="already generated"):
        scheduler.add_request(done)
    assert [r.request_id for r in scheduler.waiting] == ["fits"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 0},
        {"block_size": 0},
        {"num_gpu_blocks": -1},
        {"long_prefill_token_threshold": -1},
        {"max_num_seqs": 64, "max_num_batched_tokens": 32},
    ],
    ids=["seqs", "budget", "block-size", "blocks", "threshold", "budget-below-seqs"],
)
def test_engine_config_validation(kwargs) -> None:
    with pytest.raises(ValueError, match="EngineConfig"):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"num_prompt_tokens": 0}, "num_prompt_tokens"), ({"num_output_tokens": 0}, "num_output_tokens")],
    ids=["prompt", "output"],
)
def test_sim_request_validation(kwargs, message) -> None:
    args = {"request_id": "x", "num_prompt_tokens": 4, "num_output_tokens": 4, "arrival_time_s": 0.0} | kwargs
    with pytest.raises(ValueError, match=message):
        SimRequest(**args)


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (5, 1, 5)],
)
def test_blocks_for_tokens(num_tokens, block_size, expected) -> None:
    assert blocks_for_tokens(num_tokens, block_size) == expected


def test_block_pool_all_or_nothing_and_double_free() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) and not pool.allocate(2)
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 3)
    pool.free(3)
    with pytest.raises(ValueError):
        pool.free(1)
    with pytest.raises(ValueError):
        BlockPool(0)


# ---- properties ---------------------------------------------------------------------------------------------

_ALLOWED_TRANSITIONS = {
    (RequestStatus.WAITING, RequestStatus.RUNNING),
    (RequestStatus.RUNNING, RequestStatus.PREEMPTED),
    (RequestStatus.PREEMPTED, RequestStatus.RUNNING),
    (RequestStatus.RUNNING, RequestStatus.FINISHED),
    (RequestStatus.WAITING, RequestStatus.ABORTED),
    (RequestStatus.RUNNING, RequestStatus.ABORTED),
    (RequestStatus.PREEMPTED, RequestStatus.ABORTED),
}


@st.composite
def workloads(draw):
    """(config, [(arrival step, prompt tokens, output tokens)], abort probability, seed)."""
    requests = draw(
        st.lists(
            st.tuples(st.integers(0, 30), st.integers(1, 60), st.integers(1, 24)),
            min_size=1,
            max_size=16,
        )
    )
    max_num_seqs = draw(st.integers(1, 8))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    chunked = draw(st.booleans())
    budget = draw(st.integers(max_num_seqs, 64))
    if not chunked:
        budget = max(budget, max(p + o - 1 for _, p, o in requests))
    need_blocks = max(blocks_for_tokens(p + o, block_size) for _, p, o in requests)
    num_gpu_blocks = need_blocks + draw(st.integers(0, 40 // block_size + 4))
    threshold = draw(st.one_of(st.just(0), st.integers(1, budget)))
    config = EngineConfig(max_num_seqs, budget, block_size, num_gpu_blocks, chunked, threshold)
    return config, requests, draw(st.sampled_from([0.0, 0.05])), draw(st.integers(0, 2**32))


def _assert_block_invariants(scheduler: Scheduler) -> None:
    cfg = scheduler.config
    assert scheduler.num_free_blocks + scheduler.num_used_blocks == cfg.num_gpu_blocks
    expected = sum(blocks_for_tokens(r.num_computed_tokens, cfg.block_size) for r in scheduler.running)
    assert scheduler.num_used_blocks == expected
    assert 0.0 <= scheduler.kv_cache_usage_frac <= 1.0


def _check_transitions(requests: dict[str, SimRequest], last_status: dict[str, RequestStatus]) -> None:
    for rid, request in requests.items():
        if request.status != last_status[rid]:
            assert (last_status[rid], request.status) in _ALLOWED_TRANSITIONS
            last_status[rid] = request.status


def _run_trace(config: EngineConfig, arrivals, abort_prob: float, seed: int):
    """Run a workload step by step, checking invariants; return (trace, requests by id). Under the "priority"
    policy each request gets a priority 0-2 drawn from the seed and arrives at its step."""
    rng = random.Random(seed)
    scheduler = Scheduler(config)
    by_priority = config.scheduling_policy == "priority"
    requests = {f"r{i}": SimRequest(f"r{i}", p, o, arrival_time_s=float(step) if by_priority else 0.0,
                                    priority=rng.randrange(3) if by_priority else 0)
                for i, (step, p, o) in enumerate(arrivals)}
    by_step: dict[int, list[str]] = {}
    for i, (step, _, _) in enumerate(arrivals):
        by_step.setdefault(step, []).append(f"r{i}")
    last_status = {rid: RequestStatus.WAITING for rid in requests}
    trace = []
    step = 0
    while step <= max(by_step) or scheduler.has_unfinished_requests():
        assert step < 5000, "no progress"
        for rid in by_step.get(step, []):
            scheduler.add_request(requests[rid])
        live = [r.request_id for r in [*scheduler.running, *scheduler.waiting]]
        if live and rng.random() < abort_prob:
            scheduler.abort_request(rng.choice(live))
        _check_transitions(requests, last_status)
        batch = scheduler.schedule()
        assert batch.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(scheduler.running) <= config.max_num_seqs
        if scheduler.has_unfinished_requests():
            assert batch.num_scheduled_tokens, "unfinished work but an empty step"
        if by_priority:
            keys = [(r.priority, r.arrival_time_s) for r in scheduler.waiting]
            assert keys == sorted(keys), "the waiting queue is out of (priority, arrival) order"
        _check_transitions(requests, last_status)
        output = scheduler.update_after_step(batch, float(step))
        _assert_block_invariants(scheduler)
        _check_transitions(requests, last_status)
        trace.append((tuple(batch.num_scheduled_tokens.items()), tuple(batch.preempted_request_ids),
                      tuple(r.request_id for r in output.finished)))
        step += 1
    return trace, requests


@settings(max_examples=250, deadline=None)
@given(workloads())
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_properties_over_random_workloads(policy, workload) -> None:
    config, arrivals, abort_prob, seed = workload
    config = dataclasses.replace(config, scheduling_policy=policy)
    trace, requests = _run_trace(config, arrivals, abort_prob, seed)
    assert not any(r.status in (RequestStatus.WAITING, RequestStatus.RUNNING) for r in requests.values())
    for request in requests.values():
        if request.status == RequestStatus.FINISHED:
            assert request.num_generated_tokens == request.num_output_tokens
            assert request.first_token_time_s is not None and request.finish_time_s is not None
            assert request.first_token_time_s <= request.finish_time_s
        else:
            assert request.status == RequestStatus.ABORTED
    event("preempted" if any(r.num_preemptions for r in requests.values()) else "no preemption")
    if abort_prob == 0.0:
        assert all(r.status == RequestStatus.FINISHED for r in requests.values())
    # Same inputs, same trace.
    assert _run_trace(config, arrivals, abort_prob, seed)[0] == trace
