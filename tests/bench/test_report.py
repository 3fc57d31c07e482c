"""Tests of bench/report.py: hand-computed statistics and the table layout."""

from __future__ import annotations

import dataclasses
import math

import pytest

import numpy as np

from bench.decisions import summarize_decisions
from bench.loadgen import RequestResult
from bench.report import (
    ControlPlaneCost,
    PolicyRun,
    PolicySummary,
    compare,
    format_comparison,
    format_costs,
    format_table,
    summarize,
)

A, B, C = "127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"


def _ok(i: int, ttft_s: float, e2e_s: float, instance: str) -> RequestResult:
    return RequestResult(f"r{i}", 10, 5, 0.1 * i, 200, instance, ttft_s, e2e_s, 5, None)


def _err(i: int, instance: str | None, status: int | None) -> RequestResult:
    return RequestResult(f"e{i}", 10, 5, 0.0, status, instance, 0.001, None, None, "boom")


def test_summarize_hand_computed() -> None:
    results = [
        _ok(0, 1.0, 2.0, A),
        _ok(1, 2.0, 4.0, A),
        _ok(2, 3.0, 6.0, B),
        _ok(3, 4.0, 8.0, B),
        _ok(4, 5.0, 10.0, B),
        _err(5, A, 500),  # reached an instance: counted there, excluded from latencies
        _err(6, None, None),  # reached no instance
    ]
    s = summarize("round-robin", results)
    assert (s.policy, s.num_requests, s.num_errors) == ("round-robin", 7, 2)
    # Linear interpolation (numpy default): p = x[0] + q/100 * (n-1) steps; n=5 -> p99 at rank 3.96.
    assert s.ttft_mean_s == pytest.approx(3.0)
    assert s.ttft_p50_s == pytest.approx(3.0)
    assert s.ttft_p99_s == pytest.approx(4.96)
    assert s.e2e_mean_s == pytest.approx(6.0)
    assert s.e2e_p99_s == pytest.approx(9.92)
    assert s.requests_per_instance == {A: 3, B: 3}


def test_summarize_with_no_success_gives_nan_latencies() -> None:
    s = summarize("random", [_err(0, A, 503)])
    assert (s.num_requests, s.num_errors) == (1, 1)
    assert all(math.isnan(v) for v in (s.ttft_mean_s, s.ttft_p50_s, s.ttft_p99_s, s.e2e_mean_s, s.e2e_p99_s))


def test_summarize_empty() -> None:
    s = summarize("random", [])
    assert (s.num_requests, s.num_errors, s.requests_per_instance) == (0, 0, {})


def _summary(policy: str, per_instance: dict[str, int], ttft_mean_s: float = 0.1234) -> PolicySummary:
    return PolicySummary(policy, 10, 1, ttft_mean_s, 0.1, 1.5, 2.25, 12.5, per_instance)


def test_format_table_layout() -> None:
    table = format_table(
        [_summary("random", {A: 4, B: 6}), _summary("least-requests", {A: 5, B: 5}, math.nan)], [A, B]
    )
    lines = table.splitlines()
    assert lines[0].split() == [
        "policy", "requests", "errors", "TTFT", "mean", "TTFT", "p50", "TTFT", "p99", "E2E", "mean", "E2E", "p99",
        "i0", "i1",
    ]
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].split() == ["random", "10", "1", "0.123", "0.100", "1.500", "2.250", "12.500", "4", "6"]
    assert lines[3].split() == ["least-requests", "10", "1", "-", "0.100", "1.500", "2.250", "12.500", "5", "5"]
    # Fixed width: the numeric columns end at the same offset in every row.
    assert len({len(line) for line in lines[:4]}) == 1
    assert f"i0 = {A}" in table and f"i1 = {B}" in table
    assert "other" not in lines[0]


def test_format_table_counts_unknown_instances_as_other() -> None:
    table = format_table([_summary("random", {A: 4, C: 6})], [A, B])
    lines = table.splitlines()
    assert lines[0].split()[-3:] == ["i0", "i1", "other"]
    assert lines[2].split()[-3:] == ["4", "0", "6"]


def _run(policy: str, ttfts: list[float], seeds=(0,), decisions=None, predictions=0.0) -> PolicyRun:
    by_seed = {seed: [RequestResult(f"s{seed}-{i}", 10, 5, 0.1 * i, 200, A, t, 2 * t + 1, 5, None)
                      for i, t in enumerate(ttfts)] for seed in seeds}
    n = len(ttfts) * len(seeds)
    return PolicyRun(policy, by_seed, decisions, ControlPlaneCost(policy, n, predictions, 0, 0.5, 0.25, 0.1))


