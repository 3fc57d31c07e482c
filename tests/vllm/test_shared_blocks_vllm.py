"""Shared KV blocks that no block key names, on real vLLM: identical prompts sent to a server directly (no router,
so its plugin-mode sidecar has no Admit and no keys for them) run together on blocks vLLM's prefix cache shares;
counted per request, their blocks exceed the KV cache. The sidecar's Predict must still answer (the snapshot gives
them a synthetic shared prefix, ``predictor.state_source.explain_shared_blocks``); it answered INVALID_ARGUMENT
("N blocks wanted, 0 free") before.
"""

from __future__ import annotations

import asyncio
import json
import math

import grpc
import httpx
import pytest

from deploy.vllm.launch import SERVED_MODEL_NAME
from predictor.api import pb, pb_grpc

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = " ".join(["story"] * 180)
"""~180 tokens of the tiny model: 5 full 32-token blocks that identical requests share."""


def test_identical_prompts_beyond_the_kv_cache_still_get_predictions(vllm_stack):
    server = vllm_stack.vllm[0]
    sidecar = vllm_stack.sidecars[server.address]
    over: list[tuple[int, int]] = []  # (blocks counted per request, the engine's blocks) when the first exceeds
    answers: list[float] = []

    async def run() -> None:
        async with httpx.AsyncClient(base_url=f"http://{server.address}", timeout=300) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json={
                "model": SERVED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 48, "ignore_eos": True}))
                for _ in range(12)]
            async with grpc.aio.insecure_channel(sidecar) as channel:
                stub = pb_grpc.PredictorStub(channel)
                while not all(t.done() for t in tasks):
                    state = json.loads(server.state_path.read_text())
                    engine = state["engine"]
                    counted = sum(math.ceil(row[2] / engine["block_size"]) for row in state["running"])
                    if counted > engine["num_gpu_blocks"]:
                        over.append((counted, engine["num_gpu_blocks"]))
                        reply = await stub.Predict(pb.PredictRequest(
                            request_id="probe", num_prompt_tokens=40, num_predicted_output_tokens=8), timeout=10)
                        answers.append(reply.ttft_s)
                    await asyncio.sleep(0.05)
            for response in await asyncio.gather(*tasks):
                assert response.status_code == 200, response.text

    asyncio.run(run())
    assert over, "the running requests never held more blocks, counted apiece, than the cache: nothing was tested"
    assert len(answers) == len(over) and all(a > 0 for a in answers)
