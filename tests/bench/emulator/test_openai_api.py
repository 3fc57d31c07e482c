"""Tests for bench/emulator/openai_api.py: request parsing and response shaping (no server)."""

from __future__ import annotations

import json

import pytest

from bench.emulator.openai_api import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ApiError,
    ResponseShaper,
    apply_chat_template,
    context_length_error,
    parse_request,
    prompt_tokens_details,
    usage_json,
)


def _body(**fields: object) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


@pytest.mark.parametrize(
    ("prompt", "text", "num_ids"),
    [
        ("hello", "hello", None),
        (["hello"], "hello", None),
        ([1, 2, 3], None, 3),
        ([[1, 2, 3, 4]], None, 4),
    ],
    ids=["string", "list-of-one-string", "token-ids", "list-of-one-token-id-list"],
)
def test_prompt_forms(prompt: object, text: str | None, num_ids: int | None) -> None:
    parsed = parse_request(_body(prompt=prompt), is_chat=False)
    assert (parsed.prompt_text, parsed.num_prompt_token_ids) == (text, num_ids)
    assert parsed.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS
    assert not parsed.stream and not parsed.ignore_eos


@pytest.mark.parametrize(
    ("raw", "is_chat", "param"),
    [
        (b"{not json", False, None),
        (b"[1, 2]", False, None),
        (json.dumps({"prompt": "x", "model": 7}).encode(), False, "model"),
        (_body(prompt=["a", "b"]), False, "prompt"),
        (_body(prompt=[[1], [2]]), False, "prompt"),
        (_body(prompt=7), False, "prompt"),
        (_body(prompt=[]), False, "prompt"),
        (_body(prompt="x", n=2), False, "n"),
        (_body(prompt="x", max_tokens="5.5"), False, "max_tokens"),
        (_body(prompt="x", max_tokens=True), False, "max_tokens"),
        (_body(prompt="x", max_tokens=0), False, "max_tokens"),
        (_body(prompt="x", stream="yes"), False, "stream"),
        (_body(messages="hi"), True, "messages"),
        (_body(messages=[]), True, "messages"),
        (_body(messages=[{"content": "no role"}]), True, "messages"),
        (_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), True, "messages"),
    ],
    ids=["bad-json", "not-object", "model-not-string", "batch-strings", "batch-ids", "int-prompt", "empty-prompt", "n2",
         "max-tokens-str", "max-tokens-bool", "max-tokens-zero", "stream-str", "messages-str", "messages-empty",
         "message-no-role", "image-part"],
)
def test_bad_requests_are_400(raw: bytes, is_chat: bool, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        parse_request(raw, is_chat=is_chat)
    body = info.value.to_json()
    assert info.value.status == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
    assert body["error"]["param"] == param and body["error"]["message"]


@pytest.mark.parametrize("value", ["4", 4.0, 4])
def test_max_tokens_is_read_as_vllm_reads_it(value) -> None:
    """pydantic's lax int, as vLLM's request models (and the extproc) read it."""
    assert parse_request(_body(prompt="x", max_tokens=value), is_chat=False).max_tokens == 4


def test_batch_prompt_message_is_clear() -> None:
    with pytest.raises(ApiError, match="batched prompts are not supported"):
        parse_request(_body(prompt=["a", "b"]), is_chat=False)


def test_chat_fields_and_template() -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    parsed = parse_request(_body(messages=messages, max_completion_tokens=7, max_tokens=99, stream=True,
                                 stream_options={"include_usage": True}, ignore_eos=True), is_chat=True)
    assert parsed.prompt_text == "system: be brief\nuser: hi there\nassistant:"
    assert parsed.max_tokens == 7  # max_completion_tokens wins over the deprecated max_tokens
    assert parsed.stream and parsed.include_usage and parsed.ignore_eos
    assert parse_request(_body(messages=messages), is_chat=True).max_tokens is None
    assert parse_request(_body(messages=messages, max_tokens=5), is_chat=True).max_tokens == 5


def test_chat_template_is_plain_join() -> None:
    assert apply_chat_template([{"role": "user", "content": None}]) == "user: \nassistant:"


def test_token_id_prompts_keep_their_ids_and_out_of_range_ids_are_refused() -> None:
    assert parse_request(_body(prompt=[7, 0, 2**32 - 1]), is_chat=False).prompt_token_ids == (7, 0, 2**32 - 1)
    for bad in ([-1, 2], [2**32]):
        with pytest.raises(ApiError) as err:
            parse_request(_body(prompt=bad), is_chat=False)
        assert err.value.status == 400 and err.value.param == "prompt"


def test_usage_carries_prompt_tokens_details_only_when_given() -> None:
    assert usage_json(10, 3) == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    details = prompt_tokens_details(False, 32, 0, stream=True)
    assert details == {"cached_tokens": 32}
    assert usage_json(10, 3, details)["prompt_tokens_details"] == {"cached_tokens": 32}
    assert prompt_tokens_details(False, 32, 0) == {"cached_tokens": 32, "created_cache_tokens": None,
                                                   "multimodal_tokens": None}
    assert prompt_tokens_details(True, 32, 64) == {"cached_tokens": 32, "created_cache_tokens": 64,
                                                   "multimodal_tokens": None}


def test_context_length_error_names_the_numbers() -> None:
    err = context_length_error(4096, 4000, 200)
    assert err.status == 400 and "4096" in err.message and "4200" in err.message


@pytest.mark.parametrize("is_chat", [False, True], ids=["completions", "chat"])
def test_shapes(is_chat: bool) -> None:
    shaper = ResponseShaper(is_chat, "id-1", "m", 123)
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    full = shaper.full_response(" tok en ize", "length", usage)
    assert full["object"] == ("chat.completion" if is_chat else "text_completion")
    assert full["usage"] == usage and full["choices"][0]["finish_reason"] == "length"
    first = shaper.sse_chunk(" tok", first=True)
    assert first.startswith(b"data: ") and first.endswith(b"\n\n")
    chunk = json.loads(first[len(b"data: "):])
    if is_chat:
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": " tok"}
        later = json.loads(shaper.sse_chunk(" en", first=False)[6:])
        assert later["choices"][0]["delta"] == {"content": " en"}
    else:
        assert chunk["choices"][0]["text"] == " tok"
    last = json.loads(shaper.sse_chunk("", first=False, finish_reason="stop")[6:])
    assert "usage" not in last and last["choices"][0]["finish_reason"] == "stop"
    usage_only = json.loads(shaper.sse_usage_chunk(usage)[6:])
    assert usage_only["usage"] == usage and usage_only["choices"] == []
