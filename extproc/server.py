"""``astrolabe extproc``: the grpc.aio server, gRPC health, config reload and graceful shutdown.

No routing code lives here: ``stream.StreamHandler`` handles each ext_proc stream and ``router.Router`` decides.

Health (grpc.health.v1) reports the service names ``""``, ``liveness``, ``readiness`` and
``envoy.service.ext_proc.v3.ExternalProcessor``. ``liveness`` is SERVING while the process runs; the others
become SERVING after the first discovered endpoint list (``discovery.source`` kubernetes or dns:
``extproc.discovery``) and the first round of endpoint health checks and NOT_SERVING when shutdown starts, so that
Envoy's health checker moves new streams elsewhere while in-flight streams drain (for at most
``grace_period_s``; a stream still open then is cancelled, which ends nothing for a request whose route was
already sent, since every response phase is skipped).

Tracing (``tracing:`` in the config and the ``OTEL_*`` variables, ``astrolabe.tracing``): set up in ``main``
before the server starts, shut down (queued spans exported, for at most 2 s) after it stopped.

Worker processes (``workers`` > 1): ``main`` runs ``extproc.workers.supervise``, whose workers each run `run`
with ``reuse_port`` (the port shared with SO_REUSEPORT, bound once the worker is ready).

Logs (``astrolabe.logs``): ``main`` sets them up from the flags first (so that config errors are logged as
asked), then from ``log_level`` / ``log_format`` (the flags win); every line logged while a stream handles a
request carries its request id and, with tracing on, its trace id (``extproc.stream``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import random
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from astrolabe.envoy import DEFAULT_BUFFER_LIMIT_BYTES as ENVOY_BUFFER_LIMIT_BYTES
from astrolabe.cli import HelpFormatter
from astrolabe.lifecycle import settle_heap, wait_for_termination
from astrolabe.logs import DEFAULT_LOG_FORMAT, DEFAULT_LOG_LEVEL, add_arguments as add_log_arguments, setup_logging
from astrolabe.tls import BackendTls, ClientTls, ServerTls, TlsError, server_credentials
from astrolabe.tracing import Tracing, TracingConfigError, setup_tracing
from extproc import wire
from extproc.config import LIVE_KEYS, ConfigError, ExtprocConfig, changed_keys, load_config, replace_config
from extproc.endpoint_metrics import MetricsScraper
from extproc.decision_log import DecisionLog
from extproc.discovery import build_source
from extproc.lengths import OutputLengthEstimator
from extproc.metrics import ExtprocMetrics
from extproc.fleet_state import FleetState
from extproc.predictor_client import PredictorClient
from extproc.policies.registry import build_policy
from extproc.pool import EndpointPool, HealthChecker
from extproc.prompt_tokens import PromptTokenCounter, TokenizerLoadError
from extproc.router import Router
from extproc.spans import NO_SPAN, RequestSpan
from extproc.stream import StreamHandler
from tagger.artifact import TaggerLoadError
from tagger.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

SERVICE_NAME = "astrolabe-extproc"
"""The extproc's default ``service.name`` (``tracing.service_name`` or ``OTEL_SERVICE_NAME`` replace it)."""
TRACER_NAME = "astrolabe.extproc"
"""Instrumentation scope of every extproc span."""

