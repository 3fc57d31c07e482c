"""Real vLLM's KV cache events, read by `predictor.kv_events`: the index's keys equal the router's keys.

One vLLM server of its own (tiny model, prefix caching on, ``--kv-events-config`` publishing over ZMQ on a free
loopback port), the project's `KvEventSubscriber` in this process. A token-id prompt is sent twice and a longer
one sharing its first blocks once; the index then holds exactly the keys `predictor.sim.block_hash.block_keys`
gives for those token ids (what the extproc computes for the request), decoded from vLLM's own encoding, with no
undecodable batch. Stopped by PID at the end; its log stays in ``.cache/vllm/test-kv-events/`` (as the tier's
other logs in ``.cache/vllm/test-run/``).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import httpx
import msgpack
import pytest
import zmq

from astrolabe.procs import ProcessGroup, free_port
from deploy.vllm.launch import REPO_DIR, SERVED_MODEL_NAME, VllmSettings, ensure_tiny_model, vllm_command, vllm_env
from predictor.kv_events import KvEventIndex, KvEventSubscriber
from predictor.sim.block_hash import block_keys

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SETTINGS = VllmSettings()


@pytest.fixture(scope="module")
def vllm_with_kv_events():
    tmp = REPO_DIR / ".cache" / "vllm" / "test-kv-events"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model_dir = ensure_tiny_model()
    port, events_port = free_port(), free_port()
    cmd = [arg for arg in vllm_command(model_dir, port, SETTINGS) if arg != "--no-enable-prefix-caching"]
    cmd += ["--enable-prefix-caching", "--kv-events-config",
            json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                        "endpoint": f"tcp://*:{events_port}", "topic": "kv"})]  # "*": vLLM binds (else it connects)
    with ProcessGroup() as procs:
        process = procs.start(cmd, name=f"vllm-{port}", env=vllm_env(0, None), log_path=tmp / "vllm.log",
                              cwd=REPO_DIR, private_tmp=True)
        process.wait_http(f"http://127.0.0.1:{port}/health", timeout_s=600)
        yield f"127.0.0.1:{port}", f"tcp://127.0.0.1:{events_port}"


class _Listener:
    """A subscriber on its own thread and event loop, plus a raw SUB socket keeping the first payload."""

    def __init__(self, endpoint: str) -> None:
        self.index = KvEventIndex(SETTINGS.block_size)
        self.endpoint = endpoint
        self.loop = asyncio.new_event_loop()
        self.task = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.task = self.loop.create_task(KvEventSubscriber(self.endpoint, self.index, topic="kv").run())
        try:
            self.loop.run_until_complete(self.task)
        except asyncio.CancelledError:
            pass

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(timeout=10)


def _complete(address: str, prompt_ids: list[int]) -> dict:
    response = httpx.post(f"http://{address}/v1/completions", timeout=120,
                          json={"model": SERVED_MODEL_NAME, "prompt": prompt_ids, "max_tokens": 1,
                                "temperature": 0})
    response.raise_for_status()
    return response.json()


def test_vllm_kv_events_give_the_routers_block_keys(vllm_with_kv_events):
    address, endpoint = vllm_with_kv_events
    raw = zmq.Context.instance().socket(zmq.SUB)
    raw.setsockopt(zmq.SUBSCRIBE, b"kv")
    raw.setsockopt(zmq.RCVTIMEO, 60_000)
    raw.connect(endpoint)
    listener = _Listener(endpoint)
    try:
        bs = SETTINGS.block_size
        # Warm-up requests until the subscription is live (a SUB socket misses what is published before it joins).
        shared = [(7 * i + 3) % 500 + 10 for i in range(4 * bs)]
        for attempt in range(30):
            _complete(address, [11 + attempt] * (bs + 2))
            if listener.index.counts.batches:
                break
        assert listener.index.counts.batches, "no KV event batch reached the subscriber"
        _complete(address, shared + [1, 2, 3])
        _complete(address, shared + [1, 2, 3])
        longer = shared + [(5 * i) % 400 + 20 for i in range(2 * bs + 5)]
        _complete(address, longer)
        expected = block_keys(longer, bs)
        for _ in range(200):
            if listener.index.num_prefix_blocks(expected) == len(expected):
                break
            threading.Event().wait(0.05)
        index = listener.index
        assert index.num_prefix_blocks(block_keys(shared + [1, 2, 3], bs)) == len(shared) // bs
        assert index.num_prefix_blocks(expected) == len(expected)
        assert index.counts.undecodable == 0 and index.counts.orphans == 0, index.counts
        frames = raw.recv_multipart()
        events = msgpack.unpackb(frames[2], raw=False)[1]
        assert isinstance(events[0], dict) and "type" in events[0], "vLLM 0.32 publishes the map encoding"
    finally:
        listener.stop()
        raw.close(linger=0)
