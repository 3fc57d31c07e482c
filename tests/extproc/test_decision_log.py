"""extproc.decision_log: one JSON record per decision, flushed, and never a failure on the request path."""

import json

from extproc.decision import Decision
from extproc.decision_log import DecisionLog
from extproc.policies.base import Prediction
from extproc.request import RoutingRequest

REQUEST = RoutingRequest("abc", "POST", "/v1/completions")
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
        {"endpoint": "10.0.0.1:80", "ttft_s": 0.03, "e2e_s": 2.9, "state_age_s": 0.01, "queue_s": 0.0},
        {"endpoint": "10.0.0.2:80", "ttft_s": None, "e2e_s": None, "state_age_s": None, "queue_s": None}]
    assert record["stage_s"] == {"tokens": 0.0002, "length": 0.0003, "predict": 0.0012}
    assert (record["num_prompt_tokens"], record["num_predicted_output_tokens"], record["length_source"]) == (291, 180, 1)


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
    log.write(REQUEST, DECISION)
    assert log.num_records == 0 and log._file is None


def test_flush_writes_buffered_records_while_traffic_is_quiet(tmp_path):
    log = DecisionLog(tmp_path / "d.jsonl", flush_interval_s=3600.0)
    log.write(REQUEST, DECISION)
    assert (tmp_path / "d.jsonl").read_text() == ""  # buffered
    log.flush()  # the server's timer
    assert len((tmp_path / "d.jsonl").read_text().splitlines()) == 1
    log.close()
    log.flush()  # after close: nothing, no error
