"""Starts a real stack on loopback for integration tests: backends, the extproc and the real Envoy."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from astrolabe.procs import ManagedProcess, ProcessGroup, free_port

PY = sys.executable
T = TypeVar("T")


def poll_until(check: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Calls ``check`` until it returns a truthy value and returns that value (a condition another process
    reaches offers no event to wait on).

    Raises:
        TimeoutError: ``check`` stayed falsy for ``timeout_s`` seconds; the message names ``what``.
    """
    deadline_s = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)


def signal_process(proc: ManagedProcess, sig: signal.Signals) -> None:
    """Sends ``sig`` to ``proc``'s whole process group, by its PID (SIGKILL, SIGSTOP, SIGCONT: a fault; the
    ``ProcessGroup`` still reaps it). A group that is gone already is not an error."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class Stack:
    """Handles of a running stack; ``procs`` owns every process. ``env`` is added to every process's environment
    (e.g. the ``OTEL_*`` variables that turn tracing on)."""

    procs: ProcessGroup
    tmp: Path
    mode: str
    env: dict[str, str] | None = None
    envoy_url: str = ""
    admin_url: str = ""
    extproc_port: int = 0
    metrics_url: str = ""
    extproc: ManagedProcess | None = None
    config_path: Path | None = None
    backends: dict[str, ManagedProcess] = field(default_factory=dict)

    def start_echo(self) -> str:
        port = free_port()
        proc = self.procs.start([PY, "-m", "tests.integration.echo_backend", "--port", str(port)],
                                name=f"echo-{port}", log_path=self.tmp / f"echo-{port}.log", env=self.env)
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout_s=20)
        self.backends[f"127.0.0.1:{port}"] = proc
        return f"127.0.0.1:{port}"

    def start_emulator(self, *extra: str, port: int | None = None) -> str:
        """Starts an emulated vLLM instance (``extra``: more ``astrolabe emulator`` flags) on ``port`` (None: a free
        one; a fixed one restarts an instance where it was); returns its ``ip:port`` once ``/health`` answers."""
        port = port or free_port()
        proc = self.procs.start([PY, "-m", "astrolabe", "emulator", "--port", str(port), *extra],
                                name=f"emulator-{port}", log_path=self.tmp / f"emulator-{port}.log", env=self.env)
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout_s=30)
        self.backends[f"127.0.0.1:{port}"] = proc
        return f"127.0.0.1:{port}"

    def start_sidecar(self, backend: str, *extra: str) -> str:
        port = free_port()
        proc = self.procs.start([PY, "-m", "astrolabe", "predictor", "serve", "--backend", backend,
                                 "--listen", f"127.0.0.1:{port}", *extra],
                                name=f"sidecar-{port}", log_path=self.tmp / f"sidecar-{port}.log", env=self.env)
        proc.wait_tcp("127.0.0.1", port, timeout_s=30)
        return f"127.0.0.1:{port}"

    def write_config(self, endpoints: list[dict], **extra) -> None:
        self.extproc_port = self.extproc_port or free_port()
        metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.config_path = self.tmp / "extproc.yaml"
        self.config_path.write_text(json.dumps({
            "listen": f"127.0.0.1:{self.extproc_port}", "metrics_listen": f"127.0.0.1:{metrics_port}",
            "drain_delay_s": 0.5, "grace_period_s": 1.0,
            "health_check": {"interval_s": 0.5, "timeout_s": 0.5, "unhealthy_threshold": 1},
            "endpoints": endpoints, **extra}))

    def start_extproc(self, workers: int = 1) -> None:
        """Starts the extproc (``workers`` > 1: its supervisor and that many worker processes, ``--workers``) and
        waits until it accepts connections and serves /metrics."""
        self.extproc = self.procs.start([PY, "-m", "astrolabe", "extproc", "--config", str(self.config_path),
                                         "--log-level", "DEBUG", "--workers", str(workers)],
                                        name="extproc", log_path=self.tmp / "extproc.log", env=self.env)
        self.extproc.wait_tcp("127.0.0.1", self.extproc_port, timeout_s=20)
        self.extproc.wait_http(self.metrics_url, timeout_s=20)

    def start_envoy(self, *extra: str, wait_routable: bool = True) -> str:
        """Starts an Envoy in front of the extproc (``extra``: more ``astrolabe envoy`` flags); returns its URL,
        also kept in ``envoy_url``, once its admin interface is ready and (``wait_routable``) a GET got through
        the extproc."""
        port, admin = free_port(), free_port()
        proc = self.procs.start([PY, "-m", "astrolabe", "envoy", "--mode", self.mode, "--listen-port", str(port),
                                 "--admin-port", str(admin), "--extproc", f"127.0.0.1:{self.extproc_port}", *extra],
                                name=f"envoy-{port}", log_path=self.tmp / f"envoy-{port}.log")
        proc.wait_http(f"http://127.0.0.1:{admin}/ready", timeout_s=20)
        self.envoy_url, self.admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
        if wait_routable:
            self.wait_routable()
        return self.envoy_url

    def wait_routable(self, timeout_s: float = 20.0) -> None:
        """Until Envoy has a healthy connection to the extproc (a GET gets through)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.envoy_url}/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("Envoy never routed a request through the extproc")
            time.sleep(0.1)

    def samples(self) -> list:
        """One scrape of the extproc's /metrics: its samples (``prometheus_client`` ``Sample``s), to read several
        series at the same moment with `metric`."""
        from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

        return [sample for family in text_string_to_metric_families(httpx.get(self.metrics_url, timeout=5).text)
                for sample in family.samples]

    def metric(self, series: str, samples: list | None = None) -> float:
        """The sum of the extproc's /metrics samples named as ``series`` that carry at least its labels, e.g.
        ``astrolabe_extproc_requests_total{outcome="routed"}`` (every policy); from ``samples`` (`samples`) if
        given, else from a new scrape. Raises KeyError if none does."""
        name, _, labels_text = series.partition("{")
        wanted = dict(re.findall(r'(\w+)="([^"]*)"', labels_text))
        values = [sample.value for sample in (self.samples() if samples is None else samples)
                  if sample.name == name and wanted.items() <= sample.labels.items()]
        if not values:
            raise KeyError(series)
        return sum(values)

    def in_flight(self, endpoint: str) -> float:
        """The extproc's own in-flight count for ``endpoint`` (from its /metrics)."""
        return self.metric(f'astrolabe_extproc_in_flight_requests{{endpoint="{endpoint}"}}')


def sidecar_state(address: str, timeout_s: float = 2.0) -> dict:
    """A predictor sidecar's view of its instance (its ``State`` RPC, JSON: ``running``, ``waiting``,
    ``state_age_s``, ``reconcile`` ...).

    Raises:
        grpc.RpcError: the sidecar did not answer within ``timeout_s`` seconds.
    """
    import grpc

    from predictor import predictor_pb2, predictor_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = predictor_pb2_grpc.PredictorStub(channel).State(predictor_pb2.StateRequest(), timeout=timeout_s)
    return json.loads(reply.state_json)
