"""Envoy's own replies through the real Envoy binary: OpenAI-style JSON errors like the extproc's, status kept.

Each case makes Envoy answer by itself (`astrolabe.envoy.local_reply_config`): a backend that refuses the connection
(503), request headers over Envoy's 60 KiB limit (431; the ext_proc filter is skipped for that reply, else it was
lost with the connection), a body over buffered mode's 16 MiB buffer (413), no processor reachable (503), and the
least-request baseline with no backend up (503). The extproc's own answers (a bad body, a POST without a body) pass
through unchanged: not wrapped in a second error.
"""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from astrolabe.envoy import DEFAULT_BUFFER_LIMIT_BYTES
from astrolabe.procs import ProcessGroup, free_port
from tests.extproc.fuzz_bodies import assert_openai_error
from tests.integration.stack import PY, Stack, signal_process

pytestmark = [pytest.mark.envoy]

MODEL = "m"
DOOMED_MODEL = "doomed"
ENVOY_BUFFER_BYTES = DEFAULT_BUFFER_LIMIT_BYTES
"""Buffered mode's per-connection buffer: a larger body is Envoy's 413."""


@pytest.fixture(scope="module", params=["full-duplex", "buffered"])
def stack(request, tmp_path_factory):
    """Two backends: one serves model m, the other (model "doomed") is killed once the extproc saw it healthy, so
    the extproc still routes to it (its active check runs every 60 s) and Envoy's connection is refused."""
    with ProcessGroup() as procs:
        s = Stack(procs, tmp_path_factory.mktemp(request.param), request.param)
        alive, doomed = s.start_echo(), s.start_echo()
        s.write_config([{"address": alive, "models": [MODEL]}, {"address": doomed, "models": [DOOMED_MODEL]}],
                       policy="least-requests",
                       health_check={"interval_s": 60, "timeout_s": 0.5, "unhealthy_threshold": 1})
        s.start_extproc()
        s.start_envoy()
        signal_process(s.backends[doomed], signal.SIGKILL)
        s.backends[doomed].wait(timeout_s=10)
        s.doomed = doomed
        yield s


def _post(url: str, content: bytes, path: str = "/v1/completions", headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=content, timeout=30,
                      headers={"content-type": "application/json", **(headers or {})})


def _envoy_error(reply: httpx.Response, status: int) -> dict:
    """The OpenAI-style error of one of Envoy's own replies: its message ends with Envoy's response code details."""
    assert reply.status_code == status, reply.text[:300]
    assert reply.headers["content-type"] == "application/json"
    error = assert_openai_error(status, reply.content)
    assert "(Envoy: " in error["message"] and error["param"] is None, error
    return error


def test_a_refused_connection_is_a_json_503(stack):
    reply = _post(stack.envoy_url, json.dumps({"model": DOOMED_MODEL, "prompt": "hi"}).encode())
    error = _envoy_error(reply, 503)
    assert error["type"] == "ServiceUnavailableError"
    assert "connection failure" in error["message"] and "upstream_reset_before_response_started" in error["message"]


def test_headers_over_envoys_limit_get_a_json_431(stack):
    """The HTTP/1 codec refuses the headers (Envoy's default max_request_headers_kb, 60 KiB) and closes the
    connection after its reply: the reply must not wait for the processor (it did, and was lost)."""
    routed = stack.metric("astrolabe_extproc_requests_total")
    reply = _post(stack.envoy_url, json.dumps({"model": MODEL, "prompt": "hi"}).encode(),
                  headers={"x-padding": "p" * (80 * 1024)})
    error = _envoy_error(reply, 431)
    assert error["type"] == "RequestHeaderFieldsTooLargeError" and "http1.headers_too_large" in error["message"]
    assert stack.metric("astrolabe_extproc_requests_total") == routed  # the extproc never saw it


def test_a_body_over_the_limit_gets_a_json_413(stack):
    """Buffered: over Envoy's 16 MiB buffer, Envoy's own 413. Full duplex: no Envoy limit, the extproc's 413 (over
    its max_body_bytes, 8 MiB by default), which passes unchanged."""
    reply = _post(stack.envoy_url, json.dumps({"model": MODEL, "prompt": "x" * ENVOY_BUFFER_BYTES}).encode())
    if stack.mode == "buffered":
        error = _envoy_error(reply, 413)
        assert error["type"] == "RequestTooLargeError" and "request_payload_too_large" in error["message"]
    else:
        error = assert_openai_error(413, reply.content)
        assert "exceeds the limit" in error["message"] and "(Envoy: " not in error["message"]


def test_the_extprocs_own_errors_pass_unchanged(stack):
    reply = _post(stack.envoy_url, b"{not json")
    error = assert_openai_error(400, reply.content)
    assert error["message"].startswith("request body is not valid JSON") and "Envoy" not in error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_post_without_a_body_to_an_inference_route_is_400(stack, path):
    reply = _post(stack.envoy_url, b"", path=path)
    assert reply.status_code == 400 and reply.headers["content-type"] == "application/json"
    error = assert_openai_error(400, reply.content)
    assert error["type"] == "BadRequestError" and "body is empty" in error["message"]


def test_requests_without_a_body_elsewhere_are_still_routed(stack):
    assert httpx.get(f"{stack.envoy_url}/v1/models", timeout=10).status_code == 200
    reply = _post(stack.envoy_url, b"", path="/v1/embeddings")
    assert reply.status_code == 200 and reply.json()["body_bytes"] == 0


def test_no_processor_is_a_json_503(stack):
    """An Envoy whose processor address has nothing listening (FailClose): the ext_proc filter's status_on_error."""
    port, admin = free_port(), free_port()
    proc = stack.procs.start([PY, "-m", "astrolabe", "envoy", "--mode", stack.mode, "--listen-port", str(port),
                              "--admin-port", str(admin), "--extproc", f"127.0.0.1:{free_port()}"],
                             name=f"envoy-no-picker-{port}", log_path=stack.tmp / f"envoy-no-picker-{port}.log")
    try:
        proc.wait_http(f"http://127.0.0.1:{admin}/ready", timeout_s=20)
        for reply in (_post(f"http://127.0.0.1:{port}", json.dumps({"model": MODEL, "prompt": "hi"}).encode()),
                      httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30)):
            error = _envoy_error(reply, 503)
            assert error["message"].startswith("the endpoint picker (ext_proc) did not answer the request")
            assert "ext_proc_error" in error["message"]
    finally:
        proc.stop()


def test_the_least_request_baseline_answers_json_too(tmp_path):
    """Every template carries the same local_reply_config: no backend listening, Envoy's 503 is JSON."""
    with ProcessGroup() as procs:
        port, admin = free_port(), free_port()
        proc = procs.start([PY, "-m", "astrolabe", "envoy", "--mode", "least-request", "--listen-port", str(port),
                            "--admin-port", str(admin), "--backends", f"127.0.0.1:{free_port()}"],
                           name="envoy-least-request", log_path=tmp_path / "envoy.log")
        proc.wait_http(f"http://127.0.0.1:{admin}/ready", timeout_s=20)
        error = _envoy_error(_post(f"http://127.0.0.1:{port}", b'{"model": "m", "prompt": "hi"}'), 503)
        assert error["type"] == "ServiceUnavailableError"
