"""A small real OTLP/gRPC trace receiver: the OTLP ``TraceService`` on loopback, keeping every span it receives.

It speaks the real protocol (``opentelemetry.proto.collector.trace.v1.TraceService/Export``, the service definition
shipped in ``opentelemetry-proto``), so the SDK's OTLP exporter and Envoy's OpenTelemetry tracer export to it
unchanged. Tests read the spans in process (`OtlpReceiver.wait_for`); ``python -m bench.otlp_receiver --listen
HOST:PORT --output FILE`` runs it as a process that writes one JSON line per span (`ReceivedSpan.as_dict`).
Not a collector for production: no TLS, no retention limit beyond ``max_spans``, no other signals.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, IO

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

logger = logging.getLogger(__name__)

_KINDS = {value: name.removeprefix("SPAN_KIND_") for name, value in trace_pb2.Span.SpanKind.items()}


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """One span as received, ids as lower-case hex (``parent_span_id`` "" for a root).

    Attributes:
        service_name: the exporting resource's ``service.name``.
        kind: ``SERVER``, ``CLIENT``, ``INTERNAL``, ``PRODUCER``, ``CONSUMER`` or ``UNSPECIFIED``.
        start_time_unix_ns, end_time_unix_ns: wall-clock nanoseconds since the epoch.
        attributes: attribute -> value (lists for array values).
        events: ``(name, attributes)`` per event, in order.
        links: ``(trace_id, span_id)`` per link.
        status_code: ``UNSET``, ``OK`` or ``ERROR``.
    """

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: str
    service_name: str
    start_time_unix_ns: int
    end_time_unix_ns: int
    attributes: dict[str, Any]
    events: tuple[tuple[str, dict[str, Any]], ...]
    links: tuple[tuple[str, str], ...]
    status_code: str

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


def _value(any_value: common_pb2.AnyValue) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(any_value.kvlist_value.values)
    if kind == "bytes_value":
        return any_value.bytes_value.hex()
    return None if kind is None else getattr(any_value, kind)


def _attributes(key_values: Sequence[common_pb2.KeyValue]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in key_values}


def spans_of(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """Every span of one ``Export`` request, flattened (resource and scope levels dropped but the service name)."""
    spans = []
    for resource_spans in request.resource_spans:
        service = _attributes(resource_spans.resource.attributes).get("service.name", "")
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex(), name=span.name, kind=_KINDS.get(span.kind, "?"),
                    service_name=service, start_time_unix_ns=span.start_time_unix_nano,
                    end_time_unix_ns=span.end_time_unix_nano, attributes=_attributes(span.attributes),
                    events=tuple((e.name, _attributes(e.attributes)) for e in span.events),
                    links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                    status_code=trace_pb2.Status.StatusCode.Name(span.status.code).removeprefix("STATUS_CODE_")))
    return spans


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    def Export(self, request, context):  # noqa: N802 (gRPC method name)
        self._receiver.add(spans_of(request))
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """The OTLP/gRPC trace service on ``listen`` (a synchronous gRPC server: its threads, not an event loop).

    Args:
        listen: ``host:port``; port 0 picks a free one (`port` tells which).
        max_spans: spans kept at most (older ones are dropped first).
        sink: called with each batch of received spans, on a server thread (e.g. to write them to a file).

    Use as a context manager, or `start` and `stop`.
    """

    def __init__(self, listen: str = "127.0.0.1:0", max_spans: int = 100_000,
                 sink: Callable[[list[ReceivedSpan]], None] | None = None) -> None:
        self._server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port(listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {listen}")
        self.host = listen.rpartition(":")[0] or "127.0.0.1"
        self._max_spans = max_spans
        self._sink = sink
        self._spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self.num_exports = 0

    @property
    def endpoint(self) -> str:
        """``http://host:port``: the value of ``OTEL_EXPORTER_OTLP_ENDPOINT`` that reaches this receiver."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self, grace_s: float = 0.5) -> None:
        self._server.stop(grace_s).wait()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def add(self, spans: list[ReceivedSpan]) -> None:
        """Keeps ``spans`` (what one Export carried) and wakes `wait_for`."""
        if self._sink is not None:
            self._sink(spans)
        with self._changed:
            self._spans.extend(spans)
            del self._spans[:-self._max_spans]
            self.num_exports += 1
            self._changed.notify_all()

    def spans(self) -> list[ReceivedSpan]:
        """A copy of the spans received so far, in arrival order."""
        with self._changed:
            return list(self._spans)

    def clear(self) -> None:
        with self._changed:
            self._spans.clear()

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float) -> list[ReceivedSpan]:
        """Waits until ``predicate(spans)`` holds (checked on each Export), and returns the spans.

        Raises:
            TimeoutError: it did not hold within ``timeout_s`` seconds (the message counts what arrived).
        """
        deadline_s = time.monotonic() + timeout_s
        with self._changed:
            while not predicate(self._spans):
                left_s = deadline_s - time.monotonic()
                if left_s <= 0:
                    names = sorted({f"{s.service_name}:{s.name}" for s in self._spans})
                    raise TimeoutError(f"spans never matched within {timeout_s} s; {len(self._spans)} received: "
                                       f"{names}")
                self._changed.wait(left_s)
            return list(self._spans)


def format_trace(spans: Sequence[ReceivedSpan]) -> str:
    """One trace as an indented tree, a line per span: start offset and duration (ms), service, name, kind;
    children in start order. Spans whose parent is not among ``spans`` are roots."""
    ids = {s.span_id for s in spans}
    start_ns = min((s.start_time_unix_ns for s in spans), default=0)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for span in sorted((s for s in spans if (s.parent_span_id if s.parent_span_id in ids else "") == parent),
                           key=lambda s: s.start_time_unix_ns):
            lines.append(f"{(span.start_time_unix_ns - start_ns) / 1e6:9.2f} "
                         f"{(span.end_time_unix_ns - span.start_time_unix_ns) / 1e6:9.2f}  {'  ' * depth}"
                         f"{span.service_name}: {span.name} ({span.kind})")
            walk(span.span_id, depth + 1)

    walk("", 0)
    return "\n".join(["start ms   dur ms  span", *lines])


def _json_lines_sink(out: IO[str]) -> Callable[[list[ReceivedSpan]], None]:
    lock = threading.Lock()

    def write(spans: list[ReceivedSpan]) -> None:
        with lock:
            for span in spans:
                out.write(json.dumps(span.as_dict(), separators=(",", ":")) + "\n")
            out.flush()

    return write


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.otlp_receiver``: receive until SIGTERM/SIGINT, one JSON line per span to ``--output``."""
    parser = argparse.ArgumentParser(prog="python -m bench.otlp_receiver", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:4317", help="host:port (default 127.0.0.1:4317)")
    parser.add_argument("--output", type=Path, required=True, help="JSON-lines file, one span per line (appended)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with args.output.open("a", encoding="utf-8") as out:
        try:
            receiver = OtlpReceiver(args.listen, max_spans=1, sink=_json_lines_sink(out))
        except OSError as exc:
            logger.error("%s", exc)
            return 2
        with receiver:
            logger.info("OTLP/gRPC receiver on %s, spans to %s", receiver.endpoint, args.output)
            stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
