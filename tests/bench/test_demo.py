"""Tests of bench/demo.py: argument handling, and a quick end-to-end run through real Envoy as a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench import demo
from bench.procs import pid_alive

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_defaults_meet_the_documented_sizing() -> None:
    cfg = demo._parse_args([])
    assert cfg.num_instances == 4
    assert cfg.policies == ("astrolabe", "round-robin", "least-requests")
    assert cfg.num_requests >= 300
    assert (cfg.load, cfg.rate_qps, cfg.body_mode) == (0.85, None, "full-duplex")


@pytest.mark.parametrize(
    "argv",
    [["--policies", " , "], ["--num-instances", "0"], ["--time-scale", "0"], ["--load", "0.5", "--rate-qps", "3"]],
    ids=["no-policies", "no-instances", "zero-time-scale", "load-and-rate"],
)
def test_bad_arguments_exit_with_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo._parse_args(argv)
    assert exc.value.code == 2


def test_plan_trace_sets_the_rate_from_simulated_capacity() -> None:
    cfg = demo._parse_args(["--num-requests", "40", "--num-instances", "2", "--time-scale", "2", "--load", "0.5"])
    plan = demo.plan_trace(cfg)
    assert len(plan.trace) == 40
    assert plan.capacity_qps == pytest.approx(2 * plan.instance_capacity_virtual_qps / 2)
    assert plan.rate_qps == pytest.approx(0.5 * plan.capacity_qps)
    assert max(r.num_output_tokens for r in plan.trace) <= cfg.max_output_tokens
    # The same seed gives the same requests whatever the rate.
    explicit = demo.plan_trace(demo._parse_args(["--num-requests", "40", "--rate-qps", "1.0"]))
    assert [r.id for r in explicit.trace] == [r.id for r in plan.trace]
    assert explicit.trace[-1].arrival_offset_s == pytest.approx(plan.trace[-1].arrival_offset_s * plan.rate_qps)


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
    # bench.procs logs "started NAME (pid N), log PATH" for every process.
    return [int(line.split("(pid ")[1].split(")")[0]) for line in stderr.splitlines() if " started " in line]


@pytest.mark.envoy
@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path: Path) -> None:
    argv = [
        "--num-instances", "2", "--num-requests", "20", "--policies", "astrolabe,round-robin,least-requests",
        "--no-progress", "--log-dir", str(tmp_path),
    ]
    done = _run_demo(argv, timeout_s=200)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-5000:]}"
    lines = done.stdout.splitlines()
    assert any(line.startswith("time: emulated H200 step times x") for line in lines)
    policies = (["astrolabe"], ["round-robin"], ["least-requests"])
    rows = {}
    for cells in map(str.split, lines):  # the first row of each policy is the latency table's
        if cells[:1] in policies and cells[0] not in rows:
            rows[cells[0]] = cells
    assert set(rows) == {"astrolabe", "round-robin", "least-requests"}
    for cells in rows.values():
        # policy, requests, errors, 5 latencies, then one count per instance.
        assert cells[1:3] == ["20", "0"]
        assert sum(int(n) for n in cells[8:10]) == 20
    # Round robin alternates between the two instances.
    assert rows["round-robin"][8:10] == ["10", "10"]
    # the comparison with the best baseline and the control-plane cost follow the table
    assert any(line.startswith("TTFT p99 ") and line.endswith("x") for line in lines)
    costs = [cells for cells in map(str.split, lines) if cells[:1] == ["astrolabe"]][-1]
    assert costs[1] == "2.00"  # two predictions per request (k = 2, both instances)
    pids = _started_pids(done.stderr)
    assert len(pids) == 2 + 2 + 3 * 2  # emulators, sidecars, then extproc + Envoy per policy
    assert not [pid for pid in pids if pid_alive(pid)]
    assert {p.name for p in tmp_path.glob("results-*.jsonl")} == {
        "results-astrolabe.jsonl", "results-round-robin.jsonl", "results-least-requests.jsonl"
    }


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
