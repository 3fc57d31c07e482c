"""Routing errors and the single map from error code to HTTP status and OpenAI-style JSON body.

Source of the body shape: OpenAI API error objects as vLLM returns them
(``{"error": {"message", "type", "param", "code"}}``, vllm/entrypoints/openai/protocol.py ErrorResponse).
"""

from __future__ import annotations

import enum
import json


class ErrorCode(enum.Enum):
    """Why a request was answered by the extproc instead of being routed."""

    BAD_REQUEST = "bad_request"            # body not JSON, not an object, missing prompt, wrong types
    MODEL_NOT_FOUND = "model_not_found"    # no endpoint declares the requested model
    BODY_TOO_LARGE = "body_too_large"      # over the configured max_body_bytes
    NO_HEALTHY_ENDPOINT = "no_healthy_endpoint"
    SHED = "shed"                          # load shed (reserved: the Endpoint Picker protocol's 429)
    INTERNAL = "internal"                  # a bug in the extproc; logged with its traceback


# code -> (HTTP status, OpenAI error type)
_STATUS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.BAD_REQUEST: (400, "BadRequestError"),
    ErrorCode.MODEL_NOT_FOUND: (404, "NotFoundError"),
    ErrorCode.BODY_TOO_LARGE: (413, "RequestTooLargeError"),
    ErrorCode.SHED: (429, "RateLimitError"),
    ErrorCode.NO_HEALTHY_ENDPOINT: (503, "ServiceUnavailableError"),
    ErrorCode.INTERNAL: (500, "InternalServerError"),
}


class RoutingError(Exception):
    """A request the extproc answers itself with an HTTP error.

    Args:
        code: the reason; decides the HTTP status.
        message: human-readable explanation sent to the client.
        param: the offending request field, if any (OpenAI ``param``).
    """

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    @property
    def http_status(self) -> int:
        return _STATUS[self.code][0]

    def json_body(self) -> bytes:
        """The OpenAI-style JSON error body, UTF-8."""
        status, type_ = _STATUS[self.code]
        return json.dumps(
            {"error": {"message": self.message, "type": type_, "param": self.param, "code": status}}
        ).encode()
