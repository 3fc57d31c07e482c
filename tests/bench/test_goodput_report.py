"""Tests of bench/goodput_report.py: the router label syntax, the class draw, and goodput from per-request arrays."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from bench.goodput_report import (CRITICAL, SHEDDABLE, RouterLabel, class_rng, draw_classes, format_ratios,
                                  format_rows, met_objectives, parse_label, pooled_row, write_csv)


def test_labels_split_into_router_rule_bound_window_and_engine_policy():
    assert parse_label("astrolabe") == RouterLabel("astrolabe", "astrolabe")
    assert parse_label("astrolabe+slo") == RouterLabel("astrolabe+slo", "astrolabe", "slo")
    assert parse_label("astrolabe-k2+headroom=0.25@1/priority") == RouterLabel(
        "astrolabe-k2+headroom=0.25@1/priority", "astrolabe-k2", "headroom", 0.25, 1.0, True)
    assert parse_label("least-requests/priority").engine_priority
    assert parse_label("astrolabe-k2:prefer_meeting=false+slo").base == "astrolabe-k2:prefer_meeting=false"
    for bad in ("astrolabe+refuse", "astrolabe+slo=1", "astrolabe+headroom=x", "astrolabe+headroom@x",
                "astrolabe/lifo", "+slo", "/priority"):
        with pytest.raises(ValueError):
            parse_label(bad)
    with pytest.raises(ValueError):
        parse_label("astrolabe+none", rules=("slo", "headroom"))


def test_classes_are_drawn_per_request_from_the_seed():
    classes = draw_classes(4000, class_rng(0))
    assert set(classes) == {CRITICAL, SHEDDABLE}
    assert 0.38 < classes.count(CRITICAL) / len(classes) < 0.42
    assert draw_classes(100, class_rng(0)) == classes[:100]  # the same seed, the same classes
    assert draw_classes(100, class_rng(1)) != classes[:100]
    # the simulation's draw before it was shared: random.Random(seed + 7), one random() per request
    rng = random.Random(7)
    assert classes[:50] == [CRITICAL if rng.random() < 0.4 else SHEDDABLE for _ in range(50)]
    assert draw_classes(10, class_rng(0), critical_frac=0.0) == [SHEDDABLE] * 10


def _hand_made():
    """Ten requests of one seed: critical met (0.5 s), critical missed (2 s), critical met (1 s exactly),
    sheddable met (3 s), sheddable missed (6 s), sheddable refused (x3), critical failed, sheddable met (0.1 s)."""
    nan = math.nan
    ttfts = np.array([0.5, 2.0, 1.0, 3.0, 6.0, nan, nan, nan, nan, 0.1])
    critical = np.array([True, True, True, False, False, False, False, False, True, False])
    objectives = np.where(critical, 1.0, 5.0)
    refused = np.array([False] * 5 + [True] * 3 + [False, False])
    return ttfts, objectives, critical, refused


def test_a_refused_or_failed_request_meets_nothing():
    ttfts, objectives, _, _ = _hand_made()
    assert met_objectives(ttfts, objectives).tolist() == [1, 0, 1, 1, 0, 0, 0, 0, 0, 1]
    assert met_objectives(np.array([100.0]), np.array([np.inf])).tolist() == [1.0]  # no objective: always met


def test_pooled_row_counts_goodput_attainment_and_refusals_per_class():
    ttfts, objectives, critical, refused = _hand_made()
    row = pooled_row("r", 1.5, 30.0, ttfts, objectives, critical, np.zeros(10, dtype=int), refused, num_errors=1)
    assert row.goodput.value == pytest.approx(30.0 * 4 / 10)  # 4 of 10 arrivals met, x the offered rate
    assert row.goodput.low <= row.goodput.value <= row.goodput.high
    assert row.attainment[CRITICAL] == pytest.approx(2 / 4)  # the failed critical request missed
    assert row.attainment[SHEDDABLE] == pytest.approx(2 / 6)
    assert row.shed_frac == {CRITICAL: 0.0, SHEDDABLE: pytest.approx(3 / 6)}
    assert (row.num_shed, row.num_critical_shed, row.num_errors) == (3, 0, 1)
    # P99 over the served requests only (a refusal or a failure has no TTFT)
    assert row.ttft_p99_s[CRITICAL].value == pytest.approx(np.percentile([0.5, 2.0, 1.0], 99))
    assert row.ttft_p99_s[SHEDDABLE].value == pytest.approx(np.percentile([3.0, 6.0, 0.1], 99))
    table = format_rows([row])
    assert "errors" in table.splitlines()[0] and "shed, unprobed met" not in table
    assert "50.0% (3)" in table and "0.0% (0)" in table


def test_ratios_pair_the_same_requests(tmp_path):
    ttfts, objectives, critical, refused = _hand_made()
    groups = np.zeros(10, dtype=int)
    met_ref = met_objectives(ttfts, objectives)
    everything = np.ones(10)
    met = {("ref", 1.0): (met_ref, groups), ("ref", 2.0): (met_ref, groups), ("all", 1.0): (everything, groups),
           ("all", 2.0): (everything, groups)}
    text = format_ratios(met, ["all", "ref"], "ref", [1.0, 2.0])
    # one bootstrap block (10 requests < 50): the interval is the ratio itself; 10 met / 4 met
    assert "  all: 1x 2.50 [2.50, 2.50] higher; 2x 2.50 [2.50, 2.50] higher" in text
    assert "  all: 2x 2.00 [2.00, 2.00]" in text  # twice the rate, the same attainment
    assert format_ratios(met, ["all"], "missing", [1.0, 2.0]).startswith("goodput / the router's own")
    row = pooled_row("r", 1.0, 10.0, ttfts, objectives, critical, groups, refused)
    lines = write_csv(tmp_path / "g.csv", [row], 'a "setting"').read_text().splitlines()
    header, values = lines[0].split(","), lines[1].split(",")
    assert header[-1] == "settings" and values[-1] == "\"a 'setting'\""
    assert values[header.index("num_critical_shed")] == "0" and values[header.index("num_errors")] == ""
