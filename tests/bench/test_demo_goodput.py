"""Tests of ``astrolabe demo --objectives`` (bench/demo_goodput.py and its part of bench/demo.py): arguments, the
per-request classes and headers, each label's extproc config, the goodput arithmetic on hand-made results, and one
short end-to-end run through real Envoy."""

from __future__ import annotations

import csv
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import demo, demo_goodput
from bench.goodput_report import CRITICAL, SHEDDABLE
from bench.loadgen import DROP_REASON_HEADER, OBJECTIVE_HEADER, RequestResult, request_headers
from bench.workloads import TraceRequest
from astrolabe.procs import pid_alive
from extproc.admission import DROP_REASON_HEADER as EXTPROC_DROP_REASON_HEADER
from extproc.admission import OBJECTIVE_HEADERS
from extproc.config import parse_config

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTANCES = ["127.0.0.1:1", "127.0.0.1:2"]
SIDECARS = {"127.0.0.1:1": "127.0.0.1:3", "127.0.0.1:2": "127.0.0.1:4"}


def test_objectives_defaults_and_overrides():
    cfg = demo._parse_args(["--objectives"])
    assert cfg.objectives and cfg.multiples == (1.0, 1.2, 1.5, 2.0) and cfg.load == 1.0
    assert cfg.policies == ("envoy-least-request", "least-requests", "astrolabe", "astrolabe+slo",
                            "astrolabe+headroom", "astrolabe+headroom/priority")
    assert cfg.base_policies == ("envoy-least-request", "least-requests", "astrolabe", "astrolabe", "astrolabe",
                                 "astrolabe")
    assert cfg.engine.scheduling_policy == "priority"  # one fleet, priority engines, for every router
    assert cfg.engine.scheduling_args() == ["--scheduling-policy", "priority"]
    assert demo._parse_args([]).engine.scheduling_args() == []  # the plain demo passes no new flag
    quick = demo._parse_args(["--objectives", "--quick"])
    assert quick.multiples == (1.5,) and set(quick.policies) == {"astrolabe+slo", "astrolabe+headroom/priority",
                                                                  "envoy-least-request"}
    custom = demo._parse_args(["--objectives", "--multiples", "2,1", "--policies", "astrolabe+headroom=0.25@1",
                               "--num-requests", "30"])
    assert custom.multiples == (2.0, 1.0) and custom.policies == ("astrolabe+headroom=0.25@1",)
    assert custom.num_requests == 30


@pytest.mark.parametrize("argv", [
    ["--multiples", "1.5"], ["--objectives", "--workload", "multi-turn"], ["--objectives", "--backend", "vllm"],
    ["--objectives", "--load", "1.2"], ["--objectives", "--rate-qps", "3"], ["--objectives", "--multiples", "0"],
    ["--objectives", "--multiples", "1,x"], ["--objectives", "--multiples", "1,1"],
    ["--objectives", "--policies", "astrolabe+lifo"], ["--objectives", "--policies", "least-requests+headroom"],
    ["--objectives", "--policies", "envoy-least-request/priority"], ["--objectives", "--policies", "nope+slo"],
    ["--objectives", "--policies", "astrolabe,astrolabe"], ["--objectives", "--trace-file", "spans.jsonl"],
    ["--policies", "astrolabe+slo"],
], ids=["multiples-without-objectives", "multi-turn", "vllm", "load", "rate", "zero-multiple", "bad-multiple",
        "repeated-multiple", "unknown-rule", "rule-without-predictions", "priority-without-extproc", "unknown-policy",
        "repeated-label", "tracing", "label-without-objectives"])
def test_combinations_that_make_no_sense_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        demo._parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def _trace(n: int) -> list[TraceRequest]:
    return [TraceRequest(i * 0.5, "p", 10, 20, f"s0-{i}") for i in range(n)]


