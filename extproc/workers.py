"""``workers`` > 1: one supervisor process and N extproc worker processes that serve one listening port.

Why SO_REUSEPORT and not a socket handed out: gRPC (grpcio) binds its own listening sockets (``add_*_port``) and
takes no listening socket from elsewhere (grpc core's ``*_from_fd`` calls take one connected socket), so each
worker binds ``listen`` itself with SO_REUSEPORT (``grpc.so_reuseport``); the kernel hands each new connection to
one worker's listening socket (by a hash of its addresses), and the connection stays there. Envoy holds one HTTP/2
connection per worker thread to the extproc (``--concurrency``, 2 by default in ``astrolabe envoy``), so with few
gateway threads whole connections, not streams, are what the workers share, and two connections may well land on
the same worker. Workers therefore end each connection after `WORKER_MAX_CONNECTION_AGE_S` (gRPC's
``max_connection_age``: a graceful GOAWAY, the streams in flight go on; gRPC adds +-10 % jitter): Envoy opens a
new one for the next streams, which the kernel gives to any worker, so over a few seconds every worker takes a
share. A stream limit per connection (``grpc.max_concurrent_streams``) would spread concurrent streams at once,
but Envoy sends streams on a new connection before it has read the server's SETTINGS and the extproc's gRPC
server refuses those past the limit (measured: 64 of 128 requests answered 503); Envoy's own
``http2_protocol_options.max_concurrent_streams`` on the extproc cluster would not have that race.

The refusal to share a port with another program stays: the supervisor first binds every address of ``listen``
with a plain socket (no SO_REUSEPORT; SO_REUSEADDR as gRPC sets it, so connections in TIME_WAIT do not count),
which fails while any socket listens there, with SO_REUSEPORT or not; it then exits 2 with the message one
process gives ("invalid configuration: listen: cannot listen on ..."). It then holds the port, for its whole life,
with bound SO_REUSEPORT sockets that never listen (they take no connection): port 0 stays the port it picked, and
the port stays this extproc's while a worker restarts. Only a program that sets SO_REUSEPORT itself, under the same
user, can still join later (the kernel's rule for SO_REUSEPORT; gRPC servers set it by default).

Lifecycle:

- Start: the workers start at once (``multiprocessing``, spawn: a fresh interpreter each, nothing shared), each a
  whole extproc (its own pool and health checks, router, sidecar channels and watch streams, decision log writer
  and metrics); the supervisor waits until every one is ready. A worker that exits first (a configuration error
  only a worker meets: TLS files, the tagger, discovery; it logged the error) ends the start: the other workers
  are stopped and the supervisor exits with that worker's status (2 for a configuration error).
- A worker that dies later is restarted (WARNING, with its exit status), no sooner than `RESTART_DELAY_S` after
  its previous start; its open ext_proc streams are lost with it (Envoy answers those requests with its
  ``failure_mode_allow`` behaviour, as for one process that dies). A restarted worker that exits before it is
  ready ends the supervisor with status 1 (after stopping the others), so that the orchestrator restarts the pod
  rather than the pod serving on fewer workers for good.
- A ready worker's event loop beats every `HEARTBEAT_INTERVAL_S` (one byte on a pipe); one silent for
  `STALL_TIMEOUT_S` (SIGSTOP, a hung loop) is SIGKILLed and restarted as above (ERROR): a hung worker keeps the
  connections the kernel gave it, and a break-it pass measured no request at all succeeding for 12 s while one of 2
  workers was stopped.
- SIGTERM or SIGINT to the supervisor: passed to every worker, which drains as one process does (readiness
  NOT_SERVING, ``drain_delay_s``, then ``grace_period_s``); the supervisor waits for them, SIGKILLs any worker
  still running `KILL_MARGIN_S` after that, and exits 0.
- The supervisor killed (SIGKILL, the OOM killer): every worker watches its parent (the sentinel of
  ``multiprocessing.parent_process``) and drains as on SIGTERM, so no worker outlives it.

Metrics (``metrics_listen``): each worker serves its own registry on an ephemeral loopback port; the supervisor
serves ``metrics_listen`` and on each scrape reads every ready worker's and adds them up, sample by sample
(`merge_expositions`): counters and histograms are sums over the workers, as are gauges except
`GAUGE_COMBINE`'s (an endpoint is healthy if every worker's checks pass; a sidecar's state age is the oldest). The
workers are read in parallel; one that does not answer within `SCRAPE_TIMEOUT_S` (busy, stopped) counts with the
last exposition read from it, so that the sums do not go down. A worker being restarted is missing from the sum
until it is ready, and its counters start again from 0: the sums go down then, which Prometheus reads as a counter
reset. Why not prometheus-client's multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``): the extproc exports its pool gauges and its per-sidecar call and prediction
counts from custom collectors read at scrape time (``extproc.metrics``), and "custom collectors do not work" in
that mode (prometheus-client's documentation, "Multiprocess Mode").

Logs: every worker writes to the supervisor's stderr; each of its lines names it (``worker=<index> pid=<pid>`` in
text, ``worker`` and ``pid`` keys in JSON: ``astrolabe.logs.set_worker``); the supervisor's lines carry neither.

Decision log (``decision_log_path``): every worker appends to the same file, whole lines per write under
``O_APPEND`` (``extproc.decision_log``); each record's ``pid`` names the worker that decided.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import ipaddress
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from astrolabe.logs import set_worker, setup_logging
from extproc.config import ConfigError, ExtprocConfig, replace_config

logger = logging.getLogger(__name__)

WORKER_MAX_CONNECTION_AGE_S = 1.0
"""A worker's connections get a graceful GOAWAY after this long, seconds, so that new connections, each to any
worker, take the next streams (module docstring). Costs Envoy one connection per thread per second."""
RESTART_DELAY_S = 1.0
"""Least time between two starts of one worker, seconds (a worker that dies at once is not restarted in a loop)."""
KILL_MARGIN_S = 5.0
"""At shutdown, time past ``drain_delay_s + grace_period_s`` after which a worker still running gets SIGKILL,
seconds (a worker's own drain ends by then, its tracer's flush included)."""
SCRAPE_TIMEOUT_S = 1.0
"""Longest wait for one worker's /metrics during a scrape of the supervisor's, seconds (the workers are read in
parallel; one that does not answer in time counts with its last exposition read)."""
HEARTBEAT_INTERVAL_S = 0.5
"""A ready worker's event loop writes one byte to its supervisor this often, seconds."""
STALL_TIMEOUT_S = 5.0
"""A ready worker whose heartbeat stops this long (a stopped process, an event loop that hangs) is SIGKILLed and
restarted, seconds: the kernel keeps handing it connections (SO_REUSEPORT), so a hung worker would take its share of
Envoy's connections, and with them all requests on them, for as long as it hangs."""
GAUGE_COMBINE: dict[str, Callable[[Sequence[float]], float]] = {
    "astrolabe_extproc_endpoint_healthy": min,
    "astrolabe_extproc_watched_state_age_seconds": max,
}
"""Gauges that are not summed over the workers, and how they combine (`merge_expositions`)."""


