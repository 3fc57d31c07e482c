"""The processes of ``astrolabe demo``: emulated vLLM instances, predictor sidecars, and the router tier.

Owns starting them in a ``astrolabe.procs.ProcessGroup`` (so errors and Ctrl-C stop them all) and waiting until they
are ready, plus reading what they report (CPU time, queue gauges). Nothing imports this module but the demo.

The router tier has ``num_routers`` replicas, as a production gateway does: R Envoys, the client spreading its
requests over them (each request names its replica: ``TraceRequest.router``). For an ext_proc policy there are
R extproc replicas too, and every Envoy's ext_proc cluster lists all of them (as a Kubernetes Service would), so
that each extproc sees only the requests Envoy happens to give it: its own in-flight counts and its own metrics
scrapes. For ``envoy-least-request`` the Envoys balance by themselves (``astrolabe envoy --mode least-request``),
each with its own active-request counts.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from astrolabe.procs import ManagedProcess, ProcessGroup, ProcessStartError, free_port
from predictor.backend_metrics import MetricsFormatError, parse_vllm_metrics

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
ENVOY_LEAST_REQUEST = "envoy-least-request"
"""Policy name of the baseline that runs Envoy's own LEAST_REQUEST load balancer and no extproc."""

_START_TIMEOUT_S = 60.0
_IDLE_TIMEOUT_S = 60.0
_POLL_INTERVAL_S = 0.1


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What every emulated instance and its sidecar are told (vLLM names; ``time_scale`` x H200 step times;
    ``scheduling_policy``: vLLM's ``--scheduling-policy``, fcfs or priority, given to the emulators and the sidecars
    alike)."""

    model: str
    max_num_seqs: int
    max_num_batched_tokens: int
    num_gpu_blocks: int
    block_size: int
    time_scale: float
    stream_interval: int
    max_model_len: int
    scheduling_policy: str = "fcfs"

    def scheduling_args(self) -> list[str]:
        """``--scheduling-policy`` for a non-default policy (none for fcfs: what every version of both takes)."""
        return [] if self.scheduling_policy == "fcfs" else ["--scheduling-policy", self.scheduling_policy]


def start_emulators(procs: ProcessGroup, num_instances: int, engine: EngineSettings, seed: int, log_dir: Path,
                    state_dir: Path | None, env: dict[str, str] | None = None) -> list[str]:
    """Start ``num_instances`` emulators on free ports and wait for ``/health``; returns their ``ip:port``.

    With ``state_dir`` each one publishes its engine state to ``state_dir/emulator-<i>.json`` (the vLLM plugin's
    format), for sidecars in plugin mode. ``env`` is added to their environment (the demo's ``OTEL_*`` tracing).

    Raises:
        ProcessStartError: an emulator exited or was not healthy within the start timeout.
    """
    started: list[tuple[ManagedProcess, str]] = []
    for i in range(num_instances):
        port = free_port(HOST)
        cmd = [
            sys.executable, "-m", "astrolabe", "emulator", "--host", HOST, "--port", str(port),
            "--served-model-name", engine.model, "--max-num-seqs", str(engine.max_num_seqs),
            "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
            "--num-gpu-blocks", str(engine.num_gpu_blocks), "--block-size", str(engine.block_size),
            "--time-scale", str(engine.time_scale), "--stream-interval", str(engine.stream_interval),
            "--max-model-len", str(engine.max_model_len), "--seed", str(seed + i), *engine.scheduling_args(),
        ]
        if state_dir is not None:
            cmd += ["--state-path", str(state_dir / f"emulator-{i}.json")]
        proc = procs.start(cmd, name=f"emulator-{i}", log_path=log_dir / f"emulator-{i}.log", env=env)
        _lower_priority(proc.pid)
        started.append((proc, f"{HOST}:{port}"))
    # Started all at once above, waited for here: their imports overlap.
    for proc, address in started:
        proc.wait_http(f"http://{address}/health", _START_TIMEOUT_S)
    return [address for _, address in started]


EMULATOR_NICENESS = 10
"""Scheduling niceness of the emulators. They stand in for GPUs, which in production run on other machines than
the router and never take its CPU; on this small machine their Python step loops would otherwise preempt the
router and the sidecars (the system under test) and add milliseconds to every decision, the same for every
policy. A lower priority keeps the stand-ins from distorting what is measured; their own step times are
deadline-based (``bench.emulator.engine_loop``), so a late wake-up costs them little."""


def _lower_priority(pid: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, pid, EMULATOR_NICENESS)
    except OSError as exc:  # not permitted (or gone): measure anyway
        logger.warning("cannot lower the priority of emulator %d: %s", pid, exc)


def start_sidecars(procs: ProcessGroup, instances: Sequence[str], engine: EngineSettings, log_dir: Path,
                   state_dir: Path | None, env: dict[str, str] | None = None) -> dict[str, str]:
    """Start one predictor sidecar per instance (same engine limits and time scale); returns instance -> sidecar.

    With ``state_dir`` the sidecars read the emulators' engine state (``--state-source vllm-plugin``);
    otherwise they keep a ledger reconciled with ``/metrics``. ``env`` is added to their environment.

    Raises:
        ProcessStartError: a sidecar exited or did not listen within the start timeout.
    """
    started: list[tuple[ManagedProcess, str, str]] = []
    for i, instance in enumerate(instances):
        port = free_port(HOST)
        cmd = [
            sys.executable, "-m", "astrolabe", "predictor", "serve", "--backend", instance,
            "--listen", f"{HOST}:{port}", "--batch-time-model", engine.model, "--time-scale", str(engine.time_scale),
            "--max-num-seqs", str(engine.max_num_seqs), "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
            "--num-gpu-blocks", str(engine.num_gpu_blocks), "--block-size", str(engine.block_size),
            *engine.scheduling_args(),
        ]
        if state_dir is not None:
            cmd += ["--state-source", "vllm-plugin", "--vllm-state-path", str(state_dir / f"emulator-{i}.json")]
        else:
            cmd += ["--state-source", "ledger"]
        proc = procs.start(cmd, name=f"sidecar-{i}", log_path=log_dir / f"sidecar-{i}.log", env=env)
        started.append((proc, instance, f"{HOST}:{port}"))
    for proc, _, address in started:
        proc.wait_tcp(HOST, int(address.rsplit(":", 1)[1]), _START_TIMEOUT_S)
    return {instance: address for _, instance, address in started}


def _stat_fields(stat: Path) -> list[str]:
    """The fields of a /proc/<pid>/stat file after the command name (which may hold spaces and parentheses).

    Raises:
        OSError: the process is gone.
    """
    return stat.read_text().rsplit(")", 1)[1].split()


def _cpu_s(fields: list[str]) -> float:
    """User + system CPU time of `_stat_fields`, seconds (utime and stime, in clock ticks)."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far, seconds (Linux /proc); 0.0 if it is gone."""
    try:
        return _cpu_s(_stat_fields(Path(f"/proc/{pid}/stat")))
    except OSError:
        return 0.0


def _proc_stats():
    """(pid, the fields of /proc/<pid>/stat after the command name) of every live process (Linux)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            yield int(stat.parent.name), _stat_fields(stat)
        except OSError:
            continue  # exited meanwhile


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (Linux /proc), e.g. an extproc supervisor and its workers."""
    return [pid for pid, fields in _proc_stats() if int(fields[2]) == pgid]


def group_cpu_seconds(pgids: dict[int, str]) -> Counter:
    """CPU seconds so far (user + system, Linux /proc) of every live process in the process groups ``pgids``
    (group id -> label), summed per label: a `astrolabe.procs.ManagedProcess` leads its own group, so the Envoy that
    an ``astrolabe envoy`` launcher runs is counted with it."""
    totals: Counter = Counter()
    for _, fields in _proc_stats():
        label = pgids.get(int(fields[2]))
        if label is not None:
            totals[label] += _cpu_s(fields)
    return totals


def wait_grpc_ready(proc: ManagedProcess, address: str, timeout_s: float) -> None:
    """Wait until the extproc's gRPC health service reports ``readiness`` SERVING.

    Raises:
        ProcessStartError: the process exited, or it was not ready within ``timeout_s``.
    """
    import grpc  # noqa: PLC0415 (only the demo's router start needs it)
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

    deadline_s = time.monotonic() + timeout_s
    request = health_pb2.HealthCheckRequest(service="readiness")
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if not proc.is_running():
                raise ProcessStartError(f"{proc.name} exited with {proc.returncode}; log:\n{proc.log_tail()}")
            try:
                if stub.Check(request, timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet
            if time.monotonic() >= deadline_s:
                raise ProcessStartError(f"{proc.name} not ready within {timeout_s} s; log:\n{proc.log_tail()}")
            time.sleep(_POLL_INTERVAL_S)


@dataclass(frozen=True, slots=True)
class RouterTracing:
    """How a router tier traces (``bench.demo_tracing`` builds it).

    Attributes:
        extproc_env: ``OTEL_*`` variables added to each extproc's environment.
        envoy_args: ``astrolabe envoy`` flags of Envoy's tracer (``--otlp-endpoint`` ...).
    """

    extproc_env: dict[str, str]
    envoy_args: tuple[str, ...]


@dataclass(slots=True)
class RouterTier:
    """The running router replicas of one policy.

    Attributes:
        base_urls: each Envoy's ``http://host:port``, replica order.
        extprocs: the extproc processes (none for ``envoy-least-request``).
        envoys: the Envoy processes.
        metrics_urls: each extproc's Prometheus ``/metrics`` URL.
        decision_logs: each extproc's decision log (JSON lines, ``extproc.decision_log``).
    """

    base_urls: list[str]
    extprocs: list[ManagedProcess] = field(default_factory=list)
    envoys: list[ManagedProcess] = field(default_factory=list)
    metrics_urls: list[str] = field(default_factory=list)
    decision_logs: list[Path] = field(default_factory=list)

    @property
    def processes(self) -> list[ManagedProcess]:
        return [*self.extprocs, *self.envoys]

    def stop(self) -> None:
        """Stops Envoys first (no new requests), then extprocs (which flush their decision logs)."""
        for proc in [*self.envoys, *self.extprocs]:
            proc.stop()


def start_router_tier(procs: ProcessGroup, policy: str, extproc_config: dict, num_routers: int, body_mode: str,
                      instances: Sequence[str], log_dir: Path, tracing: RouterTracing | None = None,
                      label: str | None = None) -> RouterTier:
    """Start ``num_routers`` Envoys (and as many extprocs, unless ``policy`` is ``envoy-least-request``).

    Args:
        procs: where the processes live.
        policy: the policy name (an extproc policy or `ENVOY_LEAST_REQUEST`).
        extproc_config: the extproc YAML as a mapping, without ``listen``, ``metrics_listen`` and
            ``decision_log_path`` (set here per replica).
        num_routers: replicas (>= 1).
        body_mode: Envoy's ext_proc body mode (``full-duplex`` or ``buffered``).
        instances: the backends' ``ip:port`` (for ``envoy-least-request``).
        log_dir: process logs, configs and decision logs.
        tracing: the tier's Envoy tracer and extproc ``OTEL_*`` variables; None = untraced.
        label: names the tier's processes and files (``extproc-<label>-<r>.log``, ``decisions-<label>-<r>.jsonl``);
            None = ``policy``.

    Raises:
        ProcessStartError: a process exited or was not ready within the start timeout.
    """
    label = label or policy
    tier = RouterTier(base_urls=[])
    if policy != ENVOY_LEAST_REQUEST:
        addresses = []
        for r in range(num_routers):
            address, metrics = f"{HOST}:{free_port(HOST)}", f"{HOST}:{free_port(HOST)}"
            decision_log = log_dir / f"decisions-{label}-{r}.jsonl"
            decision_log.unlink(missing_ok=True)
            config = {"listen": address, "metrics_listen": metrics, "decision_log_path": str(decision_log),
                      **extproc_config}
            path = log_dir / f"extproc-{label}-{r}.yaml"
            path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
            tier.extprocs.append(procs.start(
                [sys.executable, "-m", "astrolabe", "extproc", "--config", str(path)],
                name=f"extproc-{label}-{r}", log_path=log_dir / f"extproc-{label}-{r}.log",
                env=None if tracing is None else tracing.extproc_env))
            addresses.append(address)
            tier.metrics_urls.append(f"http://{metrics}/metrics")
            tier.decision_logs.append(decision_log)
        # Envoy answers 500 to requests that reach it before the processor listens: wait first.
        for proc, address in zip(tier.extprocs, addresses):
            wait_grpc_ready(proc, address, _START_TIMEOUT_S)
        mode_args = ["--mode", body_mode, "--extproc", ",".join(addresses)]
    else:
        mode_args = ["--mode", "least-request", "--backends", ",".join(instances)]
    admin_urls = []
    for r in range(num_routers):
        listen_port, admin_port = free_port(HOST), free_port(HOST)
        tier.envoys.append(procs.start(
            [sys.executable, "-m", "astrolabe", "envoy", *mode_args, "--listen-port", str(listen_port),
             "--admin-port", str(admin_port), "--concurrency", "1", *(tracing.envoy_args if tracing else ())],
            name=f"envoy-{label}-{r}", log_path=log_dir / f"envoy-{label}-{r}.log"))
        tier.base_urls.append(f"http://{HOST}:{listen_port}")
        admin_urls.append(f"http://{HOST}:{admin_port}/ready")
    for proc, url in zip(tier.envoys, admin_urls):
        proc.wait_http(url, _START_TIMEOUT_S)
    return tier


def scrape_sum(url: str, series_prefix: str) -> float:
    """Sum of the samples of ``url`` (Prometheus text) whose line starts with ``series_prefix``; 0 if none.

    Raises:
        OSError: the URL cannot be read.
    """
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=2.0) as resp:
        lines = resp.read().decode("utf-8", errors="replace").splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(series_prefix))


def _scrape_queue(address: str) -> int:
    """Running plus waiting requests on ``/metrics`` of ``address`` (``predictor.backend_metrics``).

    Raises:
        OSError: the instance cannot be reached.
        MetricsFormatError: its /metrics lacks vLLM's queue gauges.
    """
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{address}/metrics", timeout=2.0) as resp:
        observed = parse_vllm_metrics(resp.read().decode("utf-8", errors="replace"))
    return observed.num_running + observed.num_waiting


def wait_idle(instances: Sequence[str], timeout_s: float = _IDLE_TIMEOUT_S) -> bool:
    """Wait until every instance reports no running and no waiting request; False on timeout."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        try:
            busy = [a for a in instances if _scrape_queue(a) > 0]
        except (OSError, MetricsFormatError) as exc:
            busy = [f"unreadable ({exc})"]
        if not busy:
            return True
        if time.monotonic() >= deadline_s:
            logger.warning("instances still busy after %s s: %s", timeout_s, busy)
            return False
        time.sleep(_POLL_INTERVAL_S)