def test_each_request_gets_a_class_from_the_seed_and_the_client_names_it():
    trace = demo_goodput.with_objectives(_trace(2000), seed=0)
    share = sum(r.objective == CRITICAL for r in trace) / len(trace)
    assert 0.37 < share < 0.43 and {r.objective for r in trace} == {CRITICAL, SHEDDABLE}
    assert demo_goodput.with_objectives(_trace(2000), seed=0) == trace
    assert [r.objective for r in demo_goodput.with_objectives(_trace(50), seed=1)] != [r.objective for r in trace[:50]]
    # the Gateway API Inference Extension's header, which the extproc reads
    assert OBJECTIVE_HEADER == OBJECTIVE_HEADERS[0] and DROP_REASON_HEADER == EXTPROC_DROP_REASON_HEADER
    assert request_headers(trace[0])[OBJECTIVE_HEADER] == trace[0].objective
    assert OBJECTIVE_HEADER not in request_headers(_trace(1)[0])
    # a multiple scales the gaps; a tag makes the ids this replay's own (the sidecars outlive every replay)
    fast = demo_goodput.at_multiple(trace[:3], 2.0, tag="3x2")
    assert [r.arrival_offset_s for r in fast] == [0.0, 0.25, 0.5] and fast[1].objective == trace[1].objective
    assert [r.id for r in fast] == ["s0-0~3x2", "s0-1~3x2", "s0-2~3x2"]
    assert [r.id for r in demo_goodput.at_multiple(trace[:1], 1.0)] == ["s0-0"]


def test_plan_trace_runs_at_capacity_with_classes():
    cfg = demo._parse_args(["--objectives", "--num-requests", "40", "--num-instances", "2", "--seeds", "0,1"])
    plan = demo.plan_trace(cfg)
    assert plan.rate_qps == pytest.approx(plan.capacity_qps)  # 1x; the multiples scale it at replay
    for seed, trace in plan.traces.items():
        expected = demo_goodput.with_objectives(trace, seed)
        assert [r.objective for r in trace] == [r.objective for r in expected]
        assert {r.objective for r in trace} == {CRITICAL, SHEDDABLE}


def test_each_label_configures_its_extproc():
    cfg = demo._parse_args(["--objectives", "--policies", "least-requests,astrolabe,astrolabe+slo,astrolabe+headroom,"
                            "astrolabe+headroom/priority,astrolabe+headroom=0.25@0.5"])
    named = {"critical": {"priority": 0, "ttft_ms": 1000}, "sheddable": {"priority": -1, "ttft_ms": 5000}}
    expected = {
        "least-requests": ("least-requests", {"named": named, "admission": "none"}),
        "astrolabe": ("astrolabe", {"named": named, "admission": "none"}),  # not the extproc's default headroom
        "astrolabe+slo": ("astrolabe", {"named": named, "admission": "slo"}),
        "astrolabe+headroom": ("astrolabe", {"named": named, "admission": "headroom"}),
        "astrolabe+headroom/priority": ("astrolabe", {"named": named, "admission": "headroom",
                                                      "engine_priority": True}),
        "astrolabe+headroom=0.25@0.5": ("astrolabe", {"named": named, "admission": "headroom",
                                                      "protect_ttft_ms": 250.0, "pressure_window_s": 0.5}),
    }
    for label, (policy, objectives) in expected.items():
        config = demo.extproc_config(cfg, label, INSTANCES, SIDECARS)
        assert (config["policy"], config["objectives"]) == (policy, objectives), label
        parsed = parse_config(config)  # the extproc takes it
        assert parsed.objectives.admission == objectives["admission"]
        assert parsed.objectives.engine_priority == ("engine_priority" in objectives)
        assert parsed.objectives.objective_config().objectives["sheddable"].sheddable
    plain = demo.extproc_config(demo._parse_args([]), "astrolabe", INSTANCES, SIDECARS)
    assert "objectives" not in plain
    assert demo_goodput.pressure_window_s("astrolabe+headroom") == 2.0
    assert demo_goodput.pressure_window_s("astrolabe+headroom@0.5") == 0.5
    assert demo_goodput.pressure_window_s("astrolabe+slo") == 0.0
    assert demo_goodput.file_label("astrolabe+headroom/priority") == "astrolabe+headroom-priority"


