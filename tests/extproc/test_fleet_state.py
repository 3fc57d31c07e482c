"""Prediction in the router (extproc/fleet_state.py, protocol v1.2) with real sidecars streaming over gRPC."""

import asyncio
import collections
import random
import time

import grpc
import pytest

from extproc.config import EndpointConfig
from extproc.fleet_state import FleetState
from extproc.lengths import OutputLengthConfig, OutputLengthEstimator
from extproc.policies.registry import build_policy
from extproc.pool import EndpointPool
from extproc.predictor_client import PredictorClient, PredictorClientConfig
from extproc.request import RoutingRequest
from extproc.router import Router
from predictor.api import pb, pb_grpc
from predictor.residual_rules import ResidualRules
from predictor.server import Sidecar, SidecarConfig
from tests.extproc.test_router import ENGINE, request, sidecars  # noqa: F401 (the fixture)


async def watching_router(predictors_by_endpoint, seed=0, params=None, **fleet_args):
    endpoints = [EndpointConfig(f"10.0.0.{i}:8000", (), p) for i, p in enumerate(predictors_by_endpoint, 1)]
    client = PredictorClient(PredictorClientConfig(min_backoff_s=0.05, max_backoff_s=0.2))
    # the test sidecars have no backend to reconcile with: their state age is infinite, accept it here
    fleet = FleetState(client, **{"interval_s": 0.01, "max_state_age_s": float("inf"), **fleet_args})
    fleet.watch([p for p in predictors_by_endpoint if p])
    assert await fleet.first_states(5.0)
    rng = random.Random(seed)
    lengths = OutputLengthEstimator(OutputLengthConfig(source="fixed", fixed_tokens=128))
    return Router(EndpointPool(endpoints), build_policy("astrolabe", params or {}, rng), None, client, lengths, rng,
                  fleet=fleet)


async def close(router):
    await router.fleet.close()
    await router.predictors.close()