_GRPC_MESSAGE_OVERHEAD_BYTES = 1 << 20
"""Room above ``max_body_bytes`` for the rest of a ProcessingRequest (headers, metadata)."""


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """The ext_proc service: one ``StreamHandler`` per ``Process`` stream (and, with a ``tracer``, one request span,
    whose parent may come from the stream's metadata: ``extproc.spans``).

    Until `ready` is set (the server's first endpoint list and health round, and the sidecars' first states, are
    in), every new stream is aborted with UNAVAILABLE: Envoy then applies its ``failure_mode_allow`` as for an
    absent processor (fail-open: its own load balancing; fail-closed: ``status_on_error``), where an answer from an
    extproc that knows no healthy endpoint yet would be a 503 for a fleet that is up. A Kubernetes Service does
    not send to a pod that is not ready; Envoy in front of a single extproc host does in panic routing.

    NOTE: after a request is routed its stream stays open until the HTTP request ends (Envoy waits for the
    response-trailers phase); that end is the request's release. At shutdown such streams are closed with OK
    status instead of being cancelled at the end of the grace period: Envoy then skips the remaining phases
    and the HTTP response continues, whereas a cancelled stream is a processor error that fails it. A stream that
    relays the response body (FULL_DUPLEX_STREAMED response mode) is not closed early: Envoy forwards only the
    chunks the processor sends back, so it stays open until the response ends or the grace period is over.
    """

    def __init__(self, router: Router, max_body_bytes: int, tracer=None) -> None:
        self._router = router
        self._max_body_bytes = max_body_bytes
        self._tracer = tracer
        self.draining = asyncio.Event()
        self.ready = asyncio.Event()
        """Set once the server is first ready; stays set through the shutdown's drain."""

    async def Process(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        if not self.ready.is_set():
            logger.debug("a stream before the extproc is ready: UNAVAILABLE")
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the extproc is not ready yet (waiting for its endpoint list, health checks or "
                                "sidecars)")
        span = NO_SPAN if self._tracer is None else RequestSpan(self._tracer, context.invocation_metadata() or ())
        handler = StreamHandler(self._router, self._max_body_bytes, span)
        messages = request_iterator.__aiter__()
        try:
            while True:
                # At shutdown a routed stream is closed at once, unless its response flows through it: that one
                # runs to the response's end (or the grace period).
                drains = handler.routed and not handler.relays_response
                message = await (self._next_or_drain(messages) if drains else _next(messages))
                if message is None:
                    break
                for response in await handler.on_message(message):
                    yield response
            logger.debug("stream of %s ended", handler.request_id)
        except asyncio.CancelledError:
            logger.debug("stream of %s cancelled", handler.request_id)
            raise
        except DecodeError as exc:  # bytes that are no ProcessingRequest: the caller's error, not ours
            logger.warning("stream of %s: a message does not decode (%s): INVALID_ARGUMENT", handler.request_id, exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ProcessingRequest does not decode: {exc}")
        finally:
            handler.close()

    async def _next_or_drain(self, messages):
        """The next message, or None when the stream ends or shutdown asks routed streams to close."""
        read = asyncio.ensure_future(_next(messages))
        drain = asyncio.ensure_future(self.draining.wait())
        try:
            await asyncio.wait((read, drain), return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the stream is cancelled meanwhile (Envoy ends it): else both tasks outlive it, leaked
            drain.cancel()
            if not read.done():
                read.cancel()
        return read.result() if read.done() and not read.cancelled() else None


async def _next(messages):
    """The next message of the stream, or None at its end."""
    try:
        return await messages.__anext__()
    except StopAsyncIteration:
        return None


FIRST_STATES_TIMEOUT_S = 2.0
"""At start in watch mode, the longest wait for the sidecars' first states before serving, seconds."""


class ConfigWatcher:
    """Reloads the config file when its content changes; applies the endpoint list live (`LIVE_KEYS`).

    Each reload logs the keys that changed against the running configuration, and which of them need a restart
    (WARNING when any does: they are not applied, and stay listed at each later reload until the restart); an
    invalid file is logged and ignored (the previous pool keeps serving).

    Args:
        path: the config file.
        config: the running configuration.
        pool: where a new endpoint list goes.
        overrides: the command line's values (``replace_config`` keys), applied to each reloaded file too, so
            that a flag is not reported as a change of its key.
        publish: where the new endpoint list goes instead of straight into ``pool`` (the server's, which also
            connects the new endpoints' sidecars and forgets those that left); None = ``pool.replace``.
    """

    def __init__(self, path: Path, config: ExtprocConfig, pool: EndpointPool,
                 overrides: Mapping[str, Any] | None = None, publish=None) -> None:
        self._path = path
        self._config = config
        self._pool = pool
        self._publish = publish or pool.replace
        self._overrides = dict(overrides or {})
        self._digest = _digest(path)

    def poll(self) -> bool:
        """Checks the file once; returns True when a new endpoint list was applied (never with discovery)."""
        digest = _digest(self._path)
        if digest is None or digest == self._digest:
            return False
        self._digest = digest
        try:
            new = load_config(self._path)
            if self._overrides:
                new = replace_config(new, **self._overrides)
        except ConfigError as exc:
            logger.error("config reload rejected, keeping the previous endpoints: %s", exc)
            return False
        except Exception:  # noqa: BLE001 (a bug here must not end live reload for good: logged, next change retried)
            logger.exception("config reload failed, keeping the previous endpoints")
            return False
        changed = changed_keys(self._config, new)
        restart = [key for key in changed if key.split(".")[0] not in LIVE_KEYS]
        if restart:
            logger.warning("config reloaded: changed %s; need a restart (not applied): %s", ", ".join(changed),
                           ", ".join(restart))
        elif changed:
            logger.info("config reloaded: changed %s (applied live)", ", ".join(changed))
        else:
            logger.info("config reloaded: no key changed")
        if self._config.discovery.source != "static":
            return False  # the pool's endpoints are discovered; the file's list is empty
        if new.endpoints != self._config.endpoints:
            logger.info("endpoints now %d: added %s; removed %s", len(new.endpoints),
                        _addresses(new.endpoints, self._config.endpoints) or "none",
                        _addresses(self._config.endpoints, new.endpoints) or "none")
        self._publish(new.endpoints)
        self._config = dataclasses.replace(self._config, endpoints=new.endpoints)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._config.reload_interval_s)
            self.poll()


def _load_tagger(config: ExtprocConfig):
    """The in-process length tagger for ``output_length.source: tagger`` (the shipped light tagger when
    ``tagger_path`` is null), else None.

    Raises:
        TaggerLoadError: ``tagger_path`` is not a tagger directory (or its model cannot be loaded).
    """
    if config.output_length.source != "tagger":
        return None
    from tagger.serve import load_service  # noqa: PLC0415 (the tagger loads its model only when configured)

    return load_service(config.output_length.tagger_path)


def _addresses(endpoints, others) -> str:
    """The endpoints of ``endpoints`` not in ``others`` (a changed model list or sidecar counts), comma-separated."""
    return ", ".join(e.address for e in endpoints if e not in others)


def _digest(path: Path) -> bytes | None:
    try:
        return hashlib.sha256(path.read_bytes()).digest()
    except OSError:
        return None


MAX_PENDING_STREAMS = 65536
"""ext_proc streams gRPC core may hold before the server picks them up: Envoy's circuit-breaker limit on requests to
the extproc (``astrolabe.envoy.DEFAULT_MAX_UPSTREAM_REQUESTS``)."""


class ExtprocServer:
    """The running extproc: gRPC server, health, background tasks.

    Args:
        config: validated configuration.
        config_path: file to watch for endpoint changes, or None.
        tracing: the process's tracing (``setup_tracing``); None = off. The caller shuts it down.
        overrides: the command line's values, applied to each reloaded file too (`ConfigWatcher`).
        reuse_port: bind ``listen`` with SO_REUSEPORT, beside the other workers of one supervisor
            (``extproc.workers``); False (one process) = a port in use is an error.
        max_connection_age_s: a connection gets a graceful GOAWAY this long after it opened (streams in flight
            go on; new ones come on a new connection: a worker's, ``extproc.workers``); None = never.
    """

    def __init__(self, config: ExtprocConfig, config_path: Path | None = None, tracing: Tracing | None = None,
                 overrides: Mapping[str, Any] | None = None, reuse_port: bool = False,
                 max_connection_age_s: float | None = None) -> None:
        self.config = config
        self.tracing = tracing or Tracing.off()
        tracer = self.tracing.tracer(TRACER_NAME) if self.tracing.enabled else None
        # With health checks on, an endpoint (also one added by a reload) serves only after passing one.
        self.pool = EndpointPool(config.endpoints, new_endpoints_healthy=not config.health_check.enabled)
        rng = random.Random(config.seed)
        policy = build_policy(config.policy, config.policy_params, rng)
        self.metrics = ExtprocMetrics(self.pool)
        try:  # TLS files are read here, so that a bad one stops the start with the key that named it
            self._credentials = server_credentials(ServerTls(**dataclasses.asdict(config.tls))) if config.tls else None
        except TlsError as exc:
            raise ConfigError(f"tls: {exc}") from None
        try:
            client_tls = ClientTls(**dataclasses.asdict(config.predictor_tls)) if config.predictor_tls else None
            self.predictors = PredictorClient(config.predictor_client, tracer=tracer, tls=client_tls)
        except TlsError as exc:
            raise ConfigError(f"predictor_tls: {exc}") from None
        backend_tls = BackendTls(**dataclasses.asdict(config.backend_tls)) if config.backend_tls else None
        # Only load-based policies read engine metrics; the others never scrape the backends.
        try:
            self.endpoint_metrics = (MetricsScraper(self.pool, config.metrics_interval_s, config.metrics_staleness_s,
                                                    backend_tls=backend_tls, metrics_format=config.metrics_format)
                                     if policy.needs_metrics else None)
            self._checker = (HealthChecker(self.pool, config.health_check, backend_tls)
                             if config.health_check.enabled else None)
        except TlsError as exc:
            raise ConfigError(f"backend_tls: {exc}") from None
        self.metrics.watch_predictors(self.predictors)
        client_config = config.predictor_client
        self.fleet = (FleetState(self.predictors, interval_s=client_config.watch_interval_s,
                                 max_age_s=client_config.watch_max_age_s,
                                 max_state_age_s=client_config.max_state_age_s)
                      if client_config.mode == "watch" and policy.needs_predictions else None)
        if self.fleet is not None:
            self.metrics.watch_fleet(self.fleet)
        self.decision_log = None
        if config.decision_log_path:
            try:
                self.decision_log = DecisionLog(config.decision_log_path)
            except OSError as exc:
                raise ConfigError(f"decision_log_path: cannot open {config.decision_log_path}: {exc}") from None
        try:
            prefix_cache = config.prefix_cache
            prompt_tokens = PromptTokenCounter(config.tokenizers,
                                               block_size=prefix_cache.block_size if prefix_cache.enabled else None,
                                               max_keyed_chars=prefix_cache.max_keyed_chars,
                                               max_keyed_messages=prefix_cache.max_keyed_messages)
        except TokenizerLoadError as exc:
            raise ConfigError(str(exc)) from None
        if policy.needs_predictions and not config.tokenizers:
            logger.warning("no tokenizers configured: prompt tokens are counted with the shipped WordPiece, not "
                           "the served models' tokenizers (set 'tokenizers' in the config)")
        objectives = config.objectives.objective_config()
        self.router = Router(self.pool, policy, self.metrics, self.predictors,
                             OutputLengthEstimator(config.output_length, _load_tagger(config)), rng,
                             endpoint_metrics=self.endpoint_metrics, decision_log=self.decision_log,
                             prompt_tokens=prompt_tokens, tracer=tracer, num_fallbacks=config.fallback_endpoints,
                             passive_ejection=config.health_check.enabled, fleet=self.fleet,
                             objectives=objectives, admission=config.objectives.admission_params(),
                             engine_priority=config.objectives.engine_priority)
        if not policy.needs_predictions and any(o.sheddable for o in objectives.configured()):
            logger.warning("objectives: sheddable (priority < 0) objectives are configured, but policy %r makes no "
                           "predictions, so admission never refuses a request (only a predicting policy can)",
                           config.policy)
        if config.objectives.engine_priority and not any(o.priority for o in objectives.configured()):
            logger.warning("objectives.engine_priority: every configured objective has priority 0, so every request "
                           "carries priority 0 to the engines (first come, first served); name objectives with other "
                           "priorities in objectives.named")
        if config.fallback_endpoints:
            logger.warning("fallback_endpoints %d: the destination is a list of %d endpoints, which only a gateway "
                           "that takes a list follows (Envoy's override_host policy: astrolabe envoy --pool); "
                           "Envoy's ORIGINAL_DST cluster (astrolabe envoy without --pool) answers 503 to every "
                           "request", config.fallback_endpoints, config.fallback_endpoints + 1)
        self._source = build_source(config.discovery)
        self._first_sync = asyncio.Event()
        if self._source is None and policy.needs_predictions and not any(e.predictor for e in config.endpoints):
            logger.warning("policy %r needs predictor sidecars but no endpoint names one: every request "
                           "falls back to least-requests", config.policy)
        self._metrics_server = None
        self.health = health.aio.HealthServicer()
        self._watcher = (ConfigWatcher(config_path, config, self.pool, overrides, publish=self._publish)
                         if config_path else None)
        self._tasks: list[asyncio.Task] = []
        # Above Envoy's buffered-mode limit too, so that an oversized body gets our 413, not a gRPC error (503).
        max_message_bytes = max(config.max_body_bytes, ENVOY_BUFFER_LIMIT_BYTES) + _GRPC_MESSAGE_OVERHEAD_BYTES
        self._server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # gRPC binds with SO_REUSEPORT by default: a second extproc on the same port would start and share the
            # connections silently; off, it fails to bind ("cannot listen on ..."). On only for the workers of one
            # supervisor, which checked that no other program holds the port (extproc.workers).
            ("grpc.so_reuseport", int(reuse_port)),
            # gRPC core queues at most 1,000 (hard limit 3,000) calls not yet picked up and fails the rest with
            # INTERNAL: a burst of 2,000-3,000 requests lost 9-17% as empty 503s (a break-it pass). Envoy's own cap on
            # concurrent streams to the extproc (its circuit breakers, astrolabe envoy) is the limit that counts.
            ("grpc.server.max_pending_requests", MAX_PENDING_STREAMS),
            ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_STREAMS),
            # Envoy PINGs the extproc every second (astrolabe envoy: a frozen extproc is dropped): gRPC core would
            # count pings on a quiet connection as abuse (default: one per 5 min, 2 strikes) and close it, streams
            # in flight included.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 500),
            ("grpc.http2.max_ping_strikes", 0),
            *([] if max_connection_age_s is None else
              [("grpc.max_connection_age_ms", round(max_connection_age_s * 1000))]),  # grace: none (unbounded)
        ])
        self._processor = ExternalProcessor(self.router, config.max_body_bytes, tracer)
        pb_grpc.add_ExternalProcessorServicer_to_server(self._processor, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self._reuse_port = reuse_port
        self.port = 0
        self.metrics_port = 0
        """The bound metrics port once started (0: ``metrics_listen`` off)."""

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in wire.HEALTH_SERVICE_NAMES:
            if name != "liveness":
                await self.health.set(name, status)

    async def start(self) -> int:
        """Binds and starts serving; returns the bound port (the config may ask for port 0). One process binds
        first (a port in use stops the start before anything else runs) and serves health while it gets ready; a
        worker (``reuse_port``) binds last, once ready, so that its siblings take every connection until then.

        Raises:
            ConfigError: the listen or metrics address cannot be bound.
        """
        if not self._reuse_port:
            self._bind()
        if self.config.metrics_listen:  # before the gRPC server starts, so that a busy port leaves nothing running
            host, _, port = self.config.metrics_listen.rpartition(":")
            try:
                self._metrics_server, _ = start_http_server(int(port), addr=host, registry=self.metrics.registry)
                self.metrics_port = self._metrics_server.server_port
                logger.info("metrics on http://%s:%d/metrics", host, self.metrics_port)
            except OSError as exc:
                raise ConfigError(f"metrics_listen: cannot listen on {self.config.metrics_listen}: {exc}") from None
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self._set_serving(False)
        if not self._reuse_port:
            await self._server.start()
        if self._source is not None:  # readiness waits for the first discovered list (an API or DNS failure: logged)
            logger.info("extproc %s, not ready until the first endpoint list (discovery %s)",
                        "binds once ready (a worker)" if self._reuse_port else
                        f"listening on {self.config.listen} (port {self.port})", self.config.discovery.source)
            discovery = asyncio.create_task(self._source.run(self._publish), name="endpoint-discovery")
            self._tasks.append(discovery)
            synced = asyncio.create_task(self._first_sync.wait())
            await asyncio.wait((discovery, synced), return_when=asyncio.FIRST_COMPLETED)
            synced.cancel()
            if discovery.done():  # a source ends only on an error it cannot retry (e.g. no kubeconfig)
                await self.stop_now()  # raises that error
                raise ConfigError("discovery: the endpoint source stopped before its first list")
        if self._checker:
            self._tasks.append(asyncio.create_task(self._checker.run(), name="endpoint-health"))
            await self._checker.first_round_done.wait()
        if self._watcher:
            self._tasks.append(asyncio.create_task(self._watcher.run(), name="config-watch"))
        if self.endpoint_metrics is not None:
            self._tasks.append(asyncio.create_task(self.endpoint_metrics.run(), name="endpoint-metrics"))
        if self.decision_log is not None:
            self._tasks.append(asyncio.create_task(_flush_every(self.decision_log, 1.0), name="decision-log"))
        if self.router.policy.needs_predictions:
            get_tokenizer()  # loaded now rather than by the first request, on the event loop
            self._connect([e.predictor for e in self.pool.endpoints if e.predictor])
            if self.fleet is not None and not await self.fleet.first_states(FIRST_STATES_TIMEOUT_S):
                logger.warning("not every sidecar sent its state within %g s of the start: their candidates fall "
                               "back until they do", FIRST_STATES_TIMEOUT_S)
        settle_heap()
        if self._reuse_port:
            self._bind()
            await self._server.start()
        await self._set_serving(True)
        self._processor.ready.set()
        params = getattr(self.router.policy, "params", None)
        tls = ("plaintext" if self.config.tls is None else
               "mutual TLS" if self.config.tls.client_ca_file else "TLS")
        logger.info("extproc listening on %s (port %d, %s), policy %s %s, endpoints: %d", self.config.listen,
                    self.port, tls, self.config.policy,
                    params if params is not None else dict(self.config.policy_params), len(self.pool.endpoints))
        return self.port

    def _bind(self) -> None:
        """Adds ``listen`` to the gRPC server (sets ``port``).

        Raises:
            ConfigError: it cannot be bound.
        """
        try:
            if self._credentials is None:
                self.port = self._server.add_insecure_port(self.config.listen)
            else:
                self.port = self._server.add_secure_port(self.config.listen, self._credentials)
        except RuntimeError:  # gRPC's "Failed to bind": in use (SO_REUSEPORT is off), or not an address here
            self.port = 0
        if self.port == 0:
            raise ConfigError(f"listen: cannot listen on {self.config.listen}")

    def _publish(self, endpoints) -> None:
        """A discovery source's new endpoint list: into the pool (in-flight requests keep their destination); the
        health checker checks the new ones at once; sidecars of new endpoints are connected, those of endpoints
        that left are dropped with their metric series. O(endpoints) per call."""
        old = {e.address: e for e in self.pool.endpoints}
        new = {e.address: e for e in endpoints}
        self.pool.replace(endpoints)
        self._first_sync.set()
        predictors = {e.predictor for e in endpoints if e.predictor}
        for address, endpoint in old.items():
            if address not in new:
                self.metrics.forget_endpoint(address, endpoint.predictor)
                if endpoint.predictor and endpoint.predictor not in predictors:
                    self.predictors.forget(endpoint.predictor)
                    if self.fleet is not None:
                        self.fleet.forget(endpoint.predictor)
        added = [e for a, e in new.items() if old.get(a) != e]
        if added and self._checker is not None:
            self._checker.wake()
        if self.router.policy.needs_predictions:
            self._connect([e.predictor for e in added if e.predictor])

    def _connect(self, sidecars: list[str]) -> None:
        """Opens the channels to ``sidecars`` and, in watch mode, follows their states."""
        self.predictors.connect(sidecars)
        if self.fleet is not None:
            self.fleet.watch(sidecars)

    async def stop_now(self) -> None:
        """Stops at once, without the drain (a start that failed or was interrupted)."""
        await self._close(0)

    async def stop(self) -> None:
        """Graceful shutdown.

        readiness NOT_SERVING; for ``drain_delay_s`` new streams are still served (Envoy's health checker needs
        that long to move traffic to other replicas); then routed streams are closed with OK status (their HTTP
        responses go on), new streams are refused, and streams still being routed get ``grace_period_s``.
        """
        await self._set_serving(False)
        await asyncio.sleep(self.config.drain_delay_s)
        self._processor.draining.set()
        await self._close(self.config.grace_period_s)
        logger.info("extproc stopped")

    async def _close(self, grace_s: float) -> None:
        """Stops the gRPC server (streams get ``grace_s``), the metrics server and the background tasks, and closes
        the sidecar channels, the decision log and the tagger; then raises the first error a background task
        ended with, if any."""
        # The metrics server's shutdown waits for its serve_forever poll (0.5 s): in a thread, beside the rest.
        metrics_stopped = (asyncio.ensure_future(asyncio.to_thread(self._metrics_server.shutdown))
                           if self._metrics_server is not None else None)
        await self._server.stop(grace_s)
        for task in self._tasks:
            task.cancel()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.fleet is not None:
            await self.fleet.close()
        await self.predictors.close()
        if self.decision_log is not None:
            self.decision_log.close()
        if self.router.lengths.tagger is not None:
            self.router.lengths.tagger.close()
        if metrics_stopped is not None:
            await metrics_stopped
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise errors[0]


async def _flush_every(log: DecisionLog, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        log.flush()


async def serve(config: ExtprocConfig, config_path: Path | None, tracing: Tracing | None = None,
                overrides: Mapping[str, Any] | None = None, *, reuse_port: bool = False,
                max_connection_age_s: float | None = None, on_ready: Callable[[ExtprocServer], None] | None = None,
                parent_fd: int | None = None) -> None:
    """Runs until SIGTERM or SIGINT, then shuts down gracefully.

    Args:
        config, config_path, tracing, overrides, reuse_port, max_connection_age_s: as `ExtprocServer`.
        on_ready: called once the server is ready (a worker tells its supervisor, ``extproc.workers``).
        parent_fd: a file descriptor that turns readable when the parent process is gone (a worker's
            supervisor): taken as SIGTERM, so that a worker never outlives it.
    """
    server = ExtprocServer(config, config_path, tracing, overrides, reuse_port, max_connection_age_s)
    termination = asyncio.ensure_future(wait_for_termination())  # signals handled from now on, also while starting
    if parent_fd is not None:
        asyncio.get_running_loop().add_reader(parent_fd, _parent_gone, parent_fd)
    starting = asyncio.ensure_future(server.start())
    await asyncio.wait((termination, starting), return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # e.g. still waiting for the first discovered endpoint list
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        logger.info("shutdown requested before the extproc was ready: stopping")
        await server.stop_now()
        return
    starting.result()  # a start-up error (ConfigError ...) ends the process here
    if on_ready is not None:
        on_ready(server)
    await termination
    logger.info("shutdown requested: draining for at most %.1f s (drain_delay_s %.1f s, then grace_period_s %.1f s)",
                config.drain_delay_s + config.grace_period_s, config.drain_delay_s, config.grace_period_s)
    await server.stop()


def _parent_gone(fd: int) -> None:
    asyncio.get_running_loop().remove_reader(fd)
    logger.warning("the supervisor is gone: shutting down")
    os.kill(os.getpid(), signal.SIGTERM)


def run(config: ExtprocConfig, config_path: Path | None, overrides: Mapping[str, Any] | None = None,
        **serve_args: Any) -> int:
    """Sets up tracing and runs `serve` (``serve_args``: its keywords) on uvloop until it ends; returns the exit
    status: 0, or 2 for a configuration that cannot be served (the error logged)."""
    try:
        tracing = setup_tracing(SERVICE_NAME, config.tracing)
    except TracingConfigError as exc:
        logger.error("invalid tracing configuration: %s", exc)
        return 2
    try:
        uvloop.run(serve(config, config_path, tracing, overrides, **serve_args))
    except TaggerLoadError as exc:
        logger.error("invalid configuration: output_length.tagger_path: %s", exc)
        return 2
    except ConfigError as exc:  # a file or port the configuration names cannot be used
        logger.error("invalid configuration: %s", exc)
        return 2
    finally:
        tracing.shutdown()
    return 0


def main(argv: list[str]) -> int:
    """Entry point of ``astrolabe extproc``; returns the exit status (2 for an invalid configuration)."""
    parser = argparse.ArgumentParser(prog="astrolabe extproc", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--config", required=True, type=Path,
                        help="YAML config (README 'Configuration reference', extproc/config.py); the "
                             "ASTROLABE_EXTPROC_* variables override its keys")
    parser.add_argument("--listen", help="host:port of the gRPC service; default: the config's 'listen'")
    parser.add_argument("--workers", type=int,
                        help="extproc processes serving on the listen port (> 1: a supervisor and N workers, "
                             "extproc/workers.py); default: the config's 'workers'")
    parser.add_argument("--policy", help="routing policy name; default: the config's 'policy'")
    add_log_arguments(parser, None, None, unset="the config's {key} ({default})")
    args = parser.parse_args(argv)
    setup_logging(args.log_level or DEFAULT_LOG_LEVEL, args.log_format or DEFAULT_LOG_FORMAT)
    overrides = {key: value for key, value in (("listen", args.listen), ("workers", args.workers),
                                               ("policy", args.policy), ("log_level", args.log_level),
                                               ("log_format", args.log_format))
                 if value is not None}
    try:
        config = load_config(args.config)
        if overrides:
            config = replace_config(config, **overrides)
    except (ConfigError, ValueError) as exc:
        logger.error("invalid configuration: %s", exc)
        return 2
    setup_logging(config.log_level, config.log_format)
    if config.workers > 1:
        from extproc.workers import supervise  # noqa: PLC0415 (one process needs no supervisor)

        return supervise(config, args.config, overrides, run)
    return run(config, args.config, overrides)