def _result(request: TraceRequest, ttft_s: float | None = None, drop: str | None = None,
            error: str | None = None) -> RequestResult:
    return RequestResult(request.id, 10, 20, request.arrival_offset_s, status=429 if drop else 200, ttft_s=ttft_s,
                         e2e_s=ttft_s, drop_reason=drop, error=error)


def test_goodput_of_hand_made_results_counts_a_refusal_as_missed_but_not_as_an_error():
    trace = [TraceRequest(i, "p", 10, 20, f"s0-{i}", objective=c)
             for i, c in enumerate([CRITICAL, CRITICAL, SHEDDABLE, SHEDDABLE, SHEDDABLE])]
    results = [_result(trace[0], 0.4), _result(trace[1], 1.5), _result(trace[2], 4.0),
               _result(trace[3], drop="headroom"), _result(trace[4], error="timed out after 60 s")]
    assert results[3].refused and not results[3].ok and results[3].error is None
    row = demo_goodput.row_of("astrolabe+headroom", 2.0, 10.0, {0: trace}, {0: results})
    assert row.rate_qps == 20.0
    assert row.goodput.value == pytest.approx(20.0 * 2 / 5)  # the critical at 0.4 s and the sheddable at 4 s
    assert row.attainment == {CRITICAL: 0.5, SHEDDABLE: pytest.approx(1 / 3)}
    assert (row.num_shed, row.num_critical_shed, row.num_errors) == (1, 0, 1)
    assert row.shed_frac[SHEDDABLE] == pytest.approx(1 / 3)
    with pytest.raises(ValueError):  # results that are not the trace's, in its order
        demo_goodput.row_of("x", 1.0, 10.0, {0: trace}, {0: results[::-1]})
    tagged = [dataclasses.replace(r, id=f"{r.id}~0x2") for r in results]  # a tagged replay pairs with the trace
    assert demo_goodput.row_of("x", 2.0, 10.0, {0: trace}, {0: tagged}) == dataclasses.replace(row, policy="x")
    with pytest.raises(ValueError):  # s0-1 is not s0-10
        demo_goodput.row_of("x", 1.0, 10.0, {0: trace[1:2]}, {0: [dataclasses.replace(results[0], id="s0-10~0x1")]})
    # the plain demo's table counts only real failures as errors
    from bench.report import summarize

    assert summarize("p", results).num_errors == 1


def test_report_prints_the_tables_and_writes_the_csv(tmp_path, capsys):
    trace = demo_goodput.with_objectives(_trace(120), seed=0)
    runs = []
    for label, ttft_s in (("astrolabe+slo", 2.0), ("astrolabe+headroom/priority", 0.2)):
        results = {m: {0: [_result(r, ttft_s if r.objective == CRITICAL or n % 2 else None,
                                   drop=None if r.objective == CRITICAL or n % 2 else "critical_pressure")
                           for n, r in enumerate(trace)]} for m in (1.0, 1.5)}
        runs.append(demo_goodput.ObjectivesRun(label, results, {1.0: 1.01, 1.5: float("nan")},
                                               route_s={1.0: (0.004, 0.09)}))
    rows = demo_goodput.report(runs, {0: trace}, 20.0, (1.0, 1.5), tmp_path / "goodput.csv", "s")
    out = capsys.readouterr().out
    assert [(r.policy, r.multiple) for r in rows] == [("astrolabe+slo", 1.0), ("astrolabe+slo", 1.5),
                                                      ("astrolabe+headroom/priority", 1.0),
                                                      ("astrolabe+headroom/priority", 1.5)]
    assert rows[0].attainment[CRITICAL] == 0.0 and rows[2].attainment[CRITICAL] == 1.0
    assert "goodput / astrolabe+slo's" in out and "astrolabe+headroom/priority: 1x" in out
    assert "own goodput at 1x" in out and "emulator step times" in out and "1.01-1.01" in out
    assert "astrolabe+slo 1x 4.0 / 90; astrolabe+headroom/priority 1x 4.0 / 90" in out
    with (tmp_path / "goodput.csv").open() as fp:
        table = list(csv.DictReader(fp))
    assert len(table) == 4 and table[0]["policy"] == "astrolabe+slo" and float(table[0]["num_shed"]) > 0


