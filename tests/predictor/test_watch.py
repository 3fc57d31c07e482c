"""Watch streams (protocol v1.2) of a sidecar in plugin mode: what makes a state worth sending, and what each
stream costs while nothing changes (``predictor/server.py`` ``Sidecar._watch_loop``)."""

from __future__ import annotations

import asyncio
import os
import time

import grpc

from predictor.api import pb, pb_grpc
from predictor.instance_state import decode
from predictor.server import WATCH_HEARTBEAT_S, Sidecar, SidecarConfig
from tests.predictor.test_state_source import _state_text


def _write(path, seq: int, running: list) -> None:
    """Replaces the state file atomically, as the plugin does."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(_state_text(seq=seq, published_monotonic_s=time.monotonic(), running=running))
    os.replace(tmp, path)


def _rows(num_generated: int, ids=("cmpl-a-0-1a2b3c4d", "cmpl-b-0-1a2b3c4d")) -> list:
    return [[rid, 40, 40 + num_generated, num_generated, 200, 4, 0] for rid in ids]


async def test_progress_alone_waits_for_the_heartbeat_and_a_queue_change_is_sent_with_the_next_poll(tmp_path):
    """An engine that publishes every 5 ms while its requests only decode: each stream gets a state per heartbeat
    (with the newest progress), not one per poll; a request that joins the queue reaches both streams at once."""
    path = tmp_path / "state.json"
    _write(path, 1, _rows(1))
    sidecar = Sidecar(SidecarConfig(backend="127.0.0.1:1", listen="127.0.0.1:0", state_source="vllm-plugin",
                                    vllm_state_path=str(path), discover_kv_cache=False, watch_interval_s=0.01))
    await sidecar.start()
    received: dict[int, list[tuple[float, object]]] = {1: [], 2: []}

    async def follow(stub, router_id):
        async for message in stub.Watch(pb.WatchRequest(router_id=router_id), timeout=10):
            received[router_id].append((time.monotonic(), decode(message)))

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            stub = pb_grpc.PredictorStub(channel)
            tasks = [asyncio.create_task(follow(stub, r)) for r in (1, 2)]
            await asyncio.sleep(0.2)
            start_s, seq = time.monotonic(), 1
            while time.monotonic() - start_s < 1.0:  # decode progress only: 200 publications
                seq += 1
                _write(path, seq, _rows(seq))
                await asyncio.sleep(0.005)
            progress = {r: [s for t, s in received[r] if t >= start_s] for r in received}
            changed_s = time.monotonic()
            _write(path, seq + 1, _rows(seq + 1, ("cmpl-a-0-1a2b3c4d", "cmpl-b-0-1a2b3c4d", "cmpl-c-0-1a2b3c4d")))
            while time.monotonic() - changed_s < 2 and not all(
                    any(len(s.snapshot.running) == 3 for t, s in received[r] if t >= changed_s) for r in received):
                await asyncio.sleep(0.005)
            for task in tasks:
                task.cancel()
    finally:
        await sidecar.stop(0)
    for router_id, states in progress.items():
        # ~10 heartbeats in the second (the 10 ms poll saw ~100 publications), each with fresh progress
        assert 3 <= len(states) <= 1.0 / WATCH_HEARTBEAT_S + 3, (router_id, len(states))
        generated = [s.snapshot.running[0].num_generated_tokens for s in states]
        assert generated == sorted(generated) and generated[-1] > generated[0] + 100
        assert any(len(s.snapshot.running) == 3 for t, s in received[router_id] if t >= changed_s)
