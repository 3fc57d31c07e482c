"""Fuzzing the body parser (``extproc.request.parse_body`` and ``decode_body``) with Hypothesis.

Properties:
- any body, path and ``content-encoding`` (malformed or deeply nested JSON, invalid UTF-8, huge numbers, wrong
  types in every field, content parts, token-id prompts, compressed, mislabelled, corrupted or multi-member
  bodies) is either read into a well-formed ``RoutingRequest`` or refused with ``RoutingError(BAD_REQUEST)``
  and an OpenAI-style JSON body; no other exception escapes;
- a well-typed body is read exactly as the module docstring says (an oracle built beside the generator);
- compressing a body (any chain of gzip / deflate) never changes how it is read;
- a compressed body decodes to at most ``max_decoded_bytes``, and decoding a bomb holds at most a few times that
  in memory (tracemalloc).

Each shrunk failure the fuzzers found is pinned as an explicit case (``test_regressions``).

Longer runs: ``ASTROLABE_FUZZ_EXAMPLES=100000 .venv/bin/pytest -q tests/extproc/test_fuzz_request.py`` raises
every property's ``max_examples``; ``python -m tests.extproc.fuzz --minutes 10`` runs them for a stated time
(``tests/extproc/fuzz.py``); ``tests/extproc/fuzz_atheris.py`` is a coverage-guided harness (atheris).
"""

from __future__ import annotations

import gzip
import json
import tracemalloc
import urllib.parse
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.errors import ErrorCode, RoutingError
from extproc.request import (
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    RoutingRequest,
    decode_body,
    parse_body,
)
from tests.extproc.fuzz_bodies import (
    CODINGS,
    PATHS,
    assert_openai_error,
    encode,
    encoded_bodies,
    fuzz_settings,
    json_bodies,
    well_typed_requests,
)

MAX_DECODED_BYTES = 1 << 20
"""Decoded-body limit of the fuzz properties, bytes (small, so that generated bombs cross it)."""


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_request(request: RoutingRequest, path: str, raw: bytes) -> None:
    """The invariants of every ``RoutingRequest`` that ``parse_body`` returns for ``raw`` sent to ``path``."""
    assert request.num_body_bytes == len(raw)
    assert request.path == urllib.parse.unquote(path.split("?", 1)[0])  # the query string is not routed on
    assert request.model is None or (isinstance(request.model, str) and _utf8(request.model))
    assert type(request.stream) is bool
    assert request.max_tokens is None or (type(request.max_tokens) is int and request.max_tokens >= 0)
    if request.prompt_token_ids is not None:
        assert all(type(i) is int and i >= 0 for i in request.prompt_token_ids)
    if request.prompt_text is not None:
        assert _utf8(request.prompt_text)
    if request.path == COMPLETIONS_PATH:
        assert (request.prompt_text is None) != (request.prompt_token_ids is None)
    elif request.path == CHAT_COMPLETIONS_PATH:
        assert request.prompt_text is not None and request.prompt_token_ids is None
        assert request.chat_messages and all(_utf8(role) and _utf8(text) for role, text in request.chat_messages)
        assert request.prompt_text == "\n".join(text for _, text in request.chat_messages)
    else:
        assert request.prompt_text is None and request.prompt_token_ids is None and request.max_tokens is None


def check_parse(path: str, raw: bytes, content_encoding: str | None,
                max_decoded_bytes: int = MAX_DECODED_BYTES) -> RoutingRequest | None:
    """``parse_body`` either reads ``raw`` into a well-formed request (returned) or refuses it with a 400 and an
    OpenAI-style error (None returned); any other exception propagates (a fuzz failure)."""
    try:
        request = parse_body("fuzz", "POST", path, raw, content_encoding, max_decoded_bytes)
    except RoutingError as error:
        assert error.code is ErrorCode.BAD_REQUEST and error.http_status == 400
        assert_openai_error(error.http_status, error.json_body())
        return None
    check_request(request, path, raw)
    return request


@fuzz_settings(500)
@given(path=st.sampled_from(PATHS), sent=encoded_bodies())
def test_any_body_is_read_or_refused_with_a_400(path, sent):
    raw, content_encoding = sent
    check_parse(path, raw, content_encoding)


@fuzz_settings(200)
@given(case=well_typed_requests(), codings=st.lists(st.sampled_from(CODINGS), max_size=2),
       ensure_ascii=st.booleans())
