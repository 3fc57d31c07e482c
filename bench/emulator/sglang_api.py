"""SGLang's native API for the emulator in SGLang mode (``astrolabe emulator --api sglang``): wire format only.

Owns parsing a ``/generate`` body into the emulator's :class:`bench.emulator.openai_api.ParsedRequest`, shaping its
answers (one JSON object, or SSE events that each carry the whole text so far), and the ``/get_server_info`` and
``/get_model_info`` objects. Knows nothing of the scheduler or of time; must not import aiohttp or ``predictor.sim``.

Source: python/sglang/srt/managers/io_struct.py ``GenerateReqInput`` (``text`` | ``input_ids``, ``sampling_params``,
``stream``, ``rid``), python/sglang/srt/sampling/sampling_params.py (``max_new_tokens`` default 128, ``ignore_eos``),
python/sglang/srt/entrypoints/http_server.py (``generate_request``: SSE ``data: {json}`` events then
``data: [DONE]``; errors ``{"error": {"message"}}`` with status 400; ``get_server_info``: the server arguments, the
scheduler's info and ``internal_states``; ``health_generate``). Known differences: one prompt and ``n == 1`` only
(as the OpenAI routes); no logprobs, stop strings or other sampling parameters (accepted and ignored);
``meta_info`` carries the ids, counts, finish reason and ``e2e_latency`` only.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from bench.emulator.openai_api import MAX_TOKEN_ID, ApiError, ParsedRequest, json_object

logger = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 128
"""``sampling_params.max_new_tokens`` when a ``/generate`` request gives none (SGLang's ``SamplingParams``)."""

HEALTH_POLL_S = 1.0
"""How long SGLang's ``/health`` and ``/health_generate`` take at least, seconds: they queue a one-token request
and poll the detokenizer once per second (``health_generate``: ``await asyncio.sleep(1)``), so a health check with
a timeout of 1 s or less fails against SGLang."""


def _single(value: Any, param: str) -> Any:
    """The one element of a one-element list (a batch of one), else ``value`` itself."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list, dict)):
        if len(value) > 1:
            raise ApiError(400, f"batched '{param}' is not supported by the emulator: send one prompt", param=param)
        return value[0]
    return value


def parse_generate(raw_body: bytes) -> tuple[ParsedRequest, str | None]:
    """Parses a ``/generate`` body: (the request, its ``rid`` or None).

    Raises:
        ApiError: 400 for invalid JSON, neither ``text`` nor ``input_ids`` (with both, ``input_ids`` is the
            prompt, as SGLang does), a batch of several prompts, a wrong type, ``n != 1`` or
            ``max_new_tokens < 0`` (0 is answered at once with no tokens, as SGLang does).
    """
    body = json_object(raw_body)
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None:
        raise ApiError(400, "Either text, input_ids or input_embeds should be provided.", param="text")
    if ids is not None:
        text = None  # with both, SGLang takes the prompt from input_ids
    text, ids = _single(text, "text"), _single(ids, "input_ids")
    if text is not None and not isinstance(text, str):
        raise ApiError(400, "'text' must be a string", param="text")
    if ids is not None and not (isinstance(ids, list) and ids and
                                all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in ids)):
        raise ApiError(400, "'input_ids' must be a non-empty list of token ids", param="input_ids")
    params = _single(body.get("sampling_params") or {}, "sampling_params")
    if not isinstance(params, dict):
        raise ApiError(400, "'sampling_params' must be an object", param="sampling_params")
    max_new_tokens = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new_tokens is None:
        max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ApiError(400, f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}",
                       param="sampling_params.max_new_tokens")
    if params.get("n", 1) != 1:
        raise ApiError(400, "only n=1 is supported by the emulator", param="sampling_params.n")
    ignore_eos, stream, rid = params.get("ignore_eos", False), body.get("stream", False), body.get("rid")
    if not isinstance(ignore_eos, bool) or not isinstance(stream, bool):
        raise ApiError(400, "'ignore_eos' and 'stream' must be booleans")
    if rid is not None and not isinstance(rid, str):
        raise ApiError(400, "'rid' must be a string", param="rid")
    parsed = ParsedRequest(is_chat=False, model=None, prompt_text=text,
                           prompt_token_ids=None if ids is None else tuple(ids), max_tokens=max_new_tokens,
                           stream=stream, include_usage=False, ignore_eos=ignore_eos)
    return parsed, rid


def generate_json(rid: str, text: str, finish_reason: str | None, num_prompt_tokens: int, num_completion_tokens: int,
                  e2e_latency_s: float, num_cached_tokens: int = 0) -> dict[str, Any]:
    """One ``/generate`` answer object (or one SSE event's): the text so far and its ``meta_info``
    (``cached_tokens``: prompt tokens found in the prefix cache; always 0 under the SGLang scheduling rules,
    which do not model SGLang's radix cache).

    ``finish_reason``: "stop", "length" or None while unfinished; SGLang writes ``{"type": "length", "length": N}``
    for a request cut at ``max_new_tokens`` and ``{"type": "stop", "matched": ...}`` for an EOS.
    """
    reason: dict[str, Any] | None = None
    if finish_reason == "length":
        reason = {"type": "length", "length": num_completion_tokens}
    elif finish_reason == "stop":
        reason = {"type": "stop", "matched": 2}
    return {"text": text, "meta_info": {"id": rid, "finish_reason": reason, "prompt_tokens": num_prompt_tokens,
                                        "completion_tokens": num_completion_tokens, "cached_tokens": num_cached_tokens,
                                        "e2e_latency": e2e_latency_s}}


def sse(obj: dict[str, Any]) -> bytes:
    """One SSE event ``data: {json}\\n\\n``."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def error_json(message: str) -> dict[str, Any]:
    """SGLang's native error body (``http_server._create_error_response``)."""
    return {"error": {"message": message}}


def server_info(model_path: str, max_running_requests: int, chunked_prefill_size: int, page_size: int,
                num_pages: int, max_model_len: int, schedule_policy: str = "fcfs") -> dict[str, Any]:
    """The ``/get_server_info`` object: the server arguments that shape scheduling, the scheduler's info
    (``max_total_num_tokens``: KV tokens = pages x page_size) and one ``internal_states`` entry (one DP rank)."""
    max_total_num_tokens = num_pages * page_size
    return {"model_path": model_path, "served_model_name": model_path, "tokenizer_path": model_path,
            "context_length": max_model_len, "max_running_requests": max_running_requests,
            "chunked_prefill_size": chunked_prefill_size, "page_size": page_size, "schedule_policy": schedule_policy,
            "enable_mixed_chunk": False, "schedule_conservativeness": 1.0, "dp_size": 1, "tp_size": 1,
            "max_total_tokens": None, "enable_metrics": True, "status": "ready",
            "max_total_num_tokens": max_total_num_tokens, "max_req_input_len": max_model_len - 1,
            "internal_states": [{"max_total_num_tokens": max_total_num_tokens, "last_gen_throughput": 0.0}],
            "version": "astrolabe-emulator"}


def model_info(model_path: str) -> dict[str, Any]:
    """The ``/get_model_info`` object."""
    return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default"}
