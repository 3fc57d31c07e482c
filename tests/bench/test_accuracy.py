"""The accuracy benchmark's figures from recorded outcomes (the replay itself runs in the vLLM tier's bench)."""

import pytest

from bench.accuracy import Outcome, summarize


def test_mape_and_hindsight_agreement():
    outcomes = [
        Outcome(predicted_e2e_s=1.0, actual_e2e_s=2.0, other_predicted_e2e_s=1.5, other_actual_e2e_s=3.0),  # right
        Outcome(predicted_e2e_s=3.0, actual_e2e_s=2.0, other_predicted_e2e_s=4.0, other_actual_e2e_s=1.0),  # wrong
        Outcome(predicted_e2e_s=1.0, actual_e2e_s=1.0, other_predicted_e2e_s=2.0),  # not probed
    ]
    summary = summarize([*outcomes, RuntimeError("failed")])
    assert summary["mape"] == pytest.approx((0.5 + 0.5 + 0.0) / 3)
    assert summary["probes"] == 2 and summary["agreement"] == pytest.approx(0.5) and summary["errors"] == 1
    assert summary["mean_actual_e2e_s"] == pytest.approx(5 / 3)