# The port


@dataclass
class PortReservation:
    """The sockets that hold ``listen``'s port for the workers (bound with SO_REUSEPORT, never listening)."""

    listen: str
    """``listen`` with the port the workers bind (port 0 replaced by the one picked)."""
    port: int
    sockets: list[socket.socket]

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def _bind(family: int, host: str, port: int, reuse_port: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        else:  # as gRPC binds: connections in TIME_WAIT do not hold the port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and ipaddress.ip_address(host.split("%")[0]).is_unspecified:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # "[::]": IPv4 too, as gRPC binds it
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def reserve_port(listen: str) -> PortReservation:
    """Checks that no other program holds ``listen`` (``host:port``, as the config's ``listen``) and holds its port
    for the workers (module docstring).

    Raises:
        ConfigError: the address does not resolve, or a socket listens on its port already; the message is the
            one a single process gives.
    """
    host, _, port_text = listen.rpartition(":")
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    error = ConfigError(f"listen: cannot listen on {listen}")
    try:
        infos = socket.getaddrinfo(name or None, int(port_text), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        raise error from None
    addresses = list(dict.fromkeys((family, sockaddr[0]) for family, _, _, _, sockaddr in infos))
    port = int(port_text)
    bound: list[tuple[int, str]] = []
    probes: list[socket.socket] = []
    try:
        for family, address in addresses:
            try:
                probes.append(_bind(family, address, port, reuse_port=False))
            except OSError as exc:
                if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):  # e.g. no ::1 here: gRPC skips it too
                    continue
                raise error from None
            bound.append((family, address))
            port = port or probes[-1].getsockname()[1]
    finally:
        for probe in probes:
            probe.close()
    if not bound:
        raise error
    holders: list[socket.socket] = []
    try:  # the port was free a moment ago; a program that took it since then makes this fail
        for family, address in bound:
            holders.append(_bind(family, address, port, reuse_port=True))
    except OSError:
        for holder in holders:
            holder.close()
        raise error from None
    return PortReservation(f"{host}:{port}", port, holders)


# Metrics


def merge_expositions(texts: Sequence[str]) -> list[Metric]:
    """The workers' Prometheus text expositions as one: each sample (name and labels) summed over the texts that
    carry it, except ``*_created`` (the earliest) and `GAUGE_COMBINE`'s gauges. Families keep their first seen
    order, samples too.

    Raises:
        ValueError: a text is not the Prometheus text format.
    """
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                values[family.name] = {}
            samples = values[family.name]
            for sample in family.samples:
                samples.setdefault((sample.name, tuple(sorted(sample.labels.items()))), []).append(sample.value)
    merged = []
    for name, family in families.items():
        for (sample_name, labels), sample_values in values[name].items():
            combine = (min if sample_name.endswith("_created") else
                       GAUGE_COMBINE.get(name, sum) if family.type == "gauge" else sum)
            family.add_sample(sample_name, dict(labels), combine(sample_values))
        merged.append(family)
    return merged


class _WorkersCollector(Collector):
    """Reads every ready worker's /metrics at scrape time and yields their sum (`merge_expositions`)."""

    def __init__(self, ports: Callable[[], list[int]]) -> None:
        self._ports = ports
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._last: dict[int, str] = {}  # metrics port -> the last exposition read from it
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="scrape")

    def describe(self):
        return []  # nothing is read at registration

    def _read(self, port: int) -> str:
        with self._opener.open(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as response:
            return response.read().decode()

    def collect(self):
        ports = self._ports()
        texts = []
        for port, future in [(port, self._executor.submit(self._read, port)) for port in ports]:
            try:
                self._last[port] = future.result()
            except OSError as exc:  # busy or stopped: its last exposition (none: a worker just started)
                logger.warning("metrics of the worker on port %d not read (%s): its last ones are used", port, exc)
            if port in self._last:
                texts.append(self._last[port])
        for port in set(self._last) - set(ports):  # a worker gone (restarted: a new port)
            del self._last[port]
        yield from merge_expositions(texts)


# The workers


def _worker_main(index: int, config: ExtprocConfig, config_path: Path | None, overrides: Mapping[str, Any],
                 ready, beats, run: Callable[..., int]) -> None:
    """A worker process: one whole extproc on the shared port (``run``: `extproc.server.run`, pickled by name, so
    this module needs no import of the server's); sends ``(pid, metrics port)`` on ``ready`` once it serves, then
    writes a byte to ``beats`` every `HEARTBEAT_INTERVAL_S` from its event loop; exits with ``run``'s status."""
    set_worker(index)  # every line of this process says which worker wrote it
    setup_logging(config.log_level, config.log_format)
    logger.info("worker %d (pid %d) starting", index, os.getpid())

    def on_ready(server) -> None:
        ready.send((os.getpid(), server.metrics_port))
        ready.close()
        fd = beats.fileno()
        os.set_blocking(fd, False)  # a supervisor that does not read (stopped) must not block the event loop
        loop = asyncio.get_running_loop()

        def beat() -> None:
            with contextlib.suppress(BlockingIOError, BrokenPipeError):
                os.write(fd, b".")
            loop.call_later(HEARTBEAT_INTERVAL_S, beat)

        beat()

    parent = multiprocessing.parent_process()
    raise SystemExit(run(config, config_path, overrides, reuse_port=True, on_ready=on_ready,
                         parent_fd=None if parent is None else parent.sentinel,
                         max_connection_age_s=WORKER_MAX_CONNECTION_AGE_S))


@dataclass
class _Worker:
    index: int
    process: multiprocessing.process.BaseProcess
    ready: multiprocessing.connection.Connection
    beats: multiprocessing.connection.Connection
    started_s: float
    last_beat_s: float = 0.0
    metrics_port: int = 0
    is_ready: bool = False
    restarted: bool = False
    killed: bool = False  # SIGKILLed by the watchdog, not reaped yet


class _Supervisor:
    def __init__(self, config: ExtprocConfig, config_path: Path | None, overrides: Mapping[str, Any],
                 run: Callable[..., int]) -> None:
        self._run = run
        self._config = config
        self._config_path = config_path
        self._overrides = dict(overrides)
        self.listen = config.listen
        self._context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []
        self.signals: list[int] = []
        self._wake_r, self._wake_w = socket.socketpair()
        for sock in (self._wake_r, self._wake_w):
            sock.setblocking(False)

    def metrics_ports(self) -> list[int]:
        return [w.metrics_port for w in self.workers if w.is_ready and w.metrics_port]

    def start(self, index: int, restarted: bool = False) -> _Worker:
        receive, send = self._context.Pipe(duplex=False)
        beats, beat = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=_worker_main, name=f"astrolabe-extproc-worker-{index}",
            args=(index, self._config, self._config_path, self._overrides, send, beat, self._run))
        process.start()
        send.close()  # the worker holds the only write end: its death reads as EOF here
        beat.close()
        os.set_blocking(beats.fileno(), False)
        worker = _Worker(index, process, receive, beats, time.monotonic(), restarted=restarted)
        logger.info("worker %d started (pid %d)", index, process.pid)
        return worker

    def handle_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda s, _frame: self.signals.append(s))
        signal.set_wakeup_fd(self._wake_w.fileno())

    def wait(self, timeout_s: float | None) -> list[Any]:
        objects = [self._wake_r, *(w.process.sentinel for w in self.workers),
                   *(w.ready for w in self.workers if not w.is_ready)]
        ready = multiprocessing.connection.wait(objects, timeout_s)
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(64):
                pass
        return ready

    def kill_stalled(self) -> None:
        """Reads the ready workers' heartbeats; SIGKILLs one silent for `STALL_TIMEOUT_S` (its death then restarts
        it)."""
        now_s = time.monotonic()
        for worker in self.workers:
            if not worker.is_ready or worker.killed or not worker.process.is_alive():
                continue  # a killed worker is restarted once its death is reaped: one kill, one log line
            with contextlib.suppress(BlockingIOError, OSError):
                while os.read(worker.beats.fileno(), 4096):
                    worker.last_beat_s = now_s
            if now_s - worker.last_beat_s > STALL_TIMEOUT_S:
                logger.error("worker %d (pid %d) gave no sign of life for %.1f s (stopped, or its event loop hangs): "
                             "SIGKILL", worker.index, worker.process.pid, now_s - worker.last_beat_s)
                worker.process.kill()
                worker.killed = True

    def take_ready(self, worker: _Worker) -> bool:
        """Reads ``worker``'s ready message if one came; True when it did."""
        try:
            if not worker.ready.poll():
                return False
            _, worker.metrics_port = worker.ready.recv()
        except (EOFError, OSError):  # it died before it was ready
            return False
        worker.is_ready = True
        worker.last_beat_s = time.monotonic()
        worker.ready.close()
        return True

    def stop_all(self) -> None:
        """SIGTERM to every live worker; waits for their drain, then SIGKILL (module docstring)."""
        for worker in self.workers:
            if worker.process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.process.pid, signal.SIGTERM)
        deadline_s = (time.monotonic() + self._config.drain_delay_s + self._config.grace_period_s + KILL_MARGIN_S)
        for worker in self.workers:
            worker.process.join(max(0.0, deadline_s - time.monotonic()))
            if worker.process.is_alive():
                logger.warning("worker %d (pid %d) still runs after the drain: SIGKILL", worker.index,
                               worker.process.pid)
                worker.process.kill()
                worker.process.join()
        self.close()

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        self._wake_r.close()
        self._wake_w.close()


