"""bench.extproc_bench (and its helpers bench.extproc_drive, bench.fast_backend): the pure parts, and one quick
real run of every section."""

import cProfile
import json
import pstats
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from bench import extproc_bench as eb
from bench.extproc_drive import destination_of, processing_messages, prompts
from bench.fast_backend import metrics_text
from bench.stats import p50, p99
from predictor.backend_metrics import parse_vllm_metrics


@pytest.mark.parametrize(("round_index", "expected"), [(0, ["a", "b", "c"]), (1, ["b", "c", "a"]),
                                                       (2, ["c", "a", "b"]), (3, ["a", "b", "c"])],
                         ids=["r0", "r1", "r2", "wraps"])
def test_rotated_gives_each_item_the_lead_in_turn(round_index, expected):
    assert eb.rotated(["a", "b", "c"], round_index) == expected


def test_abba_alternates_which_arm_goes_first():
    assert [eb.abba(r) for r in range(3)] == [("static", "extproc"), ("extproc", "static"), ("static", "extproc")]


def test_paired_difference_of_a_constant_shift_is_that_shift_with_a_point_interval():
    b = np.random.default_rng(0).exponential(1e-3, 400)
    for statistic in (p50, p99):
        interval = eb.paired_difference_ci(b + 2e-3, b, statistic, num_resamples=200)
        assert interval.value == pytest.approx(2e-3)
        assert interval.low == pytest.approx(2e-3) and interval.high == pytest.approx(2e-3)


def test_paired_difference_interval_covers_its_value_and_is_signed():
    rng = np.random.default_rng(1)
    b = rng.exponential(1e-3, 500)
    a = b * rng.uniform(0.5, 1.0, 500)  # a is lower: a negative difference
    interval = eb.paired_difference_ci(a, b, p50, num_resamples=300)
    assert interval.low <= interval.value <= interval.high < 0


@pytest.mark.parametrize(("a", "b"), [([1.0], [1.0, 2.0]), ([], [])], ids=["lengths-differ", "empty"])
def test_paired_difference_refuses_unpaired_input(a, b):
    with pytest.raises(ValueError):
        eb.paired_difference_ci(a, b, p50)


def test_policy_capacity_ratios():
    r = eb.PolicyCapacity("astrolabe", num_saturated=1000, saturated_wall_s=2.0, saturated_cpu_s=1.6)
    assert (r.decisions_per_s, r.decisions_per_cpu_s, r.busy_frac) == (500.0, 625.0, 0.8)
    assert np.isnan(eb.PolicyCapacity("random").decisions_per_cpu_s)  # nothing measured: NaN, not a crash


def test_sidecar_cpu_per_decision_and_above_the_background():
    r = eb.PolicyCapacity("astrolabe", num_saturated=1000, saturated_wall_s=2.0, saturated_sidecar_cpu_s=1.5)
    assert (r.sidecar_cpu_s_per_decision, r.sidecar_cores) == (1.5e-3, 0.75)
    assert r.sidecar_cpu_s_above(0.25) == pytest.approx(1e-3)  # 1.5 s - 0.25 cores x 2 s, over 1000 decisions
    idle = eb.PolicyCapacity("random")
    assert np.isnan(idle.sidecar_cpu_s_per_decision) and np.isnan(idle.sidecar_cpu_s_above(0.25))


def test_fmt_ms():
    assert (eb.fmt_ms(0.0012345), eb.fmt_ms(float("nan"))) == ("1.234", "-")


def _profile_of(fn) -> pstats.Stats:
    profiler = cProfile.Profile()
    profiler.runcall(fn)
    return pstats.Stats(profiler)


def test_phase_shares_partition_the_profiled_time():
    from extproc.request import parse_body  # noqa: PLC0415

    body = prompts(1, 0)[0]
    stats_ = _profile_of(lambda: [parse_body("x", "POST", "/v1/chat/completions", body) for _ in range(200)])
    shares = eb.phase_shares(stats_)
    assert list(shares) == list(eb.PHASES)
    assert sum(shares.values()) == pytest.approx(stats_.total_tt)
    assert shares["body parsing (JSON)"] > 0  # parse_body is an entry function
    assert shares["policy"] == 0 and shares["Predict/Admit/Release client"] == 0


