"""The OpenAI-style error ``type`` of an HTTP status, shared by the extproc's own answers (``extproc/errors.py``) and
Envoy's local replies (``astrolabe envoy`` renders Envoy's ``local_reply_config`` from it), so both speak the same
shape: ``{"error": {"message", "type", "param", "code"}}`` as vLLM returns it (vllm/entrypoints/openai/protocol.py
ErrorResponse). Imports only the standard library: the launcher below the extproc uses it.
"""

from __future__ import annotations

import http
import re

IMMEDIATE_RESPONSE_DETAILS_PREFIX = "astrolabe_"
"""Start of the ``details`` of every extproc immediate response (``extproc.messages.immediate_error``: the
prefix and the error code's value), which Envoy records as the reply's ``response.code_details``. Envoy's
``local_reply_config`` (``astrolabe envoy``) formats every local reply whose details do not start with it: the
extproc's answers are already OpenAI-style JSON."""

_ERROR_TYPES: dict[int, str] = {
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
}
"""The ``type`` of a status whose reason phrase does not give the name used here: OpenAI's ``RateLimitError``
(openai-python ``_exceptions.py``) and ``InternalServerError`` (as vLLM names it); 413's phrase changed between
Python versions ("Request Entity Too Large", "Content Too Large")."""

GENERIC_ERROR_TYPE = "APIError"
"""The ``type`` of a status outside `http.HTTPStatus` (openai-python's base error class)."""


def error_type(status: int) -> str:
    """The OpenAI-style error ``type`` of HTTP ``status``: `_ERROR_TYPES`, else the reason phrase in CamelCase with
    ``Error`` (400 ``BadRequestError``, 404 ``NotFoundError``, 503 ``ServiceUnavailableError``, 504
    ``GatewayTimeoutError``, 431 ``RequestHeaderFieldsTooLargeError``), else `GENERIC_ERROR_TYPE`."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        return GENERIC_ERROR_TYPE
    return "".join(word.capitalize() for word in re.split(r"[^A-Za-z0-9]+", phrase) if word) + "Error"
