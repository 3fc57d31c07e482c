"""The extproc's span of each routed request: where its parent comes from, what it records, what it propagates.

One SERVER span per ext_proc stream (= one HTTP request), named ``astrolabe.route``, from the request headers
to the decision (or the error answer): it is the router's part of the request's trace. The stream calls it at
its phase points (`RequestSpan.start`, `request`, `decision`, `rejected`, `end`); the router's child spans (the
length estimate, each Predict and Admit call) hang below it because the stream routes with it as the current
span (`RequestSpan.activated`). Tracing observes the request path; it never changes a decision, and a malformed
trace context only costs the trace (a new root), never the request.

NOTE: the parent. The caller's context can arrive twice: in the request's ``traceparent`` / ``tracestate`` headers
(the client's own context) and in the ext_proc gRPC stream's metadata (Envoy's, when Envoy's tracer is on: its
ext_proc call span, itself a child of Envoy's request span, which continues the client's headers). The
**metadata wins** when it holds a valid context: it is the direct caller, so the chain stays client -> Envoy ->
extproc; the headers are the parent only when the metadata has none (Envoy not tracing). When both are valid but
in different traces (a proxy that started its own), the headers' context is kept as a span link.

Attribute names: OpenTelemetry GenAI (``gen_ai.operation.name``, ``gen_ai.request.model``,
``gen_ai.request.max_tokens``), general (``server.address``/``server.port`` of the chosen endpoint,
``error.type``, ``http.request.method``, ``url.path``, ``http.response.status_code`` of an error answer), and
``astrolabe.*`` for the rest (below). Each probed endpoint is one ``astrolabe.candidate`` event.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from astrolabe.logs import trace_id_hex
from astrolabe.tracing import (ADMIT_ID, NUM_PREDICTED_OUTPUT_TOKENS, NUM_PROMPT_TOKENS, SERVER_ADDRESS, SERVER_PORT,
                               context_from, inject_headers)
from extproc.decision import Decision
from extproc.errors import RoutingError
from extproc.request import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, GENERATE_PATH, RoutingRequest
from predictor.residual_rules import (
    LENGTH_SOURCE_EXACT,
    LENGTH_SOURCE_FIXED,
    LENGTH_SOURCE_TAGGER,
    LENGTH_SOURCE_TAGGER_LATER_TURN,
)

SPAN_NAME = "astrolabe.route"
CANDIDATE_EVENT = "astrolabe.candidate"

# Attribute keys (GenAI and general semantic conventions first).
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
MAX_INT64 = 2**63 - 1
"""Largest integer attribute value OTLP encodes (int64)."""
ERROR_TYPE = "error.type"
REQUEST_ID = "astrolabe.request_id"            # the client's x-request-id (or the generated one)
POLICY = "astrolabe.policy"                    # the policy that decided (least-requests on a fallback)
BASIS = "astrolabe.basis"                      # prediction | partial | fallback | policy (extproc.router)
OUTCOME = "astrolabe.outcome"                  # routed | fallback | an error code | abandoned
FALLBACK_REASON = "astrolabe.fallback_reason"  # on a fallback: extproc.router.FALLBACK_REASONS
DROP_REASON = "astrolabe.drop_reason"          # on a refusal (429): extproc.admission.SHED_REASONS
LENGTH_SOURCE = "astrolabe.length_source"      # tagger | tagger_later_turn | fixed | exact | unspecified
DESTINATION = "astrolabe.destination"          # the destination header's value, ip:port
ROUTING_S = "astrolabe.routing_s"              # headers to decision, seconds
NUM_CANDIDATES = "astrolabe.num_candidates"
# Keys of an astrolabe.candidate event.
CANDIDATE_ENDPOINT = "astrolabe.candidate.endpoint"
CANDIDATE_ANSWERED = "astrolabe.candidate.answered"    # False: no sidecar, failed, late, backing off, stale
CANDIDATE_CHOSEN = "astrolabe.candidate.chosen"
CANDIDATE_TTFT_S = "astrolabe.candidate.predicted_ttft_s"
CANDIDATE_E2E_S = "astrolabe.candidate.predicted_e2e_s"
CANDIDATE_QUEUE_S = "astrolabe.candidate.predicted_queue_s"
CANDIDATE_STATE_AGE_S = "astrolabe.candidate.state_age_s"

MAX_REQUEST_TEXT_CHARS = 256
"""Longest value taken from the request (model, path, request id) into an attribute: a client must not be able to
push megabytes through the trace pipeline (the excess is cut, with a trailing "...")."""

_OPERATIONS = {CHAT_COMPLETIONS_PATH: "chat", COMPLETIONS_PATH: "text_completion", GENERATE_PATH: "text_completion"}
LENGTH_SOURCE_LABELS = {LENGTH_SOURCE_TAGGER: "tagger", LENGTH_SOURCE_TAGGER_LATER_TURN: "tagger_later_turn",
                        LENGTH_SOURCE_FIXED: "fixed", LENGTH_SOURCE_EXACT: "exact"}
"""``predictor.residual_rules.LENGTH_SOURCE_*`` -> the value of ``astrolabe.length_source`` (else ``unspecified``)."""


def clip_text(text: str) -> str:
    """``text`` cut to `MAX_REQUEST_TEXT_CHARS` (with a trailing "..."), for a value taken from the request."""
    return text if len(text) <= MAX_REQUEST_TEXT_CHARS else text[:MAX_REQUEST_TEXT_CHARS - 3] + "..."


def host_port(address: str) -> tuple[str, int | None]:
    """``ip:port`` (or ``[v6]:port``; the first of a comma-separated list) as (host, port); port None if absent."""
    host, _, port = address.split(",", 1)[0].rpartition(":")
    if not host:
        return address, None
    return host.strip("[]"), int(port) if port.isdigit() else None


class RequestSpan:
    """The span of one stream, or nothing when tracing is off (every method is then a no-op: `NO_SPAN`).

    Args:
        tracer: the extproc's tracer; None = tracing off.
        grpc_metadata: the stream's invocation metadata, ``(key, value)`` pairs (binary ``-bin`` values skipped).
    """

    __slots__ = ("_tracer", "_metadata", "_span", "_ended")

    def __init__(self, tracer: trace.Tracer | None, grpc_metadata: Sequence[tuple[str, str | bytes]] = ()) -> None:
        self._tracer = tracer
        self._metadata = grpc_metadata
        self._span: trace.Span | None = None
        self._ended = False

    def start(self, headers: Mapping[str, str], request_id: str) -> None:
        """Starts the span now (at the request headers), as a child of the caller's context (module NOTE).

        Args:
            headers: the request headers, lower-case names.
            request_id: the request's id (``x-request-id`` or the generated one).
        """
        if self._tracer is None or self._span is not None:
            return
        from_metadata = context_from({k: v for k, v in self._metadata if isinstance(v, str)})
        from_headers = context_from(headers)
        links = ()
        if from_metadata is not None and from_headers is not None:
            header_context = trace.get_current_span(from_headers).get_span_context()
            if header_context.trace_id != trace.get_current_span(from_metadata).get_span_context().trace_id:
                links = (Link(header_context),)
        parent = from_metadata or from_headers or Context()  # an empty context: a new root, never an ambient one
        attributes = {REQUEST_ID: clip_text(request_id), "http.request.method": clip_text(headers.get(":method", "")),
                      "url.path": clip_text(headers.get(":path", "").split("?", 1)[0])}
        self._span = self._tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.SERVER, links=links,
                                             attributes=attributes)

    @property
    def trace_id(self) -> str | None:
        """The span's trace id, 32 hex digits, for log lines; None before `start` or with tracing off."""
        return None if self._span is None else trace_id_hex(self._span.get_span_context())

    @contextlib.contextmanager
    def activated(self) -> Iterator[None]:
        """The span is the current one inside (the router's spans become its children); it does not end here."""
        if self._span is None:
            yield
            return
        with trace.use_span(self._span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
            yield

    def request(self, request: RoutingRequest) -> None:
        """Records what the body says (GenAI attributes)."""
        span = self._span
        if span is None or not span.is_recording():
            return
        operation = _OPERATIONS.get(request.path)
        if operation is not None:
            span.set_attribute(GEN_AI_OPERATION_NAME, operation)
        if request.model is not None:
            span.set_attribute(GEN_AI_REQUEST_MODEL, clip_text(request.model))
        if request.max_tokens is not None:
            # OTLP carries int64: a larger cap (vLLM accepts any int) would be dropped with an error per export.
            span.set_attribute(GEN_AI_REQUEST_MAX_TOKENS, min(request.max_tokens, MAX_INT64))

    def decision(self, decision: Decision, chosen_policy: str) -> None:
        """Records the decision (policy, basis, tokens, every candidate, the destination) and ends the span.

        Args:
            decision: what the router decided.
            chosen_policy: the configured policy; a decision by another one (least-requests) is a fallback.
        """
        span = self._span
        if span is None or self._ended:
            return
        if span.is_recording():
            fallback = decision.policy != chosen_policy
            host, port = host_port(decision.destination)
            attributes = {POLICY: decision.policy, BASIS: decision.basis, OUTCOME: "fallback" if fallback else "routed",
                          DESTINATION: decision.destination, SERVER_ADDRESS: host, ROUTING_S: decision.routing_s,
                          NUM_CANDIDATES: len(decision.candidates)}
            if port is not None:
                attributes[SERVER_PORT] = port
            if decision.fallback_reason:
                attributes[FALLBACK_REASON] = decision.fallback_reason
            if decision.candidates:
                attributes.update({ADMIT_ID: decision.request_id, NUM_PROMPT_TOKENS: decision.num_prompt_tokens,
                                   NUM_PREDICTED_OUTPUT_TOKENS: decision.num_predicted_output_tokens,
                                   LENGTH_SOURCE: LENGTH_SOURCE_LABELS.get(decision.length_source, "unspecified")})
                attributes.update({f"astrolabe.stage.{name}_s": value for name, value in decision.stage_s})
            span.set_attributes(attributes)
            for address, prediction in decision.candidates:
                event = {CANDIDATE_ENDPOINT: address, CANDIDATE_ANSWERED: prediction is not None,
                         CANDIDATE_CHOSEN: address == decision.destination}
                if prediction is not None:
                    event.update({CANDIDATE_TTFT_S: prediction.ttft_s, CANDIDATE_E2E_S: prediction.e2e_s,
                                  CANDIDATE_QUEUE_S: prediction.queue_s,
                                  CANDIDATE_STATE_AGE_S: prediction.state_age_s})
                span.add_event(CANDIDATE_EVENT, event)
        self.end()

    def rejected(self, error: RoutingError) -> None:
        """Records an error answer (a 5xx also sets the span's status to ERROR) and ends the span."""
        span = self._span
        if span is None or self._ended:
            return
        if span.is_recording():
            span.set_attributes({OUTCOME: error.code.value, ERROR_TYPE: error.code.value,
                                 "http.response.status_code": error.http_status})
            if error.reason:
                span.set_attribute(DROP_REASON, error.reason)
            if error.http_status >= 500:
                span.set_status(Status(StatusCode.ERROR, error.message))
        self.end()

    def upstream_headers(self) -> list[tuple[str, bytes]]:
        """``traceparent`` / ``tracestate`` (and ``baggage``) naming this span, for the upstream request's header
        mutation, so that the backend's own tracing joins the trace; empty when off or not yet started."""
        if self._span is None:
            return []
        return [(key, value.encode("latin-1", "replace")) for key, value in inject_headers(self._span)]

    def end(self, outcome: str | None = None) -> None:
        """Ends the span (idempotent); ``outcome`` is recorded when given (e.g. ``abandoned``: the stream ended
        before a decision)."""
        span = self._span
        if span is None or self._ended:
            return
        self._ended = True
        if outcome is not None and span.is_recording():
            span.set_attribute(OUTCOME, outcome)
        span.end()


NO_SPAN = RequestSpan(None)
"""The span of every stream while tracing is off: records nothing, propagates nothing, costs a method call."""
