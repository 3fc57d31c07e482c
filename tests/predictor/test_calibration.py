"""Tests for predictor/calibration.py: online refits of the step-time model from measured steps."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest

from predictor.calibration import StepSample, StepTimeCalibrator
from predictor.sim.batch_time import LinearBatchTimeModel

PRIOR = LinearBatchTimeModel.default("llama-2-7b")
# An engine the prior has never seen: every step 2.5x as long, and a larger fixed cost (a CPU-bound engine).
TRUE = dataclasses.replace(PRIOR.scaled(2.5), c0_s=0.015)


def _steps(model: LinearBatchTimeModel, n: int, rng: random.Random, *, noise: float = 0.03,
           decode_only: bool = False) -> list[StepSample]:
    """Steps of random shapes (decodes with random contexts, sometimes a prefill chunk) timed by ``model``."""
    out = []
    for _ in range(n):
        seqs = rng.randint(1, 48)
        chunk = 0 if decode_only or rng.random() < 0.6 else rng.randint(16, 512)
        context = sum(rng.randint(50, 2000) for _ in range(seqs))
        attention = chunk * (chunk + rng.randint(0, 500)) if chunk else 0
        num_seqs = seqs + (1 if chunk else 0)
        t = model.step_time_from_counts_s(seqs + chunk, attention, context, num_seqs)
        out.append(StepSample(seqs + chunk, attention, context, num_seqs, t * max(0.2, 1 + rng.gauss(0, noise))))
    return out


def _error_on_fresh_shapes(model: LinearBatchTimeModel, truth: LinearBatchTimeModel, seed: int = 99) -> float:
    fresh = _steps(truth, 500, random.Random(seed), noise=0.0)
    return float(np.mean([abs(model.step_time_from_counts_s(s.num_tokens, s.prefill_attention_work,
                                                              s.decode_context_tokens, s.num_seqs) / s.duration_s - 1)
                          for s in fresh]))


def _feed(calibrator: StepTimeCalibrator, batches, now_s: float = 0.0) -> float:
    for batch in batches:
        calibrator.observe(batch)
        now_s += 1.0
        calibrator.maybe_refit(now_s)
    return now_s


def test_it_converges_on_an_engine_whose_coefficients_differ_from_the_prior():
    rng = random.Random(0)
    calibrator = StepTimeCalibrator(PRIOR)
    assert _error_on_fresh_shapes(PRIOR, TRUE) > 0.5  # the prior is far off
    _feed(calibrator, (_steps(TRUE, 50, rng) for _ in range(20)))
    status = calibrator.status()
    assert status.source == "online" and status.num_refits >= 3
    assert status.residual < 0.05 < 0.5 < status.prior_residual  # 3% noise on the steps
    assert _error_on_fresh_shapes(calibrator.model, TRUE) < 0.03
    assert status.scale_vs_prior == pytest.approx(2.6, rel=0.15)


def test_it_recovers_after_the_engine_changes():
    rng = random.Random(1)
    calibrator = StepTimeCalibrator(PRIOR, window=256)
    now_s = _feed(calibrator, (_steps(TRUE, 50, rng) for _ in range(15)))
    slower = TRUE.scaled(1.8)  # e.g. a noisy neighbour
    assert _error_on_fresh_shapes(calibrator.model, slower) > 0.4
    _feed(calibrator, (_steps(slower, 50, rng) for _ in range(20)), now_s)
    assert _error_on_fresh_shapes(calibrator.model, slower) < 0.04


def test_outliers_do_not_corrupt_the_fit():
    rng = random.Random(2)
    calibrator = StepTimeCalibrator(PRIOR)
    batches = []
    for _ in range(20):
        batch = _steps(TRUE, 50, rng)
        # 5% of steps 20x as long (a stalled process, a GC pause) and 2% 50x as short
        batch = [dataclasses.replace(s, duration_s=s.duration_s * (20 if rng.random() < 0.05 else
                                                                   0.02 if rng.random() < 0.02 else 1))
                 for s in batch]
        batches.append(batch)
    _feed(calibrator, batches)
    assert calibrator.status().num_outliers > 0
    assert _error_on_fresh_shapes(calibrator.model, TRUE) < 0.05


def test_an_idle_engine_leaves_the_model_alone():
    calibrator = StepTimeCalibrator(PRIOR)
    for now_s in range(100):
        calibrator.observe([])
        assert not calibrator.maybe_refit(float(now_s))
    status = calibrator.status()
    assert calibrator.model == PRIOR and status.source == "prior" and status.num_samples == 0
    assert math.isnan(status.residual) and status.scale_vs_prior == 1.0


def test_no_refit_before_the_minimum_sample_size_and_bad_steps_are_ignored():
    rng = random.Random(3)
    calibrator = StepTimeCalibrator(PRIOR, min_samples=64)
    calibrator.observe(_steps(TRUE, 63, rng))
    calibrator.observe([StepSample(0, 0, 0, 0, 0.01), StepSample(5, 0, 100, 5, float("nan")),
                        StepSample(5, 0, 100, 5, -1.0), StepSample(5, 0, 100, 5, 0.0)])
    assert calibrator.status().num_samples == 63 and not calibrator.maybe_refit(10.0)
    calibrator.observe(_steps(TRUE, 1, rng))
    assert calibrator.maybe_refit(10.0) and calibrator.status().source == "online"


def test_one_refit_changes_no_prediction_by_more_than_max_change():
    rng = random.Random(4)
    calibrator = StepTimeCalibrator(PRIOR, max_change=1.5)
    steps = _steps(TRUE, 200, rng)
    calibrator.observe(steps)
    assert calibrator.refit()
    for s in steps:
        ratio = (calibrator.model.step_time_from_counts_s(s.num_tokens, s.prefill_attention_work,
                                                          s.decode_context_tokens, s.num_seqs)
                 / PRIOR.step_time_from_counts_s(s.num_tokens, s.prefill_attention_work, s.decode_context_tokens,
                                                 s.num_seqs))
        assert 1 / 1.5 - 1e-9 <= ratio <= 1.5 + 1e-9


def test_a_refit_that_does_not_improve_is_rejected_and_the_last_good_model_stays():
    rng = random.Random(5)
    calibrator = StepTimeCalibrator(PRIOR)
    calibrator.observe(_steps(PRIOR, 200, rng, noise=0.0))  # the prior is already exact: nothing to gain
    assert not calibrator.refit()
    assert calibrator.model == PRIOR and calibrator.status().num_rejected == 1


def test_a_decode_only_window_keeps_the_prior_shape_where_it_cannot_see():
    rng = random.Random(6)
    calibrator = StepTimeCalibrator(PRIOR)
    _feed(calibrator, (_steps(TRUE, 50, rng, decode_only=True) for _ in range(20)))
    # Prefill attention was never exercised: its coefficient is the prior's, scaled like the rest (TRUE = 2.5x).
    assert calibrator.model.c2_s_per_token2 == pytest.approx(2.5 * PRIOR.c2_s_per_token2, rel=0.3)
    decode_steps = _steps(TRUE, 300, random.Random(7), noise=0.0, decode_only=True)
    assert np.mean([abs(calibrator.model.step_time_from_counts_s(s.num_tokens, 0, s.decode_context_tokens,
                                                                 s.num_seqs) / s.duration_s - 1)
                    for s in decode_steps]) < 0.03


@pytest.mark.parametrize("kwargs", [{"window": 8}, {"min_samples": 0}, {"min_samples": 600}, {"max_change": 1.0},
                                    {"ridge": -1.0}, {"outlier_k": 0.0}])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        StepTimeCalibrator(PRIOR, **kwargs)


def test_a_refit_on_a_narrow_window_still_gives_every_batch_a_positive_time():
    rng = random.Random(8)
    calibrator = StepTimeCalibrator(PRIOR, min_samples=16)
    # Only big decode batches with long contexts, timed by an engine with no per-token cost at all.
    flat = dataclasses.replace(TRUE, c1_s_per_token=0.0, c3_s_per_token=0.0, c4_s_per_seq=0.0)
    _feed(calibrator, ([s for s in _steps(flat, 80, rng, decode_only=True, noise=0.3) if s.num_seqs > 30]
                       for _ in range(20)))
    model = calibrator.model
    assert model.c0_s > 0 and min(model.c1_s_per_token, model.c2_s_per_token2, model.c3_s_per_token) >= 0
    for shape in [(1, 0, 1, 1), (512, 512 * 512, 0, 1), (48, 0, 48 * 4096, 48), (1, 1, 0, 1)]:
        assert model.step_time_from_counts_s(*shape) > 0


def test_no_refit_is_attempted_without_new_steps():
    rng = random.Random(9)
    calibrator = StepTimeCalibrator(PRIOR)
    calibrator.observe(_steps(TRUE, 100, rng))
    assert calibrator.maybe_refit(0.0)
    before = calibrator.status()
    for now_s in range(1, 30):  # the engine idles: nothing new, nothing attempted, nothing counted
        assert not calibrator.maybe_refit(float(now_s))
    after = calibrator.status()
    assert (after.num_refits, after.num_rejected) == (before.num_refits, before.num_rejected)


def test_steps_that_run_late_and_catch_up_keep_the_model_on_their_sum():
    """An engine on a deadline (the emulator on a loaded CPU): a step that runs 8x late is followed by steps that
    take almost nothing until the deadline is met again; single steps scatter, their sum stays on the model. Most
    steps of a window are then catch-ups, so a median ratio put the model 20x too fast (its sidecar then drew 15 of
    a 64-request burst over 8 instances through Envoy); the total ratio keeps a prefill's price near the truth."""
    rng = random.Random(7)
    calibrator = StepTimeCalibrator(PRIOR, min_samples=64, refit_interval_s=0.0)
    debt_s = 0.0  # how far the engine runs behind its deadline
    for round_ in range(20):
        steps = []
        for _ in range(40):
            seqs = rng.randint(1, 4)
            chunk = 69 if rng.random() < 0.1 else 0
            context = sum(rng.randint(60, 90) for _ in range(seqs))
            num_seqs = seqs + (1 if chunk else 0)
            t = PRIOR.step_time_from_counts_s(seqs + chunk, chunk * chunk, context, num_seqs)
            if debt_s <= 0 and rng.random() < 0.15:  # a stall: this step takes 8x, the next ones catch up
                duration_s, debt_s = 8 * t, 7 * t
            elif debt_s > 0:
                duration_s = max(t - debt_s, 0.03 * t)
                debt_s -= t - duration_s
            else:
                duration_s = t
            steps.append(StepSample(seqs + chunk, chunk * chunk, context, num_seqs, duration_s))
        calibrator.observe(steps)
        calibrator.maybe_refit(float(round_))
    truth = PRIOR.step_time_from_counts_s(69, 69 * 69, 0, 1)
    assert calibrator.model.step_time_from_counts_s(69, 69 * 69, 0, 1) >= 0.3 * truth