def test_well_typed_bodies_are_read_as_documented(case, codings, ensure_ascii):
    path, body, expected = case
    raw = encode(json.dumps(body, ensure_ascii=ensure_ascii).encode(), codings)
    request = check_parse(path, raw, ", ".join(codings))
    assert request is not None
    assert {key: getattr(request, key) for key in expected} == expected


@fuzz_settings(200)
@given(path=st.sampled_from(PATHS), data=json_bodies(),
       codings=st.lists(st.sampled_from(CODINGS), min_size=1, max_size=3), split=st.floats(0, 1))
def test_compression_never_changes_the_reading(path, data, codings, split):
    """Also when the outer gzip layer is two members (split at ``split`` of its input; RFC 1952 2.2)."""
    raw = encode(data, codings)
    if codings[-1] in ("gzip", "x-gzip"):
        inner = encode(data, codings[:-1])
        cut = int(split * len(inner))
        raw = encode(inner[:cut], codings[-1:]) + encode(inner[cut:], codings[-1:])

    def reading(body: bytes, encoding: str | None):
        try:
            return parse_body("fuzz", "POST", path, body, encoding, MAX_DECODED_BYTES), None
        except RoutingError as error:
            return None, (error.code, error.message, error.param)

    plain, plain_error = reading(data, None)
    packed, packed_error = reading(raw, ", ".join(codings))
    if _largest_decoded_bytes(data, codings) > MAX_DECODED_BYTES:  # e.g. three fields nested 100 000 deep
        assert packed_error is not None and "decodes to more than" in packed_error[1]
        return
    assert packed_error == plain_error
    if plain is not None:
        assert packed.num_body_bytes == len(raw)
        assert packed == RoutingRequest(**{**_fields(plain), "num_body_bytes": len(raw)})


def _largest_decoded_bytes(data: bytes, codings: list[str]) -> int:
    """The largest output of any decoding step of ``encode(data, codings)``, bytes (identity decodes nothing)."""
    return max((len(encode(data, codings[:i])) for i, c in enumerate(codings) if c != "identity"), default=0)


def _fields(request: RoutingRequest) -> dict:
    return {name: getattr(request, name) for name in RoutingRequest.__slots__}


@fuzz_settings(200)
@given(data=st.binary(max_size=2048) | st.integers(0, 3 * MAX_DECODED_BYTES).map(lambda n: b"\0" * n),
       codings=st.lists(st.sampled_from(CODINGS), max_size=3))
def test_decoding_round_trips_within_the_limit_and_refuses_beyond(data, codings):
    sent = encode(data, codings)
    if any(c != "identity" for c in codings) and len(data) > MAX_DECODED_BYTES:
        with pytest.raises(RoutingError, match="decodes to more than"):
            decode_body(sent, ", ".join(codings), MAX_DECODED_BYTES)
    else:
        assert decode_body(sent, ", ".join(codings), MAX_DECODED_BYTES) == data


@fuzz_settings(200)
@given(data=json_bodies(), codings=st.lists(st.sampled_from(["gzip", "deflate"]), min_size=1, max_size=2),
       truncate=st.booleans(), where=st.floats(0, 1), trailing=st.binary(min_size=1, max_size=8))
def test_truncated_or_trailing_compressed_data_is_refused(data, codings, truncate, where, trailing):
    """Bytes missing from, or following, the outer stream (too few for another gzip member) are a 400: routing
    never reads a body other than the one the backend would decode."""
    sent = encode(data, codings)
    sent = sent[:int(where * (len(sent) - 1))] if truncate else sent + trailing
    damaged = "not valid (gzip|deflate) data"
    if _largest_decoded_bytes(data, codings) > MAX_DECODED_BYTES:  # the limit may be crossed before the damage
        damaged += "|decodes to more than"
    with pytest.raises(RoutingError, match=damaged) as info:
        decode_body(sent, ", ".join(codings), MAX_DECODED_BYTES)
    assert_openai_error(info.value.http_status, info.value.json_body())


