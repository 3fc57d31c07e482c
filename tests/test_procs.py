"""Tests for astrolabe/procs.py with real child processes (Python one-liners and http.server)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from astrolabe.procs import ProcessGroup, ProcessStartError, free_port, pid_alive

# Ignores SIGTERM, then listens so that a test knows the handler is installed before it signals.
_IGNORE_SIGTERM = """
import signal, socket, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sock = socket.socket(); sock.bind(("127.0.0.1", int(sys.argv[1]))); sock.listen()
time.sleep(600)
"""

# Starts a grandchild in the same process group, logs its pid, then listens.
_SPAWN_GRANDCHILD = """
import socket, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("grandchild", child.pid, flush=True)
sock = socket.socket(); sock.bind(("127.0.0.1", int(sys.argv[1]))); sock.listen()
time.sleep(600)
"""

_SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_http_server_starts_answers_and_stops(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "hello.txt").write_text("hello")
    log_path = tmp_path / "server.log"
    with ProcessGroup() as procs:
        server = procs.start(
            [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
            name="http-server", log_path=log_path, cwd=tmp_path,
        )
        server.wait_tcp("127.0.0.1", port, timeout_s=30)
        body = server.wait_http(f"http://127.0.0.1:{port}/hello.txt", timeout_s=30)
        assert body == b"hello"
        assert server.wait_http(f"http://127.0.0.1:{port}/missing", timeout_s=30, expect_status=404)
        assert server.is_running()
        returncode = server.stop()
        assert returncode == -signal.SIGTERM
        assert not server.is_running()
        assert not pid_alive(server.pid)
        assert server.stop() == returncode  # idempotent
    assert "GET /hello.txt" in log_path.read_text()


def test_env_is_added_to_the_inherited_environment() -> None:
    code = (
        "import os, socket, sys, time\n"
        "print(os.environ['ASTROLABE_TEST_VAR'], 'PATH' in os.environ, flush=True)\n"
        "sock = socket.socket(); sock.bind(('127.0.0.1', int(sys.argv[1]))); sock.listen()\n"
        "time.sleep(600)\n"
    )
    port = free_port()
    with ProcessGroup() as procs:
        proc = procs.start([sys.executable, "-c", code, str(port)], name="env", env={"ASTROLABE_TEST_VAR": "x42"})
        proc.wait_tcp("127.0.0.1", port, timeout_s=30)
        proc.stop()
    assert proc.log_tail() == "x42 True"


def test_group_stops_everything_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with ProcessGroup() as procs:
            first = procs.start(_SLEEP, name="first")
            second = procs.start(_SLEEP, name="second")
            raise RuntimeError("boom")
    for proc in (first, second):
        assert not proc.is_running()
        assert not pid_alive(proc.pid)


def test_stop_kills_a_process_that_ignores_sigterm() -> None:
    port = free_port()
    with ProcessGroup() as procs:
        stubborn = procs.start([sys.executable, "-c", _IGNORE_SIGTERM, str(port)], name="stubborn")
        stubborn.wait_tcp("127.0.0.1", port, timeout_s=30)
        assert stubborn.wait(timeout_s=0.1) is None
        assert stubborn.stop(timeout_s=0.5) == -signal.SIGKILL
        assert not pid_alive(stubborn.pid)


def test_stop_reaches_the_whole_process_group() -> None:
    port = free_port()
    with ProcessGroup() as procs:
        parent = procs.start([sys.executable, "-c", _SPAWN_GRANDCHILD, str(port)], name="parent")
        parent.wait_tcp("127.0.0.1", port, timeout_s=30)
        grandchild_pid = int(parent.log_tail().split()[-1])
        assert pid_alive(grandchild_pid)
        parent.stop()
    # SIGKILL is delivered by then; the grandchild (not our child: we cannot wait for it) dies within moments.
    deadline_s = time.monotonic() + 2.0
    while pid_alive(grandchild_pid) and time.monotonic() < deadline_s:
        time.sleep(0.005)
    assert not pid_alive(grandchild_pid)


@pytest.mark.parametrize(
    "wait",
    [
        lambda proc: proc.wait_tcp("127.0.0.1", free_port(), timeout_s=30),
        lambda proc: proc.wait_http(f"http://127.0.0.1:{free_port()}/", timeout_s=30),
    ],
    ids=["wait_tcp", "wait_http"],
)
def test_start_error_shows_the_log_tail_when_the_process_exits(wait) -> None:
    code = "import sys; print('line one'); print('fatal: no such model', file=sys.stderr); sys.exit(3)"
    with ProcessGroup() as procs:
        proc = procs.start([sys.executable, "-c", code], name="crasher")
        with pytest.raises(ProcessStartError) as info:
            wait(proc)
    message = str(info.value)
    assert "crasher" in message
    assert "exited with code 3" in message
    assert "fatal: no such model" in message
    assert proc.stop() == 3


def test_start_error_on_timeout_names_what_was_awaited() -> None:
    port = free_port()
    with ProcessGroup() as procs:
        proc = procs.start(_SLEEP, name="sleeper")
        with pytest.raises(ProcessStartError, match=f"did not accept tcp 127.0.0.1:{port}"):
            proc.wait_tcp("127.0.0.1", port, timeout_s=0.2)
        assert proc.is_running()


def test_missing_program_raises_at_start() -> None:
    with ProcessGroup() as procs:
        with pytest.raises(FileNotFoundError):
            procs.start(["/nonexistent/astrolabe-no-such-program"], name="missing")
        assert procs.processes == []


def test_free_port_can_be_bound() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    assert 0 < port < 65536


def test_free_port_never_hands_out_one_port_twice() -> None:
    # The kernel may give the same ephemeral port to two binds in a row: CI once saw a listener and its admin port
    # drawn equal. 500 draws from ~28k ephemeral ports repeat one with probability ~0.99 without the guard.
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_a_private_tmp_is_the_process_tempdir_and_goes_with_it(tmp_path: Path) -> None:
    """What the process leaves in its temp folder (a file and a Unix socket, as vLLM leaves) is removed once it has
    stopped; without ``private_tmp`` the temp folder is the inherited one."""
    script = ("import os, socket, tempfile, time; d = tempfile.gettempdir(); print(d, flush=True); "
              "open(os.path.join(d, 'left.db'), 'w').close(); "
              "socket.socket(socket.AF_UNIX).bind(os.path.join(d, 'ipc-sock')); time.sleep(60)")
    with ProcessGroup() as procs:
        proc = procs.start([sys.executable, "-c", script], name="leaves-files", log_path=tmp_path / "a.log",
                           private_tmp=True)
        deadline = time.monotonic() + 10
        while not (proc.tmp_dir is not None and (proc.tmp_dir / "ipc-sock").exists()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (proc.tmp_dir / "left.db").exists() and (proc.tmp_dir / "ipc-sock").exists()
        assert (tmp_path / "a.log").read_text().strip() == str(proc.tmp_dir)
        plain = procs.start([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"], name="plain",
                            log_path=tmp_path / "b.log")
        plain.wait(10)
    assert not proc.tmp_dir.exists()
    assert plain.tmp_dir is None and (tmp_path / "b.log").read_text().strip() != str(proc.tmp_dir)
