"""Tests for bench.predictor_bench and bench.cli: the quick benchmark runs and prints its table."""

from __future__ import annotations

import random

import pytest

from bench.cli import main as bench_main
from bench.predictor_bench import BENCH_CONFIG, build_state, load_lengths, percentile
from predictor.sim.batch_time import LinearBatchTimeModel


def test_quick_run_prints_a_row_per_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["predictor", "--quick", "--lognormal", "--sizes", "16", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "p99 ms" in lines[1] and "speed-up" in lines[1]
    rows = [line.split("|") for line in lines[3:]]
    assert [int(row[0]) for row in rows] == [16, 64]
    for row in rows:
        p50_ms, p99_ms, steps = (float(x) for x in row[1].split())
        assert 0 < p50_ms <= p99_ms and steps >= 1


def test_header_names_the_fast_predict_that_ran(capsys: pytest.CaptureFixture[str]) -> None:
    from predictor.sim.predict import FAST_PREDICT_IMPLEMENTATION

    assert bench_main(["predictor", "--quick", "--lognormal", "--sizes", "16"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(f"fast_predict: {FAST_PREDICT_IMPLEMENTATION}")
    assert bench_main(["predictor", "--quick", "--lognormal", "--sizes", "16", "--python"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("fast_predict: python")


def test_state_holds_the_requested_mix() -> None:
    rng = random.Random(3)
    lengths = load_lengths(rng, use_sharegpt=False)
    snapshot = build_state(256, lengths, rng, LinearBatchTimeModel.default("llama-2-7b"))
    assert len(snapshot.waiting) + len(snapshot.running) == 256
    assert len(snapshot.running) <= BENCH_CONFIG.max_num_seqs and snapshot.waiting
    assert any(r.num_generated_tokens > 0 for r in snapshot.running)
    snapshot.to_scheduler()  # a valid state


def test_unknown_benchmark_and_percentile() -> None:
    assert bench_main(["nope"]) == 2
    assert bench_main([]) == 2
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 99) == 2.0


def test_shared_prefix_states_carry_block_keys_that_share_the_system_prompt(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rng = random.Random(5)
    lengths = load_lengths(rng, use_sharegpt=False)
    snapshot = build_state(64, lengths, rng, LinearBatchTimeModel.default("llama-2-7b"), shared_prefix_tokens=64)
    requests = [*snapshot.running, *snapshot.waiting]
    assert all(r.block_keys is not None and len(r.block_keys) == r.num_prompt_tokens // BENCH_CONFIG.block_size
               for r in requests)
    first_keys = [r.block_keys[0] for r in requests if r.block_keys]
    assert max(first_keys.count(k) for k in first_keys) > 1  # some requests start with the same system prompt
    assert len(set(first_keys)) > 1  # and some do not
    assert bench_main(["predictor", "--quick", "--lognormal", "--sizes", "16", "--shared-prefix", "64"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("block keys (shared prefix 64 tokens)")
