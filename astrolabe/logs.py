"""Logging set-up shared by every service (extproc, predictor sidecar, tagger, emulator) and the other commands.

Owns: the two line formats (`LOG_FORMATS`: ``text`` for people, ``json`` for log pipelines), the ``--log-level``
and ``--log-format`` flags (`add_arguments`), installing one stderr handler on the root logger (`setup_logging`),
and the request context that every line logged while handling a request carries (`bind_request`,
`request_context`). Imports only the standard library and the OpenTelemetry API. Must not import ``extproc``,
``predictor``, ``tagger`` or ``bench``: they import this module.

A JSON line is one object with ``time`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger`` and
``message``, plus, when known: ``request_id``, ``trace_id`` and ``span_id`` (lower-case hex, W3C widths),
``exception`` (the formatted traceback) and ``stack``; in a worker process (`set_worker`: the extproc's
``workers`` > 1) also ``worker`` (its index, 0-based) and ``pid``. A text line is
``<time> <LEVEL> <logger> [worker=.. pid=.. request_id=.. trace_id=..]: <message>``, the bracket only when known.

NOTE: where the request context comes from. The extproc serves many ext_proc streams on one asyncio loop; each
gRPC call runs in a task of its own, and a ``ContextVar`` is per task (asyncio copies the context into each task
it starts, so the Predict fan-out and the fire-and-forget Admit/Release calls of a request inherit its id). A
service binds the request id (and, when it knows it, the trace id) when a request arrives; the handler's
`RequestContextFilter` reads them at each record. The trace id and span id come first from the OpenTelemetry
span current when the line is logged (a sidecar's Predict span, the extproc's request span while it routes),
else from the bound trace id (the extproc's request span outside the routing step). With tracing off there is
no valid span and nothing bound: lines carry the request id only. A thread started without the context (the
tagger's batch worker, the tracing exporter) logs without it.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import datetime
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from opentelemetry import trace

LOG_FORMATS = ("text", "json")
"""Values of ``--log-format`` (and of the extproc's ``log_format`` key)."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""Values of ``--log-level`` (any case on the command line; and of the extproc's ``log_level`` key)."""
DEFAULT_LOG_LEVEL = "INFO"
DEFAULT_LOG_FORMAT = "text"

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(context)s: %(message)s"


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What identifies the request being handled: its ``x-request-id`` and its trace (32 hex digits), or None."""

    request_id: str | None = None
    trace_id: str | None = None


_CURRENT: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("astrolabe_request", default=None)


_WORKER: int | None = None
"""This process's worker index (`set_worker`), or None: not one of several workers."""


def set_worker(index: int | None) -> None:
    """Marks every line this process logs from now on with ``worker=index`` and its pid (None: no mark), so that
    the lines of N worker processes sharing one stderr can be told apart. A process-wide setting: a worker process
    calls it once at start (``extproc.workers``)."""
    global _WORKER
    _WORKER = index


def bind_request(request_id: str | None, trace_id: str | None = None) -> None:
    """Makes ``request_id`` (and ``trace_id``, 32 hex digits) the request context of the current task and of the
    tasks it starts from now on, until the task ends or the next bind.

    For a handler whose task lives as long as its request (a gRPC call); elsewhere use `request_context`.
    """
    _CURRENT.set(RequestContext(request_id, trace_id))


@contextlib.contextmanager
def request_context(request_id: str | None, trace_id: str | None = None) -> Iterator[None]:
    """`bind_request` for the body of a ``with`` statement; the previous context is restored at its end (for a
    handler that shares its task with other requests, e.g. an HTTP keep-alive connection)."""
    token = _CURRENT.set(RequestContext(request_id, trace_id))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_request() -> RequestContext | None:
    """The request context bound in the current task, or None."""
    return _CURRENT.get()


def trace_id_hex(span_context: trace.SpanContext) -> str | None:
    """A span context's trace id as 32 lower-case hex digits, or None for an invalid one (tracing off)."""
    return format(span_context.trace_id, "032x") if span_context.is_valid else None


def current_trace() -> tuple[str | None, str | None]:
    """(trace id, span id) in hex of the span current now, else (the bound trace id, None); (None, None) when
    neither is known (module NOTE)."""
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        return trace_id_hex(span_context), format(span_context.span_id, "016x")
    bound = _CURRENT.get()
    return (bound.trace_id if bound is not None else None), None


