"""Size limits hold under load (issue 14, security), through the real Envoy binary in both body modes.

Under a burst of 200 concurrent oversized requests interleaved with 100 valid ones: every oversized body gets a
413 with the extproc's OpenAI-style error (full-duplex: counted as it streams; buffered: one gRPC message, which
the extproc's gRPC limit admits up to Envoy's 16 MiB buffer so that the answer is the 413, not a gRPC error),
every valid request is served, nothing hangs, the extproc's in-flight counts return to 0 and its memory stays
bounded. Headers over Envoy's 60 KiB limit get Envoy's 431 before the extproc sees them.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from astrolabe.procs import ProcessGroup
from tests.integration.stack import Stack, poll_until

pytestmark = [pytest.mark.envoy, pytest.mark.slow]

MODEL = "m"
MAX_BODY_BYTES = 64 * 1024
OVERSIZED_BYTES = 1024 * 1024
NUM_OVERSIZED, NUM_VALID = 200, 100
MAX_RSS_GROWTH_BYTES = {"full-duplex": 256 * 1024 * 1024, "buffered": 464 * 1024 * 1024}
"""How much the extproc may grow while 200 bodies of 1 MiB pass. Full-duplex: it drops each body at the limit as
it streams in, so less than their sum (200 MiB) plus slack. Buffered: Envoy sends each body whole in one gRPC
message, and on a loaded machine they may all wait at once (the received bytes and the decoded message, 2 x 200
MiB), so less than that plus 64 MiB."""


@pytest.fixture(scope="module", params=["full-duplex", "buffered"])
def stack(request, tmp_path_factory):
    with ProcessGroup() as procs:
        s = Stack(procs, tmp_path_factory.mktemp(request.param), request.param)
        echoes = [s.start_echo() for _ in range(2)]
        s.write_config([{"address": a, "models": [MODEL]} for a in echoes], policy="least-requests",
                       max_body_bytes=MAX_BODY_BYTES)
        s.start_extproc()
        s.start_envoy()
        yield s


def _rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def _burst(url: str) -> list[tuple[str, int, dict | None]]:
    oversized = json.dumps({"model": MODEL, "prompt": "x" * OVERSIZED_BYTES}).encode()
    valid = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2}).encode()
    kinds = ["oversized"] * NUM_OVERSIZED + ["valid"] * NUM_VALID
    kinds = [kinds[i] for i in sorted(range(len(kinds)), key=lambda i: (i * 7919) % len(kinds))]  # interleaved
    limits = httpx.Limits(max_connections=len(kinds), max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        async def send(kind: str) -> tuple[str, int, dict | None]:
            reply = await client.post(f"{url}/v1/completions", content=oversized if kind == "oversized" else valid,
                                      headers={"content-type": "application/json"})
            body = reply.json() if reply.headers.get("content-type") == "application/json" else None
            return kind, reply.status_code, body

        return await asyncio.gather(*(send(kind) for kind in kinds))


def test_oversized_bodies_under_load_get_413_and_valid_ones_are_served(stack):
    before = _rss_bytes(stack.extproc.pid)
    results = asyncio.run(_burst(stack.envoy_url))
    after = _rss_bytes(stack.extproc.pid)
    for kind, status, body in results:
        if kind == "oversized":
            assert status == 413 and body["error"]["code"] == 413, (status, body)
        else:
            assert status == 200, (status, body)
    poll_until(lambda: stack.metric("astrolabe_extproc_in_flight_requests") == 0, timeout_s=10,
               what="in-flight counts back to 0")
    assert after - before < MAX_RSS_GROWTH_BYTES[stack.mode], (before, after)
    assert stack.metric('astrolabe_extproc_requests_total{outcome="body_too_large"}') == NUM_OVERSIZED


def test_headers_over_envoys_limit_are_refused(stack):
    """Over Envoy's 60 KiB header limit: refused with Envoy's 431 (an OpenAI-style JSON error) before the extproc
    or a backend sees the request. The ext_proc filter is skipped for that reply (envoy/README.md, "Envoy's own
    replies"): before, it held the reply for the processor and lost it with the connection the codec closed."""
    routed = stack.metric("astrolabe_extproc_requests_total")
    reply = httpx.post(f"{stack.envoy_url}/v1/completions", timeout=20,
                       content=json.dumps({"model": MODEL, "prompt": "hi"}),
                       headers={"content-type": "application/json", "x-padding": "p" * (80 * 1024)})
    assert reply.status_code == 431 and reply.json()["error"]["code"] == 431, reply.text[:200]
    assert stack.metric("astrolabe_extproc_requests_total") == routed  # the extproc never saw it
    reply = httpx.post(f"{stack.envoy_url}/v1/completions", timeout=20,
                       content=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                       headers={"content-type": "application/json", "x-padding": "p" * 4096})
    assert reply.status_code == 200  # under the limits (Envoy's, and the echo backend's 8 KiB): served