def test_fast_backend_metrics_are_read_by_the_sidecars_own_parser():
    observation = parse_vllm_metrics(metrics_text(3, 16384, 16))
    assert (observation.num_running, observation.num_waiting) == (3, 0)


def test_large_prompts_are_about_200_kb_and_distinct():
    bodies = eb.large_prompts(3, 0)
    assert all(200_000 < len(b) < 230_000 for b in bodies)
    assert len(set(bodies)) == 3
    assert json.loads(bodies[0])["max_tokens"] == 1


def test_processing_messages_carry_the_body_and_destination_is_read_back():
    from extproc import messages  # noqa: PLC0415

    headers, body = processing_messages("r1", b"{}")
    assert headers.request_headers.headers.headers[1].raw_value == b"/v1/chat/completions"
    assert body.request_body.body == b"{}" and body.request_body.end_of_stream
    assert destination_of(messages.body_route("10.0.0.1:8000")) == "10.0.0.1:8000"


def test_formats_name_every_figure():
    capacity = [eb.PolicyCapacity(p, latency_s=[1e-3, 2e-3], num_saturated=10, saturated_wall_s=0.01,
                                  saturated_cpu_s=0.008, saturated_sidecar_cpu_s=0.004 if p == "random" else 0.006,
                                  bases=Counter(prediction=12)) for p in eb.POLICIES]
    text = eb.format_capacity(capacity, 32)
    header, _, *rows = text.splitlines()
    column = header.index("sidecars CPU ms/decision")
    assert [row[column:column + len("sidecars CPU ms/decision")].strip() for row in rows[:2]] == ["0.400", "0.600"]
    assert "(0.40 sidecar cores in random's blocks" in text and "astrolabe 0.200" in text  # (0.006 - 0.4 x 0.01) / 10
    assert all(p in text for p in eb.POLICIES) and "x the goal of 1000/s per core" in text
    assert "astrolabe with 2 workers: 1250 decisions per CPU-second summed" in text and "1.00 x one process" in text
    cell = eb.AddedLatency("astrolabe", "full-duplex", "small", 200.0, static_s=[1e-3] * 60,
                           extproc_s=[2e-3] * 60, wall_s=1.0, cpu_s=Counter(extproc=0.5))
    text = eb.format_envoy([cell])
    assert "1.000 [1.000, 1.000]" in text and "meets it" in text
    result = eb.ProfileResult(dict.fromkeys(eb.PHASES, 0.001), 10, 0.02)
    assert all(phase in eb.format_profile(result) for phase in eb.PHASES)


def test_bad_arguments_are_refused():
    for argv in (["--sections", "nope"], ["--envoy-policies", "gie"], ["--rounds", "0"]):
        with pytest.raises(SystemExit) as exc:
            eb._parse_args(argv)
        assert exc.value.code == 2


@pytest.mark.slow
@pytest.mark.envoy
def test_quick_run_reports_every_section_with_every_request_routed():
    """One real run of every section with tiny arguments; decisions that were not routed raise in the bench,
    requests not answered by an instance are counted as failed."""
    argv = ["--quick", "--num-latency", "10", "--num-saturated", "40", "--num-requests", "20", "--num-large", "2",
            "--num-profiled", "60", "--envoy-policies", "astrolabe"]
    done = subprocess.run([sys.executable, "-m", "astrolabe", "bench", "extproc", *argv], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for heading in ("1. decisions per second", "2. latency added through Envoy", "3. where one decision's time goes"):
        assert heading in out
    section_1, rest = out.split("2. latency added through Envoy")
    section_2 = rest.split("3. where")[0]
    capacity = {line.split()[0]: line.split() for line in section_1.splitlines()
                if len(line.split()) == 11 and line.split()[0] in eb.POLICIES}  # the table's rows
    assert set(capacity) == set(eb.POLICIES)
    assert all(row[1] == "10" and row[4] == "40" for row in capacity.values())  # every decision counted
    assert capacity["astrolabe"][-1].endswith("%")  # the share decided on predictions
    envoy_rows = [line.split() for line in section_2.splitlines() if line.startswith("astrolabe ")]
    assert len(envoy_rows) == 4  # 2 body modes x 2 prompt sizes
    assert all(row[5] == "0" for row in envoy_rows)  # no request failed, every one answered by an instance
    assert all(phase in out for phase in eb.PHASES)
