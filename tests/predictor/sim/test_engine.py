"""Tests for predictor.sim.engine: virtual clock, advance_to semantics, capacity measurement."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.sim.batch_time import LinearBatchTimeModel
from predictor.sim.engine import Engine, measure_capacity_qps
from predictor.sim.request import RequestStatus, SimRequest
from predictor.sim.scheduler import EngineConfig, ScheduledBatch


@dataclass(frozen=True)
class ConstantStepTime:
    """A `BatchTimeModel` fake: every non-empty step takes `step_s` seconds."""

    step_s: float = 1.0

    def step_time_s(self, batch: ScheduledBatch) -> float:
        return self.step_s if batch.num_scheduled_tokens else 0.0


def _engine(**config) -> Engine:
    return Engine(EngineConfig(**config), ConstantStepTime())


def test_idle_engine_step_returns_none_and_keeps_clock() -> None:
    engine = _engine()
    assert engine.step() is None and engine.now_s == 0.0
    assert engine.run_until_idle() == [] and engine.now_s == 0.0
    assert engine.advance_to(5.0) == [] and engine.now_s == 5.0
    assert engine.advance_to(1.0) == [] and engine.now_s == 5.0, "the clock never moves back"


def test_advance_to_runs_steps_starting_before_time_and_completes_the_one_in_progress() -> None:
    engine = _engine()
    request = SimRequest("a", 4, 3, arrival_time_s=0.0)
    engine.add_request(request)
    steps = engine.advance_to(1.5)
    assert [(s.start_s, s.duration_s) for s in steps] == [(0.0, 1.0), (1.0, 1.0)]
    assert engine.now_s == 2.0, "the step started at 1.0 is atomic and ends at 2.0"
    assert engine.advance_to(2.0) == [] and engine.now_s == 2.0, "a step starting exactly at time_s waits"
    steps = engine.advance_to(10.0)
    assert [s.start_s for s in steps] == [2.0]
    assert [r.request_id for r in steps[0].output.finished] == ["a"]
    assert engine.now_s == 10.0, "idle after the last step: the clock jumps to time_s"
    assert (request.first_token_time_s, request.finish_time_s) == (1.0, 3.0)


def test_future_arrivals_wait_for_the_clock() -> None:
    engine = _engine()
    engine.add_request(SimRequest("late", 4, 1, arrival_time_s=5.0))
    engine.add_request(SimRequest("early", 4, 1, arrival_time_s=0.5))
    assert engine.num_pending_arrivals == 2 and engine.next_step_start_s() == 0.5
    assert engine.advance_to(0.5) == []
    first = engine.step()
    assert first is not None and first.start_s == 0.5 and list(first.batch.num_scheduled_tokens) == ["early"]
    steps = engine.run_until_idle()
    assert [(s.start_s, list(s.batch.num_scheduled_tokens)) for s in steps] == [(5.0, ["late"])]
    assert engine.now_s == 6.0 and not engine.has_work()


def test_add_request_errors_are_raised_at_submission() -> None:
    engine = _engine(block_size=16, num_gpu_blocks=2)
    engine.add_request(SimRequest("a", 4, 1, arrival_time_s=3.0))
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request(SimRequest("a", 4, 1, arrival_time_s=0.0))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(SimRequest("big", 40, 1, arrival_time_s=9.0))
    assert engine.num_pending_arrivals == 1


def test_non_positive_step_time_is_an_error() -> None:
    engine = Engine(EngineConfig(), ConstantStepTime(0.0))
    engine.add_request(SimRequest("a", 4, 1, arrival_time_s=0.0))
    with pytest.raises(ValueError, match="batch-time model"):
        engine.step()


@pytest.mark.parametrize(("max_num_seqs", "expected_qps"), [(1, 8 / 128), (4, 8 / 32)], ids=["1-seq", "4-seqs"])
def test_measure_capacity_exact_with_constant_step_time(max_num_seqs: int, expected_qps: float) -> None:
    # Each request: 1 prefill step + 15 decode steps; groups of max_num_seqs run back to back.
    qps = measure_capacity_qps(EngineConfig(max_num_seqs=max_num_seqs), ConstantStepTime(), [(8, 16)], 8)
    assert qps == pytest.approx(expected_qps)


def test_measure_capacity_grows_with_max_num_seqs_on_fitted_model() -> None:
    model = LinearBatchTimeModel.default("llama-2-7b")
    workload = [(200, 100), (600, 50), (50, 200)]
    capacities = [measure_capacity_qps(EngineConfig(max_num_seqs=n), model, workload, 120) for n in (1, 4, 16)]
    assert 0 < capacities[0] < capacities[1] < capacities[2]


def test_measure_capacity_input_errors() -> None:
    with pytest.raises(ValueError, match="empty"):
        measure_capacity_qps(EngineConfig(), ConstantStepTime(), [])
    with pytest.raises(ValueError, match="num_requests"):
        measure_capacity_qps(EngineConfig(), ConstantStepTime(), [(1, 1)], 0)


def _run(config: EngineConfig, arrivals: list[tuple[float, int, int]]):
    engine = Engine(config, LinearBatchTimeModel.default("llama-3-8b"))
    requests = [SimRequest(f"r{i}", p, o, t) for i, (t, p, o) in enumerate(arrivals)]
    for request in requests:
        engine.add_request(request)
    trace = []
    last_end_s = 0.0
    # Alternate advance_to and step so both paths run.
    for time_s in sorted(t for t, _, _ in arrivals):
        for result in engine.advance_to(time_s):
            assert result.start_s >= last_end_s and result.duration_s > 0
            last_end_s = result.start_s + result.duration_s
            assert engine.now_s >= last_end_s
            trace.append((result.start_s, tuple(result.batch.num_scheduled_tokens.items())))
    for result in engine.run_until_idle():
        assert result.start_s >= last_end_s
        last_end_s = result.start_s + result.duration_s
        trace.append((result.start_s, tuple(result.batch.num_scheduled_tokens.items())))
    return trace, requests, engine


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.0, 0.5, allow_nan=False), st.integers(1, 300), st.integers(1, 40)),
        min_size=1,
        max_size=12,
    ),
    st.integers(1, 6),
    st.integers(24, 80),
)
def test_virtual_time_properties(arrivals, max_num_seqs: int, num_gpu_blocks: int) -> None:
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=128, num_gpu_blocks=num_gpu_blocks)
    trace, requests, engine = _run(config, arrivals)
    for request in requests:
        assert request.status == RequestStatus.FINISHED
        assert request.num_generated_tokens == request.num_output_tokens
        assert request.arrival_time_s < request.first_token_time_s <= request.finish_time_s <= engine.now_s
    assert not engine.has_work() and engine.scheduler.num_used_blocks == 0
    assert _run(config, arrivals)[0] == trace, "same inputs give identical traces"


def test_sim_package_imports_no_grpc_or_asyncio() -> None:
    """The sim stays pure (STYLE 2.1): a fresh interpreter importing it loads neither grpc nor asyncio."""
    code = "import sys, predictor.sim; print(sorted(m for m in ('grpc', 'asyncio') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
