"""``workers: 2`` through the real Envoy: a supervisor and two extproc worker processes on one port
(extproc/workers.py). Both workers decide, every request is served, the supervisor's /metrics sums the workers',
a port held by another program is refused, a dead worker is restarted, and the workers never outlive the
supervisor (SIGTERM drains them all; SIGKILL of the supervisor ends them too)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import socket
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from astrolabe.procs import ProcessGroup, free_port, pid_alive
from extproc.workers import STALL_TIMEOUT_S
from tests.integration.stack import Stack, poll_until

pytestmark = [pytest.mark.envoy]

MODEL = "m"
NUM_ROUNDS, ROUND_SIZE, PAUSE_S = 8, 32, 0.5
"""Requests sent in rounds over ~4 s: a worker ends each connection after ~1 s
(extproc.workers.WORKER_MAX_CONNECTION_AGE_S) and Envoy's 2 threads open new ones, each to either worker; all
of them on one worker would take ~8 such draws in a row coming up the same (~1 in 128)."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with ProcessGroup() as procs:
        s = Stack(procs, tmp_path_factory.mktemp("workers"), "buffered")
        s.echoes = sorted(s.start_echo() for _ in range(2))
        s.decision_log = s.tmp / "decisions.jsonl"
        s.write_config([{"address": a, "models": [MODEL]} for a in s.echoes], policy="least-requests",
                       decision_log_path=str(s.decision_log))
        s.start_extproc(workers=2)
        poll_until(lambda: len(worker_pids(s)) == 2, 20, "both workers ready")
        s.start_envoy()
        yield s


def worker_pids(stack: Stack) -> dict[int, int]:
    """Worker index -> pid of its latest ready process, from the supervisor's log."""
    text = stack.extproc.log_path.read_text(errors="replace")
    return {int(i): int(pid) for i, pid in re.findall(r"worker (\d+) \(pid (\d+)\) ready", text)}


async def _requests(url: str, prefix: str, num: int) -> list[int]:
    limits = httpx.Limits(max_connections=num)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        async def one(i: int) -> int:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
            reply = await client.post(f"{url}/v1/completions", json=body, headers={"x-request-id": f"{prefix}-{i}"})
            return reply.status_code

        return await asyncio.gather(*(one(i) for i in range(num)))


def _decisions(stack: Stack, prefix: str, num: int) -> list[dict]:
    def read() -> list[dict]:
        if not stack.decision_log.exists():
            return []
        records = [json.loads(line) for line in stack.decision_log.read_text().splitlines()]
        return [r for r in records if r["request_id"].startswith(prefix)]

    return poll_until(lambda: (lambda r: r if len(r) >= num else [])(read()), 10, f"{num} decisions of {prefix}")


def test_both_workers_decide_and_every_request_is_served(stack):
    routed_before = stack.metric('astrolabe_extproc_requests_total{outcome="routed"}')
    statuses = []
    for r in range(NUM_ROUNDS):
        statuses += asyncio.run(_requests(stack.envoy_url, f"spread{r}", ROUND_SIZE))
        time.sleep(PAUSE_S)
    num = NUM_ROUNDS * ROUND_SIZE
    assert Counter(statuses) == Counter({200: num})
    records = _decisions(stack, "spread", num)
    assert len(records) == num  # one decision per request, none torn by two writers
    by_pid = Counter(r["pid"] for r in records)
    print(f"decisions per worker pid: {dict(by_pid)}")
    assert set(by_pid) == set(worker_pids(stack).values()), f"decisions per worker pid: {dict(by_pid)}"
    # The supervisor's /metrics is the sum over the workers.
    routed = stack.metric('astrolabe_extproc_requests_total{outcome="routed"}') - routed_before
    assert routed == num


def test_a_port_another_program_holds_is_refused(stack, tmp_path):
    config = json.loads(stack.config_path.read_text())
    with socket.socket() as other:  # another program listening, without SO_REUSEPORT
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        for listen, workers in ((f"127.0.0.1:{taken}", "2"), (f"127.0.0.1:{stack.extproc_port}", "2"),
                                (f"127.0.0.1:{stack.extproc_port}", "1")):  # ours is taken for others too
            path = tmp_path / "other.yaml"
            path.write_text(json.dumps({**config, "listen": listen, "metrics_listen": None,
                                        "decision_log_path": None}))
            done = subprocess.run([sys.executable, "-m", "astrolabe", "extproc", "--config", str(path),
                                   "--workers", workers], capture_output=True, text=True, timeout=60)
            assert done.returncode == 2, done.stderr
            assert f"invalid configuration: listen: cannot listen on {listen}" in done.stderr


