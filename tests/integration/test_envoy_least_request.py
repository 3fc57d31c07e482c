"""The two Envoy set-ups beside the single-processor one, with the real Envoy binary and real processes.

- ``--mode least-request``: plain Envoy, no ext_proc, its own LEAST_REQUEST balancer over emulated vLLM
  instances (the benchmark baseline). Requests are served and spread; with streams held open on a slow
  instance, new requests mostly go to the idle ones.
- ``--mode full-duplex --extproc A,B``: two ``astrolabe extproc`` replicas behind one Envoy. Both receive
  ext_proc streams, requests succeed, and when one replica stops the other carries on alone.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from astrolabe.procs import ProcessGroup, free_port
from tests.integration.stack import Stack

pytestmark = [pytest.mark.envoy]

PY = sys.executable
EMU_MODEL = "llama-2-7b"
INSTANCE_HEADER = "x-emulator-instance"
FAST_TIME_SCALE = "0.2"  # 5x faster than the modelled H200: a 1-token request takes a few ms
SLOW_TIME_SCALE = "5"  # 25x slower than the fast ones: 400 tokens stream for ~10 s
HELD_STREAM_TOKENS = 400  # ~0.5 s on a fast instance, ~10 s on the slow one
NUM_SPREAD_REQUESTS = 30
NUM_PROBE_REQUESTS = 90


def _start_envoy(procs: ProcessGroup, tmp: Path, *args: str) -> tuple[str, str]:
    """``astrolabe envoy ARGS`` on free ports; returns (listener URL, admin URL) once Envoy is ready."""
    port, admin = free_port(), free_port()
    proc = procs.start([PY, "-m", "astrolabe", "envoy", "--listen-port", str(port), "--admin-port", str(admin),
                        *args], name="envoy", log_path=tmp / "envoy.log")
    proc.wait_http(f"http://127.0.0.1:{admin}/ready", timeout_s=20)
    return f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"


def _host_stats(admin_url: str, cluster: str, stat: str) -> dict[str, str]:
    """``stat`` of every host of ``cluster`` from Envoy's admin ``/clusters``, keyed by ``ip:port``."""
    values = {}
    for line in httpx.get(f"{admin_url}/clusters", timeout=2, trust_env=False).text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster and parts[2] == stat:
            values[parts[1]] = parts[3]
    return values


def _wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll ``condition`` every 50 ms (another process offers no event to wait on)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _completion(max_tokens: int, *, stream: bool = False) -> bytes:
    return json.dumps({"model": EMU_MODEL, "prompt": "hello there", "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": stream}).encode()


# ---------------------------------------------------------------------------------------------------------
# --mode least-request


