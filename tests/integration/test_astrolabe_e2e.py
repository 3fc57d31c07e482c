"""The astrolabe policy end to end: real Envoy -> extproc -> Po2 over 4 emulated instances with sidecars."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from astrolabe.procs import ProcessGroup
from predictor.api import pb, pb_grpc
from tests.integration.stack import Stack

pytestmark = [pytest.mark.envoy]

MODEL = "llama-2-7b"
TIME_SCALE = "10"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with ProcessGroup() as procs:
        s = Stack(procs, tmp_path_factory.mktemp("astrolabe"), "full-duplex")
        engine = ["--max-num-seqs", "4", "--max-num-batched-tokens", "512", "--num-gpu-blocks", "256"]
        emulators = [s.start_emulator("--time-scale", TIME_SCALE, *engine) for _ in range(4)]
        s.sidecars = {e: s.start_sidecar(e, "--time-scale", TIME_SCALE, *engine) for e in emulators}
        s.write_config([{"address": e, "models": [MODEL], "predictor": p} for e, p in s.sidecars.items()],
                       policy="astrolabe", policy_params={"k": 2},
                       predictor_client={"predict_timeout_s": 0.5},
                       objectives={"named": {"batch": {"priority": -1, "ttft_ms": 60000}}, "retry_after_s": 2})
        s.start_extproc()
        s.start_envoy()
        yield s


async def _one(client, stack, i):
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {i} " * 20}],
            "max_tokens": 24, "ignore_eos": True, "stream": True}
    async with client.stream("POST", f"{stack.envoy_url}/v1/chat/completions", json=body) as response:
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        return response.status_code, response.headers.get("x-emulator-instance"), lines


async def _burst(stack, n):
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(_one(client, stack, i) for i in range(n)))


def test_burst_is_served_and_routed_by_predictions(stack):
    results = asyncio.run(_burst(stack, 24))
    assert all(status == 200 for status, _, _ in results)
    assert all(lines[-1] == "data: [DONE]" for _, _, lines in results)
    served = {instance for _, instance, _ in results}
    assert len(served) >= 3  # 24 requests at 4 seqs per instance: queueing makes Po2 spread them
    assert stack.metric('astrolabe_extproc_requests_total{outcome="routed"}') >= 24
    with pytest.raises(KeyError):  # no request fell back
        stack.metric('astrolabe_extproc_requests_total{outcome="fallback"}')


async def _state(address):
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await pb_grpc.PredictorStub(channel).State(pb.StateRequest(), timeout=5)
        return json.loads(reply.state_json)


def test_sidecars_were_told_and_reconcile(stack):
    states = [asyncio.run(_state(p)) for p in stack.sidecars.values()]
    assert all(s["state_age_s"] < 2.0 for s in states)  # reconciled with the emulator's /metrics recently
    assert sum(s["reconcile"]["num_reconciliations"] for s in states) > 0


async def _loaded_then(stack, headers):
    """While a burst of 24 requests keeps every instance busy, one more request with ``headers``: its status,
    headers and body; and the burst's statuses."""
    async with httpx.AsyncClient(timeout=60) as client:
        burst = [asyncio.create_task(_one(client, stack, i)) for i in range(24)]
        await asyncio.sleep(0.5)
        body = {"model": MODEL, "prompt": "one more " * 20, "max_tokens": 8}
        response = await client.post(f"{stack.envoy_url}/v1/completions", json=body, headers=headers)
        statuses = [status for status, _, _ in await asyncio.gather(*burst)]
    return response, statuses


def test_a_sheddable_request_that_would_miss_its_objective_gets_429_with_retry_after(stack):
    # names the sheddable objective and tightens it to 1 ms, out of reach on a busy instance
    response, statuses = asyncio.run(_loaded_then(stack, {"x-gateway-inference-objective": "batch",
                                                          "x-slo-ttft-ms": "1"}))
    assert statuses == [200] * 24
    assert response.status_code == 429, response.text
    assert response.headers["retry-after"] == "2"
    assert response.headers["x-astrolabe-drop-reason"] == "slo_unreachable"
    assert response.json()["error"]["code"] == 429 and "slo_unreachable" in response.json()["error"]["message"]
    assert stack.metric('astrolabe_extproc_shed_total{priority="-1",reason="slo_unreachable"}') >= 1
    # the same objective without the sheddable priority is routed (priority >= 0 is never refused); so is a
    # request whose objective header is absurd (ignored, counted)
    response, _ = asyncio.run(_loaded_then(stack, {"x-slo-ttft-ms": "1", "x-slo-tpot-ms": "-4"}))
    assert response.status_code == 200
    assert stack.metric('astrolabe_extproc_objective_headers_invalid_total{header="x-slo-tpot-ms"}') >= 1
