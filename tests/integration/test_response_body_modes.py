"""Real Envoy asking the extproc for the response too, as Istio's InferencePool support does (response headers
sent, response body FULL_DUPLEX_STREAMED): the response reaches the client whole, streamed or not."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from astrolabe.envoy import envoy_binary
from bench.procs import ProcessGroup, free_port
from tests.integration.stack import Stack

pytestmark = [pytest.mark.envoy]
PY = sys.executable
MODEL = "m"


@pytest.fixture(scope="module")
def envoy_url(tmp_path_factory):
    with ProcessGroup() as procs:
        s = Stack(procs, tmp_path_factory.mktemp("response-body"), "full-duplex")
        emulator = s.start_emulator("--served-model-name", MODEL, "--time-scale", "0.05")
        s.write_config([{"address": emulator, "models": [MODEL]}], policy="least-requests")
        s.start_extproc()
        port, admin = free_port(), free_port()
        rendered = subprocess.run(
            [PY, "-m", "astrolabe", "envoy", "--mode", "full-duplex", "--listen-port", str(port), "--admin-port",
             str(admin), "--extproc", f"127.0.0.1:{s.extproc_port}", "--print-config"],
            capture_output=True, text=True, check=True).stdout
        patched = rendered.replace("response_header_mode: SKIP", "response_header_mode: SEND").replace(
            "response_body_mode: NONE", "response_body_mode: FULL_DUPLEX_STREAMED")
        assert "response_body_mode: FULL_DUPLEX_STREAMED" in patched and "response_header_mode: SEND" in patched
        config = s.tmp / "envoy-response-body.yaml"
        config.write_text(patched)
        proc = procs.start([str(envoy_binary()), "-c", str(config), "--disable-hot-restart", "--log-level", "warning"],
                           name="envoy-response-body", log_path=s.tmp / "envoy-response-body.log")
        proc.wait_http(f"http://127.0.0.1:{admin}/ready", timeout_s=20)
        s.envoy_url = f"http://127.0.0.1:{port}"
        s.wait_routable()
        yield s.envoy_url


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_the_response_body_comes_back_whole(envoy_url, stream):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 40, "ignore_eos": True, "stream": stream}
    response = httpx.post(f"{envoy_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text[:300]
    if stream:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in events[:-1]) >= 1
    else:
        assert response.json()["usage"]["completion_tokens"] == 40
