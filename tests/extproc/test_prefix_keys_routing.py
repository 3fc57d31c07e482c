"""Block keys on the request path with real sidecars over gRPC: the router computes them, sends them with Predict
and Admit (the sidecar's ledger keeps them), predicts with them from watched states, fills
``EndpointView.num_prefix_blocks_cached``, and tells the policy when a request ends (``Policy.on_finished``)."""

from __future__ import annotations

import asyncio
import random

import grpc

from extproc.config import EndpointConfig
from extproc.fleet_state import FleetState
from extproc.lengths import OutputLengthConfig, OutputLengthEstimator
from extproc.policies.least_requests import LeastRequestsPolicy
from extproc.policies.registry import build_policy
from extproc.pool import EndpointPool
from extproc.predictor_client import PredictorClient, PredictorClientConfig
from extproc.prompt_tokens import PromptTokenCounter
from extproc.request import RoutingRequest
from extproc.router import Router
from predictor.api import pb, pb_grpc
from tests.extproc.test_router import sidecars, until  # noqa: F401 (the fixture)

BLOCK_SIZE = 16  # the test sidecars' engine (tests/extproc/test_router.py ENGINE)
PROMPT = " ".join(f"paragraph {i} explains how a prefix cache shortens the prefill." for i in range(120))


def _request(i: int, prompt: str = PROMPT) -> RoutingRequest:
    return RoutingRequest(f"req-{i}", "POST", "/v1/completions", prompt_text=prompt, max_tokens=64)


def _router(predictors, fleet: FleetState | None = None, client: PredictorClient | None = None,
            block_size: int | None = BLOCK_SIZE) -> Router:
    endpoints = [EndpointConfig(f"10.0.0.{i}:8000", (), p) for i, p in enumerate(predictors, 1)]
    client = client or PredictorClient(PredictorClientConfig(predict_timeout_s=0.5, min_backoff_s=60,
                                                             max_state_age_s=float("inf")))
    rng = random.Random(0)
    return Router(EndpointPool(endpoints), build_policy("astrolabe", {"k": 2}, rng), None, client,
                  OutputLengthEstimator(OutputLengthConfig(source="fixed", fixed_tokens=64)), rng,
                  prompt_tokens=PromptTokenCounter(block_size=block_size), fleet=fleet)


async def test_predict_and_admit_carry_the_keys_and_the_instance_holding_the_prefix_predicts_a_shorter_ttft(
        sidecars):
    started = await sidecars(2)
    router = _router([f"127.0.0.1:{s.port}" for s in started])
    try:
        first = await router.route(_request(1))
        keys = router.prompt_tokens.tokens(_request(1)).block_keys
        assert keys and first.routed is not None and first.routed.block_keys == keys
        assert first.routed.prompt_text is None  # the routed request is kept without its prompt
        holder = next(s for s in started if f"127.0.0.1:{s.port}" == first.predictor)
        # held by its Predict without keys; the Admit that confirms it brings them
        await until(lambda: getattr(holder.ledger.scheduler.get_request(first.request_id), "block_keys", None) == keys)
        other_sidecar = next(s for s in started if s is not holder)
        assert other_sidecar.ledger.scheduler.get_request(first.request_id) is None  # its hold was dropped
        await asyncio.sleep(0.3)  # the ledger's simulated instance prefills it (its blocks cached as they fill)
        second = await router.route(_request(2))
        ttft = {address: p.ttft_s for address, p in second.candidates}
        other = next(a for a in ttft if a != first.destination)
        assert ttft[first.destination] < 0.5 * ttft[other], ttft
        assert second.destination == first.destination
        cold = await router.route(_request(3, PROMPT.replace("paragraph", "section")))  # another prompt: no hit
        cold_ttft = {address: p.ttft_s for address, p in cold.candidates}
        assert cold_ttft[first.destination] > ttft[first.destination]
    finally:
        await router.predictors.close()


async def test_keys_at_another_block_size_are_ignored_by_the_sidecar(sidecars):
    (sidecar,) = await sidecars(1)
    router = _router([f"127.0.0.1:{sidecar.port}"], block_size=8)
    try:
        decision = await router.route(_request(1))
        assert decision.routed.block_keys  # computed at 8 tokens a block ...
        await until(lambda: sidecar.ledger.scheduler.get_request(decision.request_id) is not None)
        assert sidecar.ledger.scheduler.get_request(decision.request_id).block_keys is None  # ... ignored at 16
    finally:
        await router.predictors.close()


