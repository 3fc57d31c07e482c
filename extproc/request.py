"""OpenAI request bodies -> ``RoutingRequest``: the protocol-free view the router and policies see.

Accepted shapes (OpenAI API, as vLLM serves it — vllm/entrypoints/openai/protocol.py):
- ``/v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids, or a list of lists of
  token ids; ``max_tokens``.
- ``/v1/chat/completions``: ``messages`` is a list of ``{"role": str, "content": ...}`` whose content is a
  string, null (assistant turns with tool calls), or a list of content parts (``{"type": "text", "text": str}``;
  other part types such as images are accepted and carry no text); ``max_completion_tokens`` wins over the
  deprecated ``max_tokens``.
- ``/generate`` (SGLang's native API, python/sglang/srt/managers/io_struct.py ``GenerateReqInput``): ``text`` (a
  string or a list of strings) or ``input_ids`` (token ids or a list of token-id lists; with both, the prompt is
  ``input_ids``, as SGLang 0.5.23 serves it);
  ``sampling_params`` (an object, or one per prompt) with ``max_new_tokens`` (SGLang's default 128 when absent,
  python/sglang/srt/sampling/sampling_params.py) and ``n``; ``stream``. Its ``model`` is absent (any endpoint).
- any other path: the body must be a JSON object; only ``model`` and ``stream`` are read. A body whose
  ``content-type`` is not JSON there (vLLM's ``/v1/audio/transcriptions`` and ``/v1/audio/translations`` take
  ``multipart/form-data``) is not read at all: the request is routed on its headers (`opaque_body_request`).
A list of prompts is routed as one request (one backend serves the whole batch): its texts are joined with
newlines and its token ids concatenated.

The strings routing reads (``model``, the prompt, message roles and texts) must be valid Unicode: a lone
surrogate, which JSON's ``\\uXXXX`` escapes can write, is refused (it could not be encoded into a span, a log line
or a tokenizer's input).

Raises ``RoutingError(BAD_REQUEST)`` for every malformed body; nothing else escapes.
"""

from __future__ import annotations

import email.message
import json
import urllib.parse
import zlib
from dataclasses import dataclass

from pydantic import TypeAdapter, ValidationError