def test_comparison_against_every_baseline_with_paired_intervals() -> None:
    rng = np.random.default_rng(0)
    base = rng.exponential(0.1, size=600).tolist()
    runs = [_run("astrolabe", [0.5 * t for t in base]), _run("least-requests", base),
            _run("round-robin", [t + 0.0 for t in base])]
    comparisons = compare(runs)
    assert {(c.figure, c.baseline) for c in comparisons} == {
        (f, b) for f in ("TTFT p99", "TTFT mean", "TTFT p50", "E2E mean", "E2E p99")
        for b in ("least-requests", "round-robin")}
    p99 = next(c for c in comparisons if c.figure == "TTFT p99" and c.baseline == "least-requests")
    assert p99.ratio.value == pytest.approx(0.5) and p99.verdict == "better" and p99.ratio.high < 1
    text = format_comparison(comparisons)
    assert "verdict: astrolabe's P99 TTFT is lower than every baseline's, and its mean TTFT is no worse" in text


def test_comparison_says_where_it_loses_and_rejects_different_traces() -> None:
    base = [0.1 + 0.001 * i for i in range(300)]
    text = format_comparison(compare([_run("astrolabe", [t * 2 for t in base]), _run("least-requests", base)]))
    assert "NOT lower than that of least-requests (worse); its mean TTFT is worse than least-requests's" in text
    # no P99 win, and no mean loss either: the line says both
    same = format_comparison(compare([_run("astrolabe", base), _run("least-requests", base)]))
    assert "NOT lower than that of least-requests (no difference); its mean TTFT is no worse than any" in same
    with pytest.raises(ValueError, match="same traces"):
        compare([_run("astrolabe", base), _run("least-requests", base[:-1])])


def test_comparison_needs_both_sides() -> None:
    assert "no comparison" in format_comparison(compare([_run("round-robin", [1.0])]))
    assert "no comparison" in format_comparison(compare([_run("astrolabe", [1.0])]))


def test_failed_requests_count_as_infinitely_slow_in_comparisons() -> None:
    base = [0.1] * 200
    ours = _run("astrolabe", base)
    for i in range(0, 200, 20):  # 5% failed, spread over the trace: every resample's P99 is a failure
        ours.results_by_seed[0][i] = RequestResult(f"s0-{i}", 10, 5, 0.0, 503, None, None, None, None, "HTTP 503")
    p99 = next(c for c in compare([ours, _run("least-requests", base)]) if c.figure == "TTFT p99")
    assert p99.ratio.value == math.inf and p99.verdict == "worse"


def test_costs_and_decision_bases_per_request() -> None:
    decisions = summarize_decisions([
        {"request_id": "s0-0", "basis": "prediction", "routing_s": 0.002, "destination": A,
         "candidates": [{"endpoint": A, "ttft_s": 0.1, "e2e_s": 1.2}]},
        {"request_id": "s0-1", "basis": "fallback", "routing_s": 0.004, "destination": A, "candidates": []},
    ], _run("x", [0.1, 0.2]).results)
    text = format_costs([_run("astrolabe", [0.1, 0.2], decisions=decisions, predictions=4),
                         _run("round-robin", [0.1, 0.2])])
    astro = text.splitlines()[2].split()
    assert astro == ["astrolabe", "2.00", "50.0%", "0.0%", "50.0%", "250.00", "50.00", "125.00"]
    assert text.splitlines()[3].split()[1:5] == ["0.00", "-", "-", "-"]


def test_prediction_quality_shows_what_the_sidecars_checked() -> None:
    from bench.decisions import DecisionSummary
    from bench.report import format_prediction_quality
    from bench.sidecar_checks import SidecarChecks

    decisions = DecisionSummary(num_decisions=10, routing_p50_s=0.005, routing_p99_s=0.02, basis_share={"prediction": 1.0}, num_scored=10, ttft_mape=0.5,
                                ttft_median_abs_error_s=0.01, e2e_mape=1.2, e2e_median_abs_error_s=1.5,
                                ttft_hindsight_agreement=0.75, num_pairs=40)
    run = dataclasses.replace(_run("astrolabe", [0.1] * 10, decisions=decisions),
                              sidecar_checks=SidecarChecks(9, 0.25, 10, 0.125, 4, 3, 0.05))
    text = format_prediction_quality([run])
    assert ("astrolabe, checked by the sidecars themselves (admission to first token / to release): TTFT MAPE "
            "25.0% over 9, E2E MAPE 12.5% over 10; step-time model calibrated online on 3 of 4 sidecars (error on "
            "measured steps 5.0%)") in text
