"""The /metrics scraper against a real emulated vLLM, and the router filling metrics and recent dispatches."""

import asyncio
import random

import aiohttp
import pytest

from bench.emulator.server import EmulatorConfig, start_emulator
from extproc.config import EndpointConfig, parse_config
from extproc.endpoint_metrics import MetricsScraper, to_endpoint_metrics
from extproc.policies.registry import build_policy
from extproc.pool import EndpointPool
from extproc.request import RoutingRequest
from extproc.router import Router
from extproc.server import ExtprocServer
from predictor.ledger import BackendObservation
from predictor.sim import EngineConfig

ENGINE = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=512)
MODEL = "llama-2-7b"


class ManualClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
async def emulator():
    # time_scale 20: every modelled second takes 20 wall seconds, so requests stay in flight while we scrape.
    emu = await start_emulator(EmulatorConfig(port=0, engine=ENGINE, time_scale=20.0))
    yield emu
    await emu.stop()


async def test_idle_emulator_reads_all_blocks_free(emulator):
    address = f"{emulator.host}:{emulator.port}"
    scraper = MetricsScraper(EndpointPool([EndpointConfig(address)]))
    assert scraper.get(address) is None  # never scraped
    async with aiohttp.ClientSession() as session:
        await scraper.run_once(session)
    metrics = scraper.get(address)
    assert metrics.num_gpu_blocks == 512 and metrics.num_free_blocks == 512
    assert (metrics.num_requests_running, metrics.num_requests_waiting) == (0, 0)
    assert metrics.kv_cache_usage_frac == 0.0 and metrics.num_waiting_prompt_blocks is None
    assert scraper.num_failures == 0


async def test_busy_emulator_shows_running_waiting_and_used_blocks(emulator):
    address = f"{emulator.host}:{emulator.port}"
    scraper = MetricsScraper(EndpointPool([EndpointConfig(address)]))
    body = {"model": MODEL, "prompt": "hello " * 100, "max_tokens": 2000, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(session.post(f"http://{address}/v1/completions", json=body))
                 for _ in range(6)]
        try:
            metrics = None
            for _ in range(500):  # condition wait: until the engine is full (max_num_seqs = 4 running)
                await scraper.run_once(session)
                metrics = scraper.get(address)
                if metrics.num_requests_running == 4:
                    break
                await asyncio.sleep(0.01)
            assert (metrics.num_requests_running, metrics.num_requests_waiting) == (4, 2)
            assert 0 < metrics.num_free_blocks < 512
            assert metrics.num_free_blocks == int((1 - metrics.kv_cache_usage_frac) * 512 + 1e-9)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_stale_and_failed_scrapes_read_none(emulator):
    address = f"{emulator.host}:{emulator.port}"
    dead = "127.0.0.1:1"
    clock = ManualClock()
    scraper = MetricsScraper(EndpointPool([EndpointConfig(address), EndpointConfig(dead)]), interval_s=0.05,
                             staleness_s=2.0, timeout_s=5.0, clock=clock)
    async with aiohttp.ClientSession() as session:
        await scraper.run_once(session)
    assert scraper.get(dead) is None and scraper.num_failures == 1
    clock.now_s += 1.5
    assert scraper.get(address).age_s == pytest.approx(1.5)
    clock.now_s += 1.0
    assert scraper.get(address) is None  # 2.5 s old > 2 s staleness


@pytest.mark.parametrize(
    "observation, free, gpu_blocks",
    [(BackendObservation(3, 1, 0.25, num_gpu_blocks=1000), 750, 1000),
     (BackendObservation(3, 1, 0.25), 0, 0),
     (BackendObservation(3, 1, 1.5, num_gpu_blocks=100), 0, 100)],
    ids=["derived-free-blocks", "no-cache-config", "usage-clamped"],
)
def test_to_endpoint_metrics(observation, free, gpu_blocks):
    metrics = to_endpoint_metrics(observation, 0.1)
    assert (metrics.num_free_blocks, metrics.num_gpu_blocks, metrics.age_s) == (free, gpu_blocks, 0.1)