def test_a_dead_worker_is_restarted(stack):
    old = worker_pids(stack)
    os.kill(old[0], signal.SIGKILL)
    new = poll_until(lambda: (lambda p: p if p.get(0, old[0]) != old[0] else None)(worker_pids(stack)), 30,
                     "worker 0 restarted")
    assert new[1] == old[1] and not pid_alive(old[0])
    assert "worker 0 (pid %d) exited with status -9: restarting it" % old[0] in stack.extproc.log_path.read_text()
    statuses = asyncio.run(_requests(stack.envoy_url, "after-restart", 16))
    assert statuses == [200] * 16


def test_a_stopped_worker_is_killed_and_restarted_and_its_sums_do_not_drop(stack):
    """SIGSTOP: the worker's heartbeat stops, the supervisor SIGKILLs it after STALL_TIMEOUT_S and restarts it
    (a hung worker keeps the connections the kernel gave it); meanwhile the summed counters keep its last values."""
    asyncio.run(_requests(stack.envoy_url, "before-stop", 16))
    routed_before = stack.metric('astrolabe_extproc_requests_total{outcome="routed"}')
    old = worker_pids(stack)
    os.kill(old[1], signal.SIGSTOP)
    try:
        assert stack.metric('astrolabe_extproc_requests_total{outcome="routed"}') == routed_before
        new = poll_until(lambda: (lambda p: p if p.get(1, old[1]) != old[1] else None)(worker_pids(stack)),
                         STALL_TIMEOUT_S + 30, "worker 1 killed and restarted")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(old[1], signal.SIGCONT)
    assert new[0] == old[0] and not pid_alive(old[1])
    assert f"worker 1 (pid {old[1]}) gave no sign of life" in stack.extproc.log_path.read_text()
    statuses = asyncio.run(_requests(stack.envoy_url, "after-stall", 16))
    assert statuses == [200] * 16


def _supervisor(tmp: Path, config_path: Path, procs: ProcessGroup, name: str):
    proc = procs.start([sys.executable, "-m", "astrolabe", "extproc", "--config", str(config_path), "--workers", "2"],
                       name=name, log_path=tmp / f"{name}.log")
    pids = poll_until(lambda: (lambda p: p if len(p) == 2 else None)(
        {int(i): int(pid) for i, pid in re.findall(r"worker (\d+) \(pid (\d+)\) ready",
                                                   proc.log_path.read_text(errors="replace"))}), 30, "2 workers")
    return proc, list(pids.values())


def test_sigterm_to_the_supervisor_ends_every_worker(stack, tmp_path):
    config = json.loads(stack.config_path.read_text())
    path = tmp_path / "own.yaml"
    path.write_text(json.dumps({**config, "listen": f"127.0.0.1:{free_port()}", "metrics_listen": None,
                                "decision_log_path": None}))
    with ProcessGroup() as procs:
        proc, pids = _supervisor(tmp_path, path, procs, "sigterm")
        os.kill(proc.pid, signal.SIGTERM)  # the supervisor alone, as Kubernetes signals PID 1
        assert proc.wait(30) == 0, proc.log_tail()
        assert not any(pid_alive(pid) for pid in pids)
        stopped = [line for line in proc.log_tail().splitlines() if "extproc stopped" in line]
        # each worker drained, and its lines name it
        named = sorted((int(i), int(pid)) for line in stopped
                       for i, pid in re.findall(r"\[worker=(\d+) pid=(\d+)\]", line))
        assert [i for i, _ in named] == [0, 1] and {pid for _, pid in named} == set(pids), stopped

        proc, pids = _supervisor(tmp_path, path, procs, "sigkill")
        os.kill(proc.pid, signal.SIGKILL)  # no chance to stop them: they watch their parent
        poll_until(lambda: not any(pid_alive(pid) for pid in pids), 30, "workers gone after their supervisor")
