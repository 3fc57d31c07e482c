"""A burst that saturates this machine, through real Envoy -> extproc -> 4 emulators with sidecars, at the default
20 ms Predict deadline: most decisions must still be made on predictions, and no sidecar may be put in backoff
for being late (users saw 2,116 of 2,236 requests fall back at concurrency 50 before the client told a late
sidecar from a dead one)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from astrolabe.procs import ProcessGroup
from tests.integration.stack import Stack

pytestmark = [pytest.mark.envoy, pytest.mark.slow]

MODEL = "llama-2-7b"
NUM_REQUESTS = 400
CONCURRENCY = 50


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with ProcessGroup() as procs:
        s = Stack(procs, tmp_path_factory.mktemp("burst"), "full-duplex")
        engine = ["--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--num-gpu-blocks", "1024",
                  "--time-scale", "1"]
        emulators = [s.start_emulator(*engine) for _ in range(4)]
        sidecars = {e: s.start_sidecar(e, *engine) for e in emulators}
        s.write_config([{"address": e, "models": [MODEL], "predictor": p} for e, p in sidecars.items()],
                       policy="astrolabe", predictor_client={"mode": "predict"})  # 20 ms deadline
        # Predict mode: this tier is about Predict round trips under a burst; the default (predictions in the
        # router) never waits on a sidecar, and test_herding checks its bursts.
        s.start_extproc()
        s.start_envoy()
        yield s


async def _burst(url: str) -> list[int]:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {i} " * 30}],
                "max_tokens": 16, "ignore_eos": True, "stream": True}
        async with gate, client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_lines():
                pass
            return response.status_code

    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(one(client, i) for i in range(NUM_REQUESTS)))


def _sum(stack: Stack, name: str, label: str = "") -> float:
    """Sum of the samples of counter ``name`` whose labels contain ``label`` (e.g. ``outcome="ok"``)."""
    return sum(float(line.split()[-1]) for line in httpx.get(stack.metrics_url, timeout=2).text.splitlines()
               if line.startswith(name + "{") and label in line)


def test_a_burst_is_routed_mostly_on_predictions(stack):
    statuses = asyncio.run(_burst(stack.envoy_url))
    assert statuses == [200] * NUM_REQUESTS
    decisions = _sum(stack, "astrolabe_extproc_decisions_total")
    on_predictions = _sum(stack, "astrolabe_extproc_decisions_total", 'basis="prediction"')
    late = _sum(stack, "astrolabe_extproc_predictor_calls_total", 'outcome="late"')
    skipped = _sum(stack, "astrolabe_extproc_predictor_calls_total", 'outcome="skipped_backoff"')
    print(f"burst: {on_predictions:.0f} of {decisions:.0f} decisions on predictions, {late:.0f} Predicts late, "
          f"{skipped:.0f} skipped by backoff")
    assert decisions >= NUM_REQUESTS and _sum(stack, "astrolabe_extproc_predictor_calls_total") >= 2 * NUM_REQUESTS
    assert on_predictions / decisions > 0.5
    assert skipped < 0.05 * 2 * NUM_REQUESTS
