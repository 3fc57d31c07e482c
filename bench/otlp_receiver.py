"""A small real OTLP/gRPC trace receiver: the OTLP ``TraceService`` on loopback, keeping every span it receives.

It speaks the real protocol (``opentelemetry.proto.collector.trace.v1.TraceService/Export``, the service definition
shipped in ``opentelemetry-proto``), so the SDK's OTLP exporter and Envoy's OpenTelemetry tracer export to it
unchanged. Tests read the spans in process (`OtlpReceiver.wait_for`); ``python -m bench.otlp_receiver --listen
HOST:PORT --output FILE`` runs it as a process that writes one JSON line per span (`ReceivedSpan.as_dict`;
`start_process` starts that process for the demo and the benches), and ``python -m bench.otlp_receiver --show
FILE`` prints one trace of such a file as a tree (`format_trace`), or lists them (``--list``).
Not a collector for production: no TLS, no retention limit beyond ``max_spans``, no other signals.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import signal
import sys
import textwrap
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

from astrolabe.procs import ProcessGroup, free_port

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


def format_trace(spans: Sequence[ReceivedSpan], with_attributes: bool = False, width: int = 116) -> str:
    """One trace as an indented tree, a line per span: start offset and duration (ms), service, name, kind;
    children in start order. Spans whose parent is not among ``spans`` are roots.

    Args:
        spans: the spans of one trace, any order.
        with_attributes: also a block under each span: its status when not UNSET, its attributes (``key=value``)
            and each event (``event NAME: key=value``, keys without the event's own name as prefix), wrapped at
            ``width`` characters.
        width: line width of the attribute blocks.
    """
    ids = {s.span_id for s in spans}
    start_ns = min((s.start_time_unix_ns for s in spans), default=0)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for span in sorted((s for s in spans if (s.parent_span_id if s.parent_span_id in ids else "") == parent),
                           key=lambda s: s.start_time_unix_ns):
            lines.append(f"{(span.start_time_unix_ns - start_ns) / 1e6:9.2f} "
                         f"{(span.end_time_unix_ns - span.start_time_unix_ns) / 1e6:9.2f}  {'  ' * depth}"
                         f"{span.service_name}: {span.name} ({span.kind})")
            if with_attributes:
                lines.extend(_attribute_lines(span, " " * (22 + 2 * depth), width))
            walk(span.span_id, depth + 1)

    walk("", 0)
    return "\n".join(["start ms   dur ms  span", *lines])


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ",".join(map(_text, value)) + "]"
    return str(value)


def _attribute_lines(span: ReceivedSpan, indent: str, width: int) -> list[str]:
    """The ``with_attributes`` block of `format_trace` for one span."""
    items = [f"status={span.status_code}"] if span.status_code != "UNSET" else []
    items += [f"{key}={_text(value)}" for key, value in span.attributes.items()]
    lines = textwrap.wrap(" ".join(items), width, initial_indent=indent, subsequent_indent=indent,
                          break_on_hyphens=False) if items else []
    for name, attributes in span.events:
        text = " ".join(f"{key.removeprefix(name + '.')}={_text(value)}" for key, value in attributes.items())
        lines += textwrap.wrap(f"event {name}: {text}", width, initial_indent=indent,
                               subsequent_indent=indent + "      ", break_on_hyphens=False)
    return lines


def read_spans(path: Path) -> list[ReceivedSpan]:
    """The spans of a file that ``--output`` wrote (one JSON line per span), in file order.

    Raises:
        OSError: the file cannot be read.
        ValueError: a line is not a span record (the message names the file and line).
    """
    spans = []
    with path.open(encoding="utf-8") as fp:
        for number, line in enumerate(fp, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                spans.append(ReceivedSpan(**{**record, "events": tuple((n, a) for n, a in record["events"]),
                                             "links": tuple((t, s) for t, s in record["links"])}))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{number}: not a span record ({exc})") from None
    return spans


def group_traces(spans: Sequence[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    """trace id -> its spans, traces in the order their first span arrived."""
    traces: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        traces.setdefault(span.trace_id, []).append(span)
    return traces


def select_trace(spans: Sequence[ReceivedSpan], trace_id: str | None = None,
                 request_id: str | None = None) -> list[ReceivedSpan]:
    """The spans of one trace: the one whose id starts with ``trace_id``, or whose spans carry
    ``astrolabe.request_id`` = ``request_id`` (the x-request-id the extproc saw), else the trace with the most
    spans (the first of those to arrive: the fullest picture of a request).

    Raises:
        LookupError: no trace matches, or ``trace_id`` is the prefix of several.
    """
    traces = group_traces(spans)
    if trace_id is not None:
        found = [t for t in traces if t.startswith(trace_id.lower())]
        if len(found) != 1:
            raise LookupError(f"{len(found)} traces have an id starting with {trace_id!r}")
        return traces[found[0]]
    if request_id is not None:
        found = [t for t, members in traces.items()
                 if any(s.attributes.get("astrolabe.request_id") == request_id for s in members)]
        if not found:
            raise LookupError(f"no trace carries astrolabe.request_id={request_id!r}")
        return traces[found[0]]
    if not traces:
        raise LookupError("no spans")
    return max(traces.values(), key=len)


def format_trace_list(spans: Sequence[ReceivedSpan]) -> str:
    """One line per trace: id, spans, duration (ms), its first root's service and name, the request id."""
    lines = [f"{'trace id':<32}  {'spans':>5}  {'dur ms':>9}  root; request id"]
    for trace_id, members in group_traces(spans).items():
        ids = {s.span_id for s in members}
        root = min((s for s in members if s.parent_span_id not in ids), key=lambda s: s.start_time_unix_ns)
        duration_ms = (max(s.end_time_unix_ns for s in members) - min(s.start_time_unix_ns for s in members)) / 1e6
        request_id = next((s.attributes["astrolabe.request_id"] for s in members
                           if "astrolabe.request_id" in s.attributes), "-")
        lines.append(f"{trace_id:<32}  {len(members):>5}  {duration_ms:>9.2f}  {root.service_name}: {root.name}; "
                     f"{request_id}")
    return "\n".join(lines)


def start_process(procs: ProcessGroup, output: Path, log_path: Path, timeout_s: float = 60.0) -> str:
    """Start ``python -m bench.otlp_receiver`` in ``procs`` on a free loopback port, spans appended to ``output``,
    and wait until it listens.

    Returns:
        ``host:port`` of the receiver (prefix ``http://`` for ``OTEL_EXPORTER_OTLP_ENDPOINT``).

    Raises:
        astrolabe.procs.ProcessStartError: it exited or did not listen within ``timeout_s`` seconds.
    """
    port = free_port()
    proc = procs.start([sys.executable, "-m", "bench.otlp_receiver", "--listen", f"127.0.0.1:{port}",
                        "--output", str(output)], name="otlp-receiver", log_path=log_path)
    proc.wait_tcp("127.0.0.1", port, timeout_s)
    return f"127.0.0.1:{port}"


def _json_lines_sink(out: IO[str]) -> Callable[[list[ReceivedSpan]], None]:
    lock = threading.Lock()

    def write(spans: list[ReceivedSpan]) -> None:
        with lock:
            for span in spans:
                out.write(json.dumps(span.as_dict(), separators=(",", ":")) + "\n")
            out.flush()

    return write


def _show(args: argparse.Namespace) -> int:
    try:
        spans = read_spans(args.show)
        if args.list:
            print(format_trace_list(spans))
        else:
            print(format_trace(select_trace(spans, args.trace_id, args.request_id),
                               with_attributes=not args.no_attributes))
    except (OSError, ValueError, LookupError) as exc:
        print(f"python -m bench.otlp_receiver: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.otlp_receiver``: receive until SIGTERM/SIGINT, one JSON line per span to ``--output``;
    or, with ``--show``, print a trace of such a file. Returns 0, or 2 (cannot listen, or nothing to show)."""
    parser = argparse.ArgumentParser(prog="python -m bench.otlp_receiver", description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--output", type=Path, help="receive: JSON-lines file, one span per line (appended)")
    what.add_argument("--show", type=Path, metavar="FILE",
                      help="print one trace of FILE (written by --output) as a tree with each span's attributes")
    parser.add_argument("--listen", default="127.0.0.1:4317", help="with --output: host:port (default 127.0.0.1:4317)")
    pick = parser.add_mutually_exclusive_group()
    pick.add_argument("--trace-id", help="with --show: the trace whose id starts with this (default: the trace with "
                                         "the most spans)")
    pick.add_argument("--request-id", help="with --show: the trace of this x-request-id (its astrolabe.route span's "
                                           "astrolabe.request_id)")
    pick.add_argument("--list", action="store_true", help="with --show: list the traces instead (id, spans, "
                                                          "duration, root, request id)")
    parser.add_argument("--no-attributes", action="store_true", help="with --show: the tree only")
    args = parser.parse_args(argv)
    if args.show is not None:
        return _show(args)
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