async def test_watched_states_fill_num_prefix_blocks_cached_and_price_the_hit_locally(sidecars):
    started = await sidecars(2)
    addresses = [f"127.0.0.1:{s.port}" for s in started]
    client = PredictorClient(PredictorClientConfig(min_backoff_s=0.05, max_backoff_s=0.2))
    fleet = FleetState(client, interval_s=0.01, max_state_age_s=float("inf"))
    fleet.watch(addresses)
    assert await fleet.first_states(5.0)
    router = _router(addresses, fleet=fleet, client=client)
    seen_views = []
    candidates = router.policy.candidates
    router.policy.candidates = lambda request, views: seen_views.append(list(views)) or candidates(request, views)
    keys = PromptTokenCounter(block_size=BLOCK_SIZE).tokens(_request(0)).block_keys
    try:
        async with grpc.aio.insecure_channel(addresses[0]) as channel:  # another router's request, keyed
            await pb_grpc.PredictorStub(channel).Admit(pb.AdmitRequest(
                request_id="elsewhere", num_prompt_tokens=len(keys) * BLOCK_SIZE + 5, num_predicted_output_tokens=64,
                block_keys=keys[:20], block_keys_block_size=BLOCK_SIZE))
        await asyncio.sleep(0.3)  # its prefill runs in the ledger; a state that shows it reaches the router
        decision = await router.route(_request(1))
        cached = {v.address: v.num_prefix_blocks_cached for v in seen_views[-1]}
        assert cached == {"10.0.0.1:8000": 20, "10.0.0.2:8000": 0}  # walked until the first miss
        in_use = {v.address: v.num_prefix_blocks_in_use for v in seen_views[-1]}
        assert in_use == {"10.0.0.1:8000": 20, "10.0.0.2:8000": 0}  # "elsewhere" holds them
        ttft = {address: p.ttft_s for address, p in decision.candidates}
        assert ttft["10.0.0.1:8000"] < ttft["10.0.0.2:8000"]
        other = await router.route(_request(2, "an unrelated question " * 40))
        assert {v.num_prefix_blocks_cached for v in seen_views[-1]} == {0}
        router.release(other)
        router.release(decision)
        async with grpc.aio.insecure_channel(addresses[0]) as channel:  # "elsewhere" ends: its blocks stay cached
            assert (await pb_grpc.PredictorStub(channel).Release(pb.ReleaseRequest(request_id="elsewhere"))).known
        # a later state shows the prefix cached (free, reusable; at least the 20 blocks "elsewhere" filled, more
        # if req-1's prefill ran there) and held by no request
        await until(lambda: (blocks := fleet.prefix_blocks(addresses[0], keys, BLOCK_SIZE))[1] == 0
                    and blocks[0] >= 20)
    finally:
        await fleet.close()
        await client.close()


async def test_the_policy_hears_when_a_request_it_routed_ends():
    finished = []

    class Recording(LeastRequestsPolicy):
        needs_block_keys = True  # as a cache-aware policy: least-requests itself reads no keys

        def on_finished(self, request, address):
            finished.append((request, address))

    pool = EndpointPool([EndpointConfig("10.0.0.1:8000"), EndpointConfig("10.0.0.2:8000")])
    router = Router(pool, Recording(random.Random(0)), prompt_tokens=PromptTokenCounter(block_size=BLOCK_SIZE))
    decision = await router.route(_request(1))
    assert decision.routed.block_keys == PromptTokenCounter(block_size=BLOCK_SIZE).tokens(_request(1)).block_keys
    assert not finished
    router.release(decision)
    assert [(r.request_id, r.block_keys, a) for r, a in finished] == [
        ("req-1", decision.routed.block_keys, decision.destination)]
    no_prompt = await router.route(RoutingRequest("get", "GET", "/v1/models"))
    router.release(no_prompt)
    assert len(finished) == 2 and finished[1][0].block_keys is None
    # keys off: the policy still hears, without keys
    router = Router(pool, Recording(random.Random(0)), prompt_tokens=PromptTokenCounter())
    router.release(await router.route(_request(2)))
    assert finished[-1][0].block_keys is None and finished[-1][0].request_id == "req-2"


async def test_a_long_prompt_is_keyed_in_a_worker_thread_and_a_short_one_inline():
    import threading

    from extproc.router import OFFLOAD_TOKENIZE_CHARS

    pool = EndpointPool([EndpointConfig("10.0.0.1:8000")])
    counter = PromptTokenCounter(block_size=BLOCK_SIZE)
    threads = []
    tokens = counter.tokens
    counter.tokens = lambda request: threads.append(threading.current_thread()) or tokens(request)
    class Keyed(LeastRequestsPolicy):
        needs_block_keys = True

    router = Router(pool, Keyed(random.Random(0)), prompt_tokens=counter)
    short = await router.route(_request(1, "hello " * 100))
    long = await router.route(_request(2, "hello " * (OFFLOAD_TOKENIZE_CHARS // 6 + 1)))
    assert threads[0] is threading.main_thread() and threads[1] is not threading.main_thread()
    assert len(long.routed.block_keys) > len(short.routed.block_keys) > 0


async def test_a_load_only_policy_does_not_pay_for_keys():
    pool = EndpointPool([EndpointConfig("10.0.0.1:8000")])
    counter = PromptTokenCounter(block_size=BLOCK_SIZE)
    calls = []
    counter.tokens = lambda request: calls.append(request)
    for name in ("random", "round-robin", "least-requests", "min-qpm"):
        router = Router(pool, build_policy(name, {}, random.Random(0)), prompt_tokens=counter)
        decision = await router.route(_request(1))
        assert decision.routed.block_keys is None
    assert calls == []
