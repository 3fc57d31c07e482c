"""astrolabe.logs: the JSON and text lines, the request context per task, the level and format flags."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import os

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from astrolabe import logs

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
SPAN_ID = "b7ad6b7169203331"


@pytest.fixture
def captured():
    """A logger of its own writing through `build_handler` to a buffer: (logger, buffer, set_format)."""
    buffer = io.StringIO()
    logger = logging.getLogger("tests.logs.captured")
    logger.propagate, logger.level = False, logging.DEBUG

    def set_format(log_format: str) -> None:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.addHandler(logs.build_handler(log_format, buffer))

    set_format("json")
    yield logger, buffer, set_format
    for handler in list(logger.handlers):
        logger.removeHandler(handler)


def _lines(buffer: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def _remote_span() -> NonRecordingSpan:
    return NonRecordingSpan(SpanContext(int(TRACE_ID, 16), int(SPAN_ID, 16), is_remote=True,
                                        trace_flags=TraceFlags(TraceFlags.SAMPLED)))


def test_a_json_line_has_time_level_logger_message_and_nothing_unknown(captured):
    logger, buffer, _ = captured
    logger.info("routed %s to %s", "abc", "10.0.0.5:8000")
    (line,) = _lines(buffer)
    assert set(line) == {"time", "level", "logger", "message"}
    assert (line["level"], line["logger"], line["message"]) == ("INFO", "tests.logs.captured", "routed abc to 10.0.0.5:8000")
    assert line["time"].endswith("Z") and len(line["time"]) == len("2026-12-01T12:58:45.123Z")


def test_a_json_line_carries_the_bound_request_and_the_current_span(captured):
    logger, buffer, _ = captured
    with logs.request_context("req-1"):
        logger.warning("bound only")
        with trace.use_span(_remote_span()):
            logger.warning("inside a span")
    logger.warning("after")
    bound, in_span, after = _lines(buffer)
    assert bound["request_id"] == "req-1" and "trace_id" not in bound
    assert (in_span["request_id"], in_span["trace_id"], in_span["span_id"]) == ("req-1", TRACE_ID, SPAN_ID)
    assert "request_id" not in after


def test_the_current_span_wins_over_the_bound_trace_id(captured):
    logger, buffer, _ = captured
    other = "1" * 32
    with logs.request_context("req-1", other):
        logger.info("outside the span")
        with trace.use_span(_remote_span()):
            logger.info("inside the span")
    outside, inside = _lines(buffer)
    assert outside["trace_id"] == other and "span_id" not in outside
    assert inside["trace_id"] == TRACE_ID


def test_an_exception_is_one_json_line_with_its_traceback(captured):
    logger, buffer, _ = captured
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        logger.exception("failed")
    (line,) = _lines(buffer)
    assert line["message"] == "failed" and "ValueError: boom" in line["exception"]
    assert buffer.getvalue().count("\n") == 1


def test_a_text_line_names_the_request_only_when_known(captured):
    logger, buffer, set_format = captured
    set_format("text")
    logger.info("plain")
    with logs.request_context("req-1", TRACE_ID):
        logger.info("about a request")
    plain, about = buffer.getvalue().splitlines()
    assert plain.endswith(" INFO tests.logs.captured: plain")
    assert about.endswith(f" INFO tests.logs.captured [request_id=req-1 trace_id={TRACE_ID}]: about a request")


def test_a_worker_process_names_itself_on_every_line(captured):
    logger, buffer, set_format = captured
    logs.set_worker(3)
    try:
        logger.info("json")
        set_format("text")
        with logs.request_context("req-1"):
            logger.info("text")
    finally:
        logs.set_worker(None)
    logger.info("not a worker")
    json_line, text_line, after = buffer.getvalue().splitlines()
    assert (json.loads(json_line)["worker"], json.loads(json_line)["pid"]) == (3, os.getpid())
    assert text_line.endswith(f" INFO tests.logs.captured [worker=3 pid={os.getpid()} request_id=req-1]: text")
    assert after.endswith(" INFO tests.logs.captured: not a worker")


async def test_each_task_has_its_own_request_and_tasks_it_starts_inherit_it(captured):
    logger, buffer, _ = captured

    async def handle(request_id: str) -> None:
        logs.bind_request(request_id)
        await asyncio.sleep(0)  # the other request binds in between
        logger.info("handling")
        await asyncio.gather(asyncio.create_task(child()))

    async def child() -> None:
        logger.info("child")

    await asyncio.gather(handle("a"), handle("b"))
    by_message = sorted((line["message"], line["request_id"]) for line in _lines(buffer))
    assert by_message == [("child", "a"), ("child", "b"), ("handling", "a"), ("handling", "b")]
    assert logs.current_request() is None  # gather ran each handler in a task of its own


def test_request_context_restores_the_previous_one():
    with logs.request_context("outer"):
        with logs.request_context("inner", TRACE_ID):
            assert logs.current_request() == logs.RequestContext("inner", TRACE_ID)
        assert logs.current_request() == logs.RequestContext("outer", None)
    assert logs.current_request() is None


@pytest.mark.parametrize(("argv", "expected"), [
    ([], ("INFO", "text")),
    (["--log-level", "debug", "--log-format", "json"], ("DEBUG", "json")),
    (["--log-level", "Warning"], ("WARNING", "text")),
], ids=["defaults", "both", "any-case"])
def test_the_flags(argv, expected):
    parser = argparse.ArgumentParser()
    logs.add_arguments(parser)
    args = parser.parse_args(argv)
    assert (args.log_level, args.log_format) == expected


@pytest.mark.parametrize("argv", [["--log-level", "verbose"], ["--log-format", "xml"]], ids=["level", "format"])
def test_the_flags_reject_unknown_values(argv):
    parser = argparse.ArgumentParser()
    logs.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)


def test_unset_flags_say_what_decides():
    parser = argparse.ArgumentParser()
    logs.add_arguments(parser, None, None, unset="the config's {key} ({default})")
    assert parser.parse_args([]).log_level is None
    help_text = " ".join(parser.format_help().split())
    assert "default: the config's log_level (INFO)" in help_text
    assert "default: the config's log_format (text)" in help_text


@contextlib.contextmanager
def _bare_root():
    """The root logger without handlers, as in a fresh process (pytest adds its own to each test phase, so this
    runs inside the test), restored afterwards."""
    root = logging.getLogger()
    saved, level, installed = list(root.handlers), root.level, logs._installed
    for handler in saved:
        root.removeHandler(handler)
    logs._installed = None
    try:
        yield root
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved:
            root.addHandler(handler)
        root.setLevel(level)
        logs._installed = installed


def test_setup_logging_sets_the_level_and_a_second_call_replaces_its_handler():
    first, second = io.StringIO(), io.StringIO()
    with _bare_root() as root:
        logs.setup_logging("warning", "text", first)
        logging.getLogger("tests.logs.root").info("dropped")
        logging.getLogger("tests.logs.root").warning("kept")
        logs.setup_logging("DEBUG", "json", second)
        logging.getLogger("tests.logs.root").debug("now json")
        assert len(root.handlers) == 1 and root.level == logging.DEBUG
    assert "dropped" not in first.getvalue() and "kept" in first.getvalue()
    assert json.loads(second.getvalue())["message"] == "now json"


def test_setup_logging_leaves_a_root_logger_that_something_else_configured():
    foreign = logging.StreamHandler(io.StringIO())
    with _bare_root() as root:
        root.addHandler(foreign)
        logs.setup_logging("DEBUG", "json", io.StringIO())
        assert root.handlers == [foreign] and root.level != logging.DEBUG


@pytest.mark.parametrize(("level", "log_format"), [("loud", "text"), ("INFO", "xml")], ids=["level", "format"])
def test_setup_logging_rejects_unknown_values(level, log_format):
    with _bare_root() as root, pytest.raises(ValueError):
        try:
            logs.setup_logging(level, log_format)
        finally:
            assert root.handlers == []
