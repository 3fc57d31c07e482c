"""Tests for bench.sglang_model: the quick benchmark runs and prints its tables; its snapshots and capacity."""

from __future__ import annotations

import pytest

from bench.cli import BENCHMARKS
from bench.cli import main as bench_main
from bench.sglang_model import _snapshot_before, cap_of, capacity_qps, percentile
from predictor.sim.batch_time import LinearBatchTimeModel
from predictor.sim.engine import Engine, measure_capacity_qps
from predictor.sim.request import SimRequest
from predictor.sim.scheduler import EngineConfig

LLAMA = LinearBatchTimeModel.default("llama-2-7b")
CONFIG = EngineConfig(max_num_seqs=256, max_num_batched_tokens=512, block_size=1, num_gpu_blocks=8192,
                      scheduling="sglang")


def test_registered_with_the_bench_cli() -> None:
    assert BENCHMARKS["sglang-model"][0] == "bench.sglang_model"


def test_quick_run_prints_one_table_per_cap_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["sglang-model", "--quick", "--loads", "0.5", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "V1 path: fast_predict" in out.splitlines()[0]
    tables = out.split("\ncaps ")[1:]
    assert [t.split(":")[0] for t in tables] == ["unset", "true"]
    for table in tables:
        rows = [line for line in table.splitlines() if line.strip().endswith(tuple("0123456789"))
                and "%" in line.split()[0]]
        assert [row.split()[0] for row in rows] == ["50%", "90%"]
        for row in rows:
            _, ttft, e2e, cost = row.split("|")
            errors = [float(x) for cell in (ttft, e2e) for x in cell.replace("/", " ").split()]
            assert len(errors) == 8 and all(x >= 0 for x in errors)
            v1_ms, sglang_ms = (float(x) for x in cost.split())
            assert 0 < v1_ms and 0 < sglang_ms
            assert float(ttft.replace("/", " ").split()[2]) <= float(ttft.replace("/", " ").split()[0])


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(SystemExit):
        bench_main(["sglang-model", "--loads", "1.2"])
    assert bench_main(["sglang-model", "--quick", "--chunked-prefill-size", "0"]) == 2


def test_snapshot_holds_earlier_arrivals_that_wait_for_the_next_step() -> None:
    engine = Engine(CONFIG, LLAMA)
    requests = [SimRequest("a", 300, 40, 0.0), SimRequest("b", 20, 5, 0.001), SimRequest("c", 20, 5, 0.002)]
    for request in requests:
        engine.add_request(request)
    engine.advance_to(0.002)  # a's prefill started at 0 and ends after b and c arrived
    assert engine.now_s > 0.002
    snapshot = _snapshot_before(engine, requests, 2)
    assert [s.request_id for s in snapshot.running] == ["a"]
    assert [s.request_id for s in snapshot.waiting] == ["b"]  # c (the newcomer) is not in its own state


def test_capacity_with_unset_caps_is_measure_capacity_qps_and_true_caps_admit_more() -> None:
    lengths = [(30, 200), (200, 100), (10, 400)]
    unset = capacity_qps(CONFIG, LLAMA, lengths, "unset", 150)
    assert unset == measure_capacity_qps(CONFIG, LLAMA, lengths, 150)
    assert capacity_qps(CONFIG, LLAMA, lengths, "true", 150) > unset  # reservations near real use
    assert cap_of((3, 7), "unset") is None and cap_of((3, 7), "true") == 7


def test_percentile() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 90) == 2.0