from extproc.objectives import NO_OBJECTIVES, Objectives
from extproc.errors import ErrorCode, RoutingError

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
GENERATE_PATH = "/generate"
"""SGLang's native generation route."""
INFERENCE_PATHS = frozenset({COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH, GENERATE_PATH})
"""The routes whose body the extproc parses as an inference request (`parse_body`): a POST there needs one."""
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
"""``max_new_tokens`` of a ``/generate`` request that sets none: SGLang's ``SamplingParams`` default
(python/sglang/srt/sampling/sampling_params.py), the cap the engine applies, so routing caps predictions with it."""


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What routing needs to know about one HTTP request.

    Attributes:
        request_id: Envoy's ``x-request-id`` (or a generated one).
        method: HTTP method.
        path: request path without the query string.
        model: requested model name, None when absent (GET, or a body without ``model``).
        prompt_text: prompt (completions) or concatenated message texts (chat); None for token-id prompts.
        prompt_token_ids: token ids of a token-id prompt, concatenated; None for text prompts.
        max_tokens: requested output cap in tokens, None when the client did not set one.
        stream: whether the client asked for SSE streaming.
        num_body_bytes: size of the request body in bytes (0 without a body).
        last_user_message: chat only: the text of the last ``user`` message (what the reply answers).
        chat_messages: chat only: ``(role, text)`` of every message, in order (what a chat template renders).
        arrival_time_s: when the extproc received the request's headers, seconds on ``time.monotonic()`` (the
            cluster simulation's virtual clock there); 0.0 when unknown. Routing overhead is measured from it.
        allowed_endpoints: the gateway's subset hint (``extproc.wire.DESTINATION_SUBSET_HEADER``): normalised
            ``ip:port`` the request may go to, or a bare IP for any port of it; None = any endpoint of the pool.
        num_sequences: engine requests this HTTP request becomes, >= 1: ``n`` (choices per prompt) times the
            prompts of a completions request (a list of prompts is one engine request each; vLLM's serving_completion
            fans them out, and its engine runs each of the ``n`` choices as a request of its own).
        block_keys: keys of the prompt's full KV blocks, first block first (``predictor.sim.block_hash.block_keys``
            over the prompt's token ids as the engine sees them, chat template applied, at the pool's block size);
            None when not computed (no tokenizer, a prompt list, prefix caching off). Routers compare them with
            the block keys each instance holds or caches.
        num_prompts: prompts of the request, >= 1: a completions ``prompt`` (or SGLang ``text`` / ``input_ids``)
            list holds several, which ``prompt_text`` / ``prompt_token_ids`` join; such a request gets no block
            keys (a join is no engine request's prompt).
        objectives: the request's latency objectives and priority (``extproc/admission.py``: its headers resolved
            against the config); `NO_OBJECTIVES` by default.
        num_predicted_output_tokens: the output-length estimate the router made for it (0 until then): what a
            TPOT objective is checked with.
    """

    request_id: str
    method: str
    path: str
    model: str | None = None
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    max_tokens: int | None = None
    stream: bool = False
    num_body_bytes: int = 0
    last_user_message: str | None = None
    arrival_time_s: float = 0.0
    chat_messages: tuple[tuple[str, str], ...] | None = None
    allowed_endpoints: frozenset[str] | None = None
    num_sequences: int = 1
    block_keys: tuple[int, ...] | None = None
    num_prompts: int = 1
    objectives: Objectives = NO_OBJECTIVES
    num_predicted_output_tokens: int = 0


MAX_CHOICES = 128
"""Largest ``n`` counted in the load (a larger one counts as this many): a bound on what one request can add."""


def _bad(message: str, param: str | None = None) -> RoutingError:
    return RoutingError(ErrorCode.BAD_REQUEST, message, param)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_str(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise _bad(f"'{key}' must be a string", key)
    return value


def _optional_bool(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"'{key}' must be a boolean", key)
    return value


_COUNT = TypeAdapter(int)
"""Token counts are read as vLLM's request models read them: pydantic's ``int`` in lax Python mode (FastAPI
validates the parsed JSON so), so ``4.0`` and ``"4"`` are 4 and ``4.5`` is refused
(vllm/entrypoints/openai/protocol.py: ``max_tokens: Optional[int]``; tests/vllm compares with vLLM's own)."""


def _optional_count(body: dict, key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    try:
        count = _COUNT.validate_python(value)
    except ValidationError:
        raise _bad(f"'{key}' must be a non-negative integer", key) from None
    if count < 0:
        raise _bad(f"'{key}' must be a non-negative integer", key)
    return count


def _num_choices(body: dict) -> int:
    """``n``: choices per prompt, read as vLLM reads it (lax ``int``, default 1, at least 1)."""
    n = _optional_count(body, "n")
    if n is None:
        return 1
    if n < 1:
        raise _bad("'n' must be at least 1", "n")
    return min(n, MAX_CHOICES)


def _num_prompts(prompt: object) -> int:
    """Prompts of a completions request's valid ``prompt``: a list of strings or of token-id lists holds several."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def _token_ids(values: list, param: str) -> tuple[int, ...]:
    if not all(_is_int(v) and v >= 0 for v in values):
        raise _bad(f"'{param}' token ids must be non-negative integers", param)
    return tuple(values)


def _parse_prompt(prompt: object, param: str = "prompt") -> tuple[str | None, tuple[int, ...] | None]:
    """Returns (text, token_ids); exactly one is not None (``param``: the field's name in error messages)."""
    if isinstance(prompt, str):
        return prompt, None
    if not isinstance(prompt, list) or not prompt:
        raise _bad(f"'{param}' must be a string, a non-empty list of strings or of token ids, or a list of such "
                   "lists", param)
    if all(isinstance(p, str) for p in prompt):
        return "\n".join(prompt), None
    if all(_is_int(p) for p in prompt):
        return None, _token_ids(prompt, param)
    if all(isinstance(p, list) and p for p in prompt):
        ids: list[int] = []
        for p in prompt:
            ids.extend(_token_ids(p, param))
        return None, tuple(ids)
    raise _bad(f"'{param}' mixes types: use one string, a list of strings, a list of token ids, "
               "or a list of non-empty token-id lists", param)


def _parse_generate(body: dict) -> tuple[str | None, tuple[int, ...] | None, int, int]:
    """An SGLang ``/generate`` body (module docstring): (text, token ids, max_tokens, engine requests).

    ``max_tokens`` is the largest ``max_new_tokens`` over the prompts' sampling params (default
    `SGLANG_DEFAULT_MAX_NEW_TOKENS`); engine requests = prompts x ``n``.
    """
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if not (has_text or has_ids):
        raise _bad("'text' or 'input_ids' is required", "text")
    has_text = not has_ids  # with both, SGLang takes the prompt from input_ids (a real 0.5.23 server does)
    param = "text" if has_text else "input_ids"
    text, ids = _parse_prompt(body[param], param)
    if (text is None) == has_text:
        raise _bad("'text' must be a string or a list of strings" if has_text else
                   "'input_ids' must be token ids or a list of token-id lists", param)
    params = body.get("sampling_params")
    if params is None:
        params = [{}]
    elif isinstance(params, dict):
        params = [params]
    elif not (isinstance(params, list) and params and all(isinstance(p, dict) for p in params)):
        raise _bad("'sampling_params' must be an object or a non-empty list of objects", "sampling_params")
    max_tokens, num_choices = 0, 1
    for p in params:
        try:
            count = _optional_count(p, "max_new_tokens")
            num_choices = max(num_choices, _num_choices(p))
        except RoutingError as exc:
            raise _bad(f"sampling_params: {exc.message}", f"sampling_params.{exc.param}") from None
        max_tokens = max(max_tokens, SGLANG_DEFAULT_MAX_NEW_TOKENS if count is None else count)
    return text, ids, max_tokens, min(_num_prompts(body[param]) * num_choices, MAX_CHOICES)


def _content_text(content: object, index: int) -> str:
    param = f"messages[{index}].content"
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _bad(f"'{param}' must be a string, null, or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _bad(f"'{param}[{j}]' must be an object with a string 'type'", f"{param}[{j}]")
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise _bad(f"'{param}[{j}].text' must be a string", f"{param}[{j}].text")
            texts.append(part["text"])
    return "\n".join(texts)


def _parse_messages(messages: object) -> tuple[str, str | None, tuple[tuple[str, str], ...]]:
    """Returns (all message texts joined, the last user message's text or None, (role, text) of each)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    texts = []
    roles = []
    last_user = None
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"'messages[{i}]' must be an object", f"messages[{i}]")
        if not isinstance(message.get("role"), str):
            raise _bad(f"'messages[{i}].role' must be a string", f"messages[{i}].role")
        if not _is_encodable(message["role"]):  # the role is rendered into the prompt, as the content is
            raise _bad(f"'messages[{i}].role' contains a lone surrogate (invalid Unicode)", f"messages[{i}].role")
        texts.append(_content_text(message.get("content"), i))
        roles.append(message["role"])
        if message["role"] == "user":
            last_user = texts[-1]
    return "\n".join(texts), last_user, tuple(zip(roles, texts))


def _is_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


CONTENT_ENCODINGS = ("identity", "gzip", "x-gzip", "deflate")
"""Request ``content-encoding`` values the extproc decodes to read the body (the backend gets it unchanged)."""
MAX_DECODED_FACTOR = 4
"""A compressed body may decode to at most this many times ``max_decoded_bytes``'s base, the body limit (a
"zip bomb" is refused, not inflated)."""


def content_codings(content_encoding: str | None) -> list[str]:
    """The codings a ``content-encoding`` header lists (RFC 9110 8.4: comma-separated, applied in order),
    lower-cased, empty entries left out; [] for no header."""
    return [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]


def decode_body(body: bytes, content_encoding: str | None, max_decoded_bytes: int) -> bytes:
    """``body`` decoded per its ``content-encoding`` (RFC 9110 8.4: a comma-separated list, applied in order).

    A gzip body may hold several members, decoded one after another (RFC 1952 2.2, as ``gzip.decompress`` reads
    them); bytes after the end of a deflate stream, or after the last gzip member, are an error, and so is data
    that ends before its stream does (truncated). Memory: each coding holds at most its input plus
    ``max_decoded_bytes + 1`` decoded bytes (zlib's ``max_length``), never the inflated size of a bomb.

    Args:
        body: the body as received, bytes.
        content_encoding: the ``content-encoding`` header (None or empty: not encoded).
        max_decoded_bytes: the largest body any decoding step may produce, bytes.

    Returns:
        The decoded body.

    Raises:
        RoutingError: BAD_REQUEST for an encoding other than `CONTENT_ENCODINGS`, data that does not decode, is
            truncated or has trailing bytes, or a decoded body over ``max_decoded_bytes``.
    """
    for coding in reversed(content_codings(content_encoding)):  # the last applied comes off first
        if coding == "identity":
            continue
        if coding not in CONTENT_ENCODINGS:
            raise _bad(f"unsupported content-encoding {coding!r} (supported: {', '.join(CONTENT_ENCODINGS)})")
        body = _inflate(body, coding, max_decoded_bytes)
    return body


_INFLATE_CHUNK_BYTES = 64 * 1024
"""Compressed input is fed to zlib this much at a time, so that what is left after a gzip member (zlib's
``unused_data``, a copy) is at most this long: a body of many tiny members decodes in linear time."""


def _inflate(data: bytes, coding: str, max_decoded_bytes: int) -> bytes:
    """One gzip (every member) or deflate layer of `decode_body`."""
    gzip_coding = coding in ("gzip", "x-gzip")
    wbits = zlib.MAX_WBITS | 16 if gzip_coding else zlib.MAX_WBITS
    decoded = bytearray()
    decoder = zlib.decompressobj(wbits)
    view = memoryview(data)
    for offset in range(0, len(data), _INFLATE_CHUNK_BYTES):
        pending: bytes | memoryview = view[offset:offset + _INFLATE_CHUNK_BYTES]
        while pending:
            if decoder.eof:  # the stream ended, yet bytes follow: the next gzip member, or trailing garbage
                if not gzip_coding:
                    raise _bad(f"request body is not valid {coding} data: bytes after the end of the stream")
                decoder = zlib.decompressobj(wbits)
            try:
                decoded += decoder.decompress(pending, max_decoded_bytes + 1 - len(decoded))
            except zlib.error as exc:
                raise _bad(f"request body is not valid {coding} data: {exc}") from None
            if len(decoded) > max_decoded_bytes or decoder.unconsumed_tail:
                raise _bad(f"request body decodes to more than {max_decoded_bytes} bytes")
            pending = decoder.unused_data
    if not decoder.eof:
        raise _bad(f"request body is not valid {coding} data: truncated")
    return bytes(decoded)


def _route_path(path: str) -> str:
    """``path`` without its query string, percent-decoded: ``/v1/%63ompletions?x=1`` is ``/v1/completions`` to the
    backend."""
    return urllib.parse.unquote(path.split("?", 1)[0])


def bodiless_request(request_id: str, method: str, path: str) -> RoutingRequest:
    """The routing view of a request whose headers ended it (no body: a GET, or a POST with an empty body).

    Args:
        request_id: the request's id.
        method: HTTP method.
        path: request path as sent (kept as is in the result).

    Returns:
        A ``RoutingRequest`` with no model and no prompt (routed on its headers).

    Raises:
        RoutingError: BAD_REQUEST for a POST to an inference route (`INFERENCE_PATHS`): it has no prompt to route
            on, and the backend would refuse it anyway.
    """
    route = _route_path(path)
    if method.upper() == "POST" and route in INFERENCE_PATHS:
        raise _bad(f"request body is empty: POST {route} needs a JSON object")
    return RoutingRequest(request_id, method, path)


def is_json_media_type(content_type: str | None) -> bool:
    """Whether a request's ``content-type`` header value names JSON: ``application/json`` or a structured ``+json``
    type (RFC 6839), parameters such as ``charset`` ignored, any case; None or empty (no header) counts as JSON.
    The rule vLLM's and SGLang's FastAPI servers read a body by (fastapi/routing.py ``get_request_handler``: a body
    of any other type is not parsed as JSON, so those servers refuse it on their inference routes)."""
    if not content_type or not content_type.strip():
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def opaque_body_request(request_id: str, method: str, path: str, num_body_bytes: int) -> RoutingRequest:
    """The routing view of a request whose body is not JSON on a route that is not an inference route (e.g. vLLM's
    ``/v1/audio/transcriptions``, ``multipart/form-data``): routed on its headers, its body passed on unread.

    Args:
        request_id: the request's id.
        method: HTTP method.
        path: request path; a query string is ignored.
        num_body_bytes: the body's size as received, bytes.

    Returns:
        A ``RoutingRequest`` with no model and no prompt.

    Raises:
        RoutingError: BAD_REQUEST for an inference route (`INFERENCE_PATHS`): vLLM and SGLang read only JSON there.
    """
    route = _route_path(path)
    if route in INFERENCE_PATHS:
        raise _bad(f"{route} takes a JSON body (content-type: application/json)")
    return RoutingRequest(request_id, method, route, num_body_bytes=num_body_bytes)


def parse_body(request_id: str, method: str, path: str, body: bytes, content_encoding: str | None = None,
               max_decoded_bytes: int = 64 * 1024 * 1024) -> RoutingRequest:
    """Parses an OpenAI-style JSON body into a ``RoutingRequest``.

    Args:
        request_id: the request's id.
        method: HTTP method (``POST``).
        path: request path; a query string is ignored.
        body: the whole request body, UTF-8 JSON, possibly compressed (``content_encoding``).
        content_encoding: the request's ``content-encoding`` header (gzip and deflate are decoded, `decode_body`).
        max_decoded_bytes: the largest decoded body read, bytes.

    Returns:
        The routing view of the request (``num_body_bytes``: the body as received).

    Raises:
        RoutingError: BAD_REQUEST if the body does not decode, is not a JSON object, or a field has the wrong type,
            is missing or holds a lone surrogate.
    """
    path = _route_path(path)
    received_bytes = len(body)
    body = decode_body(body, content_encoding, max_decoded_bytes)
    try:
        parsed = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(f"request body is not valid JSON: {exc}") from None
    except ValueError as exc:  # e.g. an integer over Python's 4300-digit conversion limit
        raise _bad(f"request body has an unreadable value: {exc}") from None
    except RecursionError:
        raise _bad("request body nests too deeply") from None
    if not isinstance(parsed, dict):
        raise _bad(f"request body must be a JSON object, got {type(parsed).__name__}")
    text: str | None = None
    last_user: str | None = None
    ids: tuple[int, ...] | None = None
    max_tokens: int | None = None
    chat: tuple[tuple[str, str], ...] | None = None
    num_sequences = num_prompts = 1
    if path == COMPLETIONS_PATH:
        if "prompt" not in parsed:
            raise _bad("'prompt' is required", "prompt")
        text, ids = _parse_prompt(parsed["prompt"])
        max_tokens = _optional_count(parsed, "max_tokens")
        num_prompts = _num_prompts(parsed["prompt"])
        num_sequences = _num_choices(parsed) * num_prompts
    elif path == CHAT_COMPLETIONS_PATH:
        if "messages" not in parsed:
            raise _bad("'messages' is required", "messages")
        text, last_user, chat = _parse_messages(parsed["messages"])
        num_sequences = _num_choices(parsed)
        max_tokens = _optional_count(parsed, "max_completion_tokens")
        legacy = _optional_count(parsed, "max_tokens")
        max_tokens = legacy if max_tokens is None else max_tokens
    elif path == GENERATE_PATH:
        text, ids, max_tokens, num_sequences = _parse_generate(parsed)
        num_prompts = _num_prompts(parsed["input_ids"] if parsed.get("input_ids") is not None else parsed["text"])
    if text is not None and not _is_encodable(text):
        raise _bad("the prompt contains a lone surrogate (invalid Unicode)",
                   {CHAT_COMPLETIONS_PATH: "messages", GENERATE_PATH: "text"}.get(path, "prompt"))
    # SGLang's /generate has no model field (GenerateReqInput): one there is not the client's choice of endpoint.
    model = None if path == GENERATE_PATH else _optional_str(parsed, "model")
    if model is not None and not _is_encodable(model):  # it reaches span attributes, logs and error bodies
        raise _bad("'model' contains a lone surrogate (invalid Unicode)", "model")
    return RoutingRequest(
        request_id=request_id,
        method=method,
        path=path,
        model=model,
        prompt_text=text,
        prompt_token_ids=ids,
        max_tokens=max_tokens,
        stream=_optional_bool(parsed, "stream"),
        num_body_bytes=received_bytes,
        last_user_message=last_user,
        chat_messages=chat,
        num_sequences=num_sequences,
        num_prompts=num_prompts,
    )
