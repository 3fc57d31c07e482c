import json

import pytest

from extproc.errors import ErrorCode, RoutingError
from extproc.request import is_json_media_type, opaque_body_request, parse_body


def _parse(path, body):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_body("rid", "POST", path, raw)


@pytest.mark.parametrize(
    "body, text, ids",
    [
        ({"model": "m", "prompt": "hello"}, "hello", None),
        ({"model": "m", "prompt": ["a", "b"]}, "a\nb", None),
        ({"model": "m", "prompt": [1, 2, 3]}, None, (1, 2, 3)),
        ({"model": "m", "prompt": [[1, 2], [3]]}, None, (1, 2, 3)),
        ({"model": "m", "prompt": ""}, "", None),
    ],
    ids=["string", "list-of-strings", "token-ids", "list-of-token-id-lists", "empty-string"],
)
def test_completions_prompt_shapes(body, text, ids):
    req = _parse("/v1/completions", body)
    assert (req.prompt_text, req.prompt_token_ids, req.model) == (text, ids, "m")


@pytest.mark.parametrize(
    "messages, text",
    [
        ([{"role": "user", "content": "hi"}], "hi"),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "s\nu"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"},
                                       {"type": "image_url", "image_url": {"url": "x"}},
                                       {"type": "text", "text": "b"}]}], "a\nb"),
        ([{"role": "assistant", "content": None, "tool_calls": []}, {"role": "user", "content": "q"}], "\nq"),
    ],
    ids=["string", "system+user", "content-parts", "null-content"],
)
def test_chat_message_shapes(messages, text):
    req = _parse("/v1/chat/completions", {"model": "m", "messages": messages})
    assert req.prompt_text == text and req.prompt_token_ids is None


def test_fields_read():
    req = _parse("/v1/completions?x=1", {"model": "m", "prompt": "p", "max_tokens": 7, "stream": True})
    assert (req.path, req.max_tokens, req.stream, req.request_id) == ("/v1/completions", 7, True, "rid")
    assert req.num_body_bytes > 0


def test_chat_max_completion_tokens_wins():
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 9}
    assert _parse("/v1/chat/completions", body).max_tokens == 9
    del body["max_completion_tokens"]
    assert _parse("/v1/chat/completions", body).max_tokens == 5


def test_other_paths_need_only_an_object():
    req = _parse("/v1/embeddings", {"model": "m", "input": "x"})
    assert req.model == "m" and req.prompt_text is None


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", b"\xff\xfe", None),
        ("/v1/completions", b"[1, 2]", None),
        ("/v1/completions", b'"text"', None),
        ("/v1/completions", b"[" * 100000, None),
        ("/v1/completions", {"model": "m"}, "prompt"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"prompt": [1, True]}, "prompt"),
        ("/v1/completions", {"prompt": [-1]}, "prompt"),
        ("/v1/completions", {"prompt": [[1], []]}, "prompt"),
        ("/v1/completions", {"prompt": "p", "model": 3}, "model"),
        ("/v1/completions", {"prompt": "p", "max_tokens": "1e3"}, "max_tokens"),
        ("/v1/completions", {"prompt": "p", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "p", "max_tokens": 1.5}, "max_tokens"),
        ("/v1/completions", {"prompt": "p", "stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"model": "m"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": ["hi"]}, "messages[0]"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [1]}]}, "messages[0].content[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0].text"),
        ("/v1/chat/completions", {"messages": [{"role": "u", "content": "x"}], "max_completion_tokens": [3]},
         "max_completion_tokens"),
        ("/v1/embeddings", b"[]", None),
        ("/v1/completions", b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}", None),
        ("/v1/completions", b'{"prompt": "\\udfff"}', "prompt"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages"),
        ("/v1/%63ompletions", {"model": "m"}, "prompt"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_malformed_bodies_are_400(path, body, param):
    with pytest.raises(RoutingError) as info:
        _parse(path, body)
    err = info.value
    assert err.code is ErrorCode.BAD_REQUEST and err.http_status == 400
    assert err.param == param
    payload = json.loads(err.json_body())
    assert payload["error"]["code"] == 400 and payload["error"]["type"] == "BadRequestError"
    assert payload["error"]["message"]


COUNTS_AS_VLLM_READS_THEM = [(4, 4), (4.0, 4), ("4", 4), (True, 1), ("4.0", 4), (" 4", 4), (0, 0),
                             (2 ** 70, 2 ** 70), (4.5, None), ("1e3", None), ([4], None), ("x", None), (1e20, None)]
"""max_tokens value -> what vLLM 0.32's CompletionRequest reads (None: a validation error), as printed by
tests/vllm/test_request_schema.py against vLLM's own model; tests/vllm checks the two still agree."""


@pytest.mark.parametrize("value, expected", COUNTS_AS_VLLM_READS_THEM, ids=repr)
def test_token_counts_are_read_as_vllm_reads_them(value, expected):
    """A request vLLM accepts is not refused here: max_tokens 4.0 is 4 (a fresh-user report), "4" too, as
    pydantic's lax int in vLLM's request models; 4.5 is refused by both."""
    body = {"prompt": "p", "max_tokens": value}
    if expected is None:
        with pytest.raises(RoutingError):
            _parse("/v1/completions", body)
    else:
        assert _parse("/v1/completions", body).max_tokens == expected


def test_compressed_bodies_are_read_and_bombs_refused():
    import gzip  # noqa: PLC0415
    import zlib  # noqa: PLC0415

    raw = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 7}).encode()
    for encoding, data in (("gzip", gzip.compress(raw)), ("deflate", zlib.compress(raw)),
                           ("gzip, identity", gzip.compress(raw)), (None, raw)):
        request = parse_body("r", "POST", "/v1/completions", data, encoding)
        assert (request.prompt_text, request.max_tokens, request.num_body_bytes) == ("hello there", 7, len(data))
    with pytest.raises(RoutingError, match="not valid gzip"):
        parse_body("r", "POST", "/v1/completions", raw, "gzip")
    with pytest.raises(RoutingError, match="unsupported content-encoding 'br'"):
        parse_body("r", "POST", "/v1/completions", raw, "br")
    bomb = gzip.compress(b" " * 10_000_000)
    with pytest.raises(RoutingError, match="decodes to more than 1000000 bytes"):
        parse_body("r", "POST", "/v1/completions", bomb, "gzip", max_decoded_bytes=1_000_000)