class RequestContextFilter(logging.Filter):
    """Adds ``worker`` (`set_worker`), ``request_id``, ``trace_id`` and ``span_id`` (each None when unknown) to
    every record it sees (module NOTE for where they come from); never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = _WORKER
        bound = _CURRENT.get()
        record.request_id = bound.request_id if bound is not None else None
        record.trace_id, record.span_id = current_trace()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (keys in the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": _iso_utc(record.created), "level": record.levelname, "logger": record.name,
                "message": record.getMessage()}
        if getattr(record, "worker", None) is not None:
            line["worker"], line["pid"] = record.worker, record.process
        for key in ("request_id", "trace_id", "span_id"):
            value = getattr(record, key, None)
            if value is not None:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger> [worker=.. pid=.. request_id=.. trace_id=..]: <message>``; the bracket only when
    known."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        worker = getattr(record, "worker", None)
        known = [f"worker={worker}", f"pid={record.process}"] if worker is not None else []
        known += [f"{key}={value}" for key in ("request_id", "trace_id")
                  if (value := getattr(record, key, None)) is not None]
        record.context = f" [{' '.join(known)}]" if known else ""
        return super().format(record)


def _iso_utc(created_s: float) -> str:
    moment = datetime.datetime.fromtimestamp(created_s, tz=datetime.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def build_handler(log_format: str = DEFAULT_LOG_FORMAT, stream: IO[str] | None = None) -> logging.Handler:
    """A handler writing ``log_format`` lines to ``stream`` (default stderr), with the request context filter.

    Raises:
        ValueError: ``log_format`` is not one of `LOG_FORMATS`.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.addFilter(RequestContextFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    return handler


_installed: logging.Handler | None = None
"""The root handler `setup_logging` installed (a second call replaces it)."""


def setup_logging(level: str = DEFAULT_LOG_LEVEL, log_format: str = DEFAULT_LOG_FORMAT,
                  stream: IO[str] | None = None) -> None:
    """Configures the root logger for a command: one handler (`build_handler`) and ``level``.

    A command's entry point calls it once (the extproc twice: from its flags, then from its config). As
    ``logging.basicConfig`` does, it leaves a root logger that something else configured alone (a test runner
    or an application that embeds the command); a handler this function installed is replaced.

    Args:
        level: one of `LOG_LEVELS`, any case.
        log_format: one of `LOG_FORMATS`.
        stream: where lines go; None = stderr.

    Raises:
        ValueError: an unknown level or format.
    """
    global _installed
    name = level.upper()
    if name not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    handler = build_handler(log_format, stream)  # checks the format
    root = logging.getLogger()
    if any(h is not _installed for h in root.handlers):
        return
    if _installed is not None:
        root.removeHandler(_installed)
        _installed.close()
    root.addHandler(handler)
    root.setLevel(name)
    _installed = handler


def add_arguments(parser: argparse.ArgumentParser, level: str | None = DEFAULT_LOG_LEVEL,
                  log_format: str | None = DEFAULT_LOG_FORMAT, unset: str = "") -> None:
    """Adds ``--log-level`` and ``--log-format`` (dests ``log_level``, ``log_format``) to ``parser``.

    Args:
        parser: the command's parser.
        level: the default level; None = unset (the command resolves it, e.g. from its config).
        log_format: the default format; None = unset.
        unset: what an unset flag means, for the help, with ``{key}`` (``log_level`` / ``log_format``) and
            ``{default}`` (`DEFAULT_LOG_LEVEL` / `DEFAULT_LOG_FORMAT`) filled in, e.g.
            ``"the config's {key} ({default})"``; used for a None default only.
    """
    def default(key: str, value: str | None, fallback: str) -> str:
        return f"; default: {unset.format(key=key, default=fallback)}" if value is None else ""

    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=level, metavar="LEVEL",
                        help=f"least severe level logged: {', '.join(LOG_LEVELS)} (any case)"
                             + default("log_level", level, DEFAULT_LOG_LEVEL))
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=log_format,
                        help="text: one line for people; json: one JSON object per line (time, level, logger, "
                             "message, request_id and trace_id while handling a request)"
                             + default("log_format", log_format, DEFAULT_LOG_FORMAT))
