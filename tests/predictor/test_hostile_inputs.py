"""Regression tests for a break-it pass on calibration, outcome checks and sidecar flags (its state-file cases are
in test_state_source.py): every
hostile input is refused or ignored with a clear error, never a crash, a NaN answer or a traceback."""

from __future__ import annotations

import json
import math
import random

import pytest

from astrolabe.cli import main as astrolabe_main
from predictor.calibration import StepSample, StepTimeCalibrator
from predictor.model_shape import nearest_shipped_model, read_model_shape
from predictor.outcomes import OutcomeTracker
from predictor.server import Sidecar, SidecarConfig
from predictor.sim.batch_time import LinearBatchTimeModel

PRIOR = LinearBatchTimeModel.default("llama-2-7b")


def _normal_steps(n: int, rng: random.Random) -> list[StepSample]:
    out = []
    for _ in range(n):
        seqs = rng.randint(1, 32)
        out.append(StepSample(seqs, 0, seqs * 500, seqs, 2 * PRIOR.step_time_from_counts_s(seqs, 0, seqs * 500, seqs)))
    return out


@pytest.mark.parametrize("duration", [1e-310, 5e-324, 1e-12, 1e308, 1e5])
def test_absurd_step_durations_are_ignored_and_a_refit_never_raises(duration):
    rng = random.Random(0)
    calibrator = StepTimeCalibrator(PRIOR, min_samples=16)
    steps = _normal_steps(100, rng)
    calibrator.observe(steps[:50] + [StepSample(4, 0, 100, 4, duration)] * 60 + steps[50:])
    for _ in range(5):  # refit directly: maybe_refit waits for new steps
        calibrator.refit()
    status = calibrator.status()
    assert math.isfinite(status.residual) and status.residual < 0.05
    assert calibrator.model.step_time_from_counts_s(1, 0, 1, 1) > 0


def test_absurd_predictions_are_not_checked_and_never_poison_the_statistics():
    tracker = OutcomeTracker(bias_correction=True, min_samples=2)
    for i, (ttft, e2e) in enumerate([(5e-324, 5e-324), (1.7e308, 1.7e308), (float("nan"), 1e300), (-1, -1)]):
        tracker.admit(f"bad{i}", 0.0, ttft, e2e)
        assert tracker.release(f"bad{i}", 3.0) is None
    tracker.admit("tiny-ttft", 0.0, 5e-324, 1.0)  # E2E checked, TTFT not
    tracker.first_token("tiny-ttft", 0.1)
    tracker.release("tiny-ttft", 2.0)
    tracker.admit("ok", 0.0, 0.1, 1.0)
    tracker.release("ok", 2.0)
    assert tracker.e2e.count == 2 and tracker.ttft.count == 0
    assert tracker.correction("e2e") == pytest.approx(2.0) and math.isfinite(tracker.e2e.mape)


async def test_the_state_is_strict_json_before_the_first_reconciliation():
    sidecar = Sidecar(SidecarConfig(backend="127.0.0.1:1", state_source="ledger"))
    text = json.dumps(sidecar.state())

    def refuse(token):
        raise AssertionError(f"non-standard JSON token {token}")

    state = json.loads(text, parse_constant=refuse)
    assert state["state_age_s"] is None


@pytest.mark.parametrize("flags", [
    ["--metrics-listen", "bogus"], ["--metrics-listen", "127.0.0.1:99999"], ["--metrics-listen", ":9000"],
    ["--listen", "bogus"], ["--time-scale", "inf"], ["--calibration-min-samples", "0"]])
def test_bad_sidecar_flags_exit_2(flags):
    assert astrolabe_main(["predictor", "serve", "--backend", "127.0.0.1:1", *flags]) == 2


def test_an_unbindable_metrics_address_exits_2():
    assert astrolabe_main(["predictor", "serve", "--backend", "127.0.0.1:1", "--listen", "127.0.0.1:0",
                           "--metrics-listen", "192.0.2.1:0"]) == 2  # TEST-NET-1: not an address of this host


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"num_hidden_layers": 2, "hidden_size": 1' +
                                  "0" * 400 + "}", b"\xff\xfe".decode("latin-1")])
def test_a_hostile_model_config_is_a_value_error_naming_the_file(tmp_path, text):
    path = tmp_path / "config.json"
    path.write_text(text, encoding="latin-1")
    with pytest.raises(ValueError, match="config.json"):
        read_model_shape(path)


def test_a_small_mha_config_without_heads_finds_a_shape(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64}))
    name, distance = nearest_shipped_model(read_model_shape(path))
    assert name and math.isfinite(distance)
