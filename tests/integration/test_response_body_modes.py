"""Real Envoy asking the extproc for the response too, as Istio's InferencePool support does (response headers
sent, response body FULL_DUPLEX_STREAMED): the response reaches the client whole, streamed or not."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from astrolabe.envoy import envoy_binary
from astrolabe.procs import ProcessGroup, free_port
from tests.integration.stack import Stack

pytestmark = [pytest.mark.envoy]
PY = sys.executable
MODEL = "m"


def _start(procs: ProcessGroup, tmp, time_scale: str = "0.05", **config) -> tuple[Stack, str]:
    """Emulator, extproc and a real Envoy whose ext_proc filter sends response headers and streams response
    bodies (FULL_DUPLEX_STREAMED), as Istio's InferencePool support configures it; returns (stack, Envoy URL)."""
    s = Stack(procs, tmp, "full-duplex")
    emulator = s.start_emulator("--served-model-name", MODEL, "--time-scale", time_scale)
    s.write_config([{"address": emulator, "models": [MODEL]}], policy="least-requests", **config)
    s.start_extproc()
    port, admin = free_port(), free_port()
    rendered = subprocess.run(
        [PY, "-m", "astrolabe", "envoy", "--mode", "full-duplex", "--listen-port", str(port), "--admin-port",
         str(admin), "--extproc", f"127.0.0.1:{s.extproc_port}", "--print-config"],
        capture_output=True, text=True, check=True).stdout
    patched = rendered.replace("response_header_mode: SKIP", "response_header_mode: SEND").replace(
        "response_body_mode: NONE", "response_body_mode: FULL_DUPLEX_STREAMED")
    assert "response_body_mode: FULL_DUPLEX_STREAMED" in patched and "response_header_mode: SEND" in patched
    path = s.tmp / "envoy-response-body.yaml"
    path.write_text(patched)
    proc = procs.start([str(envoy_binary()), "-c", str(path), "--disable-hot-restart", "--log-level", "warning"],
                       name="envoy-response-body", log_path=s.tmp / "envoy-response-body.log")
    proc.wait_http(f"http://127.0.0.1:{admin}/ready", timeout_s=20)
    s.envoy_url = f"http://127.0.0.1:{port}"
    s.wait_routable()
    return s, s.envoy_url


@pytest.fixture(scope="module")
def envoy_url(tmp_path_factory):
    with ProcessGroup() as procs:
        yield _start(procs, tmp_path_factory.mktemp("response-body"))[1]


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


async def test_responses_in_flight_arrive_whole_when_the_extproc_is_stopped(tmp_path):
    """SIGTERM to the extproc while 6 long responses stream through it: in this mode Envoy forwards only what the
    processor sends back, so the extproc keeps those streams open until their responses end (within the grace
    period) instead of closing them at once, which cut 1-2 events or whole bodies (a break-it pass, 4 of 6 runs)."""
    with ProcessGroup() as procs:
        # Responses of a few seconds: they outlast the extproc's drain delay (0.5 s) after the SIGTERM.
        stack, url = _start(procs, tmp_path, time_scale="0.5", grace_period_s=20.0)

        async def one(client: httpx.AsyncClient, stream: bool):
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 600, "ignore_eos": True, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            response = await client.post(f"{url}/v1/completions", json=body)
            return response.status_code, response.text

        async with httpx.AsyncClient(timeout=60) as client:
            tasks = [asyncio.create_task(one(client, stream=i % 2 == 0)) for i in range(6)]
            await asyncio.sleep(0.3)
            os.kill(stack.extproc.pid, signal.SIGTERM)
            results = await asyncio.gather(*tasks)
        # it exits on its own once the responses are done (a second SIGTERM could land after its event loop closed,
        # where the default action kills it: a loaded run saw -15)
        assert stack.extproc.wait(timeout_s=30) == 0
    for status, text in results:
        assert status == 200, text[:200]
        if text.startswith("data: "):
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            usage = json.loads(events[-2])["usage"]
            chunks = [json.loads(e) for e in events[:-2]]
            assert sum(len(c["choices"]) for c in chunks if c["choices"]) == usage["completion_tokens"] == 600
        else:
            assert json.loads(text)["usage"]["completion_tokens"] == 600
