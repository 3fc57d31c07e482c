"""Tests for predictor/outcomes.py: predictions checked against what happened, hand-computed."""

from __future__ import annotations

import math

import pytest

from predictor.outcomes import MAX_CORRECTION, OutcomeTracker


def test_errors_match_hand_computed_cases():
    tracker = OutcomeTracker()
    tracker.admit("a", 10.0, predicted_ttft_s=0.1, predicted_e2e_s=1.0)
    tracker.admit("b", 11.0, predicted_ttft_s=0.3, predicted_e2e_s=4.0)
    tracker.first_token("a", 10.2)
    tracker.first_token("a", 10.9)  # only the first counts
    tracker.first_token("b", 11.2)
    assert tracker.release("a", 12.0) == ("a", 0.1, pytest.approx(0.2), 1.0, pytest.approx(2.0))
    tracker.release("b", 13.0)
    # TTFT: |0.1-0.2|/0.2 = 0.5, |0.3-0.2|/0.2 = 0.5; E2E: |1-2|/2 = 0.5, |4-2|/2 = 1.0
    assert tracker.ttft.count == 2 and tracker.ttft.mape == pytest.approx(0.5)
    assert tracker.e2e.count == 2 and tracker.e2e.mape == pytest.approx(0.75)
    # bias: geometric mean of predicted/observed: sqrt(0.5 * 1.5), sqrt(0.5 * 2.0)
    assert tracker.ttft.bias == pytest.approx(math.sqrt(0.75))
    assert tracker.e2e.bias == pytest.approx(1.0)
    record = tracker.as_dict()
    assert record["e2e"]["count"] == 2 and [r[0] for r in record["recent"]] == ["a", "b"]


def test_a_request_without_a_prediction_or_a_first_token_is_checked_only_where_it_can_be():
    tracker = OutcomeTracker()
    tracker.admit("none", 0.0, predicted_ttft_s=0.0, predicted_e2e_s=0.0)
    tracker.admit("nan", 0.0, predicted_ttft_s=float("nan"), predicted_e2e_s=float("inf"))
    assert not tracker.is_tracked("none") and not tracker.is_tracked("nan")
    assert tracker.release("none", 1.0) is None
    tracker.admit("ledger", 0.0, predicted_ttft_s=0.1, predicted_e2e_s=1.0)  # no first token seen
    tracker.release("ledger", 1.0)
    assert tracker.e2e.count == 1 and tracker.ttft.count == 0 and math.isnan(tracker.ttft.mape)
    tracker.first_token("unknown", 1.0)  # ignored
    assert tracker.release("ledger", 2.0) is None  # released twice: counted once


def test_a_late_admit_leaves_the_ttft_unchecked_and_the_e2e_checked():
    # The router does not wait for its Admit: one handled after the engine's first token (or after the engine
    # received the request) would measure a TTFT of nothing, clamped to 1 us (a 1,000-request demo's TTFT MAPE
    # went from ~45% to 1,687% on one such request).
    tracker = OutcomeTracker()
    tracker.admit("after-first-token", 10.0, predicted_ttft_s=0.02, predicted_e2e_s=2.0)
    tracker.first_token("after-first-token", 9.99)
    assert not tracker.awaits_first_token("after-first-token")  # the Release need not read the state again
    tracker.admit("after-arrival", 10.0, predicted_ttft_s=0.02, predicted_e2e_s=2.0)
    tracker.engine_arrival("after-arrival", 9.995)
    tracker.first_token("after-arrival", 10.001)
    tracker.admit("on-time", 10.0, predicted_ttft_s=0.02, predicted_e2e_s=2.0)
    tracker.engine_arrival("on-time", 10.004)
    tracker.first_token("on-time", 10.025)
    late = tracker.release("after-first-token", 12.0)
    assert late is not None and late[2] is None and late[4] == pytest.approx(2.0)
    assert tracker.release("after-arrival", 12.0)[2] is None
    assert tracker.release("on-time", 12.0)[2] == pytest.approx(0.025)
    assert tracker.ttft.count == 1 and tracker.ttft.mape == pytest.approx(0.2)
    assert tracker.e2e.count == 3
    assert tracker.num_ttft_unobservable == 2 and tracker.as_dict()["ttft_unobservable"] == 2
    tracker.engine_arrival("unknown", 1.0)  # ignored


def test_bias_correction_cancels_a_persistent_bias_after_enough_requests_and_is_bounded():
    tracker = OutcomeTracker(bias_correction=True, min_samples=10)
    for i in range(9):
        tracker.admit(f"r{i}", 0.0, 0.1, 1.0)
        tracker.release(f"r{i}", 2.0)  # always predicted half of what happened
    assert tracker.correction("e2e") == 1.0  # not enough requests yet
    tracker.admit("r9", 0.0, 0.1, 1.0)
    tracker.release("r9", 2.0)
    assert tracker.correction("e2e") == pytest.approx(2.0)
    assert tracker.correction("ttft") == 1.0 and tracker.ttft_offset_s() == 0.0  # no TTFT was observed
    for i in range(200):
        tracker.admit(f"s{i}", 0.0, 0.1, 0.01)
        tracker.release(f"s{i}", 2.0)  # 200x too short
    assert tracker.correction("e2e") == MAX_CORRECTION
    assert OutcomeTracker().correction("e2e") == 1.0  # off by default


def test_ttft_is_corrected_by_the_delay_the_engine_does_not_see():
    tracker = OutcomeTracker(bias_correction=True, min_samples=5)
    for i in range(40):
        tracker.admit(f"r{i}", 0.0, 0.005 + tracker.ttft_offset_s(), 1.0)  # the router acts on the corrected one
        tracker.first_token(f"r{i}", 0.035)  # 30 ms in the API server before the engine saw it
        tracker.release(f"r{i}", 1.0)
    assert tracker.ttft_offset_s() == pytest.approx(0.030)
    assert tracker.correction("e2e") == pytest.approx(1.0)
    assert OutcomeTracker(bias_correction=False).ttft_offset_s() == 0.0


def test_corrections_are_learnt_from_uncorrected_predictions_and_do_not_oscillate():
    tracker = OutcomeTracker(bias_correction=True, min_samples=5)
    for i in range(200):  # the sidecar's raw predictions: half the E2E, 30 ms short on TTFT
        factor, offset = tracker.correction("e2e"), tracker.ttft_offset_s()
        tracker.admit(f"r{i}", 0.0, 0.005 + offset, 1.0 * factor)  # what the router acted on: corrected
        tracker.first_token(f"r{i}", 0.035)
        tracker.release(f"r{i}", 2.0)
    assert tracker.correction("e2e") == pytest.approx(2.0) and tracker.ttft_offset_s() == pytest.approx(0.030)
    assert tracker.recent[-1][3] == pytest.approx(2.0) and tracker.recent[-1][1] == pytest.approx(0.035)


def test_a_request_the_backend_refused_is_not_scored():
    tracker = OutcomeTracker()
    tracker.admit("refused", 10.0, predicted_ttft_s=0.1, predicted_e2e_s=5.0)
    assert tracker.release("refused", 10.01, scored=False) is None  # a 400 after 10 ms says nothing of 5 s
    assert tracker.e2e.count == 0 and tracker.release("refused", 11.0) is None  # forgotten, not pending
