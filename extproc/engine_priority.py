"""A request's priority written into its body, for engines that schedule by priority.

vLLM started with ``--scheduling-policy priority`` orders its waiting queue by each request's ``priority`` field
(an integer, default 0, lower = handled earlier; vllm/entrypoints/openai/completion/protocol.py and
chat_completion/protocol.py, the ``priority`` field of their requests; its other generation and pooling routes take
the same field) and preempts the running request with the largest (priority, arrival); with the default ``fcfs``
policy it answers 400 to a nonzero one. With ``objectives.engine_priority`` on (``extproc/config.py``) the extproc
writes each routed request's priority there (``Router.engine_priority_of``: its objective's priority, negated),
replacing whatever the client sent: a client must not pick its own place in the engine's queue any more than its
own objective.

Every routed JSON body is rewritten (`writes_priority`, `identity_encoded`) but SGLang's ``/generate`` (its own priority convention) and a
compressed body (a ``content-encoding`` other than identity: vLLM would not read it either; counted). The rewrite
keeps the client's bytes: a body whose top-level object has no ``priority`` member gets ``"priority":N`` before its
closing brace; one that has (possibly spelled with ``\\u`` escapes, or repeated) loses those members, found by
walking the object's members with the standard library's JSON scanner (``json.decoder.scanstring`` for each key,
``JSONDecoder.raw_decode`` to step over each value), and then gets the field appended. Nothing else of the body is
re-encoded: numbers, escapes, whitespace and the text encoding (UTF-8, a BOM, UTF-16/32 as ``json.loads`` reads
them) stay as sent.
"""

from __future__ import annotations

import json
from json.decoder import scanstring

from extproc.request import GENERATE_PATH, content_codings

PRIORITY_FIELD = "priority"
_WHITESPACE = " \t\r\n"  # JSON's insignificant whitespace (RFC 8259 section 2)
_DECODER = json.JSONDecoder()


def writes_priority(path: str) -> bool:
    """Whether a routed request's body on ``path`` gets its priority written: every path but SGLang's
    ``/generate`` (its own priority convention)."""
    return path != GENERATE_PATH


def identity_encoded(content_encoding: str | None) -> bool:
    """Whether a body of this ``content-encoding`` is sent as is: no header, or a list of ``identity`` codings and
    empty entries (``extproc.request.content_codings``, as ``decode_body`` reads it); a compressed body is not
    rewritten."""
    return all(c == "identity" for c in content_codings(content_encoding))


def body_with_priority(body: bytes, priority: int) -> bytes:
    """``body`` (a JSON object, as ``extproc.request.parse_body`` accepted it, identity encoding) with its top-level
    ``priority`` set to ``priority``: every ``priority`` member the client wrote removed, one appended.

    Raises:
        ValueError: ``body`` is not a JSON object (a body `parse_body` refused never gets here).
    """
    encoding = json.detect_encoding(body)
    text = body.decode(encoding)  # utf-8-sig and utf-16 keep the BOM out of the text and put it back encoding
    if encoding != "utf-8" or '"priority"' in text or "\\u" in text:
        text = _without_priority(text)  # a member may be named priority (escapes can spell it)
    return _appended(text, priority).encode(encoding)


def _appended(text: str, priority: int) -> str:
    """``text`` (a JSON object with no ``priority`` member) with ``"priority":N`` before its closing brace."""
    end = len(text.rstrip(_WHITESPACE))
    start = len(text) - len(text.lstrip(_WHITESPACE))
    if end - start < 2 or text[start] != "{" or text[end - 1] != "}":
        raise ValueError("the request body is not a JSON object")
    empty = not text[start + 1:end - 1].strip(_WHITESPACE)
    field = f'"{PRIORITY_FIELD}":{priority}'
    return text[:end - 1] + (field if empty else "," + field) + text[end - 1:]


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _without_priority(text: str) -> str:
    """``text`` (a JSON object) without its top-level ``priority`` members, the rest byte for byte.

    Raises:
        ValueError: not a JSON object.
    """
    pos = _skip_space(text, 0)
    if not text.startswith("{", pos):
        raise ValueError("the request body is not a JSON object")
    cuts: list[tuple[int, int]] = []  # [start, end) of each priority member with the comma that joins it
    pos = _skip_space(text, pos + 1)
    previous_end = pos  # where the previous member's value ended (just after "{" for the first)
    first = True
    while not text.startswith("}", pos):
        member_start = pos
        if not text.startswith('"', pos):
            raise ValueError("the request body is not a JSON object")
        key, pos = scanstring(text, pos + 1)
        pos = _skip_space(text, pos)
        if not text.startswith(":", pos):
            raise ValueError("the request body is not a JSON object")
        _, pos = _DECODER.raw_decode(text, _skip_space(text, pos + 1))
        value_end = pos
        pos = _skip_space(text, pos)
        if key == PRIORITY_FIELD:
            # the first member takes the comma after it; any other the comma before it
            if first:
                after = _skip_space(text, pos + 1) if text.startswith(",", pos) else pos
                cuts.append((member_start, after))
            else:
                cuts.append((previous_end, value_end))
        else:
            first = False
        previous_end = value_end
        if text.startswith(",", pos):
            pos = _skip_space(text, pos + 1)
        elif not text.startswith("}", pos):
            raise ValueError("the request body is not a JSON object")
    if not cuts:
        return text
    parts, kept = [], 0
    for start, end in cuts:
        parts.append(text[kept:start])
        kept = end
    parts.append(text[kept:])
    return "".join(parts)