def supervise(config: ExtprocConfig, config_path: Path | None, overrides: Mapping[str, Any],
              run: Callable[..., int]) -> int:
    """Runs ``config.workers`` extproc workers on ``config.listen`` until SIGTERM or SIGINT (module docstring), each
    calling ``run`` (`extproc.server.run`) with ``reuse_port``, ``on_ready``, ``parent_fd`` and
    ``max_connection_age_s``;
    returns the exit status: 0 after a drain, 2 for a configuration that cannot be served (logged: ``listen`` or
    ``metrics_listen`` in use here, or a worker's own start-up error), 1 when a restarted worker failed to start.
    """
    try:
        reservation = reserve_port(config.listen)
    except ConfigError as exc:
        logger.error("invalid configuration: %s", exc)
        return 2
    # The workers' own values, also applied to each file they reload (where they are no change of the file's).
    worker_overrides = {**overrides, "listen": reservation.listen,
                        "metrics_listen": "127.0.0.1:0" if config.metrics_listen else None}
    supervisor = _Supervisor(replace_config(config, **worker_overrides), config_path, worker_overrides, run)
    metrics_server = None
    try:
        if config.metrics_listen:  # before any worker starts, so that a busy port leaves nothing running
            host, _, port = config.metrics_listen.rpartition(":")
            registry = CollectorRegistry()
            registry.register(_WorkersCollector(supervisor.metrics_ports))
            try:
                metrics_server, _ = start_http_server(int(port), addr=host, registry=registry)
            except OSError as exc:
                logger.error("invalid configuration: metrics_listen: cannot listen on %s: %s", config.metrics_listen,
                             exc)
                return 2
            logger.info("metrics of all workers on http://%s:%d/metrics", host, metrics_server.server_port)
        supervisor.handle_signals()
        logger.info("extproc supervisor (pid %d): port %d held for %d workers", os.getpid(), reservation.port,
                    config.workers)
        return _run(supervisor, config)
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        reservation.close()