def _zeros_gzip(num_bytes: int, wbits: int = zlib.MAX_WBITS | 16) -> bytes:
    """``num_bytes`` zero bytes compressed (about 1000:1), built 1 MiB at a time."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, wbits)
    chunk = b"\0" * (1 << 20)
    parts = [compressor.compress(chunk) for _ in range(num_bytes >> 20)]
    parts.append(compressor.compress(chunk[:num_bytes & ((1 << 20) - 1)]))
    return b"".join(parts) + compressor.flush()


@pytest.mark.parametrize("make, encoding", [
    (lambda: _zeros_gzip(200 << 20), "gzip"),
    (lambda: _zeros_gzip(200 << 20, zlib.MAX_WBITS), "deflate"),
    (lambda: gzip.compress(_zeros_gzip(200 << 20)), "gzip, gzip"),
    (lambda: _zeros_gzip(900 << 10) * 40, "gzip"),  # 40 members, each under the limit, 36 MiB in all
], ids=["gzip-200MiB", "deflate-200MiB", "gzip-in-gzip", "many-members"])
def test_a_bomb_is_refused_with_bounded_memory(make, encoding):
    """A body that inflates past the limit is refused, and decoding it holds at most a few times the limit
    (the body itself, the decoded bytes so far and zlib's window), never the inflated size."""
    body = make()
    tracemalloc.start()
    try:
        with pytest.raises(RoutingError, match="decodes to more than") as info:
            parse_body("bomb", "POST", COMPLETIONS_PATH, body, encoding, MAX_DECODED_BYTES)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.http_status == 400
    assert peak_bytes < 4 * MAX_DECODED_BYTES + 2 * len(body), (peak_bytes, len(body))


_VALID = b'{"model": "m", "prompt": "a", "max_tokens": 3}'
REGRESSIONS = [
    # Found by these properties; each failed before the fix beside it in extproc/request.py.
    # Only the first gzip member was read: a two-member body (valid gzip, RFC 1952 2.2) was refused as not JSON.
    pytest.param(COMPLETIONS_PATH, gzip.compress(b'{"prompt": "a", ') + gzip.compress(b'"max_tokens": 3}'), "gzip",
                 {"prompt_text": "a", "max_tokens": 3}, id="gzip-two-members"),
    # Bytes after the gzip member or the deflate stream were ignored: routed on a body the backend would refuse.
    pytest.param(COMPLETIONS_PATH, gzip.compress(_VALID) + b"garbage", "gzip", "not valid gzip data",
                 id="gzip-trailing-garbage"),
    pytest.param(COMPLETIONS_PATH, zlib.compress(_VALID) + b"x", "deflate", "bytes after the end of the stream",
                 id="deflate-trailing-bytes"),
    # A body cut inside the gzip trailer (CRC, size) decoded fine: truncation went unnoticed.
    pytest.param(COMPLETIONS_PATH, gzip.compress(_VALID)[:-4], "gzip", "truncated", id="gzip-truncated-trailer"),
    pytest.param(COMPLETIONS_PATH, b"", "gzip", "truncated", id="gzip-empty"),
    # A lone surrogate in model or a role passed (the prompt's were refused) and reached spans and tokenizers.
    pytest.param(COMPLETIONS_PATH, b'{"model": "\\ud800", "prompt": "x"}', None, "lone surrogate",
                 id="model-lone-surrogate"),
    pytest.param(CHAT_COMPLETIONS_PATH, b'{"messages": [{"role": "\\udfffuser", "content": "x"}]}', None,
                 "lone surrogate", id="role-lone-surrogate"),
    # 400 000 empty members before the body: a member loop that re-feeds zlib's unused_data (a copy of the rest of
    # the body) is quadratic (terabytes copied for an 8 MiB body: a hang); the fix feeds 64 KiB at a time.
    pytest.param(COMPLETIONS_PATH, gzip.compress(b"") * 400_000 + gzip.compress(_VALID), "gzip",
                 {"prompt_text": "a", "max_tokens": 3}, id="many-empty-gzip-members"),
]


@pytest.mark.parametrize("path, raw, encoding, expected", REGRESSIONS)
def test_regressions(path, raw, encoding, expected):
    if isinstance(expected, dict):
        request = check_parse(path, raw, encoding, max_decoded_bytes=len(_VALID) * 2)
        assert request is not None and {key: getattr(request, key) for key in expected} == expected
    else:
        with pytest.raises(RoutingError, match=expected) as info:
            parse_body("fuzz", "POST", path, raw, encoding, MAX_DECODED_BYTES)
        assert_openai_error(info.value.http_status, info.value.json_body())
