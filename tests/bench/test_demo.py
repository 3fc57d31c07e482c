"""Tests of bench/demo.py: argument handling, and quick end-to-end runs through real Envoy as a subprocess (one with
tracing to the bundled receiver)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench import demo
from bench.loadgen import session_messages
from bench.otlp_receiver import group_traces, read_spans
from astrolabe.procs import pid_alive

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_defaults_meet_the_documented_sizing() -> None:
    cfg = demo._parse_args([])
    assert (cfg.setting, cfg.mode, cfg.num_instances, cfg.num_routers) == ("production", "default", 4, 2)
    assert cfg.policies == ("astrolabe", "envoy-least-request", "least-requests", "gie")
    assert cfg.num_requests >= 1000 and cfg.seeds == (0,)
    assert (cfg.arrival, cfg.cv, cfg.max_num_seqs, cfg.num_gpu_blocks) == ("gamma", 2.0, 48, 1024)
    assert (cfg.rate_qps, cfg.body_mode, cfg.state_source) == (None, "full-duplex", "plugin")
    thorough = demo._parse_args(["--thorough"])
    assert len(thorough.seeds) == 3 and thorough.num_requests * 3 >= 3000 and "round-robin" in thorough.policies
    small = demo._parse_args(["--setting", "small", "--max-num-seqs", "16"])
    assert (small.num_routers, small.arrival, small.max_num_seqs) == (1, "poisson", 16)  # a flag beats the preset


def test_workers_reach_every_extproc_config() -> None:
    instances, sidecars = ["127.0.0.1:1", "127.0.0.1:2"], {"127.0.0.1:1": "127.0.0.1:3", "127.0.0.1:2": "127.0.0.1:4"}
    for argv, workers in (([], 1), (["--workers", "2"], 2)):
        cfg = demo._parse_args(argv)
        assert cfg.workers == workers
        for policy in ("astrolabe", "least-requests"):
            assert demo.extproc_config(cfg, policy, instances, sidecars)["workers"] == workers


@pytest.mark.parametrize(
    "argv",
    [["--policies", " , "], ["--num-instances", "0"], ["--time-scale", "0"], ["--load", "0.5", "--rate-qps", "3"],
     ["--quick", "--thorough"], ["--seeds", "a"], ["--num-routers", "0"], ["--setting", "huge"], ["--policies", "foo"],
     ["--workers", "0"]],
    ids=["no-policies", "no-instances", "zero-time-scale", "load-and-rate", "two-modes", "bad-seeds", "no-routers",
         "unknown-setting", "unknown-policy", "no-workers"],
)
def test_bad_arguments_exit_with_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo._parse_args(argv)
    assert exc.value.code == 2


def test_plan_trace_sets_the_rate_from_simulated_capacity() -> None:
    cfg = demo._parse_args(["--num-requests", "40", "--num-instances", "2", "--time-scale", "2", "--load", "0.5",
                            "--seeds", "0,1"])
    plan = demo.plan_trace(cfg)
    assert set(plan.traces) == {0, 1} and all(len(t) == 40 for t in plan.traces.values())
    assert plan.capacity_qps == pytest.approx(2 * plan.instance_capacity_virtual_qps / 2)
    assert plan.rate_qps == pytest.approx(0.5 * plan.capacity_qps)
    for trace in plan.traces.values():
        assert max(r.num_output_tokens for r in trace) <= cfg.max_output_tokens
        # a realistic cap, never the reply's own length; prompt + cap fit the context
        assert all(r.max_tokens == cfg.max_output_tokens for r in trace)
        assert all(r.num_prompt_tokens + r.max_tokens <= cfg.max_model_len for r in trace)
        assert {r.router for r in trace} == {0, 1}  # spread over the two router replicas
    assert {r.id for r in plan.traces[0]}.isdisjoint({r.id for r in plan.traces[1]})
    # the prompts come from the tagger's held-out split only (the shipped tagger never trained on them)
    from tagger.data import load_split

    held_out = {e.prompt for e in load_split().test_first}
    assert all(r.prompt in held_out for t in plan.traces.values() for r in t)
    # The same seed gives the same requests whatever the rate.
    explicit = demo.plan_trace(demo._parse_args(["--num-requests", "40", "--rate-qps", "1.0", "--seeds", "0,1"]))
    assert [r.id for r in explicit.traces[0]] == [r.id for r in plan.traces[0]]
    assert explicit.traces[0][-1].arrival_offset_s == pytest.approx(plan.traces[0][-1].arrival_offset_s * plan.rate_qps)
    oracle = demo.plan_trace(demo._parse_args(["--num-requests", "5", "--rate-qps", "1", "--output-length-source",
                                               "oracle"]))
    assert all(r.max_tokens is None for r in oracle.trace)  # exact lengths with ignore_eos


def test_multi_turn_plan_replays_held_out_conversations_as_sessions_that_fit_the_context() -> None:
    cfg = demo._parse_args(["--workload", "multi-turn", "--num-requests", "30", "--num-instances", "2",
                            "--seeds", "0,1"])
    assert cfg.arrival == "poisson" and "llm-d" in cfg.policies and "gie-prefix" in cfg.policies
    quick = demo._parse_args(["--workload", "multi-turn", "--quick"])
    assert {"astrolabe", "least-requests"} <= set(quick.policies) and set(quick.policies) & {
        "gie-prefix", "llm-d", "sglang-cache-aware", "dynamo-kv"}
    plan = demo.plan_trace(cfg)
    assert set(plan.sessions) == {0, 1} and plan.rate_qps > 0
    from tagger.data import load_split
    from tagger.tokenizer import count_tokens

    held_out = load_split().test_conversation_ids
    for sessions in plan.sessions.values():
        assert sum(len(s.turns) for s in sessions) >= 30 and any(len(s.turns) > 1 for s in sessions)
        starts = [s.start_offset_s for s in sessions]
        assert starts == sorted(starts)
        for s in sessions:
            assert s.id.split(":", 1)[1] in held_out
            assert all(t >= demo.MIN_THINK_TIME_S for t in s.think_times_s)
            last = s.turns[-1]
            assert last.num_prompt_tokens + last.num_output_tokens <= cfg.max_model_len
            # turn k's prompt = the conversation so far (recorded replies) + its message, counted as the engine does
            messages = session_messages(s, len(s.turns) - 1)
            assert [m["content"] for m in messages[1::2]] == [t.reply for t in s.turns[:-1]]
            assert sum(count_tokens(m["content"]) for m in messages) == last.num_prompt_tokens
            assert count_tokens(last.reply) == last.num_output_tokens
    config = demo.extproc_config(cfg, "llm-d", ["127.0.0.1:1"], {}, Path("/tok"))
    assert config["prefix_cache"] == {"enabled": True, "block_size": 16}
    assert config["tokenizers"] == {"llama-2-7b": "/tok"}
    assert "prefix_cache" not in demo.extproc_config(demo._parse_args([]), "astrolabe", ["127.0.0.1:1"], {})


def test_shared_prefix_plan_shares_each_tenants_context() -> None:
    cfg = demo._parse_args(["--workload", "shared-prefix", "--num-requests", "40", "--rate-qps", "2"])
    trace = demo.plan_trace(cfg).trace
    assert len(trace) == 40 and all(r.max_tokens is None for r in trace)  # exact reply lengths
    by_tenant: dict[str, set[str]] = {}
    for r in trace:
        context = r.prompt.split("\n")[0]
        by_tenant.setdefault(r.id.split(":")[1], set()).add(context)
        assert len(context.split()) == 2048 and r.num_prompt_tokens == 2048 + len(r.prompt.split("\n")[1].split())
    assert all(len(contexts) == 1 for contexts in by_tenant.values()) and len(by_tenant) > 1
    assert len({next(iter(c)) for c in by_tenant.values()}) == len(by_tenant)


def _run_demo(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run ``astrolabe demo`` in its own session; on timeout, SIGINT it (it stops its children), then kill."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "astrolabe", "demo", *argv],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            stdout, stderr = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(f"demo did not finish in {timeout_s} s\nstdout:\n{stdout}\nstderr:\n{stderr[-5000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _started_pids(stderr: str) -> list[int]:
    # astrolabe.procs logs "started NAME (pid N), log PATH" for every process.
    return [int(line.split("(pid ")[1].split(")")[0]) for line in stderr.splitlines() if " started " in line]


@pytest.mark.envoy
@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path: Path) -> None:
    argv = [
        "--num-instances", "2", "--num-requests", "24", "--seeds", "0,1",
        "--policies", "astrolabe,envoy-least-request,round-robin,least-requests", "--no-progress",
        "--log-dir", str(tmp_path),
    ]
    done = _run_demo(argv, timeout_s=300)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-5000:]}"
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Astrolabe demo, setting 'production'")
    assert any(line.startswith("sidecars: the emulators' engine state (plugin mode") for line in lines)
    assert any(line.startswith("routers: 2 replicas") for line in lines)
    names = ("astrolabe", "envoy-least-request", "round-robin", "least-requests")
    rows = {}
    for cells in map(str.split, lines):  # the first row of each policy is the latency table's
        if cells[:1] and cells[0] in names and cells[0] not in rows:
            rows[cells[0]] = cells
    assert set(rows) == set(names)
    for policy, cells in rows.items():
        # policy, requests, errors, 3 TTFT figures, the P99 interval (2 cells), 2 E2E figures, 2 routing times,
        # then one count per instance
        assert cells[1:3] == ["48", "0"], cells
        assert sum(int(n) for n in cells[-2:]) == 48
        assert (cells[10:12] == ["-", "-"]) == (policy == "envoy-least-request")  # no extproc, no routing time
    # the comparison with every baseline, with intervals and a verdict, then costs and prediction quality
    comparisons = [line for line in lines if line.startswith("TTFT p99 ")]
    assert {line.split()[2] for line in comparisons} == {"envoy-least-request", "round-robin", "least-requests"}
    assert any(line.startswith("verdict: astrolabe's P99 TTFT is") for line in lines)
    costs = [cells for cells in map(str.split, lines) if cells[:1] == ["astrolabe"]][-2]
    assert costs[1] == "2.00"  # two predictions per request (k = 2, both instances)
    assert float(costs[2].rstrip("%")) > 50  # most decisions made on predictions
    quality = [cells for cells in map(str.split, lines) if cells[:1] == ["astrolabe"]][-1]
    assert quality[1] == "48" or int(quality[1]) > 40  # the chosen instance's predictions were scored
    pids = _started_pids(done.stderr)
    # emulators, sidecars, then per policy 2 extprocs + 2 Envoys (only 2 Envoys for envoy-least-request)
    assert len(pids) == 2 + 2 + 3 * 4 + 2
    assert not [pid for pid in pids if pid_alive(pid)]
    assert {p.name for p in tmp_path.glob("results-*.jsonl")} == {f"results-{n}.jsonl" for n in names}
    assert len(list(tmp_path.glob("decisions-astrolabe-*.jsonl"))) == 2
    # this run's state folder is gone (not any folder: another demo may be running on the machine)
    (state_dir,) = [line.split("emulator state files in ")[1].split(" (removed")[0]
                    for line in done.stderr.splitlines() if "emulator state files in " in line]
    assert not Path(state_dir).exists()


@pytest.mark.envoy
@pytest.mark.slow
def test_quick_multi_turn_demo_hits_the_prefix_cache_on_later_turns(tmp_path: Path) -> None:
    """Sessions through Envoy: every turn completes (the emulators generate the recorded replies token for token)
    and later turns hit the blocks of the conversation so far, under astrolabe and a cache-aware baseline."""
    argv = ["--workload", "multi-turn", "--num-instances", "2", "--num-requests", "16", "--policies",
            "astrolabe,llm-d", "--rate-qps", "1", "--think-time-s", "1.5", "--no-progress", "--log-dir",
            str(tmp_path)]
    done = _run_demo(argv, timeout_s=300)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-5000:]}"
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Astrolabe demo, workload 'multi-turn'")
    (sessions_line,) = [line for line in lines if line.startswith("sessions: ")]
    num_turns = int(sessions_line.split(" requests)")[0].rsplit("(", 1)[1])
    assert any(line.startswith("policy ") and "cache hit" in line for line in lines)
    rows = {}
    for cells in map(str.split, lines):
        if cells[:1] and cells[0] in ("astrolabe", "llm-d") and cells[0] not in rows:
            rows[cells[0]] = cells
    assert set(rows) == {"astrolabe", "llm-d"}
    for policy, cells in rows.items():
        assert cells[1:3] == [str(num_turns), "0"], cells  # every turn of every session completed
        hit_rate = next(c for c in cells if c.endswith("%"))  # the only percentage in a latency row
        assert float(hit_rate.rstrip("%")) > 0, (policy, cells)  # later turns hit the cache
    for policy in ("astrolabe", "llm-d"):
        results = [json.loads(line) for line in (tmp_path / f"results-{policy}.jsonl").open()]
        assert len(results) == num_turns and all(r["error"] is None for r in results)
        assert any(r["id"].endswith("/1") for r in results)  # sessions had second turns
    assert not [pid for pid in _started_pids(done.stderr) if pid_alive(pid)]


@pytest.mark.envoy
@pytest.mark.slow
def test_demo_traces_its_traced_phase_to_the_file(tmp_path: Path) -> None:
    """--trace-file: the bundled receiver gets one whole trace per request of the traced phase, Envoy's span the
    root, from every kind of process; the comparison before it is not traced."""
    spans_file = tmp_path / "traces" / "spans.jsonl"
    argv = ["--num-instances", "2", "--num-routers", "1", "--num-requests", "4", "--policies", "astrolabe",
            "--rate-qps", "4", "--max-output-tokens", "16", "--trace-file", str(spans_file), "--trace-requests", "3",
            "--no-progress", "--log-dir", str(tmp_path)]
    done = _run_demo(argv, timeout_s=120)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-5000:]}"
    traces = group_traces(read_spans(spans_file))
    assert len(traces) == 3, {t: sorted(s.name for s in spans) for t, spans in traces.items()}
    phase_ids = {json.loads(line)["id"] for line in (tmp_path / "results-astrolabe-traced.jsonl").open()}
    for spans in traces.values():
        by_id = {s.span_id: s for s in spans}
        by_name = {s.name: s for s in spans}
        root = by_name["ingress"]
        assert root.service_name == "astrolabe-envoy" and root.parent_span_id == ""
        route = by_name["astrolabe.route"]
        assert by_id[route.parent_span_id].parent_span_id == root.span_id  # via Envoy's ext_proc call span
        # Envoy marks a sampled UUID in its 15th character; the rest is the id the client sent
        request_id = route.attributes["astrolabe.request_id"]
        assert request_id[14] == "9" and any(request_id[:14] + i[14] + request_id[15:] == i for i in phase_ids)
        assert route.attributes["astrolabe.outcome"] == "routed"
        assert len([e for e in route.events if e[0] == "astrolabe.candidate"]) == 2
        # predicted in the router from the sidecars' streamed states: one span each, no call into a sidecar
        predicts = [s for s in spans if s.name == "astrolabe.predict"]
        assert len(predicts) == 2 and all(s.parent_span_id == route.span_id for s in predicts)
        assert all(s.attributes["astrolabe.predicted_e2e_s"] > 0 for s in predicts)
        backend = by_name["llm_request"]
        assert backend.service_name == "astrolabe-emulator" and by_id[backend.parent_span_id].name == (
            "router backends egress")
    assert "traces: 3 traces" in done.stdout and "astrolabe-emulator: llm_request (SERVER)" in done.stdout
    assert not [pid for pid in _started_pids(done.stderr) if pid_alive(pid)]
    # the sidecars stopped before their emulators and their state files: no warning at shutdown
    sidecar_logs = sorted(tmp_path.glob("sidecar-*.log"))
    assert len(sidecar_logs) == 2 and not [p for p in sidecar_logs if "state unavailable" in p.read_text()]


@pytest.mark.envoy
@pytest.mark.slow
def test_demo_fails_with_status_2_when_a_process_fails_to_start(tmp_path: Path) -> None:
    # An explicit rate skips the capacity estimate, so the emulators are the first to reject the engine flags.
    argv = [
        "--num-instances", "1", "--num-requests", "5", "--rate-qps", "1", "--policies", "random",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "4", "--no-progress", "--log-dir", str(tmp_path),
    ]
    done = _run_demo(argv, timeout_s=60)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "a process failed to start" in done.stderr and "max_num_batched_tokens" in done.stderr
    assert done.stdout == ""
    assert not [pid for pid in _started_pids(done.stderr) if pid_alive(pid)]


def test_invalid_engine_settings_exit_2_before_starting_anything(tmp_path: Path, caplog) -> None:
    argv = ["--num-requests", "5", "--max-num-seqs", "8", "--max-num-batched-tokens", "4", "--log-dir", str(tmp_path)]
    assert demo.main(argv) == 2
    assert "max_num_batched_tokens" in caplog.text
