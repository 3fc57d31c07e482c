"""Engine priority on real vLLM (``--scheduling-policy priority``): the extproc writes each request's priority into
the body (objectives.engine_priority), vLLM serves it, the plugin publishes the policy and every request's priority
from vLLM's own Request objects, and the sidecar beside it predicts by them (README "Priority in the engine").

Its own stack (one vLLM server with the policy, its sidecar in plugin mode, the extproc, Envoy), stopped by PID at
the end of the module; logs in ``.cache/vllm/test-priority/``.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from astrolabe.procs import ProcessGroup
from deploy.vllm.launch import SERVED_MODEL_NAME, VllmSettings, start_vllm_servers
from predictor.api import pb, pb_grpc
from predictor.state_source import parse_plugin_state
from tests.integration.stack import Stack
from tests.vllm.conftest import BATCH_TIME_MODEL, ROUTER_SETTINGS, fresh_run_dir

pytestmark = [pytest.mark.vllm, pytest.mark.envoy, pytest.mark.slow]

OBJECTIVES = {"named": {"critical": {"priority": 0, "ttft_ms": 1000}, "batch": {"priority": -1, "ttft_ms": 5000}},
              "admission": "none", "engine_priority": True}


@pytest.fixture(scope="module")
def priority_stack():
    tmp = fresh_run_dir("test-priority")
    with ProcessGroup() as procs:
        (server,) = start_vllm_servers(procs, 1, tmp, settings=VllmSettings(scheduling_policy="priority"))
        stack = Stack(procs, tmp, "buffered")
        stack.server = server
        # no --scheduling-policy flag: in plugin mode the engine's state file says it
        stack.sidecar = stack.start_sidecar(server.address, "--state-source", "vllm-plugin", "--vllm-state-path",
                                            str(server.state_path), "--batch-time-model", str(BATCH_TIME_MODEL),
                                            "--calibration", "off")
        stack.write_config([{"address": server.address, "models": [SERVED_MODEL_NAME], "predictor": stack.sidecar}],
                           policy="astrolabe", seed=0, objectives=OBJECTIVES, **ROUTER_SETTINGS)
        stack.start_extproc()
        stack.start_envoy()
        yield stack


_PROMPTS = iter(range(1_000_000))
WAVES = 3
"""Bursts each test sends at most before it gives up on seeing the queue it needs."""
FULL_QUEUE = 3
"""Waiting requests enough that a probe queued behind them cannot start in the engine's next step: three prompts
of 120 tokens (`_complete`) overrun one step's 256-token budget by themselves (two and a 40-token probe already
do; one more for margin)."""


async def _complete(client: httpx.AsyncClient, url: str, objective: str, max_tokens: int) -> httpx.Response:
    # A prompt of its own (its first block differs): vLLM's prefix cache shares no block between these requests, so
    # this test is about priorities only (shared blocks no key names: tests/vllm/test_shared_blocks_vllm.py).
    # 120 tokens each: two waiting prompts and a 40-token probe overrun one step's 256-token budget
    # (VllmSettings.max_num_batched_tokens), so a probe queued behind even two of them starts a step later than one
    # that passes them; 120 + 96 stays within max_model_len 256.
    return await client.post(f"{url}/v1/completions", headers={"x-gateway-inference-objective": objective},
                             json={"model": SERVED_MODEL_NAME, "prompt": f"{next(_PROMPTS)} tell me a long story " * 20,
                                   "max_tokens": max_tokens, "ignore_eos": True})


def test_vllm_serves_the_priority_the_extproc_writes_and_the_plugin_publishes_it(priority_stack):
    url, state_path = priority_stack.envoy_url, priority_stack.server.state_path
    seen: list[dict] = []

    async def wave() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            tasks = [asyncio.create_task(_complete(client, url, "batch", 96)) for _ in range(24)]
            await asyncio.sleep(0.5)
            tasks.append(asyncio.create_task(_complete(client, url, "critical", 8)))
            while not all(t.done() for t in tasks):
                seen.append(json.loads(state_path.read_text()))
                await asyncio.sleep(0.05)
            return await asyncio.gather(*tasks)

    # This process can be starved for a second or more while vLLM runs the burst on a 2-core machine, and a wave may
    # finish unsampled: a fresh wave then (at most WAVES).
    replies: list[httpx.Response] = []
    for _ in range(WAVES):
        replies += asyncio.run(wave())
        busy = [s for s in seen if s["running"] or s["waiting"]]
        if any(p == 1 for s in busy for p, _ in s["priorities"]):
            break
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    assert busy and all(s["engine"].get("scheduling_policy") == "priority" for s in busy)
    # vLLM's own Request objects carried the priorities the extproc wrote (batch -1 -> vLLM 1, critical -> 0)
    assert {p for s in busy for p, _ in s["priorities"]} <= {0, 1} and any(p == 1 for s in busy
                                                                            for p, _ in s["priorities"])
    state = parse_plugin_state(json.dumps(busy[-1]))
    assert state.engine.scheduling_policy == "priority" and len(state.priorities) == state.num_unfinished
    assert priority_stack.metric('astrolabe_extproc_engine_priority_bodies_total{outcome="written"}') >= len(replies)


def test_the_sidecar_watches_and_predicts_with_the_engines_policy(priority_stack):
    async def wave(best):
        async with httpx.AsyncClient(timeout=300) as client, \
                grpc.aio.insecure_channel(priority_stack.sidecar) as channel:
            stub = pb_grpc.PredictorStub(channel)
            tasks = [asyncio.create_task(_complete(client, priority_stack.envoy_url, "batch", 96)) for _ in range(24)]
            while not all(t.done() for t in tasks):
                # the batch probe first: its TTFT depends on the queue, the critical one's (it passes the queue)
                # hardly, so a queue that drains between the two calls cannot make the critical one look later
                batch, critical = [await stub.Predict(pb.PredictRequest(
                    request_id="probe", num_prompt_tokens=40, num_predicted_output_tokens=8, priority=p), timeout=5)
                    for p in (1, 0)]
                state = await stub.Watch(pb.WatchRequest(router_id=9), timeout=5).read()
                if batch.num_waiting and (best is None or batch.num_waiting > best[1].num_waiting):
                    best = (critical, batch, state)
                await asyncio.sleep(0.1)
            await asyncio.gather(*tasks)
            return best

    best = None
    for _ in range(WAVES):  # a fresh wave where a starved sampler saw under FULL_QUEUE waiting (see the test above)
        best = asyncio.run(wave(best))
        if best is not None and best[1].num_waiting >= FULL_QUEUE:
            break
    assert best is not None, "the sidecar never saw a queue"
    critical, batch, state = best
    assert batch.num_waiting >= FULL_QUEUE, batch
    assert state.scheduling_policy == "priority"
    assert critical.ttft_s < batch.ttft_s  # a critical request is predicted to pass the queued batch work
