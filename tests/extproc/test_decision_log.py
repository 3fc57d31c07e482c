"""extproc.decision_log: one JSON record per decision, flushed, and never a failure on the request path."""

import dataclasses
import json

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext

from astrolabe.logs import request_context
from extproc.decision import Decision
from extproc.decision_log import DecisionLog
from extproc.policies.base import Prediction
from extproc.request import RoutingRequest

REQUEST = RoutingRequest("abc", "POST", "/v1/completions")
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
SPAN_ID = "b7ad6b7169203331"
DECISION = Decision("10.0.0.1:80", "astrolabe", "abc/123", "10.0.1.1:90", "prediction",
                    (("10.0.0.1:80", Prediction(0.03, 2.9, 0.01)), ("10.0.0.2:80", None)), 291, 180, 1, 0.002,
                    (("tokens", 0.0002), ("length", 0.0003), ("predict", 0.0012)))


def test_record_format(tmp_path):
    log = DecisionLog(tmp_path / "sub" / "d.jsonl")
    log.write(REQUEST, DECISION)
    log.close()
    log.close()  # idempotent
    (record,) = [json.loads(line) for line in (tmp_path / "sub" / "d.jsonl").read_text().splitlines()]
    assert record["request_id"] == "abc" and record["admit_id"] == "abc/123" and record["basis"] == "prediction"
    assert record["candidates"] == [
        {"endpoint": "10.0.0.1:80", "ttft_s": 0.03, "e2e_s": 2.9, "state_age_s": 0.01, "queue_s": 0.0,
         "prefix_blocks_cached": None},
        {"endpoint": "10.0.0.2:80", "ttft_s": None, "e2e_s": None, "state_age_s": None, "queue_s": None,
         "prefix_blocks_cached": None}]
    assert record["num_prompt_blocks"] is None
    assert record["stage_s"] == {"tokens": 0.0002, "length": 0.0003, "predict": 0.0012}
    assert (record["num_prompt_tokens"], record["num_predicted_output_tokens"], record["length_source"]) == (291, 180, 1)


def test_record_shows_the_prompts_blocks_and_what_each_candidate_caches(tmp_path):
    log = DecisionLog(tmp_path / "d.jsonl")
    log.write(REQUEST, dataclasses.replace(DECISION, prefix_blocks_cached=(16, 0), num_prompt_blocks=18))
    log.close()
    (record,) = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert record["num_prompt_blocks"] == 18
    assert [c["prefix_blocks_cached"] for c in record["candidates"]] == [16, 0]


def _record(tmp_path, request=REQUEST, decision=DECISION) -> dict:
    (tmp_path / "d.jsonl").unlink(missing_ok=True)
    log = DecisionLog(tmp_path / "d.jsonl")
    log.write(request, decision)
    log.close()
    (record,) = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    return record


def test_a_record_without_tracing_has_null_trace_ids_and_the_requests_model(tmp_path):
    request = RoutingRequest("abc", "POST", "/v1/completions", model="m" * 1000, max_tokens=64)
    record = _record(tmp_path, request, dataclasses.replace(DECISION, basis="fallback",
                                                            fallback_reason="no_prediction"))
    assert record["trace_id"] is None and record["span_id"] is None
    assert record["model"] == "m" * 253 + "..." and record["max_tokens"] == 64  # cut as the span's attribute
    assert (record["basis"], record["fallback_reason"]) == ("fallback", "no_prediction")


def test_a_record_names_the_span_current_when_it_is_written(tmp_path):
    span = NonRecordingSpan(SpanContext(int(TRACE_ID, 16), int(SPAN_ID, 16), is_remote=False))
    with trace.use_span(span):
        record = _record(tmp_path)
    assert (record["trace_id"], record["span_id"]) == (TRACE_ID, SPAN_ID)
    with request_context("abc", TRACE_ID):  # outside the span: the trace bound to the request's log lines
        record = _record(tmp_path)
    assert (record["trace_id"], record["span_id"]) == (TRACE_ID, None)


def test_records_are_flushed_within_the_interval(tmp_path):
    now = [0.0]
    log = DecisionLog(tmp_path / "d.jsonl", flush_interval_s=1.0, clock=lambda: now[0])
    log.write(REQUEST, DECISION)
    now[0] = 2.0
    log.write(REQUEST, DECISION)  # past the interval: both lines reach the file without close()
    assert len((tmp_path / "d.jsonl").read_text().splitlines()) == 2
    log.close()


def test_a_write_error_turns_the_log_off_without_raising(tmp_path):
    log = DecisionLog(tmp_path / "d.jsonl")
    log._file.close()  # the file went away under us: writes fail with ValueError
    log.write(REQUEST, DECISION)
    log.flush()
    log.write(REQUEST, DECISION)
    log.flush()
    assert log._file is None


def test_flush_writes_buffered_records_while_traffic_is_quiet(tmp_path):
    log = DecisionLog(tmp_path / "d.jsonl", flush_interval_s=3600.0)
    log.write(REQUEST, DECISION)
    assert (tmp_path / "d.jsonl").read_text() == ""  # buffered
    log.flush()  # the server's timer
    assert len((tmp_path / "d.jsonl").read_text().splitlines()) == 1
    log.close()
    log.flush()  # after close: nothing, no error


def _append_records(path: str, num_records: int) -> None:
    log = DecisionLog(path)  # flushed by size (many times) and at close
    for _ in range(num_records):
        log.write(REQUEST, DECISION)
    log.close()


def test_processes_appending_to_one_file_never_split_a_line(tmp_path):
    """workers > 1: every worker process appends to the same decision log (O_APPEND, whole lines per write)."""
    import multiprocessing

    path = tmp_path / "d.jsonl"
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_append_records, args=(str(path), 2000)) for _ in range(3)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
    assert [w.exitcode for w in writers] == [0, 0, 0]
    records = [json.loads(line) for line in path.read_text().splitlines()]  # a torn line would not parse
    assert len(records) == 6000
    assert sorted({r["pid"] for r in records}) == sorted(w.pid for w in writers)
