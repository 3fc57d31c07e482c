"""bench.otlp_receiver: the SDK's real OTLP/gRPC exporter talks to it; the file mode, reading the file back, the
trace tree and ``--show``."""

import io
import json
import subprocess
import sys
import time

import pytest
from opentelemetry.trace import SpanKind

from astrolabe.tracing import TracingConfig, setup_tracing
from bench import otlp_receiver
from bench.otlp_receiver import (
    OtlpReceiver,
    ReceivedSpan,
    format_trace,
    format_trace_list,
    read_spans,
    select_trace,
)
from astrolabe.procs import ProcessGroup, free_port


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


def test_start_process_returns_a_listening_receiver(tmp_path):
    with ProcessGroup() as procs:
        endpoint = otlp_receiver.start_process(procs, tmp_path / "spans.jsonl", tmp_path / "receiver.log")
        _export(endpoint)
        deadline = time.monotonic() + 10
        while len(read_spans(tmp_path / "spans.jsonl")) < 2:
            assert time.monotonic() < deadline, "spans never written"
            time.sleep(0.05)


def test_read_spans_gives_back_what_was_received(tmp_path):
    with OtlpReceiver() as receiver:
        _export(receiver.endpoint)
        spans = receiver.wait_for(lambda s: len(s) == 2, timeout_s=10)
    out = io.StringIO()
    otlp_receiver._json_lines_sink(out)(spans)
    path = tmp_path / "spans.jsonl"
    path.write_text(out.getvalue() + "\n")  # a blank line is skipped
    assert read_spans(path) == spans


@pytest.mark.parametrize("line", ["not json", "{}", '{"trace_id": "a", "bogus": 1}'],
                         ids=["not-json", "missing-keys", "unknown-key"])
def test_read_spans_names_the_bad_line(tmp_path, line):
    path = tmp_path / "spans.jsonl"
    path.write_text(json.dumps(_span("a", "1", "", "ok").as_dict()) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=r"spans.jsonl:2: not a span record"):
        read_spans(path)


def _span(trace_id, span_id, parent, name, start_ms=0.0, attributes=None, events=(), status="UNSET"):
    return ReceivedSpan(trace_id * 32, span_id * 16, parent * 16 if parent else "", name, "INTERNAL", "svc",
                        int(start_ms * 1e6), int((start_ms + 1) * 1e6), attributes or {}, tuple(events), (), status)


def test_the_tree_with_attributes_shows_status_attributes_and_events():
    spans = [_span("a", "1", "", "route", attributes={"astrolabe.basis": "prediction", "ok": True, "s": 0.012345},
                   events=[("astrolabe.candidate", {"astrolabe.candidate.endpoint": "h:1", "astrolabe.candidate.chosen":
                                                    False, "other": [1, 2]})]),
             _span("a", "2", "1", "predict", 0.5, status="ERROR")]
    lines = format_trace(spans, with_attributes=True).splitlines()
    assert lines[1].endswith("svc: route (INTERNAL)")
    assert lines[2].strip() == "astrolabe.basis=prediction ok=true s=0.01235"
    assert lines[3].strip() == "event astrolabe.candidate: endpoint=h:1 chosen=false other=[1,2]"
    assert lines[4].endswith("  svc: predict (INTERNAL)") and lines[5].strip() == "status=ERROR"
    assert format_trace(spans).splitlines() == [lines[0], lines[1], lines[4]]  # the tree alone by default
    wrapped = format_trace([_span("a", "1", "", "r", attributes={f"k{i}": "v" * 20 for i in range(10)})],
                           with_attributes=True, width=80).splitlines()
    assert len(wrapped) > 3 and all(len(line) <= 80 and line.startswith(" " * 22) for line in wrapped[2:])


TRACES = [_span("a", "1", "", "small"), _span("b", "2", "", "big", attributes={"astrolabe.request_id": "r-1"}),
          _span("b", "3", "2", "child"), _span("c", "4", "", "other"), _span("a", "5", "1", "second")]


@pytest.mark.parametrize(("kwargs", "names"),
                         [({}, ["small", "second"]), ({"trace_id": "bb"}, ["big", "child"]),
                          ({"trace_id": "C"}, ["other"]), ({"request_id": "r-1"}, ["big", "child"])],
                         ids=["most-spans-first-arrived", "trace-id-prefix", "trace-id-any-case", "request-id"])
def test_select_trace(kwargs, names):
    assert [s.name for s in select_trace(TRACES, **kwargs)] == names


@pytest.mark.parametrize("kwargs", [{"trace_id": "d"}, {"trace_id": ""}, {"request_id": "nope"}],
                         ids=["no-such-trace", "ambiguous-prefix", "no-such-request"])
def test_select_trace_raises_when_nothing_or_several_match(kwargs):
    with pytest.raises(LookupError):
        select_trace(TRACES, **kwargs)
    with pytest.raises(LookupError, match="no spans"):
        select_trace([])


def test_trace_list_has_a_line_per_trace_in_arrival_order():
    lines = format_trace_list(TRACES).splitlines()
    assert [line.split()[:2] for line in lines[1:]] == [["a" * 32, "2"], ["b" * 32, "2"], ["c" * 32, "1"]]
    assert lines[2].endswith("svc: big; r-1") and lines[1].endswith("svc: small; -")


def test_show_prints_a_trace_or_the_list_and_exits_2_on_nothing_to_show(tmp_path, capsys):
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(s.as_dict()) + "\n" for s in TRACES))
    assert otlp_receiver.main(["--show", str(path), "--request-id", "r-1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].endswith("svc: big (INTERNAL)") and "astrolabe.request_id=r-1" in out[2]
    assert otlp_receiver.main(["--show", str(path), "--trace-id", "bb", "--no-attributes"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert otlp_receiver.main(["--show", str(path), "--list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4
    assert otlp_receiver.main(["--show", str(path), "--trace-id", "d"]) == 2
    assert "0 traces have an id starting with 'd'" in capsys.readouterr().err
    assert otlp_receiver.main(["--show", str(tmp_path / "none.jsonl")]) == 2
    with pytest.raises(SystemExit):  # receive or show: one of them
        otlp_receiver.main([])