def _run(supervisor: _Supervisor, config: ExtprocConfig) -> int:
    supervisor.workers = [supervisor.start(i) for i in range(config.workers)]
    all_ready = False
    restarts: dict[int, float] = {}  # worker index -> when it may start again
    try:
        while not supervisor.signals:
            timeout_s = HEARTBEAT_INTERVAL_S
            if restarts:
                timeout_s = min(timeout_s, max(0.0, min(restarts.values()) - time.monotonic()))
            supervisor.wait(timeout_s)
            if supervisor.signals:  # a worker that ends now ends by the same signal (its process group's)
                break
            supervisor.kill_stalled()
            for worker in supervisor.workers:
                if not worker.is_ready and supervisor.take_ready(worker):
                    logger.info("worker %d (pid %d) ready", worker.index, worker.process.pid)
                if worker.process.is_alive() or worker.index in restarts:
                    continue
                worker.process.join()
                status = worker.process.exitcode
                if not worker.is_ready and (not all_ready or worker.restarted):
                    logger.error("worker %d (pid %d) exited with status %s before it was ready: stopping the "
                                 "others", worker.index, worker.process.pid, status)
                    supervisor.stop_all()
                    # its own status when it failed its first start (2: configuration), else 1 (a signal too)
                    return status if not all_ready and status and status > 0 else 1
                logger.warning("worker %d (pid %d) exited with status %s: restarting it", worker.index,
                               worker.process.pid, status)
                restarts[worker.index] = worker.started_s + RESTART_DELAY_S
            for index, when_s in list(restarts.items()):
                if time.monotonic() >= when_s:
                    del restarts[index]
                    supervisor.workers[index].beats.close()
                    supervisor.workers[index] = supervisor.start(index, restarted=True)
            if not all_ready and all(w.is_ready for w in supervisor.workers):
                all_ready = True
                logger.info("all %d workers ready on %s", config.workers, supervisor.listen)
    except BaseException:
        supervisor.stop_all()
        raise
    logger.info("shutdown requested: draining %d workers for at most %.1f s", len(supervisor.workers),
                config.drain_delay_s + config.grace_period_s)
    supervisor.stop_all()
    logger.info("extproc supervisor stopped")
    return 0
