"""Start, wait for and stop real processes (Envoy, the extproc, emulated instances) in tests and the demo.

Each process runs in its own session, hence its own process group, so ``stop`` reaches the whole tree
(e.g. ``astrolabe envoy`` and the Envoy it runs). Output goes to a log file so that a failed start can
show the tail of it. Imports only the standard library.

NOTE: readiness is polled (TCP connect / HTTP GET every 50 ms): another process offers no event to
wait on. Nothing here asserts on elapsed time; the timeouts only bound how long a failure takes.
"""

from __future__ import annotations

from collections.abc import Callable

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import IO

logger = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.05
_TAIL_READ_BYTES = 64 * 1024
_FREE_PORT_TRIES = 64
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


class ProcessStartError(RuntimeError):
    """A process exited, or did not become ready in time, while being waited for; carries its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago and that this process has not handed out before.

    The port is released before returning, so another process may take it first (rare on loopback). The kernel
    may hand the same ephemeral port to two binds in a row, so two calls could return one port (a listener and
    its admin port then collide); the ports returned are remembered to rule that out within one process.

    Raises:
        OSError: no port could be bound on ``host``.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(_FREE_PORT_TRIES):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        with _handed_out_lock:
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise OSError(f"no port on {host} that was not handed out already after {_FREE_PORT_TRIES} tries")


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a live process (a zombie counts as gone: it no longer runs)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:  # no procfs: fall back to signal 0, which cannot tell zombies apart
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    # Field 3 (after the parenthesised command name, which may contain spaces) is the state.
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


class ManagedProcess:
    """One child process in its own process group, with its output in a log file.

    Create it with ``ManagedProcess.start``. ``stop`` is idempotent and always reaps the child.
    """

    def __init__(self, popen: subprocess.Popen[bytes], *, name: str, log_path: Path, log_file: IO[bytes],
                 tmp_dir: Path | None = None):
        self._popen = popen
        self._log_file = log_file
        self.name = name
        self.log_path = log_path
        self.tmp_dir = tmp_dir

    @classmethod
    def start(
        cls,
        cmd: list[str],
        *,
        name: str,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        cwd: Path | None = None,
        private_tmp: bool = False,
    ) -> ManagedProcess:
        """Start ``cmd`` in a new session with stdout and stderr both written to one log file.

        Args:
            cmd: program and arguments.
            name: label used in logs and errors.
            env: variables added to (overriding) a copy of ``os.environ``; None adds nothing.
            log_path: log file (truncated); None creates a temporary file that is kept for inspection.
            cwd: working directory; None keeps the current one.
            private_tmp: give the process a folder of its own as ``TMPDIR`` (``tempfile.mkdtemp``, a short path
                under the system's temp folder: Unix socket paths stay under their 108 bytes), removed with
                whatever it holds once the process has stopped: for programs that leave sockets and folders in
                the temp folder (vLLM's ``vllm_dist_*`` and ZMQ IPC sockets).

        Raises:
            OSError: the program could not be executed (e.g. not found).
        """
        if log_path is None:
            fd, tmp_name = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
            os.close(fd)
            log_path = Path(tmp_name)
        log_file = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        tmp_dir = Path(tempfile.mkdtemp(prefix="astrolabe-")) if private_tmp else None
        full_env = None if env is None and tmp_dir is None else {
            **os.environ, **(env or {}), **({"TMPDIR": str(tmp_dir)} if tmp_dir is not None else {})}
        try:
            popen = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                env=full_env, cwd=cwd, start_new_session=True,
            )
        except BaseException:
            log_file.close()
            if tmp_dir is not None:
                shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
        logger.info("started %s (pid %s), log %s", name, popen.pid, log_path)
        return cls(popen, name=name, log_path=log_path, log_file=log_file, tmp_dir=tmp_dir)

    @property
    def pid(self) -> int:
        """Process id of the child, which is also its process-group id."""
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """Exit status (negative N: killed by signal N); None while it runs."""
        return self._popen.poll()

    def is_running(self) -> bool:
        """Whether the child has not exited yet."""
        return self._popen.poll() is None

    def wait(self, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` seconds for the process to exit on its own; sends no signal.

        Returns:
            Its exit status (negative N: killed by signal N), or None if it still runs.
        """
        try:
            return self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, num_lines: int = 40) -> str:
        """The last ``num_lines`` lines of the log (undecodable bytes replaced); "" if unreadable."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - _TAIL_READ_BYTES))
                data = f.read()
        except OSError:
            return ""
        return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-num_lines:])

    def _fail(self, what: str) -> ProcessStartError:
        return ProcessStartError(f"{self.name} (pid {self.pid}) {what}; log {self.log_path}:\n{self.log_tail()}")

    def _check_alive(self, waiting_for: str) -> None:
        if self._popen.poll() is not None:
            raise self._fail(f"exited with code {self._popen.returncode} while waiting for {waiting_for}")

    def wait_tcp(self, host: str, port: int, timeout_s: float) -> None:
        """Wait until ``host:port`` accepts a TCP connection.

        Raises:
            ProcessStartError: the process exited first, or ``timeout_s`` seconds passed.
        """
        what = f"tcp {host}:{port}"
        deadline_s = time.monotonic() + timeout_s
        while True:
            self._check_alive(what)
            try:
                with socket.create_connection((host, port), timeout=1.0):
                    return
            except OSError:
                pass
            if time.monotonic() >= deadline_s:
                raise self._fail(f"did not accept {what} within {timeout_s} s")
            time.sleep(_POLL_INTERVAL_S)

    def wait_http(self, url: str, timeout_s: float, expect_status: int = 200) -> bytes:
        """Wait until a GET of ``url`` answers ``expect_status``; proxies from the environment are ignored.

        Returns:
            The body of the first response with the expected status.

        Raises:
            ProcessStartError: the process exited first, or ``timeout_s`` seconds passed.
        """
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline_s = time.monotonic() + timeout_s
        last = "no answer"
        while True:
            self._check_alive(f"GET {url}")
            try:
                with opener.open(url, timeout=2.0) as response:
                    status, body = response.status, response.read()
            except urllib.error.HTTPError as exc:
                status, body = exc.code, exc.read()
            except (OSError, urllib.error.URLError) as exc:
                status, body, last = None, b"", repr(exc)
            if status == expect_status:
                return body
            if status is not None:
                last = f"status {status}"
            if time.monotonic() >= deadline_s:
                raise self._fail(f"GET {url} did not answer {expect_status} within {timeout_s} s (last: {last})")
            time.sleep(_POLL_INTERVAL_S)

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the whole group is gone already

    def stop(self, timeout_s: float = 5.0) -> int:
        """Stop the process group: SIGTERM, then SIGKILL after ``timeout_s`` seconds. Idempotent.

        Members of the group that outlive the leader (e.g. a child that ignores SIGTERM) get SIGKILL.

        Returns:
            The leader's exit status (negative N: killed by signal N).
        """
        if self._popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self._popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %s) ignored SIGTERM for %s s: SIGKILL", self.name, self.pid, timeout_s)
                self._signal_group(signal.SIGKILL)
                self._popen.wait()
        if not self._log_file.closed:
            # Only once, right after reaping: later the group id may be free for reuse. Anything
            # left in the group now (a child that ignored SIGTERM) would otherwise be orphaned.
            self._signal_group(signal.SIGKILL)
            self._log_file.close()
            if self.tmp_dir is not None:
                shutil.rmtree(self.tmp_dir, ignore_errors=True)
            logger.info("stopped %s (pid %s): exit %s", self.name, self.pid, self._popen.returncode)
        return int(self._popen.returncode)


class ProcessGroup:
    """The processes of one test or demo run; a context manager that always stops them all on exit.

    Example::

        with ProcessGroup() as procs:
            backend = procs.start([sys.executable, "-m", "http.server", "0"], name="backend")
    """

    def __init__(self) -> None:
        self._procs: list[ManagedProcess] = []

    @property
    def processes(self) -> list[ManagedProcess]:
        """The started processes, in start order."""
        return list(self._procs)

    def start(
        self,
        cmd: list[str],
        *,
        name: str,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        cwd: Path | None = None,
        private_tmp: bool = False,
    ) -> ManagedProcess:
        """Start a ``ManagedProcess`` (same arguments) and add it to the group."""
        proc = ManagedProcess.start(cmd, name=name, env=env, log_path=log_path, cwd=cwd, private_tmp=private_tmp)
        self._procs.append(proc)
        return proc

    def stop_all(self, timeout_s: float = 5.0) -> None:
        """Stop every process, last started first; keeps going if one stop fails, then re-raises it.

        Safe to call again (each ``stop`` is idempotent) and from a KeyboardInterrupt/signal path.
        """
        first_error: BaseException | None = None
        for proc in reversed(self._procs):
            try:
                proc.stop(timeout_s)
            except BaseException as exc:  # noqa: BLE001 (a second Ctrl-C must not leave orphans)
                logger.error("stopping %s (pid %s) failed: %r", proc.name, proc.pid, exc)
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()


def exit_status_of(run: Callable[[], int]) -> int:
    """``run()``'s exit status, or 2 when a process failed to start (logged), 130 on Ctrl-C (the processes are
    stopped by their ``ProcessGroup`` as the exception unwinds)."""
    try:
        return run()
    except ProcessStartError as exc:
        logger.error("a process failed to start: %s", exc)
        return 2
    except KeyboardInterrupt:
        logger.error("interrupted; every process was stopped")
        return 130


def interrupt_on_termination() -> None:
    """SIGTERM and SIGINT (which background jobs ignore) raise KeyboardInterrupt in the main thread, so a launcher's
    ``with ProcessGroup()`` block unwinds and stops its processes. Call it before starting them."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.default_int_handler)


def wait_while_running(processes: list[ManagedProcess], poll_s: float = 1.0) -> None:
    """Returns when one of ``processes`` exits or on KeyboardInterrupt (`interrupt_on_termination`)."""
    try:
        while all(p.is_running() for p in processes):
            time.sleep(poll_s)
    except KeyboardInterrupt:
        pass
