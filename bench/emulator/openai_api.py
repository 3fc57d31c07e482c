"""OpenAI request parsing and response shaping for the vLLM emulator.

Owns the wire format only: turning a JSON body of ``/v1/completions`` or ``/v1/chat/completions`` into a
:class:`ParsedRequest`, and turning token counts back into OpenAI JSON objects and SSE events. It knows
nothing of the scheduler or of time, and must not import aiohttp or ``predictor.sim``.

Source: vllm/entrypoints/openai/protocol.py (CompletionRequest, ChatCompletionRequest, ErrorResponse) and
serving_completion.py / serving_chat.py (vLLM 0.x). Known differences: one prompt and ``n == 1`` only; no
logprobs, stop strings, tools or sampling parameters (they are accepted and ignored); the chat template is a
plain "role: content" join (the tiny vLLM model's template, deploy/vllm/make_tiny_model.py), not the served
model's; ``usage`` has no ``completion_tokens_details`` and no ``prompt_tokens_details`` unless enabled (vLLM
writes them as null).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""``max_tokens`` when a completions request gives none (vLLM and OpenAI default)."""


class ApiError(Exception):
    """A request the server answers with an OpenAI error object.

    Attributes:
        status: HTTP status code (400, 404, ...).
        err_type: OpenAI error ``type`` ("BadRequestError", "NotFoundError").
        param: name of the offending field, or None.
    """

    _TYPES = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = self._TYPES.get(status, "InternalServerError")
        self.param = param

    def to_json(self) -> dict[str, Any]:
        """The error body, vLLM's shape: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What the emulator needs from one OpenAI request.

    Attributes:
        is_chat: True for ``/v1/chat/completions``.
        model: requested model name.
        prompt_text: prompt as text (chat: template applied), or None when token ids were given.
        prompt_token_ids: the prompt's token ids when it was given as ids (each in [0, 2**32)), else None.
        max_tokens: requested output cap in tokens, or None (chat without a cap: up to the context limit).
        stream: send SSE events instead of one JSON body.
        include_usage: ``stream_options.include_usage``: a last chunk with empty ``choices`` carries ``usage``.
        ignore_eos: vLLM extension; generate exactly ``max_tokens`` tokens.
        return_token_ids: vLLM extension (completions, non-streaming here): the choice carries
            ``prompt_token_ids`` and ``token_ids``.
        recorded_reply: the `REPLY_TEXT_FIELD` test hook: the reply to generate token for token, or None.
        priority: vLLM extension: the request's scheduling priority (lower = earlier; default 0), honoured under
            ``--scheduling-policy priority`` (vllm/entrypoints/openai/protocol.py ``priority: int = 0``).
    """

    is_chat: bool
    model: str | None
    prompt_text: str | None
    prompt_token_ids: tuple[int, ...] | None
    max_tokens: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool
    return_token_ids: bool = False
    recorded_reply: str | None = None
    priority: int = 0

    @property
    def num_prompt_token_ids(self) -> int | None:
        """Number of prompt token ids when the prompt was given as ids, else None."""
        return None if self.prompt_token_ids is None else len(self.prompt_token_ids)


