"""bench.otlp_receiver: the SDK's real OTLP/gRPC exporter talks to it; the file mode and the trace tree."""

import json
import subprocess
import sys
import time

import pytest
from opentelemetry.trace import SpanKind

from astrolabe.tracing import TracingConfig, setup_tracing
from bench.otlp_receiver import OtlpReceiver, format_trace
from bench.procs import free_port


def _export(endpoint: str) -> None:
    tracing = setup_tracing("svc", TracingConfig(endpoint=endpoint), environ={})
    tracer = tracing.tracer("t")
    with tracer.start_as_current_span("parent", kind=SpanKind.SERVER, attributes={"n": 3, "xs": [1.5, 2.5]}) as p:
        p.add_event("e", {"k": "v"})
        with tracer.start_as_current_span("child"):
            pass
    tracing.shutdown(timeout_s=10)


def test_spans_arrive_with_ids_parents_attributes_and_events():
    with OtlpReceiver() as receiver:
        _export(receiver.endpoint)
        spans = receiver.wait_for(lambda s: len(s) == 2, timeout_s=10)
    by_name = {s.name: s for s in spans}
    parent, child = by_name["parent"], by_name["child"]
    assert parent.parent_span_id == "" and child.parent_span_id == parent.span_id
    assert child.trace_id == parent.trace_id and len(parent.trace_id) == 32
    assert parent.kind == "SERVER" and child.kind == "INTERNAL" and parent.service_name == "svc"
    assert parent.attributes == {"n": 3, "xs": [1.5, 2.5]} and parent.events == (("e", {"k": "v"}),)
    assert parent.start_time_unix_ns <= child.start_time_unix_ns <= child.end_time_unix_ns <= parent.end_time_unix_ns
    tree = format_trace(spans).splitlines()
    assert "svc: parent (SERVER)" in tree[1] and tree[2].endswith("  svc: child (INTERNAL)")


def test_wait_for_times_out_naming_what_arrived():
    with OtlpReceiver() as receiver, pytest.raises(TimeoutError, match="0 received"):
        receiver.wait_for(lambda s: bool(s), timeout_s=0.05)


def test_the_process_writes_one_json_line_per_span(tmp_path):
    port, out = free_port(), tmp_path / "spans.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "bench.otlp_receiver", "--listen", f"127.0.0.1:{port}",
                             "--output", str(out)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while "OTLP/gRPC receiver on" not in (line := proc.stderr.readline()):
            assert line and time.monotonic() < deadline, "receiver did not start"
        _export(f"127.0.0.1:{port}")
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["name"] for r in records) == ["child", "parent"]
