"""Routing errors and the single map from error code to HTTP status and OpenAI-style JSON body.

Source of the body shape: OpenAI API error objects as vLLM returns them
(``{"error": {"message", "type", "param", "code"}}``, vllm/entrypoints/openai/protocol.py ErrorResponse).
`error_type` (``astrolabe/openai_errors.py``) names the ``type`` of any HTTP status: the extproc's own errors and
Envoy's local replies (``astrolabe envoy`` renders Envoy's ``local_reply_config`` from it, so both speak the same
shape).
"""

from __future__ import annotations

import enum
import json

from astrolabe.openai_errors import error_type

class ErrorCode(enum.Enum):
    """Why a request was answered by the extproc instead of being routed."""

    BAD_REQUEST = "bad_request"            # body not JSON, not an object, missing prompt, wrong types
    MODEL_NOT_FOUND = "model_not_found"    # no endpoint declares the requested model
    BODY_TOO_LARGE = "body_too_large"      # over the configured max_body_bytes
    NO_HEALTHY_ENDPOINT = "no_healthy_endpoint"
    SHED = "shed"                          # refused to protect latency objectives (extproc/admission.py): 429
    INTERNAL = "internal"                  # a bug in the extproc; logged with its traceback


# code -> HTTP status (its OpenAI error type: `error_type`)
_STATUS: dict[ErrorCode, int] = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.BODY_TOO_LARGE: 413,
    ErrorCode.SHED: 429,
    ErrorCode.NO_HEALTHY_ENDPOINT: 503,
    ErrorCode.INTERNAL: 500,
}


class RoutingError(Exception):
    """A request the extproc answers itself with an HTTP error.

    Args:
        code: the reason; decides the HTTP status.
        message: human-readable explanation sent to the client.
        param: the offending request field, if any (OpenAI ``param``).
        reason: a finer reason within ``code`` (a SHED's ``extproc.admission.SHED_REASONS`` entry), or "".
        headers: more response headers, (name, value) pairs (a SHED's ``retry-after`` and drop reason).
    """

    def __init__(self, code: ErrorCode, message: str, param: str | None = None, reason: str = "",
                 headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.reason = reason
        self.headers = headers

    @property
    def http_status(self) -> int:
        return _STATUS[self.code]

    def json_body(self) -> bytes:
        """The OpenAI-style JSON error body, UTF-8."""
        status = _STATUS[self.code]
        return json.dumps(
            {"error": {"message": self.message, "type": error_type(status), "param": self.param, "code": status}}
        ).encode()