def _check_type(body: dict[str, Any], key: str, types: tuple[type, ...], default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    # bool is an int subclass; a JSON true must not pass as a token count.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ApiError(400, f"'{key}' has the wrong type: {type(value).__name__}", param=key)
    return value


_COUNT = TypeAdapter(int)
"""Counts read as vLLM's request models read them: pydantic's lax ``int`` (``"4"`` and ``4.0`` are 4, ``4.5`` and
``true`` are refused; vllm/entrypoints/openai/protocol.py ``max_tokens: Optional[int]``)."""


def _count(body: dict[str, Any], key: str, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    try:
        if isinstance(value, bool):
            raise ValueError("a boolean is not a count")
        return _COUNT.validate_python(value)
    except (ValidationError, ValueError):
        raise ApiError(400, f"'{key}' must be an integer, got {value!r}", param=key) from None


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


REPLY_TEXT_FIELD = "emulator_reply_text"
"""Test hook (request body field, a string): the reply the emulator generates, token for token, ending (EOS) where
the text ends unless ``x-emulator-output-tokens`` or ``ignore_eos`` says otherwise, capped by ``max_tokens``. A
replay of recorded conversations sends each turn's recorded reply, so that the next turn, which resends it, hits
its blocks (`bench.emulator.tokens`). The router never reads it; vLLM ignores unknown fields (with a warning)."""

MAX_TOKEN_ID = (1 << 32) - 1
"""Largest prompt token id accepted (block keys hash ids as 32-bit values; real vocabularies are far smaller)."""


def _parse_prompt(prompt: Any) -> tuple[str | None, tuple[int, ...] | None]:
    """Returns (text, token_ids), exactly one not None; raises ApiError for batches, bad types or an id outside
    [0, `MAX_TOKEN_ID`]."""
    if isinstance(prompt, str):
        return prompt, None
    if _is_token_ids(prompt) and prompt:
        if not all(0 <= t <= MAX_TOKEN_ID for t in prompt):
            raise ApiError(400, f"token ids must be in [0, {MAX_TOKEN_ID}]", param="prompt")
        return None, tuple(prompt)
    if isinstance(prompt, list) and prompt:
        if len(prompt) > 1:
            raise ApiError(400, "batched prompts are not supported by the emulator: send one prompt", param="prompt")
        return _parse_prompt(prompt[0])
    raise ApiError(400, "'prompt' must be a string, a list of one string, or a (list of one) token-id list",
                   param="prompt")


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "only {'type': 'text', 'text': ...} content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise ApiError(400, "message 'content' must be a string or a list of text parts", param="messages")


def apply_chat_template(messages: Any) -> str:
    """Joins chat messages into one prompt, one ``"role: content"`` line each, then ``"assistant:"``.

    Raises:
        ApiError: 400 if ``messages`` is not a non-empty list of ``{"role": str, "content": ...}``.
    """
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    lines = []
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ApiError(400, "each message must be an object with a string 'role'", param="messages")
        lines.append(f"{msg['role']}: {_message_text(msg.get('content'))}")
    lines.append("assistant:")
    return "\n".join(lines)


def json_object(raw_body: bytes) -> dict[str, Any]:
    """The body as a JSON object.

    Raises:
        ApiError: 400 for invalid JSON or JSON that is not an object.
    """
    try:
        body = json.loads(raw_body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"invalid JSON body: {exc}") from None
    except RecursionError:
        raise ApiError(400, "invalid JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def parse_request(raw_body: bytes, is_chat: bool) -> ParsedRequest:
    """Parses and type-checks one request body.

    Args:
        raw_body: the HTTP body, UTF-8 JSON.
        is_chat: True for ``/v1/chat/completions``, False for ``/v1/completions``.

    Returns:
        The parsed request (model name not yet checked against the served one).

    Raises:
        ApiError: 400 for invalid JSON, a wrong field type, ``n != 1``, a batch of prompts, or ``max_tokens < 1``.
    """
    body = json_object(raw_body)
    model = _check_type(body, "model", (str,), None)  # None: the served model, as vLLM does
    if _count(body, "n", 1) != 1:
        raise ApiError(400, "only n=1 is supported by the emulator", param="n")
    stream = _check_type(body, "stream", (bool,), False)
    stream_options = _check_type(body, "stream_options", (dict,), {})
    ignore_eos = _check_type(body, "ignore_eos", (bool,), False)
    return_token_ids = _check_type(body, "return_token_ids", (bool,), False)
    recorded_reply = _check_type(body, REPLY_TEXT_FIELD, (str,), None)
    priority = _count(body, "priority", 0)
    if is_chat:
        prompt_text, token_ids = apply_chat_template(body.get("messages")), None
        max_tokens = _count(body, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = _count(body, "max_tokens", None)
    else:
        prompt_text, token_ids = _parse_prompt(body.get("prompt"))
        max_tokens = _count(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    return ParsedRequest(is_chat=is_chat, model=model, prompt_text=prompt_text, prompt_token_ids=token_ids,
                         max_tokens=max_tokens, stream=stream,
                         include_usage=bool(stream_options.get("include_usage", False)), ignore_eos=ignore_eos,
                         return_token_ids=return_token_ids, recorded_reply=recorded_reply, priority=priority)


def context_length_error(max_model_len: int, num_prompt_tokens: int, max_tokens: int | None) -> ApiError:
    """The 400 vLLM returns when prompt plus ``max_tokens`` exceeds ``max_model_len`` (all in tokens).

    Source: vllm/entrypoints/openai/serving_engine.py OpenAIServing._validate_input (vLLM 0.x wording).
    """
    if max_tokens is None:
        return ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, your request "
                             f"has {num_prompt_tokens} input tokens. Please reduce the length of the input messages.")
    return ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                         f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, {max_tokens} "
                         f"in the completion). Please reduce the length of the messages or completion.")


def usage_json(num_prompt_tokens: int, num_completion_tokens: int,
               prompt_tokens_details: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAI ``usage`` object (token counts); ``prompt_tokens_details`` (`prompt_tokens_details`) when given."""
    usage: dict[str, Any] = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
                             "total_tokens": num_prompt_tokens + num_completion_tokens}
    if prompt_tokens_details is not None:
        usage["prompt_tokens_details"] = prompt_tokens_details
    return usage


def prompt_tokens_details(is_chat: bool, num_cached_tokens: int, num_created_cache_tokens: int,
                          stream: bool = False) -> dict[str, Any]:
    """``usage.prompt_tokens_details`` as vLLM writes it with ``--enable-prompt-tokens-details`` (tokens): the
    prompt tokens found in the prefix cache and, for chat, the prompt tokens this request wrote into it. A
    completion's has only ``cached_tokens`` when streamed (vLLM serializes chunks with ``exclude_unset``) and
    null ``created_cache_tokens`` / ``multimodal_tokens`` otherwise (as a real vLLM 0.32 answered here).

    Source: vllm/entrypoints/openai/chat_completion/serving.py ``_make_prompt_tokens_details`` (``cached_tokens``,
    ``created_cache_tokens``, ``multimodal_tokens``) and completion/serving.py (``cached_tokens`` only), vLLM 0.32
    (``PromptTokenUsageInfo`` in vllm/entrypoints/serve/engine/protocol.py).
    """
    if is_chat:
        return {"cached_tokens": num_cached_tokens, "created_cache_tokens": num_created_cache_tokens,
                "multimodal_tokens": None}
    if stream:
        return {"cached_tokens": num_cached_tokens}
    return {"cached_tokens": num_cached_tokens, "created_cache_tokens": None, "multimodal_tokens": None}


@dataclass(frozen=True, slots=True)
class ResponseShaper:
    """Builds the JSON objects of one response; ``created`` is a Unix time in seconds (display only)."""

    is_chat: bool
    response_id: str
    model: str | None
    created: int

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def full_response(self, text: str, finish_reason: str, usage: dict[str, Any],
                      token_ids: tuple[list[int], list[int]] | None = None) -> dict[str, Any]:
        """Non-streaming body: ``chat.completion`` or ``text_completion`` with ``usage``; ``token_ids`` = (prompt
        ids, output ids) puts them in a completion's choice as ``prompt_token_ids`` and ``token_ids`` (vLLM's
        ``return_token_ids``; vllm/entrypoints/openai/completion/protocol.py ``CompletionResponseChoice``)."""
        if self.is_chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason, "stop_reason": None}
            out = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None}
            if token_ids is not None:
                choice["prompt_token_ids"], choice["token_ids"] = token_ids
            out = self._envelope("text_completion", [choice])
        out["usage"] = usage
        return out

    def sse_chunk(self, text: str, first: bool, finish_reason: str | None = None) -> bytes:
        """One SSE event ``data: {json}\\n\\n``; the chat delta of the ``first`` chunk carries the role."""
        if self.is_chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return _sse(self._envelope("chat.completion.chunk", [choice]))
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return _sse(self._envelope("text_completion", [choice]))

    def sse_usage_chunk(self, usage: dict[str, int]) -> bytes:
        """The chunk vLLM sends last when ``stream_options.include_usage`` is set: no choices, only ``usage``."""
        out = self._envelope("chat.completion.chunk" if self.is_chat else "text_completion", [])
        out["usage"] = usage
        return _sse(out)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
"""The last SSE event of every stream."""
