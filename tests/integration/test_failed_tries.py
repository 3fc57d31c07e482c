"""Failed tries at a backend through the real Envoy binary: a frozen backend is ejected like a refusing one, and a
burst's retries down the picker's fallback list are not refused by Envoy's retry circuit breaker.

The extproc's active health check runs every 60 s here, so only the passive paths can take an endpoint out: Envoy's
own reply to a try (its ``response.code_details``, sent to the extproc with the response headers) and, with
``--pool``, the fallback that served.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from astrolabe.procs import ProcessGroup
from tests.extproc.fuzz_bodies import assert_openai_error
from tests.integration.stack import Stack, signal_process

pytestmark = [pytest.mark.envoy]

MODEL = "m"
SLOW_CHECKS = {"interval_s": 60, "timeout_s": 0.5, "unhealthy_threshold": 1}
"""The extproc's active checks: one at start (every endpoint healthy), then none during the test."""


def _healthy(stack: Stack, endpoint: str) -> bool:
    return stack.metric(f'astrolabe_extproc_endpoint_healthy{{endpoint="{endpoint}"}}') == 1


def _envoy_stat(stack: Stack, name: str) -> int:
    """One counter of Envoy's admin /stats (0 when Envoy has not created it)."""
    text = httpx.get(f"{stack.admin_url}/stats", params={"filter": f"^{name}$"}, timeout=5).text
    values = [int(line.split(": ")[1]) for line in text.splitlines() if line.startswith(f"{name}: ")]
    return values[0] if values else 0


def test_a_frozen_backend_is_ejected_after_its_per_try_idle_timeout(tmp_path):
    """Three backends, round robin; one is SIGSTOPped (it accepts connections and answers nothing). The request
    routed to it ends with Envoy's 504 at the per-try idle deadline (1 s), which ejects it as a refused connection
    does: every later request is served by the two others, none waits for the frozen one."""
    idle_timeout_s = 1.0
    with ProcessGroup() as procs:
        stack = Stack(procs, tmp_path, "full-duplex")
        backends = sorted(stack.start_echo() for _ in range(3))
        stack.write_config([{"address": a, "models": [MODEL]} for a in backends], policy="round-robin",
                           health_check=SLOW_CHECKS)
        stack.start_extproc()
        stack.start_envoy("--per-try-idle-timeout-s", str(idle_timeout_s))
        frozen = backends[1]
        signal_process(stack.backends[frozen], signal.SIGSTOP)
        try:
            replies = []
            for _ in range(12):
                started_s = time.monotonic()
                reply = httpx.post(f"{stack.envoy_url}/v1/completions", json={"model": MODEL, "prompt": "hi"},
                                   timeout=10)
                replies.append((reply, time.monotonic() - started_s))
            assert not _healthy(stack, frozen)
            assert all(_healthy(stack, b) for b in backends if b != frozen)
        finally:
            signal_process(stack.backends[frozen], signal.SIGCONT)
    timed_out = [(r, s) for r, s in replies if r.status_code == 504]
    assert len(timed_out) == 1, [(r.status_code, r.text[:100]) for r, _ in replies]
    (reply, elapsed_s), = timed_out
    assert idle_timeout_s <= elapsed_s < idle_timeout_s + 2.0, elapsed_s
    error = assert_openai_error(504, reply.content)
    assert error["type"] == "GatewayTimeoutError" and "upstream_per_try_idle_timeout" in error["message"]
    served = [r.json()["served_by"] for r, _ in replies if r.status_code == 200]
    assert len(served) == 11 and frozen not in served
    # after the 504 the two others alternate: the frozen one is out of the round robin
    after = served[[r for r, _ in replies].index(reply):]
    assert set(after) == set(backends) - {frozen} and all(a != b for a, b in zip(after, after[1:]))


async def _burst(url: str, num_requests: int) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        return await asyncio.gather(*(client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
                                      for _ in range(num_requests)))


def test_a_bursts_retries_down_the_fallback_list_are_not_refused(tmp_path):
    """--pool, fallback lists of 4 endpoints, 3 of 5 backends killed after the extproc saw them healthy; 64
    requests at once. Many are routed first to a dead endpoint before the picker learns of it, and Envoy retries
    them down the list, far more than 3 at once (Envoy's default max_retries, which answered the rest with the
    refusal's 503: upstream_rq_retry_overflow). Every request is served and no retry is refused."""
    with ProcessGroup() as procs:
        stack = Stack(procs, tmp_path, "full-duplex")
        backends = sorted(stack.start_echo() for _ in range(5))
        stack.write_config([{"address": a, "models": [MODEL]} for a in backends], policy="least-requests",
                           fallback_endpoints=3, health_check=SLOW_CHECKS)
        stack.start_extproc()
        stack.start_envoy("--pool", ",".join(backends))
        dead = backends[:3]
        for address in dead:
            signal_process(stack.backends[address], signal.SIGKILL)
            stack.backends[address].wait(timeout_s=10)
        replies = asyncio.run(_burst(stack.envoy_url, 64))
        retries = _envoy_stat(stack, "cluster.backends.upstream_rq_retry")
        overflow = _envoy_stat(stack, "cluster.backends.upstream_rq_retry_overflow")
    assert [r.status_code for r in replies] == [200] * len(replies), [r.text[:200] for r in replies
                                                                      if r.status_code != 200]
    assert {r.json()["served_by"] for r in replies} <= set(backends) - set(dead)
    assert overflow == 0
    assert retries > 3, f"only {retries} retries: the burst did not test the retry limit"
