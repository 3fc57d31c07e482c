"""A request's priority written into its body, for engines that schedule by priority.

vLLM started with ``--scheduling-policy priority`` orders its waiting queue by each request's ``priority`` field
(an integer, default 0, lower = handled earlier; vllm/entrypoints/openai/protocol.py, the ``priority`` field of the
completion and chat requests) and preempts the running request with the largest (priority, arrival); with the
default ``fcfs`` policy it answers 400 to a nonzero one. With ``objectives.engine_priority`` on
(``extproc/config.py``) the extproc writes each routed request's priority there (``Router.engine_priority_of``: its
objective's priority, negated), replacing whatever the client sent: a client must not pick its own place in the
engine's queue any more than its own objective.

Only the OpenAI routes (`PRIORITY_PATHS`) are rewritten; SGLang's ``/generate`` and other paths are left alone, and
so is a compressed body (``content-encoding`` other than identity: the engine would not read it either; counted).
The rewrite keeps the client's bytes where it can: a body that names no ``priority`` key gets the field appended
before its closing brace; one that does (or that escapes a key with ``\\u``, which could spell it) is parsed and
written again with the field replaced (``json``; key order kept, non-ASCII kept as is).
"""

from __future__ import annotations

import json

from extproc.request import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH

PRIORITY_FIELD = "priority"
PRIORITY_PATHS = frozenset({COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH})
"""The routes whose body gets the priority: vLLM's OpenAI completion and chat routes."""
_WHITESPACE = b" \t\r\n"  # JSON's insignificant whitespace (RFC 8259 section 2)


def body_with_priority(body: bytes, priority: int) -> bytes:
    """``body`` (a JSON object, UTF-8, identity encoding: what ``extproc.request.parse_body`` accepted) with its
    ``priority`` field set to ``priority``.

    Raises:
        ValueError: ``body`` is not a JSON object (a body `parse_body` refused never gets here).
    """
    if b'"priority"' in body or b"\\u" in body:
        parsed = json.loads(body)
        if not isinstance(parsed, dict):
            raise ValueError("the request body is not a JSON object")
        parsed[PRIORITY_FIELD] = priority
        return json.dumps(parsed, ensure_ascii=False, separators=(",", ":")).encode()
    end = len(body.rstrip(_WHITESPACE))
    start = len(body) - len(body.lstrip(_WHITESPACE))
    if end - start < 2 or body[start] != ord("{") or body[end - 1] != ord("}"):
        raise ValueError("the request body is not a JSON object")
    empty = not body[start + 1:end - 1].strip(_WHITESPACE)
    field = b'"priority":%d' % priority
    return body[:end - 1] + (field if empty else b"," + field) + body[end - 1:]
