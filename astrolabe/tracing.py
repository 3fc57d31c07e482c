"""OpenTelemetry tracing set-up shared by the extproc, the predictor sidecar, the tagger service and the emulator.

Owns: resolving what to export from the standard ``OTEL_*`` environment variables and a service's own settings
(`TracingConfig`, the extproc's ``tracing:`` section), building the SDK tracer provider and its OTLP exporter,
the gRPC server interceptor (``opentelemetry-instrumentation-grpc``) for the services that continue a trace from
gRPC metadata, and the few propagation helpers every service shares. Imports only the OpenTelemetry API at module
level; the SDK and the exporters load only when tracing is on. Must not import ``extproc``, ``predictor``,
``tagger`` or ``bench``: they import this module.

NOTE: when tracing is on, and which value wins.

- Off (the default): nothing is configured, or ``OTEL_SDK_DISABLED=true`` (which wins over everything), or
  ``OTEL_TRACES_EXPORTER=none``. Off means no SDK, no exporter, no thread: `Tracing.tracer` is the API's
  ``NoOpTracer``, whose spans are the shared invalid span (nothing recorded, nothing injected).
- On: an endpoint is configured (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
  `TracingConfig.endpoint`), or ``OTEL_TRACES_EXPORTER`` names ``otlp`` and/or ``console`` (``otlp`` without an
  endpoint exports to the OTLP default, localhost:4317 for gRPC).
- Key by key, a standard ``OTEL_*`` variable wins over `TracingConfig` (the extproc's file): endpoint, protocol
  (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` > ``OTEL_EXPORTER_OTLP_PROTOCOL``), sampler (``OTEL_TRACES_SAMPLER``
  with ``OTEL_TRACES_SAMPLER_ARG`` over ``sampler_ratio``) and service name (``OTEL_SERVICE_NAME``, then
  ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``, over ``service_name``, over the service's default). This is
  the project's rule (the environment overrides the file), and it lets one pod environment configure the
  extproc, the sidecars and the tagger alike, which have no tracing file of their own.
- Spans go through a ``BatchSpanProcessor`` (its ``OTEL_BSP_*`` variables apply: schedule delay, queue and batch
  sizes), with one change of default: batches of `DEFAULT_MAX_EXPORT_BATCH_SIZE` spans instead of 512, because
  the exporter encodes a batch while holding the GIL (~40 us a span, measured: 512 spans are ~20 ms during which
  the event loop of the serving thread waits; 64 are ~2.5 ms, below the interpreter's 5 ms switch interval).
  The text-map propagator is the SDK's global one (``OTEL_PROPAGATORS``, default W3C ``traceparent`` /
  ``tracestate`` plus ``baggage``).
- A bad value (an unknown sampler or protocol, a ratio outside [0, 1], an endpoint that is no URL) raises
  `TracingConfigError` at start-up: it is never replaced by a default in silence.

Source: OpenTelemetry specification, "Environment Variable Specification" and "OTLP Exporter Configuration"
(SDK 1.45); the exporters' own endpoint rules apply to endpoints from the environment (for ``http/protobuf``
``/v1/traces`` is appended to ``OTEL_EXPORTER_OTLP_ENDPOINT``, not to ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``).
"""

from __future__ import annotations

import logging
import os
import threading
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from opentelemetry import propagate, trace
from opentelemetry.context import Context

logger = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http/protobuf")
"""OTLP transports the exporter speaks (``http/json`` has no Python exporter)."""

SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
            "parentbased_traceidratio")
"""Values of ``OTEL_TRACES_SAMPLER`` (the specification's built-in samplers)."""

EXPORTERS = ("otlp", "console", "none")
"""Values of ``OTEL_TRACES_EXPORTER`` (a comma-separated list)."""

OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
"""``true`` turns tracing off whatever else is set."""
OTEL_TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
"""``otlp``, ``console`` or ``none`` (comma-separated); unset = ``otlp`` when an endpoint is configured, else off."""
OTEL_EXPORTER_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
"""Base URL of the OTLP receiver for every signal, e.g. ``http://127.0.0.1:4317``."""
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
"""URL of the OTLP trace receiver; wins over ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
OTEL_EXPORTER_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
"""``grpc`` or ``http/protobuf`` for every signal."""
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
"""``grpc`` or ``http/protobuf`` for traces; wins over ``OTEL_EXPORTER_OTLP_PROTOCOL``."""
OTEL_TRACES_SAMPLER = "OTEL_TRACES_SAMPLER"
"""One of `SAMPLERS`; wins over ``TracingConfig.sampler_ratio``."""
OTEL_TRACES_SAMPLER_ARG = "OTEL_TRACES_SAMPLER_ARG"
"""The ratio in [0, 1] of the ``*traceidratio`` samplers (default 1.0)."""
OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
"""``service.name`` of every span; wins over ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES`` and the config."""

_DEFAULT_SHUTDOWN_TIMEOUT_S = 2.0

DEFAULT_MAX_EXPORT_BATCH_SIZE = 64
"""Spans per export when ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` is unset (the SDK's default is 512; module NOTE)."""
OTEL_BSP_MAX_EXPORT_BATCH_SIZE = "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"

# Attribute keys more than one service writes (each service's own keys live beside its spans).
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ADMIT_ID = "astrolabe.admit_id"
"""The id a sidecar knows a request by (the client's x-request-id made unique by the extproc)."""
NUM_PROMPT_TOKENS = "astrolabe.num_prompt_tokens"
NUM_PREDICTED_OUTPUT_TOKENS = "astrolabe.num_predicted_output_tokens"
PREDICTED_TTFT_S = "astrolabe.predicted_ttft_s"
PREDICTED_E2E_S = "astrolabe.predicted_e2e_s"
PREDICTED_QUEUE_S = "astrolabe.predicted_queue_s"
STATE_AGE_S = "astrolabe.state_age_s"
"""Seconds since the sidecar's state was last reconciled with its backend."""
LENGTH_ESTIMATE_SPAN = "astrolabe.length_estimate"
"""The span of one output-length estimate (the extproc's, and the tagger service's below its SERVER span)."""
LOCAL_PREDICT_SPAN = "astrolabe.predict"
"""An INTERNAL span per candidate predicted in the extproc from its sidecar's streamed state (``predictor_client.mode``
watch), below the route span; attributes as a Predict call's span (``server.address`` is the sidecar's)."""


class TracingConfigError(ValueError):
    """A tracing setting is invalid; the message names the variable or key and the value."""


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """A service's own tracing settings (the extproc's ``tracing:`` section); ``OTEL_*`` variables win per key.

    Attributes:
        endpoint: OTLP receiver, ``host:port`` or a ``http://`` / ``https://`` URL, as
            ``OTEL_EXPORTER_OTLP_ENDPOINT`` (for ``http/protobuf`` ``/v1/traces`` is appended); None = off unless
            the environment configures an exporter.
        protocol: ``grpc`` or ``http/protobuf``.
        sampler_ratio: share of new traces sampled, in [0, 1], as ``parentbased_traceidratio`` (a request whose
            caller sent a sampled context is always traced); None = every trace (``parentbased_always_on``).
        service_name: ``service.name``; None = the service's default (``astrolabe-extproc``, ...).
    """

    endpoint: str | None = None
    protocol: str = "grpc"
    sampler_ratio: float | None = None
    service_name: str | None = None

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise TracingConfigError(f"protocol: must be one of {PROTOCOLS}, got {self.protocol!r}")
        if self.sampler_ratio is not None and not 0.0 <= self.sampler_ratio <= 1.0:
            raise TracingConfigError(f"sampler_ratio: must be in [0, 1], got {self.sampler_ratio!r}")
        if self.endpoint is not None:
            normalize_endpoint(self.endpoint, "endpoint")


@dataclass(frozen=True, slots=True)
class ResolvedTracing:
    """What `setup_tracing` builds, after the environment was applied (pure data, for tests and the start-up log).

    Attributes:
        exporters: ``otlp`` and/or ``console``; empty = tracing off.
        endpoint: the OTLP endpoint passed to the exporter; None = the exporter reads the environment itself.
        protocol: ``grpc`` or ``http/protobuf``.
        sampler: one of `SAMPLERS`.
        sampler_ratio: the ratio of a ``*traceidratio`` sampler, in [0, 1].
        service_name: ``service.name``.
    """

    exporters: tuple[str, ...]
    endpoint: str | None
    protocol: str
    sampler: str
    sampler_ratio: float
    service_name: str


def normalize_endpoint(endpoint: str, where: str) -> str:
    """``endpoint`` as a URL: ``host:port`` becomes ``http://host:port`` (the OTLP exporters take a bare host:port
    for a TLS endpoint; a receiver named without a scheme here is plain text, as Envoy's and vLLM's are).

    Raises:
        TracingConfigError: not ``host:port`` nor a ``http(s)://host[:port][/path]`` URL (message starts with
            ``where``).
    """
    text = endpoint.strip()
    url = text if "://" in text else f"http://{text}"
    try:
        parsed = urllib.parse.urlsplit(url)
        port = parsed.port  # raises ValueError when not a number in range
    except ValueError:
        parsed, port = None, None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname or (
            "://" not in text and port is None):
        raise TracingConfigError(f"{where}: expected host:port or an http(s):// URL, got {endpoint!r}")
    return url


def _env(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name, "").strip()
    return value or None


def _exporters(environ: Mapping[str, str], endpoint_configured: bool) -> tuple[str, ...]:
    if (environ.get(OTEL_SDK_DISABLED) or "").strip().lower() == "true":
        return ()
    names = _env(environ, OTEL_TRACES_EXPORTER)
    if names is None:
        return ("otlp",) if endpoint_configured else ()
    chosen = tuple(dict.fromkeys(n.strip().lower() for n in names.split(",") if n.strip()))
    unknown = [n for n in chosen if n not in EXPORTERS]
    if unknown:
        raise TracingConfigError(f"{OTEL_TRACES_EXPORTER}: unknown exporter(s) {unknown}; known: {EXPORTERS}")
    return tuple(n for n in chosen if n != "none")


def _sampler(environ: Mapping[str, str], config: TracingConfig) -> tuple[str, float]:
    name = _env(environ, OTEL_TRACES_SAMPLER)
    if name is None:
        if config.sampler_ratio is None:
            return "parentbased_always_on", 1.0
        return "parentbased_traceidratio", config.sampler_ratio
    name = name.lower()
    if name not in SAMPLERS:
        raise TracingConfigError(f"{OTEL_TRACES_SAMPLER}: must be one of {SAMPLERS}, got {name!r}")
    arg = _env(environ, OTEL_TRACES_SAMPLER_ARG)
    if arg is None or not name.endswith("traceidratio"):
        return name, 1.0
    try:
        ratio = float(arg)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise TracingConfigError(f"{OTEL_TRACES_SAMPLER_ARG}: must be a number in [0, 1], got {arg!r}")
    return name, ratio


def _service_name(environ: Mapping[str, str], config: TracingConfig, default: str) -> str:
    name = _env(environ, OTEL_SERVICE_NAME)
    if name is None:  # OTEL_RESOURCE_ATTRIBUTES=service.name=...,k=v (values percent-encoded)
        for item in (environ.get("OTEL_RESOURCE_ATTRIBUTES") or "").split(","):
            key, _, value = item.partition("=")
            if key.strip() == "service.name" and value.strip():
                name = urllib.parse.unquote(value.strip())
    return name or config.service_name or default


def resolve(default_service_name: str, config: TracingConfig | None = None,
            environ: Mapping[str, str] | None = None) -> ResolvedTracing:
    """What tracing a service gets from ``config`` and the environment (rules in the module docstring).

    Args:
        default_service_name: ``service.name`` when neither the environment nor ``config`` names one.
        config: the service's own settings; None = none (the environment alone decides).
        environ: the environment; None = ``os.environ``.

    Raises:
        TracingConfigError: an unknown exporter, protocol or sampler, a bad ratio or endpoint.
    """
    config = config or TracingConfig()
    environ = os.environ if environ is None else environ
    env_endpoint = _env(environ, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) or _env(environ, OTEL_EXPORTER_OTLP_ENDPOINT)
    exporters = _exporters(environ, env_endpoint is not None or config.endpoint is not None)
    protocol = (_env(environ, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) or _env(environ, OTEL_EXPORTER_OTLP_PROTOCOL)
                or config.protocol)
    if protocol not in PROTOCOLS:
        raise TracingConfigError(f"{OTEL_EXPORTER_OTLP_TRACES_PROTOCOL}: must be one of {PROTOCOLS}, "
                                 f"got {protocol!r}")
    endpoint = None  # from the environment: the exporter applies its own rules
    if env_endpoint is None and config.endpoint is not None:
        endpoint = normalize_endpoint(config.endpoint, "tracing.endpoint")
        if protocol == "http/protobuf":
            endpoint = endpoint.rstrip("/") + "/v1/traces"
    sampler, ratio = _sampler(environ, config)
    return ResolvedTracing(exporters, endpoint, protocol, sampler, ratio,
                           _service_name(environ, config, default_service_name))


def _build_sampler(resolved: ResolvedTracing):
    from opentelemetry.sdk.trace import sampling  # noqa: PLC0415 (the SDK loads only when tracing is on)

    ratio = sampling.TraceIdRatioBased(resolved.sampler_ratio)
    return {"always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF, "traceidratio": ratio,
            "parentbased_always_on": sampling.ParentBased(sampling.ALWAYS_ON),
            "parentbased_always_off": sampling.ParentBased(sampling.ALWAYS_OFF),
            "parentbased_traceidratio": sampling.ParentBased(ratio)}[resolved.sampler]


def _build_exporter(name: str, resolved: ResolvedTracing):
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter  # noqa: PLC0415

        return ConsoleSpanExporter(service_name=resolved.service_name)
    if resolved.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
    try:
        return OTLPSpanExporter(endpoint=resolved.endpoint)
    except Exception as exc:  # noqa: BLE001 (the exporter reads more OTEL_EXPORTER_OTLP_* values, e.g. TIMEOUT)
        raise TracingConfigError(f"the OTLP exporter refuses its settings (OTEL_EXPORTER_OTLP_*): "
                                 f"{type(exc).__name__}: {exc}") from None


class Tracing:
    """A service's tracing: a tracer per instrumented module, the gRPC server interceptor, shutdown.

    Build it with `setup_tracing` (or `Tracing.off`). ``provider`` is None when tracing is off.
    """

    def __init__(self, provider=None, resolved: ResolvedTracing | None = None) -> None:
        self.provider = provider
        self.resolved = resolved
        self._noop = trace.NoOpTracer()

    @classmethod
    def off(cls) -> Tracing:
        """Tracing off: no-op tracers, no interceptor, nothing to shut down."""
        return cls()

    @property
    def enabled(self) -> bool:
        """Whether spans are recorded and exported."""
        return self.provider is not None

    def tracer(self, name: str) -> trace.Tracer:
        """The tracer of module ``name`` (the API's ``NoOpTracer`` when off)."""
        return self._noop if self.provider is None else self.provider.get_tracer(name)

    def server_interceptors(self, full_methods: Iterable[str]) -> list:
        """gRPC aio server interceptors that continue the caller's trace (from the call's metadata) in a SERVER
        span, for the methods named (``/package.Service/Method``); none when off, so an untraced server pays
        nothing. Health checks and other methods stay untraced (they would each start a root trace)."""
        if self.provider is None:
            return []
        from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters  # noqa: PLC0415

        traced = filters.any_of(*(filters.full_method_name(m) for m in full_methods))
        return [aio_server_interceptor(tracer_provider=self.provider, filter_=traced)]

    def shutdown(self, timeout_s: float = _DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Exports what is still queued and stops the exporter, waiting at most ``timeout_s`` seconds (an
        unreachable receiver must not hold up a server's exit); idempotent, never raises."""
        provider, self.provider = self.provider, None
        if provider is None:
            return

        def run() -> None:
            try:
                provider.shutdown()
            except Exception:  # noqa: BLE001 - a failing exporter must not fail the shutdown
                logger.exception("tracing shutdown failed")

        worker = threading.Thread(target=run, name="tracing-shutdown", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            logger.warning("tracing: spans still queued after %.1f s at shutdown were dropped", timeout_s)


def setup_tracing(default_service_name: str, config: TracingConfig | None = None,
                  environ: Mapping[str, str] | None = None, exporter=None) -> Tracing:
    """The service's `Tracing`, on or off as ``config`` and the environment say (module docstring).

    Args:
        default_service_name: ``service.name`` when nothing else names one.
        config: the service's own settings; None = the environment alone.
        environ: the environment; None = ``os.environ``.
        exporter: a span exporter to use instead of the configured ones (tests: the SDK's in-memory exporter);
            it turns tracing on with the resolved sampler and service name.

    Raises:
        TracingConfigError: see `resolve`; also ``OTEL_BSP_*`` sizes the SDK refuses (a batch larger than the
            queue).
    """
    environ = os.environ if environ is None else environ
    resolved = resolve(default_service_name, config, environ)
    if not resolved.exporters and exporter is None:
        return Tracing.off()
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

    provider = TracerProvider(sampler=_build_sampler(resolved), shutdown_on_exit=False,
                              resource=Resource.create({SERVICE_NAME: resolved.service_name}))
    exporters = [exporter] if exporter is not None else [_build_exporter(n, resolved) for n in resolved.exporters]
    # None lets the SDK read OTEL_BSP_MAX_EXPORT_BATCH_SIZE (and check it against the queue size) itself.
    batch_size = None if _env(environ, OTEL_BSP_MAX_EXPORT_BATCH_SIZE) else DEFAULT_MAX_EXPORT_BATCH_SIZE
    for span_exporter in exporters:
        try:
            processor = BatchSpanProcessor(span_exporter, max_export_batch_size=batch_size)
        except ValueError as exc:  # the SDK checks the OTEL_BSP_* sizes against each other
            provider.shutdown()
            raise TracingConfigError(f"OTEL_BSP_*: {exc}") from None
        provider.add_span_processor(processor)
    logger.info("tracing on: service %s, exporter(s) %s, endpoint %s (%s), sampler %s%s", resolved.service_name,
                ",".join(resolved.exporters) or "custom", resolved.endpoint or "from the environment",
                resolved.protocol, resolved.sampler,
                f" {resolved.sampler_ratio:g}" if resolved.sampler.endswith("ratio") else "")
    return Tracing(provider, resolved)


def context_from(carrier: Mapping[str, str]) -> Context | None:
    """The remote trace context in ``carrier`` (HTTP headers or gRPC metadata, lower-case keys), through the
    global propagator; None when it carries no valid one (absent, malformed or all-zero ids: never raises)."""
    try:
        context = propagate.extract(carrier)
    except Exception:  # noqa: BLE001 - a hostile header must cost the trace, never the request
        logger.debug("trace context not extracted", exc_info=True)
        return None
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def inject_headers(span: trace.Span) -> list[tuple[str, str]]:
    """The propagation headers that make ``span`` the parent of the next hop (``traceparent``, ``tracestate``,
    ``baggage``: whatever the global propagator writes); empty for an invalid span (tracing off)."""
    if not span.get_span_context().is_valid:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return list(carrier.items())


def grpc_metadata(span: trace.Span) -> Sequence[tuple[str, str]] | None:
    """`inject_headers` as gRPC call metadata; None (no metadata at all) for an invalid span."""
    headers = inject_headers(span)
    return tuple(headers) if headers else None