@pytest.mark.parametrize("path, body, sequences", [
    ("/v1/completions", {"prompt": "x"}, 1),
    ("/v1/completions", {"prompt": "x", "n": 4}, 4),
    ("/v1/completions", {"prompt": "x", "n": 4.0}, 4),  # read as vLLM reads it (lax int)
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}, 6),  # each prompt is an engine request, n each
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, 2),
    ("/v1/completions", {"prompt": [1, 2, 3]}, 1),  # one token-id prompt
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, 3),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": None}, 1),
    ("/v1/completions", {"prompt": "x", "n": 10**6}, 128),  # counted up to MAX_CHOICES
])
def test_choices_and_prompts_count_as_engine_requests(path, body, sequences):
    assert _parse(path, {"model": "m", **body}).num_sequences == sequences


@pytest.mark.parametrize("n", [0, -1, "many", 1.5, [2]])
def test_bad_n_is_400(n):
    with pytest.raises(RoutingError) as caught:
        _parse("/v1/completions", {"model": "m", "prompt": "x", "n": n})
    assert caught.value.code is ErrorCode.BAD_REQUEST and caught.value.param == "n"


@pytest.mark.parametrize("body, text, ids, max_tokens, sequences", [
    ({"text": "hello world"}, "hello world", None, 128, 1),  # SGLang's default max_new_tokens
    ({"text": ["a", "b"], "sampling_params": {"max_new_tokens": 7, "n": 2}}, "a\nb", None, 7, 4),
    ({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": "9"}}, None, (1, 2, 3), 9, 1),
    ({"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 3}, {}]}, None, (1, 2, 3), 128, 2),
    ({"text": "x", "sampling_params": None, "stream": True}, "x", None, 128, 1),
    ({"text": "ignored", "input_ids": [4, 5]}, None, (4, 5), 128, 1),  # SGLang takes input_ids then
    ({"text": "x", "model": "nope"}, "x", None, 128, 1),  # /generate has no model field: not an endpoint choice
])
def test_sglang_generate_bodies(body, text, ids, max_tokens, sequences):
    request = parse_body("r1", "POST", "/generate", json.dumps(body).encode())
    assert (request.prompt_text, request.prompt_token_ids, request.max_tokens, request.num_sequences) == \
        (text, ids, max_tokens, sequences)
    assert request.model is None and request.stream is bool(body.get("stream"))


@pytest.mark.parametrize("body, param", [
    ({}, "text"),
    ({"text": None, "input_ids": None}, "text"),
    ({"text": [1, 2]}, "text"),
    ({"input_ids": "abc"}, "input_ids"),
    ({"input_ids": [-1]}, "input_ids"),
    ({"text": "x", "sampling_params": 3}, "sampling_params"),
    ({"text": "x", "sampling_params": []}, "sampling_params"),
    ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 1.5}}, "sampling_params.max_new_tokens"),
    ({"text": "x", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"text": "\ud800"}, "text"),
])
def test_malformed_generate_bodies_are_400_naming_the_field(body, param):
    with pytest.raises(RoutingError) as err:
        parse_body("r1", "POST", "/generate", json.dumps(body).encode())
    assert err.value.code == ErrorCode.BAD_REQUEST and err.value.param == param


@pytest.mark.parametrize("content_type, is_json", [
    (None, True), ("", True), ("application/json", True), ("Application/JSON; charset=utf-8", True),
    ("application/vnd.api+json", True), ("multipart/form-data; boundary=x", False), ("text/plain", False),
    ("application/x-www-form-urlencoded", False), ("text/json", False)])
def test_json_media_types_are_the_ones_fastapi_parses_as_json(content_type, is_json):
    assert is_json_media_type(content_type) is is_json


def test_an_opaque_body_is_routed_on_its_headers_except_on_an_inference_route():
    request = opaque_body_request("r", "POST", "/v1/audio/transcriptions?x=1", 1234)
    assert (request.path, request.model, request.prompt_text, request.num_body_bytes) == (
        "/v1/audio/transcriptions", None, None, 1234)
    with pytest.raises(RoutingError, match="takes a JSON body"):
        opaque_body_request("r", "POST", "/v1/chat/completions", 10)
