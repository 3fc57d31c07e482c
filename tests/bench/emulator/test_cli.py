"""Tests for ``astrolabe emulator`` (bench/emulator/server.py ``main``) as real subprocesses."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx

from astrolabe.procs import free_port
from bench.emulator.server import INSTANCE_HEADER

NUM_INSTANCES = 8
_STARTUP_LIMIT_S = 90.0  # 8 interpreters importing numpy/aiohttp/tokenizers on a shared 2-core box


def _start(port: int, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "astrolabe", "emulator", "--port", str(port), "--seed", str(port),
         "--log-level", "WARNING", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def _wait_healthy(client: httpx.AsyncClient, port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline_s = time.monotonic() + _STARTUP_LIMIT_S
    while time.monotonic() < deadline_s:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "exited"
        try:
            if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"emulator on port {port} never became healthy")


def _cpu_time_s(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc/<pid>/stat (fields 14 and 15, clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stop(procs: list[subprocess.Popen[bytes]]) -> list[int | None]:
    """SIGTERM each process by PID, wait, SIGKILL stragglers; returns the exit codes."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=20))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            codes.append(None)
        if proc.stderr:
            proc.stderr.close()
    return codes


async def test_eight_instances_as_subprocesses() -> None:
    ports = [free_port() for _ in range(NUM_INSTANCES)]
    procs = [_start(port, "--time-scale", "2", "--max-num-seqs", "8") for port in ports]
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            await asyncio.gather(*(_wait_healthy(client, p, proc) for p, proc in zip(ports, procs)))
            replies = await asyncio.gather(*(client.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"model": "llama-2-7b", "prompt": "hello", "max_tokens": 8, "ignore_eos": True})
                for port in ports))
        for port, reply in zip(ports, replies):
            assert reply.status_code == 200
            assert reply.headers[INSTANCE_HEADER] == f"127.0.0.1:{port}"
            assert reply.json()["usage"]["completion_tokens"] == 8
        # Idle instances must not poll: CPU time barely moves over a second (a busy loop would burn ~1 s).
        before_s = [_cpu_time_s(proc.pid) for proc in procs]
        await asyncio.sleep(1.0)
        spent_s = [_cpu_time_s(proc.pid) - b for proc, b in zip(procs, before_s)]
        assert max(spent_s) < 0.2, spent_s
    finally:
        codes = _stop(procs)
    assert codes == [0] * NUM_INSTANCES


async def test_sigterm_with_request_in_flight_exits_zero() -> None:
    port = free_port()
    proc = _start(port, "--time-scale", "10")
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            await _wait_healthy(client, port, proc)
            async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={
                    "model": "llama-2-7b", "prompt": "hi", "max_tokens": 3000, "ignore_eos": True,
                    "stream": True}) as resp:
                lines = resp.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        break
                proc.send_signal(signal.SIGTERM)
                # The stream ends (in-flight request aborted) instead of running to 3000 tokens.
                rest = [line async for line in lines]
                assert "data: [DONE]" not in rest
        code = proc.wait(timeout=20)
    finally:
        _stop([proc])  # no-op unless the test failed early
    assert code == 0


def test_bad_flag_exits_2() -> None:
    done = subprocess.run([sys.executable, "-m", "astrolabe", "emulator", "--time-scale", "0"],
                          capture_output=True, timeout=60)
    assert done.returncode == 2 and b"time_scale" in done.stderr


def test_a_state_path_in_a_missing_folder_exits_2(tmp_path) -> None:
    """A state file that cannot be written is refused at start, not logged once while the emulator serves on with
    no state for its sidecar (a newcomer's pass)."""
    for path in (tmp_path / "missing" / "state", tmp_path):
        done = subprocess.run([sys.executable, "-m", "astrolabe", "emulator", "--state-path", str(path)],
                              capture_output=True, timeout=60)
        assert done.returncode == 2 and b"--state-path" in done.stderr, done.stderr


def test_prefix_caching_flags_are_vllms() -> None:
    """Prefix caching on by default (vLLM V1), off with vLLM's --no-enable-prefix-caching; prompt tokens details
    off by default, on with --enable-prompt-tokens-details."""
    from bench.emulator.server import _parse_args

    config, _ = _parse_args([])
    assert config.enable_prefix_caching and not config.enable_prompt_tokens_details
    config, _ = _parse_args(["--no-enable-prefix-caching", "--enable-prompt-tokens-details"])
    assert not config.enable_prefix_caching and config.enable_prompt_tokens_details
    assert _parse_args(["--enable-prefix-caching"])[0].enable_prefix_caching


def test_scheduling_policy_flag_is_vllms() -> None:
    """--scheduling-policy fcfs (default) or priority; priority with the SGLang rules is refused at start."""
    import pytest

    from bench.emulator.server import _parse_args

    assert _parse_args([])[0].engine.scheduling_policy == "fcfs"
    assert _parse_args(["--scheduling-policy", "priority"])[0].engine.scheduling_policy == "priority"
    with pytest.raises(SystemExit) as exited:
        _parse_args(["--scheduling-policy", "priority", "--scheduling", "sglang"])
    assert exited.value.code == 2