async def admitted(started, count, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while sum(s.ledger.num_unfinished() for s in started) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


# (the queued requests' length source, the new one's): exact and fixed; a tagger's first turns; its later turns
# (protocol v1.6), which both sides price by the tagger's later-turn quantiles
@pytest.mark.parametrize("admitted_source, asked_source", [(pb.LENGTH_SOURCE_EXACT, pb.LENGTH_SOURCE_FIXED),
                                                           (pb.LENGTH_SOURCE_TAGGER, pb.LENGTH_SOURCE_TAGGER),
                                                           (pb.LENGTH_SOURCE_TAGGER_LATER_TURN,
                                                            pb.LENGTH_SOURCE_TAGGER_LATER_TURN)])
async def test_a_local_prediction_is_the_sidecars_own(sidecars, admitted_source, asked_source):
    (sidecar,) = await sidecars(1)
    address = f"127.0.0.1:{sidecar.port}"
    router = await watching_router([address])
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.PredictorStub(channel)
            for i in range(10):
                await stub.Admit(pb.AdmitRequest(request_id=f"b{i}", num_prompt_tokens=300,
                                                 num_predicted_output_tokens=400, length_source=admitted_source))
            await asyncio.sleep(0.05)  # a state that includes them
            reply = await stub.Predict(pb.PredictRequest(request_id="x", num_prompt_tokens=120,
                                                         num_predicted_output_tokens=128, length_source=asked_source))
        local = router.fleet.predict(address, 120, 128, length_source=asked_source)
        # the engine moves on between the state and the Predict: a few milliseconds of simulated steps
        assert local.ttft_s == pytest.approx(reply.ttft_s, rel=0.05, abs=0.01)
        assert local.e2e_s == pytest.approx(reply.e2e_s, rel=0.05, abs=0.05)
        assert local.num_requests == 10 and router.fleet.outcomes[address]["ok"] == 1
    finally:
        await close(router)


async def test_a_router_prices_a_taggers_requests_as_the_binned_sidecar_says():
    sidecar = Sidecar(SidecarConfig(backend="127.0.0.1:1", listen="127.0.0.1:0", engine=ENGINE,
                                    discover_kv_cache=False, length_distribution="binned"))
    await sidecar.start()
    address = f"127.0.0.1:{sidecar.port}"
    router = await watching_router([address])
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.PredictorStub(channel)
            for i in range(10):  # short guesses: the binned rule expects far longer replies than the quantiles
                await stub.Admit(pb.AdmitRequest(request_id=f"b{i}", num_prompt_tokens=300,
                                                 num_predicted_output_tokens=30, length_source=pb.LENGTH_SOURCE_TAGGER))
            await asyncio.sleep(0.05)
            reply = await stub.Predict(pb.PredictRequest(request_id="x", num_prompt_tokens=120,
                                                         num_predicted_output_tokens=30,
                                                         length_source=pb.LENGTH_SOURCE_TAGGER))
        state, _ = router.fleet.state(address)
        assert state.length_distribution == "binned"
        local = router.fleet.predict(address, 120, 30, length_source=pb.LENGTH_SOURCE_TAGGER)
        assert local.e2e_s == pytest.approx(reply.e2e_s, rel=0.05, abs=0.05)
        # the default rules (what the router used before it read the state's choice) price these requests apart
        rules = ResidualRules()
        assert rules.for_source(1).expected_output_tokens(30, 0) < rules.binned.expected_output_tokens(30, 0) - 20
    finally:
        await close(router)
        await sidecar.stop(0)


async def test_a_taggers_first_and_later_turns_are_priced_apart(sidecars):
    (sidecar,) = await sidecars(1)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
        stub = pb_grpc.PredictorStub(channel)
        first, later = [await stub.Predict(pb.PredictRequest(request_id="x", num_prompt_tokens=120,
                                                              num_predicted_output_tokens=30, length_source=source))
                        for source in (pb.LENGTH_SOURCE_TAGGER, pb.LENGTH_SOURCE_TAGGER_LATER_TURN)]
    rules = sidecar.residual
    expected = [rules.for_source(s).expected_output_tokens(30, 0) for s in (1, 4)]
    assert expected[0] != expected[1] and first.e2e_s != later.e2e_s
    assert (first.e2e_s < later.e2e_s) == (expected[0] < expected[1])  # the longer expected reply takes longer


@pytest.mark.parametrize("num_instances", [4, 8])
async def test_a_simultaneous_burst_is_spread_without_a_round_trip(sidecars, num_instances):
    """64 simultaneous route() calls over idle instances: every decision predicts locally and sees this replica's
    earlier dispatches at once (queued into the streamed state), so max/min per instance <= 2."""
    started = await sidecars(num_instances)
    router = await watching_router([f"127.0.0.1:{s.port}" for s in started], seed=5)
    try:
        decisions = await asyncio.gather(*(router.route(request(i)) for i in range(64)))
        counts = collections.Counter(d.destination for d in decisions)
        assert len(counts) == num_instances and max(counts.values()) <= 2 * min(counts.values()), counts
        assert all(d.basis == "prediction" for d in decisions)
        assert router.predictors.num_calls == 0  # no Predict was sent
        await admitted(started, 64)
        assert [s.ledger.num_unfinished() for s in started] == \
            [counts[f"10.0.0.{i}:8000"] for i in range(1, num_instances + 1)]
    finally:
        await close(router)


async def test_dispatches_the_state_does_not_include_are_queued_in(sidecars):
    (sidecar,) = await sidecars(1)
    address = f"127.0.0.1:{sidecar.port}"
    router = await watching_router([address], interval_s=1.0)  # one state, then none for a second
    try:
        before = router.fleet.predict(address, 100, 128)
        for i in range(6):
            router.predictors.admit(address, f"r{i}", 100, 128)
        after = router.fleet.predict(address, 100, 128)
        assert after.num_requests == before.num_requests + 6 and after.e2e_s > before.e2e_s
        await admitted([sidecar], 6)
        state, _ = router.fleet.state(address)
        assert state.admits_seen == 0  # not sent again yet: the router still queues all six in itself
    finally:
        await close(router)


async def test_a_frozen_or_silent_sidecar_gives_no_prediction(sidecars):
    (sidecar,) = await sidecars(1)
    address = f"127.0.0.1:{sidecar.port}"
    router = await watching_router([address], max_age_s=0.05)
    try:
        assert router.fleet.predict(address, 100, 128) is not None
        await sidecar.stop(0)
        await asyncio.sleep(0.2)
        assert router.fleet.predict(address, 100, 128) is None
        counts = router.fleet.outcomes[address]
        assert counts["no_state"] + counts["stale_state"] == 1
        decision = await router.route(request(1))
        assert decision.basis == "fallback" and decision.fallback_reason == "no_prediction"
    finally:
        await close(router)


class PredictOnly(pb_grpc.PredictorServicer):
    """A sidecar of protocol v1.1: Predict, but no Watch (UNIMPLEMENTED)."""

    async def Predict(self, request, context):  # noqa: N802
        return pb.PredictResponse(ttft_s=0.1, e2e_s=1.0, state_age_s=0.0)

    async def Admit(self, request, context):  # noqa: N802
        return pb.AdmitResponse()

    async def Release(self, request, context):  # noqa: N802
        return pb.ReleaseResponse()


async def test_a_sidecar_without_watch_is_asked_by_predict():
    server = grpc.aio.server()
    pb_grpc.add_PredictorServicer_to_server(PredictOnly(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    router = await watching_router([address])
    try:
        assert not router.fleet.covers(address)
        decision = await router.route(request(1))
        assert decision.basis == "prediction" and router.predictors.num_calls == 1
    finally:
        await close(router)
        await server.stop(0)


async def test_an_engine_priority_sent_to_an_fcfs_engine_is_warned_once(sidecars, caplog):
    """engine_priority writes a priority vLLM refuses (400) under fcfs: the first prediction with a priority for a
    sidecar whose state says fcfs logs why, once per sidecar; a request of priority 0 (the default) says nothing."""
    (sidecar,) = await sidecars(1)
    address = f"127.0.0.1:{sidecar.port}"
    router = await watching_router([address])
    try:
        assert router.fleet.predict(address, 120, 128, length_source=2, priority=0) is not None
        assert "--scheduling-policy priority" not in caplog.text
        for _ in range(3):
            assert router.fleet.predict(address, 120, 128, length_source=2, priority=1) is not None
        assert caplog.text.count("--scheduling-policy priority") == 1 and address in caplog.text
    finally:
        await close(router)