async def test_router_fills_metrics_and_routes_by_them(emulator):
    busy = f"{emulator.host}:{emulator.port}"
    idle_emu = await start_emulator(EmulatorConfig(port=0, engine=ENGINE, time_scale=20.0))
    idle = f"{idle_emu.host}:{idle_emu.port}"
    pool = EndpointPool([EndpointConfig(busy), EndpointConfig(idle)])
    scraper = MetricsScraper(pool)
    router = Router(pool, build_policy("infaas", {}, random.Random(0)), endpoint_metrics=scraper)
    body = {"model": MODEL, "prompt": "hello " * 100, "max_tokens": 2000, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(session.post(f"http://{busy}/v1/completions", json=body)) for _ in range(3)]
        try:
            for _ in range(500):
                await scraper.run_once(session)
                if scraper.get(busy).num_requests_running == 3:
                    break
                await asyncio.sleep(0.01)
            views = {v.address: v for v in router._healthy_views(RoutingRequest("r", "POST", "/v1/completions"))}
            assert views[busy].metrics.num_requests_running == 3 and views[idle].metrics.num_requests_running == 0
            # Idle: 512 free / 1; busy: fewer free / 3 -> the idle one, every time.
            for i in range(5):
                decision = await router.route(RoutingRequest(f"q{i}", "POST", "/v1/completions"))
                assert decision.destination == idle and decision.policy == "infaas"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await idle_emu.stop()


async def test_router_without_metrics_falls_back_to_least_requests():
    pool = EndpointPool([EndpointConfig("127.0.0.1:1"), EndpointConfig("127.0.0.1:2")])
    router = Router(pool, build_policy("gie", {}, random.Random(0)))
    decision = await router.route(RoutingRequest("r", "POST", "/v1/completions"))
    assert decision.policy == "least-requests"


async def test_router_counts_recent_dispatches_in_the_policy_window():
    clock = ManualClock()
    pool = EndpointPool([EndpointConfig("127.0.0.1:1"), EndpointConfig("127.0.0.1:2")])
    router = Router(pool, build_policy("min-qpm", {"window_s": 10}, random.Random(0)), clock=clock)
    request = RoutingRequest("r", "POST", "/v1/completions")
    first = await router.route(request)
    router.release(first)
    second = await router.route(request)
    assert second.destination != first.destination  # first one has 1 recent dispatch
    router.release(second)
    clock.now_s += 5
    counts = {v.address: v.num_recent_requests for v in router._healthy_views(request)}
    assert counts == {"127.0.0.1:1": 1, "127.0.0.1:2": 1}
    clock.now_s += 6  # both dispatches are now 11 s old, outside the 10 s window
    assert all(v.num_recent_requests == 0 for v in router._healthy_views(request))


@pytest.mark.parametrize("policy, scrapes", [("infaas", True), ("gie", True), ("random", False),
                                             ("astrolabe", False)])
async def test_server_scrapes_only_for_policies_that_need_metrics(policy, scrapes):
    config = parse_config({"policy": policy, "endpoints": [{"address": "127.0.0.1:8000"}],
                           "health_check": {"enabled": False}, "metrics_interval_s": 0.5})
    server = ExtprocServer(config)
    assert (server.endpoint_metrics is not None) == scrapes
    if scrapes:
        assert server.endpoint_metrics.interval_s == 0.5


@pytest.mark.parametrize(("metrics_format", "readable"), [("auto", True), ("sglang", True), ("vllm", False)])
async def test_sglang_metrics_are_read_or_the_mismatch_is_said_once(caplog, metrics_format, readable):
    emu = await start_emulator(EmulatorConfig(port=0, engine=ENGINE, api="sglang"))
    try:
        address = f"127.0.0.1:{emu.port}"
        scraper = MetricsScraper(EndpointPool([EndpointConfig(address=address)]), metrics_format=metrics_format)
        async with aiohttp.ClientSession() as session:
            await scraper.run_once(session)
            await scraper.run_once(session)
        metrics = scraper.get(address)
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        if readable:
            assert metrics is not None and metrics.num_gpu_blocks == ENGINE.num_gpu_blocks and not warnings
        else:
            assert metrics is None and len(warnings) == 1
            assert f"the /metrics of {address} cannot be read as vllm metrics" in warnings[0]
    finally:
        await emu.stop()
