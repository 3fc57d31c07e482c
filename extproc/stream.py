"""One ext_proc ``Process`` stream = one HTTP request: phase handling, body buffering, response ordering.

Body modes (taken from ``protocol_config`` on the first message; Envoy 1.40 sends it):
- no body (request headers carry ``end_of_stream``, e.g. GET): routed at once on the headers, no parsing; a POST
  to an inference route without a body is answered 400 (``extproc.request.bodiless_request``).
- ``BUFFERED``: headers are answered with CONTINUE; the whole body arrives in one message and its answer
  carries the destination header mutation (allowed on a body response only in this mode) and metadata.
- ``FULL_DUPLEX_STREAMED``: the headers answer is held back until the body is complete and parsed; then the
  answers go out in Envoy's required order: headers (with the destination) -> the body re-sent as
  ``streamed_response`` chunks of <= 62 KB -> trailers (only if the request had trailers).
- any other mode (``NONE``, ``STREAMED``): routed on the headers without reading the body.

Errors become an ``immediate_response`` (OpenAI-style JSON) at the moment they are known; a body over
``max_body_bytes`` is refused as soon as the running total passes the limit.

Tracing (``extproc.spans``): the request's span starts with the headers, routes as the current span, records the
parsed request and the decision (or the error) and ends there; the answer that routes also sets the upstream
request's ``traceparent`` / ``tracestate`` to that span, so the backend's trace continues it.

Logs: the headers bind the request id and the span's trace id to the stream's task (``astrolabe.logs``), so every
line logged from then on while the stream handles the request (routing, Predict calls, errors) carries them.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import logging
import time
import uuid

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from astrolabe.logs import bind_request
from extproc import messages, wire
from extproc.admission import NO_HEADER_OBJECTIVES, header_objectives, objective_header_values
from extproc.config import ConfigError, parse_ip_port
from extproc.errors import ErrorCode, RoutingError
from extproc.engine_priority import body_with_priority, identity_encoded, writes_priority
from extproc.request import (MAX_DECODED_FACTOR, RoutingRequest, bodiless_request, is_json_media_type,
                             opaque_body_request, parse_body)
from extproc.decision import Decision
from extproc.router import Router
from extproc.spans import NO_SPAN, RequestSpan

logger = logging.getLogger(__name__)

_BodyMode = processing_mode_pb2.ProcessingMode


class Phase(enum.Enum):
    """Where the stream is in the request's life."""

    HEADERS = "headers"      # waiting for request headers
    BODY = "body"            # collecting the body
    ROUTED = "routed"        # destination sent; later messages are acknowledged unchanged
    REJECTED = "rejected"    # immediate response sent; Envoy ends the stream


