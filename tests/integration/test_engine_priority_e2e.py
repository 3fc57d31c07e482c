"""objectives.engine_priority through the real Envoy binary, in both body modes: the request body the backend
receives carries the priority vLLM reads, whole (with a content-length that matches it where Envoy sends one); an engine that schedules by
priority (the emulator with --scheduling-policy priority) serves a sheddable request that an fcfs engine refuses."""

from __future__ import annotations

import json

import httpx
import pytest

from astrolabe.procs import ProcessGroup
from tests.integration.stack import Stack

pytestmark = [pytest.mark.envoy]

EMU_MODEL = "llama-2-7b"
OBJECTIVES = {"named": {"critical": {"priority": 0, "ttft_ms": 1000}, "batch": {"priority": -1, "ttft_ms": 5000}},
              "admission": "none", "engine_priority": True}


@pytest.fixture(scope="module", params=["buffered", "full-duplex"])
def stack(request, tmp_path_factory):
    with ProcessGroup() as procs:
        s = Stack(procs, tmp_path_factory.mktemp(request.param), request.param)
        s.echo = s.start_echo()
        s.priority_engine = s.start_emulator("--served-model-name", EMU_MODEL, "--time-scale", "20",
                                             "--scheduling-policy", "priority")
        s.fcfs_engine = s.start_emulator("--served-model-name", "fcfs-model", "--time-scale", "20")
        sidecar = s.start_sidecar(s.priority_engine, "--state-source", "ledger", "--scheduling-policy", "priority",
                                  "--time-scale", "20")
        s.write_config([{"address": s.echo, "models": ["m"]},
                        {"address": s.priority_engine, "models": [EMU_MODEL], "predictor": sidecar},
                        {"address": s.fcfs_engine, "models": ["fcfs-model"]}],
                       policy="astrolabe", objectives=OBJECTIVES)
        s.start_extproc()
        s.start_envoy()
        yield s


def post(stack, body: dict, objective: str | None, path: str = "/v1/completions") -> httpx.Response:
    headers = {"content-type": "application/json"}
    if objective:
        headers["x-gateway-inference-objective"] = objective
    return httpx.post(f"{stack.envoy_url}{path}", content=json.dumps(body).encode(), headers=headers, timeout=30)


@pytest.mark.parametrize("objective, expected", [("critical", 0), ("batch", 1), (None, 0)])
def test_the_backend_receives_the_priority_with_a_matching_content_length(stack, objective, expected):
    body = {"model": "m", "prompt": "héllo " * 50, "max_tokens": 4, "priority": -50}  # the client's own is replaced
    reply = post(stack, body, objective)
    assert reply.status_code == 200, reply.text
    echo = reply.json()
    assert echo["priority"] == expected  # the whole body arrived: it parsed
    # buffered: Envoy sends the content-length the extproc set; full-duplex: Envoy streams the body chunked
    assert echo["content_length"] is None or int(echo["content_length"]) == echo["body_bytes"]


def test_chat_bodies_get_it_too(stack):
    reply = post(stack, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "batch",
                 "/v1/chat/completions")
    assert reply.status_code == 200, reply.text
    assert reply.json()["priority"] == 1


def test_a_priority_engine_serves_a_sheddable_request_that_an_fcfs_engine_refuses(stack):
    reply = post(stack, {"model": EMU_MODEL, "prompt": "hello there", "max_tokens": 8}, "batch")
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 8
    # what an engine left at fcfs answers to the same request: the reason the flag exists (extproc/config.py)
    refused = post(stack, {"model": "fcfs-model", "prompt": "hello there", "max_tokens": 8}, "batch")
    assert refused.status_code == 400
    assert "Priority scheduling is not enabled" in refused.text
    assert stack.metric('astrolabe_extproc_engine_priority_bodies_total{outcome="written"}') >= 2
