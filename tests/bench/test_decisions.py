"""bench.decisions: joining decision logs with results; overhead, bases, prediction quality, hindsight agreement."""

import json
import math

import pytest

from bench.decisions import hindsight_agreement, read_decisions, summarize_decisions
from bench.loadgen import RequestResult

A, B = "10.0.0.1:80", "10.0.0.2:80"


def record(i, dest, ttft_s, e2e_s, basis="prediction", routing_s=0.001):
    return {"request_id": f"r{i}", "basis": basis, "routing_s": routing_s, "destination": dest,
            "candidates": [{"endpoint": dest, "ttft_s": ttft_s, "e2e_s": e2e_s, "state_age_s": 0.0},
                           {"endpoint": B if dest == A else A, "ttft_s": None, "e2e_s": None, "state_age_s": None}]}


def result(i, ttft_s, e2e_s, send_s):
    return RequestResult(f"r{i}", 10, 5, send_s, 200, None, ttft_s, e2e_s, 5, None)


def test_prediction_errors_and_overhead():
    records = [record(0, A, 0.1, 1.0, routing_s=0.002), record(1, B, 0.2, 2.0, routing_s=0.004),
               record(2, A, None, None, basis="fallback")]
    results = [result(0, 0.2, 1.0, 0.0), result(1, 0.2, 4.0, 0.1), result(2, 0.1, 1.0, 0.2)]
    summary = summarize_decisions(records, results)
    assert summary.num_decisions == 3 and summary.num_scored == 2
    assert summary.ttft_mape == pytest.approx((0.5 + 0.0) / 2)
    assert summary.e2e_mape == pytest.approx((0.0 + 0.5) / 2)
    assert summary.basis_share["prediction"] == pytest.approx(2 / 3)
    assert summary.basis_share["fallback"] == pytest.approx(1 / 3)
    assert math.isnan(summary.ttft_hindsight_agreement)  # fewer than 10 pairs


def test_hindsight_agreement_counts_pairs_across_instances_close_in_time():
    send = [0.01 * i for i in range(40)]
    inst = [A if i % 2 else B for i in range(40)]
    predicted = [float(i % 5) for i in range(40)]
    agreement, pairs = hindsight_agreement(send, inst, predicted, predicted, window_s=0.05)
    assert agreement == 1.0 and pairs > 10
    reverse, _ = hindsight_agreement(send, inst, predicted, [-p for p in predicted], window_s=0.05)
    assert reverse == 0.0
    _, same_instance_pairs = hindsight_agreement(send, [A] * 40, predicted, predicted)
    assert same_instance_pairs == 0


def test_read_decisions_skips_missing_files_and_torn_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(record(0, A, 0.1, 1.0)) + "\n" + '{"request_id": "r1", "bas')
    assert [r["request_id"] for r in read_decisions([path, tmp_path / "missing.jsonl"])] == ["r0"]