class StreamHandler:
    """Turns the ``ProcessingRequest`` messages of one stream into ``ProcessingResponse`` messages.

    Args:
        router: chooses the destination and counts in-flight requests.
        max_body_bytes: larger request bodies are answered with 413.
        span: the request's span (``extproc.spans.RequestSpan``); the default records nothing (tracing off).
    """

    def __init__(self, router: Router, max_body_bytes: int, span: RequestSpan = NO_SPAN) -> None:
        self._router = router
        self._max_body_bytes = max_body_bytes
        self._phase = Phase.HEADERS
        self._body_mode = _BodyMode.BUFFERED
        self._response_body_mode = _BodyMode.NONE
        self._body = bytearray()
        self._method = ""
        self._path = ""
        self._content_encoding: str | None = None
        self._content_type: str | None = None
        self._request_id = ""
        self._arrival_time_s = 0.0
        self._span = span
        self._allowed: frozenset[str] | None = None
        self._objectives = NO_HEADER_OBJECTIVES
        self._engine_priority: int | None = None  # what the body's priority field becomes (None: left alone)
        self._num_messages = 0
        self._failed = False  # the backend answered with an error status (its response headers said so)
        self.decision: Decision | None = None

    async def on_message(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """Answers one message; never raises (unexpected errors become a 500 immediate response)."""
        try:
            return await self._dispatch(message)
        except RoutingError as error:
            return self._reject(error)
        except Exception:  # noqa: BLE001 - a bug must cost one request, not the stream loop
            logger.exception("internal error on request %s", self._request_id)
            return self._reject(RoutingError(ErrorCode.INTERNAL, "internal error in the endpoint picker"))

    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def routed(self) -> bool:
        """The destination was sent; the stream now only waits for the request to end."""
        return self._phase is Phase.ROUTED

    @property
    def relays_response(self) -> bool:
        """Routed, and Envoy streams the response body through this stream (FULL_DUPLEX_STREAMED response mode, as
        Istio's InferencePool support sets it): Envoy forwards only the chunks sent back, so closing the stream
        early would cut the response."""
        return self.routed and self._response_body_mode == _BodyMode.FULL_DUPLEX_STREAMED

    def close(self) -> None:
        """The stream ended (the HTTP request is over): release the in-flight slot, once."""
        self._span.end("abandoned")  # a no-op unless the stream ended before a decision or an error answer
        if self.decision is not None:
            self._router.release(self.decision, failed=self._failed)
            self.decision = None

    def _reject(self, error: RoutingError) -> list[pb.ProcessingResponse]:
        logger.debug("request %s rejected: %s %s", self._request_id, error.http_status, error.message)
        self._phase = Phase.REJECTED
        self._body = bytearray()  # Envoy ends the stream; nothing more is read
        self._router.metrics.count_request(self._router.policy.TYPE, error.code.value)
        self._span.rejected(error)
        return [messages.immediate_error(error)]

    async def _dispatch(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self._num_messages += 1
        # Envoy sends protocol_config on the first message only; a later one must not switch the body mode under
        # answers already sent (a BUFFERED stream would get a second headers answer and re-sent chunks).
        if self._num_messages == 1 and message.HasField("protocol_config"):
            self._body_mode = message.protocol_config.request_body_mode
            self._response_body_mode = message.protocol_config.response_body_mode
        kind = message.WhichOneof("request")
        if self._phase is Phase.REJECTED:
            return []
        if kind == "request_headers":
            if self._phase is not Phase.HEADERS:  # Envoy sends them once; a second set must not route again
                return [_acknowledge(kind)]
            self._allowed = _subset_hint(message)
            return await self._on_headers(message.request_headers)
        if kind == "response_headers" and self.decision is not None:
            served = _served_endpoint(message)
            if served is not None:
                self.decision = self._router.served(self.decision, served)
            failed = _failed_endpoint(message, self.decision.destination)
            if failed is not None:
                self._router.connect_failed(self.decision, failed)
            status = _upstream_status(message)
            if status is not None:
                self._failed = status >= 400
                self._router.answered(self.decision, status)
        if kind == "request_body":
            return await self._on_body(message.request_body)
        if kind == "request_trailers":
            return await self._on_trailers()
        # Our Envoy configs skip the response phases; gateways that send them (Istio's InferencePool support asks
        # for response bodies in FULL_DUPLEX_STREAMED mode) get them back unchanged.
        if kind == "response_body" and self._response_body_mode == _BodyMode.FULL_DUPLEX_STREAMED:
            # In this mode Envoy forwards only what the processor sends back: an empty answer would drop the body.
            return [messages.streamed_response_body_echo(message.response_body)]
        return [_acknowledge(kind)]

    async def _on_headers(self, headers: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        self._arrival_time_s = time.monotonic()
        pairs = [(h.key.lower(), (h.raw_value or h.value.encode()).decode("latin-1")) for h in headers.headers.headers]
        values = dict(pairs)
        self._method = values.get(":method", "")
        self._path = values.get(":path", "")
        # Repeated content-encoding lines are one list, in order (RFC 9110 5.3): each coding applies.
        encodings = [h for h in headers.headers.headers if h.key.lower() == "content-encoding"]
        self._content_encoding = ", ".join((h.raw_value or h.value.encode()).decode("latin-1")
                                           for h in encodings) if encodings else None
        # the first of repeated lines, as Starlette (vLLM's and SGLang's servers) reads it
        self._content_type = next((v for k, v in pairs if k == "content-type"), None)
        self._request_id = values.get(wire.REQUEST_ID_HEADER) or uuid.uuid4().hex
        self._objectives = header_objectives(objective_header_values(pairs))
        self._span.start(values, self._request_id)
        bind_request(self._request_id, self._span.trace_id)
        if headers.end_of_stream or self._body_mode not in (_BodyMode.BUFFERED, _BodyMode.FULL_DUPLEX_STREAMED):
            request = (bodiless_request(self._request_id, self._method, self._path) if headers.end_of_stream
                       else RoutingRequest(self._request_id, self._method, self._path))
            decision = await self._route(request)
            return [messages.headers_route(decision.destination_value, self._span.upstream_headers())]
        self._phase = Phase.BODY
        if self._body_mode == _BodyMode.BUFFERED:
            return [messages.headers_continue()]
        return []  # FULL_DUPLEX_STREAMED: the headers answer waits for the body

    async def _on_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self._phase is not Phase.BODY:
            return [_acknowledge("request_body")]
        chunk = body.body  # a copy (upb): read once; a chunk past the limit is not appended (a third copy)
        if len(self._body) + len(chunk) > self._max_body_bytes:
            raise RoutingError(ErrorCode.BODY_TOO_LARGE,
                               f"request body exceeds the limit of {self._max_body_bytes} bytes")
        self._body += chunk
        if self._body_mode == _BodyMode.BUFFERED:
            decision, body = await self._route_body()
            return [messages.body_route(decision.destination_value, self._upstream_headers(body), body)]
        if not body.end_of_stream:
            return []
        return await self._full_duplex_answers(had_trailers=False)

    async def _on_trailers(self) -> list[pb.ProcessingResponse]:
        if self._phase is Phase.BODY and self._body_mode == _BodyMode.FULL_DUPLEX_STREAMED:
            return await self._full_duplex_answers(had_trailers=True)
        return [messages.trailers_continue()]

    async def _full_duplex_answers(self, *, had_trailers: bool) -> list[pb.ProcessingResponse]:
        decision, rewritten = await self._route_body()
        answers = [messages.headers_route(decision.destination_value, self._upstream_headers(rewritten))]
        body, self._body = rewritten if rewritten is not None else bytes(self._body), bytearray()
        answers += messages.streamed_body(body, end_of_stream=not had_trailers)
        if had_trailers:
            answers.append(messages.trailers_continue())
        return answers

    def _upstream_headers(self, rewritten: bytes | None) -> list[tuple[str, bytes]]:
        """Headers set on the routed request: the trace context, and the ``content-length`` of a body the extproc
        rewrote (None: the body goes on as sent)."""
        headers = list(self._span.upstream_headers())
        if rewritten is not None:
            headers.append(("content-length", str(len(rewritten)).encode()))
        return headers

    async def _route_body(self) -> tuple[Decision, bytes | None]:
        """The decision on the body, and the body with the request's engine priority written in
        (``extproc/engine_priority.py``; None: the body goes on unchanged)."""
        body = bytes(self._body)
        # Not JSON, off the inference routes (an audio upload): routed on its headers, its body left as sent.
        opaque = not is_json_media_type(self._content_type)
        if opaque:
            request = opaque_body_request(self._request_id, self._method, self._path, len(body))
        else:
            request = parse_body(self._request_id, self._method, self._path, body, self._content_encoding,
                                 MAX_DECODED_FACTOR * self._max_body_bytes)
        if self._body_mode == _BodyMode.BUFFERED:
            # A routed stream lives as long as its HTTP request: it must not hold the body meanwhile.
            self._body = bytearray()
        decision = await self._route(request)
        priority = self._engine_priority
        if priority is None or opaque or not writes_priority(request.path):
            return decision, None
        if not identity_encoded(self._content_encoding):
            self._router.metrics.engine_priority_bodies.labels("encoded").inc()
            return decision, None
        self._router.metrics.engine_priority_bodies.labels("written").inc()
        return decision, body_with_priority(body, priority)

    async def _route(self, request: RoutingRequest) -> Decision:
        self._span.request(request)
        request = dataclasses.replace(request, arrival_time_s=self._arrival_time_s, allowed_endpoints=self._allowed,
                                      objectives=self._router.resolve_objectives(self._objectives, request.model))
        self._engine_priority = self._router.engine_priority_of(request)
        with self._span.activated():
            self.decision = await self._router.route(request)
        self._phase = Phase.ROUTED
        self._span.decision(self.decision, self._router.policy.TYPE)
        return self.decision


def _subset_hint(message: pb.ProcessingRequest) -> frozenset[str] | None:
    """The gateway's subset hint in the request's filter metadata (``envoy.lb.subset_hint`` /
    ``x-gateway-destination-endpoint-subset``): a list of ``ip:port`` strings, or one comma-separated string
    (what Envoy's header_to_metadata filter makes of a header). Entries are normalised ``ip:port``, or a bare IP
    (normalised) that admits any port of it, as the Inference Extension's picker matches by IP; other entries
    are not eligible. None when there is no hint, or when its value is neither a list nor a string (ignored, as
    the reference pickers do).

    Source: gateway-api-inference-extension docs/proposals/004-endpoint-picker-protocol ("Endpoint Subset").
    """
    hint = message.metadata_context.filter_metadata.get(wire.SUBSET_HINT_NAMESPACE)
    if hint is None or wire.DESTINATION_SUBSET_HEADER not in hint.fields:
        return None
    value = hint.fields[wire.DESTINATION_SUBSET_HEADER]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        entries = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    elif kind == "string_value":
        entries = value.string_value.split(",")
    else:
        logger.debug("subset hint of kind %s is not a list: ignored", kind)
        return None
    allowed = set()
    for entry in entries:
        entry = entry.strip()
        try:
            allowed.add(parse_ip_port(entry, wire.DESTINATION_SUBSET_HEADER))
        except ConfigError:
            try:
                allowed.add(str(ipaddress.ip_address(entry.strip("[]"))))
            except ValueError:
                logger.debug("subset hint entry %r is neither ip:port nor ip; not eligible", entry[:100])
    return frozenset(allowed)


EXT_PROC_ATTRIBUTES = "envoy.filters.http.ext_proc"
"""Namespace of the attributes Envoy sends with a message (the filter config's ``response_attributes``)."""
CONNECT_FAILURE_DETAILS = ("upstream_reset_before_response_started", "connection_failure")
"""``response.code_details`` of Envoy's own 503 when the upstream refused or never accepted the connection: it
starts with the first and contains the second (e.g. ``upstream_reset_before_response_started{
remote_connection_failure|delayed_connect_error:_Connection_refused}``, Envoy 1.40's ``ResponseCodeDetails``)."""
PER_TRY_TIMEOUT_DETAILS = frozenset({"upstream_per_try_idle_timeout", "upstream_per_try_timeout"})
"""``response.code_details`` of Envoy's own 504 when a try's deadline fired before the response started: the route's
``per_try_idle_timeout`` (the backend sent no byte for that long: frozen, hung) or ``per_try_timeout`` (Envoy 1.40's
``ResponseCodeDetails``). The backend accepted the connection and never answered: as unusable as one that refuses."""


def _failed_endpoint(message: pb.ProcessingRequest, destination: str) -> str | None:
    """The endpoint that failed the request, when these response headers are Envoy's own reply to a connection
    failure (`CONNECT_FAILURE_DETAILS`) or to a per-try deadline (`PER_TRY_TIMEOUT_DETAILS`) in
    ``response.code_details``: its ``upstream.address`` (normalised), else ``destination``; None for any other
    response."""
    attributes = message.attributes.get(EXT_PROC_ATTRIBUTES)
    if attributes is None or "response.code_details" not in attributes.fields:
        return None
    details = attributes.fields["response.code_details"].string_value
    prefix, marker = CONNECT_FAILURE_DETAILS
    if not (details.startswith(prefix) and marker in details) and details not in PER_TRY_TIMEOUT_DETAILS:
        return None
    upstream = attributes.fields["upstream.address"].string_value if "upstream.address" in attributes.fields else ""
    try:
        return parse_ip_port(upstream, "upstream.address") if upstream else destination
    except ConfigError:
        return destination


def _upstream_status(message: pb.ProcessingRequest) -> int | None:
    """The backend's own HTTP status in these response headers (``response.code_details`` ``via_upstream``), or
    None when Envoy answered itself or did not say."""
    attributes = message.attributes.get(EXT_PROC_ATTRIBUTES)
    if attributes is None or "response.code_details" not in attributes.fields \
            or attributes.fields["response.code_details"].string_value != "via_upstream":
        return None
    for header in message.response_headers.headers.headers:
        if header.key == ":status":
            value = (header.raw_value or header.value.encode()).decode("latin-1")
            return int(value) if value.isdigit() else None
    return None


def _served_endpoint(message: pb.ProcessingRequest) -> str | None:
    """The endpoint the gateway reports as having served the request (``envoy.lb`` /
    ``x-gateway-destination-endpoint-served`` in the response's metadata context), normalised; None if absent
    or not ``ip:port``."""
    lb = message.metadata_context.filter_metadata.get(wire.LB_METADATA_NAMESPACE)
    if lb is None or wire.DESTINATION_SERVED_KEY not in lb.fields:
        return None
    try:
        return parse_ip_port(lb.fields[wire.DESTINATION_SERVED_KEY].string_value, wire.DESTINATION_SERVED_KEY)
    except ConfigError:
        return None


def _acknowledge(kind: str | None) -> pb.ProcessingResponse:
    """An answer that changes nothing, for a phase we do not act on."""
    if kind in ("request_headers", "response_headers"):
        return pb.ProcessingResponse(**{kind: pb.HeadersResponse()})
    if kind in ("request_body", "response_body"):
        return pb.ProcessingResponse(**{kind: pb.BodyResponse()})
    if kind in ("request_trailers", "response_trailers"):
        return pb.ProcessingResponse(**{kind: pb.TrailersResponse()})
    raise RoutingError(ErrorCode.BAD_REQUEST, f"unexpected ext_proc message {kind!r}")