@pytest.fixture(scope="module")
def least_request(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("least-request")
    with ProcessGroup() as procs:
        s = Stack(procs, tmp, "least-request")
        s.fast = [s.start_emulator("--time-scale", FAST_TIME_SCALE, "--seed", str(i)) for i in range(2)]
        s.slow = s.start_emulator("--time-scale", SLOW_TIME_SCALE)
        s.envoy_url, s.admin_url = _start_envoy(
            procs, tmp, "--mode", "least-request", "--backends", ",".join([*s.fast, s.slow]))
        # Envoy health-checks GET /health before the cluster counts as initialised; wait for all three.
        _wait_until(lambda: set(_host_stats(s.admin_url, "backends", "health_flags").values()) == {"healthy"}
                    and len(_host_stats(s.admin_url, "backends", "health_flags")) == 3,
                    "backends never all healthy in Envoy")
        yield s


async def _short_request(client: httpx.AsyncClient, url: str) -> str:
    reply = await client.post(f"{url}/v1/completions", content=_completion(1),
                              headers={"content-type": "application/json"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 1
    return reply.headers[INSTANCE_HEADER]


async def test_least_request_serves_and_spreads_over_all_backends(least_request):
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        served = Counter([await _short_request(client, least_request.envoy_url)
                          for _ in range(NUM_SPREAD_REQUESTS)])
    # Sequential requests see every host idle: a tie, so the first random draw wins (uniform).
    assert set(served) == {*least_request.fast, least_request.slow}, served
    # Only this Envoy's own counters decide, and they saw every request.
    rq_total = _host_stats(least_request.admin_url, "backends", "rq_total")
    assert sum(int(v) for v in rq_total.values()) >= NUM_SPREAD_REQUESTS


async def _hold_stream(client: httpx.AsyncClient, url: str, opened: asyncio.Queue) -> None:
    """Open one long streamed completion, report its instance, then read it until cancelled or done."""
    async with client.stream("POST", f"{url}/v1/completions", content=_completion(HELD_STREAM_TOKENS, stream=True),
                             headers={"content-type": "application/json"}) as response:
        assert response.status_code == 200
        await opened.put(response.headers[INSTANCE_HEADER])
        async for _ in response.aiter_bytes():
            pass


async def test_least_request_avoids_the_backend_holding_open_streams(least_request):
    s = least_request
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        opened: asyncio.Queue[str] = asyncio.Queue()
        holders, on_slow = [], 0
        # Open long streams one at a time (Envoy places each) until the slow instance holds two of them.
        while on_slow < 2:
            assert len(holders) < 30, "Envoy never placed a stream on the slow instance"
            holders.append(asyncio.create_task(_hold_stream(client, s.envoy_url, opened)))
            on_slow += await asyncio.wait_for(opened.get(), timeout=10) == s.slow
        try:
            # The fast instances finish their streams in ~0.5 s; the slow one keeps its own open for ~10 s.
            def only_slow_busy() -> bool:
                active = _host_stats(s.admin_url, "backends", "rq_active")
                return active[s.slow] != "0" and all(active[a] == "0" for a in s.fast)
            await asyncio.to_thread(_wait_until, only_slow_busy, "fast instances never went idle")

            served = Counter([await _short_request(client, s.envoy_url) for _ in range(NUM_PROBE_REQUESTS)])
            # The streams were held all along: the slow instance was the busy one for every probe.
            assert _host_stats(s.admin_url, "backends", "rq_active")[s.slow] != "0"
        finally:
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
    # Two draws with replacement out of three hosts: the busy one wins only when drawn twice, 1/9 of the
    # time (~10 of 90); uniform choice would give it ~30. P(>= 21 | p = 1/9) < 0.1%.
    assert served[s.slow] <= 20, served
    assert all(served[a] > 0 for a in s.fast), served
    assert sum(served.values()) == NUM_PROBE_REQUESTS


# ---------------------------------------------------------------------------------------------------------
# --mode full-duplex with two extproc replicas


def _routed(stack: Stack) -> float:
    try:
        return stack.metric('astrolabe_extproc_requests_total{outcome="routed"}')
    except KeyError:  # no stream routed yet: the labelled series does not exist
        return 0.0


@pytest.fixture(scope="module")
def two_extprocs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two-extprocs")
    with ProcessGroup() as procs:
        replicas = [Stack(procs, tmp_path_factory.mktemp(f"extproc-{i}"), "full-duplex") for i in range(2)]
        emulators = [replicas[0].start_emulator("--time-scale", FAST_TIME_SCALE, "--seed", str(i)) for i in range(2)]
        for replica in replicas:  # same pool, own ports and config file
            replica.write_config([{"address": a, "models": [EMU_MODEL]} for a in emulators], policy="round-robin")
            replica.start_extproc()
        envoy_url, admin_url = _start_envoy(
            procs, tmp, "--mode", "full-duplex",
            "--extproc", ",".join(f"127.0.0.1:{r.extproc_port}" for r in replicas))
        for replica in replicas:
            replica.envoy_url = envoy_url
        replicas[0].wait_routable()
        yield replicas, emulators, admin_url


def _send_completions(envoy_url: str, n: int) -> Counter:
    served = Counter()
    with httpx.Client(timeout=30, trust_env=False) as client:
        for _ in range(n):
            reply = client.post(f"{envoy_url}/v1/completions", content=_completion(2),
                                headers={"content-type": "application/json"})
            assert reply.status_code == 200, reply.text
            served[reply.headers[INSTANCE_HEADER]] += 1
    return served


def test_both_extproc_replicas_receive_streams(two_extprocs):
    replicas, emulators, admin_url = two_extprocs
    before = [_routed(r) for r in replicas]
    served = _send_completions(replicas[0].envoy_url, 20)
    assert set(served) == set(emulators)

    def counted() -> list[float]:
        return [_routed(r) - b for r, b in zip(replicas, before)]
    # A stream is counted when it ends, a moment after its response.
    _wait_until(lambda: sum(counted()) >= 20, f"extprocs routed {counted()} of 20")
    assert sum(counted()) == 20
    # Round robin per Envoy worker: each replica gets about half.
    assert all(n >= 5 for n in counted()), counted()
    assert set(_host_stats(admin_url, "extproc", "health_flags").values()) == {"healthy"}


def test_the_other_extproc_replica_carries_on_when_one_stops(two_extprocs):
    replicas, emulators, admin_url = two_extprocs
    stopped, survivor = replicas
    stopped.extproc.stop()
    # Envoy's gRPC health check (every 1 s, down after 2 failures) takes the replica out of rotation.
    stopped_address = f"127.0.0.1:{stopped.extproc_port}"
    _wait_until(lambda: _host_stats(admin_url, "extproc", "health_flags")[stopped_address] != "healthy",
                "Envoy kept the stopped extproc in rotation")
    before = _routed(survivor)
    served = _send_completions(survivor.envoy_url, 10)
    assert sum(served.values()) == 10
    _wait_until(lambda: _routed(survivor) - before >= 10, "the surviving extproc did not route every request")
