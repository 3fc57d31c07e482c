"""End to end through the real Envoy binary, in both body modes: client -> Envoy -> extproc -> backend."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from astrolabe.procs import ProcessGroup, free_port
from tests.integration.stack import Stack

pytestmark = [pytest.mark.envoy]

MODEL = "m"
EMU_MODEL = "llama-2-7b"
MAX_BODY_BYTES = 6 * 1024 * 1024


@pytest.fixture(scope="module", params=["buffered", "full-duplex"])
def stack(request, tmp_path_factory):
    with ProcessGroup() as procs:
        s = Stack(procs, tmp_path_factory.mktemp(request.param), request.param)
        echoes = sorted(s.start_echo() for _ in range(3))
        s.outsider = s.start_echo()  # running, but not in the pool
        s.emulator = s.start_emulator("--served-model-name", EMU_MODEL, "--time-scale", "20")
        s.dead = f"127.0.0.1:{free_port()}"  # nothing listens there
        s.echoes = echoes
        s.write_config([{"address": a, "models": [MODEL]} for a in echoes]
                       + [{"address": s.emulator, "models": [EMU_MODEL]},
                          {"address": s.dead, "models": ["dead-model"]}],
                       policy="round-robin", max_body_bytes=MAX_BODY_BYTES)
        s.start_extproc()
        s.start_envoy()
        yield s


def post(stack, path, body, headers=None, timeout=30):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{stack.envoy_url}{path}", content=content, timeout=timeout,
                      headers={"content-type": "application/json", **(headers or {})})


def completion(prompt="hello", model=MODEL, **extra):
    return {"model": model, "prompt": prompt, "max_tokens": 4, **extra}


def test_served_by_the_endpoint_the_policy_chose(stack):
    served = []
    for _ in range(6):
        reply = post(stack, "/v1/completions", completion())
        assert reply.status_code == 200, reply.text
        echo = reply.json()
        # the backend that answered is the one named in the destination header the extproc set
        assert echo["destination_header"] == echo["served_by"]
        served.append(echo["served_by"])
    # round-robin over the pool in address order
    start = stack.echoes.index(served[0])
    assert served == [stack.echoes[(start + i) % 3] for i in range(6)]


def test_chat_and_get_are_routed(stack):
    reply = post(stack, "/v1/chat/completions",
                 {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert reply.status_code == 200 and reply.json()["served_by"] in stack.echoes
    reply = httpx.get(f"{stack.envoy_url}/v1/models", timeout=10)
    assert reply.status_code == 200


def test_client_destination_header_is_ignored(stack):
    for _ in range(4):
        reply = post(stack, "/v1/completions", completion(),
                     headers={"x-gateway-destination-endpoint": stack.outsider})
        echo = reply.json()
        assert echo["served_by"] in stack.echoes and echo["served_by"] != stack.outsider
        assert echo["destination_header"] == echo["served_by"]  # overwritten, not appended


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (json.dumps({"model": MODEL}).encode(), 400, "'prompt' is required"),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "many"}).encode(), 400, "max_tokens"),
        (json.dumps({"model": "unknown", "prompt": "x"}).encode(), 404, "does not exist"),
        (json.dumps({"model": "dead-model", "prompt": "x"}).encode(), 503, "no healthy endpoint"),
        (json.dumps({"model": MODEL, "prompt": "x" * (MAX_BODY_BYTES + 1)}).encode(), 413, "exceeds the limit"),
    ],
    ids=["not-json", "not-object", "no-prompt", "wrong-type", "unknown-model", "no-healthy-endpoint", "too-large"],
)
def test_errors_arrive_with_status_and_json_body(stack, body, status, fragment):
    reply = post(stack, "/v1/completions", body)
    assert reply.status_code == status, reply.text[:200]
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert error["code"] == status and fragment in error["message"]


def test_large_prompt_routes_intact(stack):
    prompt = "y" * (5 * 1024 * 1024)
    body = json.dumps(completion(prompt)).encode()
    if stack.mode == "buffered":
        # within the extproc limit and Envoy's 16 MiB buffer too
        assert len(body) < MAX_BODY_BYTES
    reply = post(stack, "/v1/completions", body, timeout=60)
    assert reply.status_code == 200, reply.text[:300]
    echo = reply.json()
    import hashlib
    assert echo["body_bytes"] == len(body) and echo["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert echo["served_by"] in stack.echoes


def _sse_events(response):
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[len("data: "):])
    return events


def test_sse_streaming_passes_through(stack):
    body = {"model": EMU_MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 12,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{stack.envoy_url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-emulator-instance"] == stack.emulator
        events = _sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def _wait_in_flight(stack, endpoint, expected, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while (value := stack.in_flight(endpoint)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def test_in_flight_held_until_the_http_request_ends(stack):
    """Envoy keeps the ext_proc stream open for the whole HTTP request, streaming response included."""
    body = {"model": EMU_MODEL, "prompt": "x", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{stack.envoy_url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert stack.in_flight(stack.emulator) == 1  # first token arrived, request still streaming
        for _ in lines:
            pass
    assert _wait_in_flight(stack, stack.emulator, 0) == 0


def test_in_flight_released_on_client_disconnect(stack):
    body = {"model": EMU_MODEL, "prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{stack.envoy_url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()  # keep a reference: closing the generator would close the response
        next(line for line in lines if line.startswith("data: "))
        assert stack.in_flight(stack.emulator) == 1
        time.sleep(0.3)
        assert stack.in_flight(stack.emulator) == 1
    # leaving the block closes the connection mid-stream
    assert _wait_in_flight(stack, stack.emulator, 0) == 0


def test_extproc_restart_while_envoy_runs_recovers(stack):
    """A stream routed before SIGTERM finishes intact; requests fail closed while no extproc runs; then recover."""
    body = {"model": EMU_MODEL, "prompt": "x", "max_tokens": 30, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{stack.envoy_url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        stack.extproc.stop()  # SIGTERM: drain delay, then routed streams are closed with OK status
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"  # the response was not cut
    reply = post(stack, "/v1/completions", completion())
    assert reply.status_code == 503  # fail closed: status_on_error
    stack.start_extproc()
    deadline = time.monotonic() + 30
    while True:
        reply = post(stack, "/v1/completions", completion())
        if reply.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert reply.status_code == 200 and reply.json()["served_by"] in stack.echoes


def test_a_body_far_over_the_limit_gets_413_not_a_reset(stack):
    """42 MB, still being sent when the answer comes (an issue-14 report saw a connection reset in full-duplex
    mode): a 413. Full-duplex: the extproc's OpenAI-style JSON. Buffered: Envoy's own 413 (plain text), since the
    body is over Envoy's buffer limit (16 MiB) before the extproc sees it."""
    reply = post(stack, "/v1/completions", {"model": MODEL, "prompt": "x" * (7 * MAX_BODY_BYTES)})
    assert reply.status_code == 413, reply.text[:200]
    if stack.mode == "full-duplex":
        assert reply.json()["error"]["code"] == 413
