"""extproc.pool: health transitions are logged once each, turning healthy at INFO and unhealthy at WARNING."""

import asyncio
import contextlib
import logging

import aiohttp
import pytest
from aiohttp import web

from extproc.config import EndpointConfig, HealthCheckConfig
from extproc.pool import EndpointPool, HealthChecker
from tests.extproc.health_backend import health_backend

ADDRESS = "10.0.0.5:8000"


@pytest.mark.parametrize(("start_healthy", "healthy", "expected"), [
    (False, True, [("INFO", f"endpoint {ADDRESS} is now healthy")]),
    (True, False, [("WARNING", f"endpoint {ADDRESS} is now UNHEALTHY")]),
    (True, True, []),
], ids=["turns-healthy", "turns-unhealthy", "unchanged"])
def test_health_transitions_are_logged_at_their_level(caplog, start_healthy, healthy, expected):
    caplog.set_level(logging.DEBUG, logger="extproc.pool")
    pool = EndpointPool([EndpointConfig(ADDRESS)], new_endpoints_healthy=start_healthy)
    pool.set_healthy(ADDRESS, healthy)
    pool.set_healthy(ADDRESS, healthy)  # no change: nothing more
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == expected
    assert pool.is_healthy(ADDRESS) == healthy


async def test_health_checks_never_change_in_flight_counts():
    """A peer reset its load counters on health transitions (issue 14): here an endpoint that fails its checks,
    leaves the pool's healthy set and comes back keeps exactly the in-flight count of the requests routed there
    (real HTTP on loopback)."""
    status = {"code": 200}

    async def health(_request: web.Request) -> web.Response:
        return web.Response(status=status["code"])

    async with health_backend(health) as (address,):
        pool = EndpointPool([EndpointConfig(address)], new_endpoints_healthy=False)
        checker = HealthChecker(pool, HealthCheckConfig(interval_s=0.05, timeout_s=1.0, unhealthy_threshold=1))
        async with _running(checker):
            await checker.first_round_done.wait()
            assert pool.is_healthy(address)
            for _ in range(3):
                pool.acquire(address)
            status["code"] = 503
            while pool.is_healthy(address):
                await asyncio.sleep(0.01)
            assert pool.in_flight(address) == 3
            status["code"] = 200
            while not pool.is_healthy(address):
                await asyncio.sleep(0.01)
            assert pool.in_flight(address) == 3
            pool.release(address)
            assert pool.in_flight(address) == 2


async def test_a_wake_checks_only_the_new_endpoints():
    """Discovery wakes the checker when endpoints appear: they are checked at once, the others wait for their
    interval (a break-it pass: every discovery event under flapping ran a full round, 9,230 checks/s at 200 pods)."""
    hits = []

    async def health(request: web.Request) -> web.Response:
        hits.append(request.host)
        return web.Response()

    async with health_backend(health, num_ports=2) as (old, new):
        pool = EndpointPool([EndpointConfig(old)], new_endpoints_healthy=False)
        checker = HealthChecker(pool, HealthCheckConfig(interval_s=30.0, timeout_s=1.0))
        async with _running(checker):
            await checker.first_round_done.wait()
            assert hits == [old]
            pool.replace([EndpointConfig(old), EndpointConfig(new)])
            checker.wake()
            while not pool.is_healthy(new):
                await asyncio.sleep(0.01)
            assert hits == [old, new]  # the old endpoint waits for its 30 s interval


@contextlib.asynccontextmanager
async def _running(checker):
    task = asyncio.create_task(checker.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_an_endpoint_that_never_passes_says_why(caplog):
    """An endpoint that starts unhealthy and never passes would otherwise never be logged (only changes are)."""
    pool = EndpointPool([EndpointConfig(address="127.0.0.1:9")], new_endpoints_healthy=False)
    checker = HealthChecker(pool, HealthCheckConfig(timeout_s=1.0))
    async with aiohttp.ClientSession() as session:
        await checker.run_once(session)
        await checker.run_once(session)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "127.0.0.1:9 fails its health check (GET http://127.0.0.1:9/health)" in warnings[0]
    assert "ClientConnectorError" in warnings[0]


async def test_a_check_that_times_out_on_health_says_what_sglang_needs(caplog):
    """SGLang's /health answers after ~1 s: the default 1 s timeout fails it, and the warning says what to set."""
    async def slow(_request):
        await asyncio.sleep(0.5)
        return web.Response(status=200)

    async with health_backend(slow) as (address,):
        pool = EndpointPool([EndpointConfig(address=address)], new_endpoints_healthy=False)
        checker = HealthChecker(pool, HealthCheckConfig(timeout_s=0.2))
        async with aiohttp.ClientSession() as session:
            await checker.run_once(session)
        assert not pool.is_healthy(address)
        checker = HealthChecker(pool, HealthCheckConfig(timeout_s=3.0))
        async with aiohttp.ClientSession() as session:
            await checker.run_once(session)
        assert pool.is_healthy(address)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "no answer within 0.2 s (an SGLang server's /health answers after about 1 s: give " \
           "health_check.timeout_s 3)" in warning
