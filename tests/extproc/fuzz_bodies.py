"""Hypothesis strategies for OpenAI request bodies as a hostile client sends them, and the checks shared by the
fuzz tests (``test_fuzz_request.py``, ``test_fuzz_stream.py``), the long run (``python -m tests.extproc.fuzz``)
and the atheris harness (``fuzz_atheris.py``). Not a test module (pytest does not collect it).

Bodies are built in three layers:
1. a JSON object whose every field the extproc reads (``model``, ``prompt``, ``messages``, ``max_tokens``,
   ``max_completion_tokens``, ``stream``) or passes on (``n``, ``stream_options``, ``temperature``, ``tools``,
   tool calls, content parts ...) is either well typed or any JSON value;
2. serialised, then mutated as bytes: raw literals that ``json.dumps`` never writes (``1e400``, an int of 5000
   digits, ``NaN``), nesting 100 000 deep, duplicated keys, invalid UTF-8, a BOM, truncation;
3. compressed per a ``content-encoding`` chain, honestly or not (wrong label, corrupted or truncated data, bombs).
"""

from __future__ import annotations

import json
import os
import zlib

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from extproc.request import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH

FUZZ_EXAMPLES_ENV = "ASTROLABE_FUZZ_EXAMPLES"
"""Environment variable: Hypothesis ``max_examples`` for every fuzz property (default: each test's modest count,
which keeps ``make test`` short)."""


def fuzz_settings(default_examples: int, **kwargs) -> settings:
    """Settings of one fuzz property: ``default_examples`` unless `FUZZ_EXAMPLES_ENV` is set; no deadline (no
    timing asserts); the size health checks off (bodies are large on purpose)."""
    return settings(max_examples=int(os.environ.get(FUZZ_EXAMPLES_ENV) or default_examples), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example], **kwargs)


PATHS = [COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH, "/v1/embeddings", "/v1/completions?stream=1",
         "/v1/%63hat/completions", "/v1/models", "", "/", "/v1/chat/completions/", "%zz"]

# Literals json.dumps never writes; each replaces a whole JSON value.
RAW_LITERALS = [b"1e400", b"-1e400", b"1" + b"0" * 5000, b"-" + b"9" * 4301, b"9" * 4299, b"NaN", b"Infinity",
                b"-Infinity", b"1E+999999999", b"1e-999999", b"-0", b"4.0", b"4.5", b"1e3", b"18446744073709551616",
                b"-9223372036854775809", b"0" * 3 + b"1", b"1.", b".5", b"+1", b"0x10", b"true", b"null",
                b'"\\ud800"', b'"\\udfff\\ud800"', b'"\\u0000"', b'"\xff\xfe"', b'"\xed\xa0\x80"', b'"\xc0\x80"']
NESTING_DEPTHS = [2, 100, 998, 999, 1000, 1001, 5000, 100_000]
INVALID_UTF8 = [b"\xff", b"\xfe", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xe2\x82"]

CODINGS = ["identity", "gzip", "x-gzip", "deflate"]
WRONG_CODINGS = ["br", "compress", "zstd", "gzip;q=1", "GZIP ", "chunked", "\x00", "gzip gzip", "*"]

_SPECIAL_STRINGS = ["", "m", "user", "assistant", "system", "tool", "text", "image_url", "\ud800", "a\udfff",
                    "\x00", "\u2028", "é", "💡", "x" * 300]
strings = st.one_of(st.text(max_size=12), st.sampled_from(_SPECIAL_STRINGS))
_BIG_INTS = [-1, 0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 63, 2 ** 64, 2 ** 70, -(2 ** 63), 10 ** 100]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.sampled_from(_BIG_INTS),
                    st.floats(allow_nan=True, allow_infinity=True), strings)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(strings, inner, max_size=4), max_leaves=10)
"""Any JSON value (floats include NaN and +-inf, which Python's json writes and reads)."""


