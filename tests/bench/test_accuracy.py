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


def test_warm_up_requests_are_not_scored():
    outcomes = [Outcome(10.0, 1.0, 1.0)] * 3 + [Outcome(1.0, 1.0, 2.0)] * 2
    assert summarize(outcomes, warmup=3)["mape"] == 0.0 and summarize(outcomes, warmup=3)["requests"] == 2


def test_calibration_cost_is_measured():
    from bench.accuracy import calibration_cost_us

    observe_us, refit_ms = calibration_cost_us(window=64, repeats=2)
    assert observe_us > 0 and refit_ms > 0


def test_sidecar_checks_pool_the_difference_between_two_readings():
    from bench.sidecar_checks import checks_between

    def state(count, mape, source="online", residual=0.05):
        return {"outcomes": {"e2e": {"count": count, "mape": mape}, "ttft": {"count": 0, "mape": None}},
                "calibration": {"source": source, "residual": residual}}

    before = {"a": state(10, 0.5), "b": state(0, None, "prior", None)}
    after = {"a": state(20, 0.3), "b": state(10, 0.2, "online", 0.15)}
    checks = checks_between(before, after)
    # a: 10 new with |err| sum 20*0.3 - 10*0.5 = 1.0; b: 10 new with 2.0 -> 3.0 / 20
    assert checks.e2e_count == 20 and checks.e2e_mape == pytest.approx(0.15)
    assert checks.ttft_count == 0 and checks.num_calibrated == 2 and checks.residual == pytest.approx(0.1)


def test_the_ingress_summary_reads_each_sidecars_state():
    from bench.accuracy import ingress_summary

    states = {"a": {"ingress": {"num_samples": 64, "delay_s": 0.0123, "mean_s": 0.2}},
              "b": {"ingress": {"num_samples": 0, "delay_s": 0.0, "mean_s": None}}, "c": {}}
    assert ingress_summary(states) == "0.012 / 0.200, -, -"
    assert ingress_summary({}) == "-"


def test_one_server_outcomes_have_no_hindsight():
    summary = summarize([Outcome(1.0, 2.0, float("nan")), Outcome(2.0, 2.0, float("nan"))])
    assert summary["mape"] == pytest.approx(0.25) and summary["probes"] == 0
