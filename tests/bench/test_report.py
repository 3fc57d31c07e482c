"""Tests of bench/report.py: hand-computed statistics and the table layout."""

from __future__ import annotations

import math

import pytest

from bench.loadgen import RequestResult
from bench.report import PolicySummary, format_table, summarize

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


def _row(policy: str, ttft_p99_s: float, e2e_p99_s: float) -> PolicySummary:
    return PolicySummary(policy, 10, 0, 1.0, 0.5, ttft_p99_s, 2.0, e2e_p99_s, {})


def test_comparison_ratios_against_the_best_baseline() -> None:
    from bench.report import format_comparison

    text = format_comparison([_row("astrolabe", 1.0, 6.0), _row("round-robin", 4.0, 5.0),
                              _row("least-requests", 2.0, 8.0)], "astrolabe")
    rows = {line.split()[0] + " " + line.split()[1]: line.split() for line in text.splitlines()[2:7]}
    assert rows["TTFT p99"][-2:] == ["least-requests", "0.50x"]  # 1.0 / 2.0
    assert rows["E2E p99"][-2:] == ["round-robin", "1.20x"]  # 6.0 / 5.0
    assert rows["TTFT mean"][-1] == "1.00x"


def test_comparison_needs_both_sides() -> None:
    from bench.report import format_comparison

    assert "no comparison" in format_comparison([_row("round-robin", 1, 1)], "astrolabe")
    assert "no comparison" in format_comparison([_row("astrolabe", 1, 1)], "astrolabe")


def test_costs_per_request() -> None:
    from bench.report import ControlPlaneCost, format_costs

    text = format_costs([ControlPlaneCost("astrolabe", 200, 400, 3, 1.5, 0.8),
                         ControlPlaneCost("round-robin", 200, 0, 0, 0.5, 0.1)])
    astro = text.splitlines()[2].split()
    assert astro == ["astrolabe", "2.00", "3", "7.50", "4.00"]
    assert text.splitlines()[3].split()[1:3] == ["0.00", "0"]