def typed_or_any(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly the well-typed value, sometimes any JSON value (a wrong type)."""
    return st.one_of(strategy, strategy, json_values)


counts = st.one_of(st.integers(-3, 2 ** 40), st.sampled_from(_BIG_INTS),
                   st.sampled_from([4.0, 4.5, -1.0, "4", " 4", "4.0", "1e3", "x", True, False, [4], {"n": 4}]))
token_ids = st.one_of(st.integers(0, 200_000), st.integers(-5, -1), st.sampled_from(_BIG_INTS),
                      st.sampled_from([True, 1.0, "1", None]))
prompts = st.one_of(strings, st.lists(strings, max_size=4), st.lists(token_ids, max_size=8),
                    st.lists(st.lists(token_ids, max_size=4), max_size=3), json_values)
content_parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": typed_or_any(strings)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": strings})}),
    st.fixed_dictionaries({"type": st.just("input_audio"),
                           "input_audio": st.fixed_dictionaries({"data": strings, "format": strings})}),
    st.fixed_dictionaries({}, optional={"type": json_values, "text": json_values}),
    json_values,
)
tool_calls = st.lists(st.fixed_dictionaries(
    {"id": typed_or_any(strings), "type": typed_or_any(st.just("function")),
     "function": typed_or_any(st.fixed_dictionaries({"name": typed_or_any(strings),
                                                     "arguments": typed_or_any(strings)}))}), max_size=2)
messages = st.lists(st.fixed_dictionaries(
    {}, optional={"role": typed_or_any(st.sampled_from(["system", "user", "assistant", "tool", "developer"])),
                  "content": typed_or_any(st.one_of(st.none(), strings, st.lists(content_parts, max_size=3))),
                  "tool_calls": typed_or_any(tool_calls), "tool_call_id": typed_or_any(strings),
                  "name": typed_or_any(strings)}) | json_values, max_size=4)
_FIELDS = {
    "model": typed_or_any(strings),
    "prompt": prompts,
    "messages": typed_or_any(messages),
    "max_tokens": counts,
    "max_completion_tokens": counts,
    "n": typed_or_any(st.integers(-1, 5)),
    "stream": typed_or_any(st.booleans()),
    "stream_options": typed_or_any(st.fixed_dictionaries({}, optional={"include_usage": json_values})),
    "temperature": typed_or_any(st.floats(allow_nan=True, allow_infinity=True)),
    "top_p": json_values,
    "seed": typed_or_any(st.integers()),
    "stop": typed_or_any(st.lists(strings, max_size=3)),
    "tools": typed_or_any(st.lists(st.fixed_dictionaries({"type": st.just("function"),
                                                          "function": json_values}), max_size=2)),
    "tool_choice": json_values,
    "logprobs": json_values,
    "response_format": json_values,
}
body_objects = st.fixed_dictionaries({}, optional=_FIELDS)
"""An OpenAI-style request object: any subset of the fields, each well typed or not."""


@st.composite
def json_bodies(draw) -> bytes:
    """Serialised `body_objects` (or any JSON value), with raw literals spliced into field positions and
    byte-level damage."""
    obj = draw(st.one_of(body_objects, body_objects, body_objects, json_values))
    raws: list[bytes] = []
    if isinstance(obj, dict) and draw(st.booleans()):
        # Put a raw literal or a deep nest where a field's value would be.
        for key in draw(st.lists(st.sampled_from(sorted(_FIELDS)), max_size=3, unique=True)):
            if draw(st.booleans()):
                raw = draw(st.sampled_from(RAW_LITERALS))
            else:
                depth = draw(st.sampled_from(NESTING_DEPTHS))
                raw = b"[" * depth + b"]" * depth if draw(st.booleans()) else b'{"a":' * depth + b"1" + b"}" * depth
            if key in ("prompt", "messages") and draw(st.booleans()):
                raw = b"[" + raw + b"]"  # inside the list the parser walks
            obj[key] = f"__RAW{len(raws)}__"
            raws.append(raw)
    text = json.dumps(obj, allow_nan=True, ensure_ascii=draw(st.booleans()))
    data = text.encode("utf-8", "surrogatepass")  # a lone surrogate becomes invalid UTF-8 (CESU-8)
    for i, raw in enumerate(raws):
        data = data.replace(f'"__RAW{i}__"'.encode(), raw, 1)
    for _ in range(draw(st.integers(0, 2))):
        data = draw(_damaged(data))
    return data


@st.composite
def _damaged(draw, data: bytes) -> bytes:
    where = draw(st.integers(0, len(data)))
    damage = draw(st.sampled_from(["truncate", "invalid-utf8", "flip", "bom", "duplicate-key", "whitespace"]))
    if damage == "truncate":
        return data[:where]
    if damage == "invalid-utf8":
        return data[:where] + draw(st.sampled_from(INVALID_UTF8)) + data[where:]
    if damage == "flip" and data:
        where = min(where, len(data) - 1)
        return data[:where] + bytes([data[where] ^ (1 << draw(st.integers(0, 7)))]) + data[where + 1:]
    if damage == "bom":
        return draw(st.sampled_from([b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff"])) + data
    if damage == "duplicate-key" and data.endswith(b"}") and len(data) > 2:
        key = draw(st.sampled_from(sorted(_FIELDS))).encode()
        return data[:-1] + b', "' + key + b'": ' + draw(st.sampled_from(RAW_LITERALS)) + b"}"
    return data[:where] + draw(st.sampled_from([b" ", b"\n", b"\t", b"\r\n", b"\x00", b"\x0c"])) + data[where:]


any_bodies = st.one_of(json_bodies(), json_bodies(), st.binary(max_size=64))
"""Everything a client may send as a body."""


def encode(data: bytes, codings: list[str]) -> bytes:
    """``data`` compressed by each content-coding in ``codings``, in order (as a client applies them)."""
    for coding in codings:
        if coding in ("gzip", "x-gzip"):
            compressor = zlib.compressobj(wbits=zlib.MAX_WBITS | 16)
            data = compressor.compress(data) + compressor.flush()
        elif coding == "deflate":
            data = zlib.compress(data)
    return data


@st.composite
def encoded_bodies(draw, bodies: st.SearchStrategy = any_bodies) -> tuple[bytes, str | None]:
    """``(body as sent, content-encoding header or None)``: compressed honestly, mislabelled, corrupted,
    truncated, multi-member, or with trailing bytes."""
    data = draw(bodies)
    codings = draw(st.lists(st.sampled_from(CODINGS), max_size=3))
    how = draw(st.sampled_from(["honest", "honest", "honest", "unlabelled", "wrong-label", "corrupt", "truncate",
                                "trailing", "members", "unsupported"]))
    label = list(codings)
    if how == "unlabelled":
        label = []
    elif how == "wrong-label":
        label = draw(st.lists(st.sampled_from(CODINGS), min_size=1, max_size=3))
    elif how == "unsupported":
        label = [*codings, draw(st.sampled_from(WRONG_CODINGS))]
    sent = encode(data, codings)
    if how == "members" and codings and codings[-1] in ("gzip", "x-gzip"):
        inner = encode(data, codings[:-1])  # RFC 1952 2.2: a gzip file is a series of members
        cut = draw(st.integers(0, len(inner)))
        sent = encode(inner[:cut], codings[-1:]) + encode(inner[cut:], codings[-1:])
    elif how == "corrupt" and sent:
        where = draw(st.integers(0, len(sent) - 1))
        sent = sent[:where] + bytes([sent[where] ^ 0xFF]) + sent[where + 1:]
    elif how == "truncate":
        sent = sent[:draw(st.integers(0, len(sent)))]
    elif how == "trailing":
        sent += draw(st.sampled_from([b"\x00", b"garbage", b"\x1f\x8b", b"\n"]))
    if not label and draw(st.booleans()):
        return sent, None
    separator = draw(st.sampled_from([", ", ",", " , ", ",,"]))
    header = separator.join(c if draw(st.booleans()) else c.upper() for c in label)
    return sent, header


# Well-typed bodies, each with what parse_body must read from it.
_texts = st.text(max_size=30)  # Hypothesis' text has no lone surrogates
_counts = st.one_of(st.none(), st.integers(0, 2 ** 40))
_ids = st.lists(st.integers(0, 2 ** 32), min_size=1, max_size=6)
_prompts = st.one_of(
    _texts.map(lambda t: (t, t, None)),
    st.lists(_texts, min_size=1, max_size=4).map(lambda ts: (ts, "\n".join(ts), None)),
    _ids.map(lambda ids: (ids, None, tuple(ids))),
    st.lists(_ids, min_size=1, max_size=3).map(lambda ls: (ls, None, tuple(i for ids in ls for i in ids))),
)
_parts = st.lists(st.one_of(
    _texts.map(lambda t: ({"type": "text", "text": t}, t)),
    st.just(({"type": "image_url", "image_url": {"url": "data:,"}}, None)),
), max_size=3)
_contents = st.one_of(st.none().map(lambda _: (None, "")), _texts.map(lambda t: (t, t)),
                      _parts.map(lambda ps: ([p for p, _ in ps], "\n".join(t for _, t in ps if t is not None))))
_messages = st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]), _contents),
                     min_size=1, max_size=4)


@st.composite
def well_typed_requests(draw) -> tuple[str, dict, dict]:
    """``(path, body object, the RoutingRequest fields parse_body must read from it)``: a well-typed completions
    or chat body (the oracle of the module docstring of ``extproc.request``)."""
    common = {"model": draw(st.one_of(st.none(), _texts)), "stream": draw(st.one_of(st.none(), st.booleans()))}
    body = {k: v for k, v in common.items() if v is not None or draw(st.booleans())}
    expected = {"model": common["model"], "stream": bool(common["stream"])}
    if draw(st.booleans()):
        prompt, text, ids = draw(_prompts)
        max_tokens = draw(_counts)
        body.update(prompt=prompt, **({"max_tokens": max_tokens} if max_tokens is not None else {}))
        expected.update(prompt_text=text, prompt_token_ids=ids, max_tokens=max_tokens)
        return COMPLETIONS_PATH, body, expected
    messages = draw(_messages)
    max_tokens, max_completion_tokens = draw(_counts), draw(_counts)
    body["messages"] = [{"role": role, "content": content} for role, (content, _) in messages]
    body.update({k: v for k, v in (("max_tokens", max_tokens), ("max_completion_tokens", max_completion_tokens))
                 if v is not None})
    users = [text for role, (_, text) in messages if role == "user"]
    expected.update(prompt_text="\n".join(text for _, (_, text) in messages), prompt_token_ids=None,
                    max_tokens=max_completion_tokens if max_completion_tokens is not None else max_tokens,
                    last_user_message=users[-1] if users else None,
                    chat_messages=tuple((role, text) for role, (_, text) in messages))
    return CHAT_COMPLETIONS_PATH, body, expected


def assert_openai_error(status: int, body: bytes) -> dict:
    """Checks that ``body`` is the extproc's OpenAI-style error for HTTP ``status`` (``extproc.errors``) and
    returns its ``error`` object.

    Raises:
        AssertionError: a field is missing or of the wrong type, or ``code`` is not ``status``.
    """
    assert 400 <= status <= 599, status
    payload = json.loads(body)  # UTF-8 JSON
    assert set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"].endswith("Error"), error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] == status, error
    return error
