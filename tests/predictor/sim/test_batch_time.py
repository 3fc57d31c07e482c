"""Tests for predictor.sim.batch_time: fit quality on the shipped H200 profile, JSON files, errors."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from predictor.sim.batch_time import (
    PROFILE_CSV_PATH,
    LinearBatchTimeModel,
    fit_linear,
    known_models,
    load_profile,
    mape,
    write_shipped_models,
)
from predictor.sim.request import SimRequest
from predictor.sim.scheduler import EngineConfig, ScheduledBatch, Scheduler

MODELS = ["llama-2-7b", "qwen2-7b", "llama-3-8b"]
NUM_ROWS = {"llama-2-7b": 81, "qwen2-7b": 81, "llama-3-8b": 86}  # per /work/shared/data/README.md


def test_shipped_models_are_the_three_profiled_shapes() -> None:
    assert known_models() == sorted(MODELS)


@pytest.mark.parametrize("model", MODELS)
def test_fit_on_shipped_csv_reaches_readme_accuracy(model: str) -> None:
    rows = load_profile(PROFILE_CSV_PATH, model)
    assert len(rows) == NUM_ROWS[model]
    fitted = fit_linear(rows)
    assert fitted.model == model
    assert mape(fitted, rows) <= 0.08
    # Physical sanity: a fixed cost and a per-token cost are positive.
    assert fitted.c0_s > 0 and fitted.c1_s_per_token > 0


@pytest.mark.parametrize("model", MODELS)
def test_shipped_json_equals_a_refit(model: str, tmp_path) -> None:
    mapes = write_shipped_models(PROFILE_CSV_PATH, tmp_path, [model])
    refit = LinearBatchTimeModel.from_json(tmp_path / f"{model}.json")
    shipped = LinearBatchTimeModel.default(model)
    for name in ("c0_s", "c1_s_per_token", "c2_s_per_token2", "c3_s_per_token", "c4_s_per_seq"):
        assert math.isclose(getattr(refit, name), getattr(shipped, name), rel_tol=1e-6, abs_tol=1e-15), name
    assert mapes[model] == pytest.approx(mape(shipped, load_profile(PROFILE_CSV_PATH, model)))


def test_json_round_trip(tmp_path) -> None:
    model = LinearBatchTimeModel("m", 0.005, 2e-5, 2e-9, 1e-7, -1e-6)
    path = tmp_path / "m.json"
    model.to_json(path)
    assert LinearBatchTimeModel.from_json(path) == model


@pytest.mark.parametrize(
    "payload",
    [
        "not json",
        json.dumps({"model": "m", "c0_s": 1.0}),
        json.dumps({"model": "m", "c0_s": 1, "c1_s_per_token": 1, "c2_s_per_token2": 1, "c3_s_per_token": 1,
                    "c4_s_per_seq": 1, "extra": 1}),
        json.dumps({"model": "m", "c0_s": "1", "c1_s_per_token": 1, "c2_s_per_token2": 1, "c3_s_per_token": 1,
                    "c4_s_per_seq": 1}),
        json.dumps([1, 2]),
    ],
    ids=["not-json", "missing-keys", "unknown-key", "string-coefficient", "not-an-object"],
)
def test_from_json_rejects_malformed_files(payload: str, tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(payload)
    with pytest.raises(ValueError):
        LinearBatchTimeModel.from_json(path)


def test_default_unknown_model_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="llama-2-7b.*llama-3-8b.*qwen2-7b"):
        LinearBatchTimeModel.default("gpt-5")
    assert LinearBatchTimeModel.default().model == "llama-2-7b"


def test_load_profile_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="no rows"):
        load_profile(PROFILE_CSV_PATH, "gpt-5")
    bad = tmp_path / "bad.csv"
    bad.write_text("model,kind,graph_ms\nm,prefill,1.0\n")
    with pytest.raises(ValueError, match="malformed"):
        load_profile(bad, "m")
    rows = load_profile(PROFILE_CSV_PATH, "llama-2-7b")
    with pytest.raises(ValueError, match="at least 5"):
        fit_linear(rows[:4])
    with pytest.raises(ValueError, match="mix models"):
        fit_linear(rows + load_profile(PROFILE_CSV_PATH, "qwen2-7b"))


def test_profile_row_maps_to_scheduled_batch_as_specified() -> None:
    mixed = next(r for r in load_profile(PROFILE_CSV_PATH, "llama-2-7b") if r.kind == "mixed")
    batch = mixed.to_batch()
    assert batch.total_num_scheduled_tokens == mixed.batch_tokens
    assert batch.prefill_attention_work == mixed.prefill_seqs * mixed.prefill_len**2
    assert batch.decode_context_tokens == mixed.decode_ctx_sum
    assert batch.num_seqs == mixed.prefill_seqs + mixed.decode_seqs
    assert mixed.time_s < 1.0  # graph_ms was converted to seconds


def test_scheduler_batch_matches_profile_prefill_row() -> None:
    """A one-request 512-token prefill from the real scheduler costs what the profile row 1x512 predicts."""
    row = next(
        r for r in load_profile(PROFILE_CSV_PATH, "llama-2-7b")
        if r.kind == "prefill" and r.prefill_seqs == 1 and r.prefill_len == 512
    )
    scheduler = Scheduler(EngineConfig())
    scheduler.add_request(SimRequest("a", 512, 1, 0.0))
    batch = scheduler.schedule()
    model = LinearBatchTimeModel.default("llama-2-7b")
    assert dataclasses.astuple(batch) == dataclasses.astuple(dataclasses.replace(row.to_batch(),
                                                                                  num_scheduled_tokens={"a": 512}))
    assert model.step_time_s(batch) == pytest.approx(row.time_s, rel=0.15)


def test_empty_batch_takes_no_time_and_more_decode_context_costs_more() -> None:
    model = LinearBatchTimeModel.default("qwen2-7b")
    assert model.step_time_s(ScheduledBatch()) == 0.0
    short = ScheduledBatch({"a": 1}, num_decode_seqs=1, decode_context_tokens=100)
    long = ScheduledBatch({"a": 1}, num_decode_seqs=1, decode_context_tokens=10_000)
    assert 0 < model.step_time_s(short) < model.step_time_s(long)


def test_step_and_decode_run_times_are_the_formula_by_hand() -> None:
    """Pins each term (the fast predictor and stepping share the formula: they agree even if it is wrong)."""
    model = LinearBatchTimeModel("m", c0_s=1e-3, c1_s_per_token=1e-5, c2_s_per_token2=1e-8, c3_s_per_token=1e-6,
                                 c4_s_per_seq=1e-4)
    # 1 ms + 100 tokens x 10 us + 1,000 tokens^2 x 10 ns + 500 context tokens x 1 us + 4 seqs x 100 us
    assert model.step_time_from_counts_s(100, 1000, 500, 4) == pytest.approx(0.00291, rel=1e-12)
    # 3 decode steps of 4 seqs from 500 context tokens: 3 x (1 ms + 4 x 10 us + 500 x 1 us + 4 x 100 us) plus
    # the context growth, 1 us x 4 seqs x (0 + 1 + 2) steps
    assert model.decode_run_time_from_counts_s(4, 500, 3) == pytest.approx(3 * 0.00194 + 12e-6, rel=1e-12)