def test_decision_times_are_split_by_the_replay_windows():
    records = [{"time_unix_s": 10.0 + i, "routing_s": 0.001 * (i + 1)} for i in range(10)]
    records.append({"time_unix_s": 12.5, "routing_s": None})  # a record without a decision time
    times = demo_goodput.route_times(records, {1.0: (10.0, 14.5), 2.0: (15.0, 19.0), 3.0: (30.0, 40.0)})
    assert set(times) == {1.0, 2.0}  # no record in the third window
    assert times[1.0][0] == pytest.approx(0.003) and times[2.0][0] == pytest.approx(0.008)
    assert times[1.0][1] == pytest.approx(0.00496)  # numpy's linear interpolation over 1-5 ms


def _started_pids(stderr: str) -> list[int]:
    return [int(line.split("(pid ")[1].split(")")[0]) for line in stderr.splitlines() if " started " in line]


@pytest.mark.envoy
@pytest.mark.slow
def test_objectives_demo_end_to_end(tmp_path: Path) -> None:
    """Through Envoy: a headroom bound of 1 ms refuses sheddable requests once both instances have work (429,
    counted as shed, not as an error; no critical request refused), the priority engines serve the /priority
    router's requests without an error, and Envoy's LEAST_REQUEST refuses nothing."""
    argv = [sys.executable, "-m", "astrolabe", "demo", "--objectives", "--num-instances", "2", "--num-routers", "1",
            "--num-requests", "40", "--multiples", "2", "--max-output-tokens", "64", "--policies",
            "astrolabe+headroom=0.001/priority,envoy-least-request", "--no-progress", "--log-dir", str(tmp_path)]
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    pids = _started_pids(done.stderr)
    assert len(pids) == 2 + 2 + 2 + 1  # emulators, sidecars, one extproc and its Envoy, one LEAST_REQUEST Envoy
    assert not [pid for pid in pids if pid_alive(pid)]
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-5000:]}"
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Astrolabe demo, objectives and admission (goodput)")
    assert any(line.startswith("engines: one fleet serves every router") for line in lines)
    with (tmp_path / "goodput.csv").open() as fp:
        rows = {r["policy"]: r for r in csv.DictReader(fp)}
    shedding, envoy = rows["astrolabe+headroom=0.001/priority"], rows["envoy-least-request"]
    assert int(shedding["num_shed"]) > 0 and float(shedding["sheddable_shed_frac"]) > 0
    assert int(shedding["num_critical_shed"]) == 0 and float(shedding["critical_shed_frac"]) == 0
    assert int(envoy["num_shed"]) == 0 and int(shedding["num_errors"]) == int(envoy["num_errors"]) == 0
    assert float(shedding["goodput_qps"]) <= float(envoy["rate_qps"])
    results = [json.loads(line) for line in (tmp_path / "results-astrolabe+headroom=0.001-priority-x2.jsonl").open()]
    refused = [r for r in results if r["drop_reason"]]
    assert len(refused) == int(shedding["num_shed"]) and all(r["status"] == 429 and r["error"] is None
                                                               for r in refused)
    decisions = [json.loads(line) for path in tmp_path.glob("decisions-*.jsonl") for line in path.open()]
    assert {d["priority"] for d in decisions} == {0, -1}  # the classes reached the router
    answered = len(results) - len(refused)
    # every answered request's body carried its priority to the engines
    assert (f"engine priority: astrolabe+headroom=0.001/priority's extprocs wrote the priority into {answered} "
            f"request bodies; {answered} requests were answered and not refused") in lines
    table = [line.split()[0] for line in lines[lines.index(next(x for x in lines if x.startswith("router "))) + 1:]
             if line.strip()][:2]
    assert table == ["astrolabe+headroom=0.001/priority", "envoy-least-request"]
