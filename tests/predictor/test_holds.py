"""Holds (predictor/holds.py): the bookkeeping, and a real sidecar over gRPC counting held requests from their
Predict until Admit confirms or Release / the end of the hold drops them."""

import asyncio
import json

import grpc
import pytest

from predictor.api import pb
from predictor.holds import MAX_HOLD_S, Holds
from predictor.server import PROTOCOL_REVISION
from tests.predictor.test_server import start_sidecar


def test_a_hold_is_confirmed_dropped_or_expires():
    holds = Holds()
    assert holds.hold("a", 10.0, 0.5) == [] and holds.hold("b", 10.1, 0.5) == [] and holds.hold("c", 10.2, 0.5) == []
    assert "a" in holds and len(holds) == 3
    hold = holds.confirm("a")
    assert hold.held_s == 10.0 and hold.until_s == 10.5 and "a" not in holds
    assert holds.confirm("a") is None  # once
    assert holds.drop("b") and not holds.drop("b")
    assert holds.expired(10.69) == [] and holds.expired(10.7) == ["c"] and len(holds) == 0
    assert holds.as_dict() == {"held_now": 0, "held": 3, "confirmed": 1, "dropped": 1, "expired": 1}


def test_holds_are_bounded_and_cut_to_the_longest_hold():
    holds = Holds(max_holds=2)
    holds.hold("a", 0.0, 1.0)
    holds.hold("b", 0.0, 1.0)
    assert holds.hold("c", 0.0, 1e9) == ["a"] and len(holds) == 2 and holds.num_expired == 1
    assert holds.confirm("c").until_s == MAX_HOLD_S


@pytest.mark.parametrize("hold_s", [0.0, -1.0, float("nan"), float("inf")])
def test_a_hold_needs_a_finite_positive_time(hold_s):
    with pytest.raises(ValueError):
        Holds().hold("a", 0.0, hold_s)


def test_a_request_is_held_once():
    holds = Holds()
    holds.hold("a", 0.0, 1.0)
    with pytest.raises(ValueError):
        holds.hold("a", 0.0, 1.0)


def ask(request_id: str, hold_s: float = 0.5) -> pb.PredictRequest:
    return pb.PredictRequest(request_id=request_id, num_prompt_tokens=200, num_predicted_output_tokens=100,
                             hold_s=hold_s)


async def test_concurrent_predicts_see_each_other_and_the_router_settles_each_hold():
    sidecar, channel, stub = await start_sidecar("127.0.0.1:1")  # no backend: ledger only
    try:
        # a burst of 8 decisions asking at once: each answer counts the holds of those answered before it
        replies = await asyncio.gather(*(stub.Predict(ask(f"r{i}"), timeout=5) for i in range(8)))
        assert sorted(r.num_running + r.num_waiting for r in replies) == list(range(8))
        assert all(r.protocol_revision == PROTOCOL_REVISION for r in replies) and sorted(r.num_held for r in replies) == list(range(8))
        assert len(sidecar.holds) == 8 and sidecar.ledger.num_unfinished() == 8
        # the router chose this instance for r0..r3 (Admit confirms), another one for r4..r7 (Release drops)
        for i in range(4):
            reply = await stub.Admit(pb.AdmitRequest(request_id=f"r{i}", num_prompt_tokens=200,
                                                     num_predicted_output_tokens=100, predicted_ttft_s=0.1,
                                                     predicted_e2e_s=1.0), timeout=5)
            assert not reply.duplicate
        for i in range(4, 8):
            assert (await stub.Release(pb.ReleaseRequest(request_id=f"r{i}"), timeout=5)).known
        assert len(sidecar.holds) == 0 and sidecar.ledger.num_unfinished() == 4
        assert sidecar.outcomes.is_tracked("r0") and not sidecar.outcomes.is_tracked("r4")
        state = json.loads((await stub.State(pb.StateRequest(), timeout=5)).state_json)
        assert state["holds"] == {"held_now": 0, "held": 8, "confirmed": 4, "dropped": 4, "expired": 0}
        # an Admit of a request that was never held counts it as before (v1.0 routers)
        assert not (await stub.Admit(pb.AdmitRequest(request_id="plain", num_prompt_tokens=10,
                                                     num_predicted_output_tokens=10), timeout=5)).duplicate
        assert sidecar.ledger.num_unfinished() == 5
    finally:
        await channel.close()
        await sidecar.stop()


async def test_a_hold_nobody_settles_ends_by_itself():
    sidecar, channel, stub = await start_sidecar("127.0.0.1:1")
    try:
        await stub.Predict(ask("lost", hold_s=0.05), timeout=5)
        assert sidecar.ledger.num_unfinished() == 1
        await asyncio.sleep(0.1)
        reply = await stub.Predict(ask("next", hold_s=0.0), timeout=5)  # a plain Predict: holds nothing
        assert reply.num_running + reply.num_waiting == 0 and sidecar.ledger.num_unfinished() == 0
        assert sidecar.holds.num_expired == 1 and len(sidecar.holds) == 0
    finally:
        await channel.close()
        await sidecar.stop()


async def test_a_second_predict_of_a_counted_request_holds_nothing_more():
    sidecar, channel, stub = await start_sidecar("127.0.0.1:1")
    try:
        await stub.Predict(ask("x"), timeout=5)
        await stub.Predict(ask("x"), timeout=5)
        await stub.Admit(pb.AdmitRequest(request_id="y", num_prompt_tokens=10, num_predicted_output_tokens=10),
                         timeout=5)
        await stub.Predict(ask("y"), timeout=5)  # admitted already: not held again
        assert sidecar.ledger.num_unfinished() == 2 and len(sidecar.holds) == 1
    finally:
        await channel.close()
        await sidecar.stop()


async def test_a_request_that_cannot_fit_is_refused_and_not_held():
    sidecar, channel, stub = await start_sidecar("127.0.0.1:1")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Predict(pb.PredictRequest(request_id="huge", num_prompt_tokens=10**6,
                                                 num_predicted_output_tokens=1, hold_s=0.5), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(sidecar.holds) == 0 and sidecar.ledger.num_unfinished() == 0
    finally:
        await channel.close()
        await sidecar.stop()


async def test_a_router_is_answered_without_its_own_holds_and_told_which_of_its_admits_count():
    """Router 7 accounts its own decisions (admits_seen + its own count of dispatches); router 9's holds count for
    it at once."""
    sidecar, channel, stub = await start_sidecar("127.0.0.1:1")
    try:
        def ask_as(router_id, request_id):
            return pb.PredictRequest(request_id=request_id, num_prompt_tokens=200, num_predicted_output_tokens=100,
                                     hold_s=0.5, router_id=router_id)

        for i in range(3):
            await stub.Predict(ask_as(7, f"a{i}"), timeout=5)
        await stub.Predict(ask_as(9, "b0"), timeout=5)
        mine = await stub.Predict(ask_as(7, "a3"), timeout=5)
        assert mine.num_running + mine.num_waiting == 1 and mine.num_held == 1 and mine.admits_seen == 0
        theirs = await stub.Predict(ask_as(9, "b1"), timeout=5)
        assert theirs.num_running + theirs.num_waiting == 4 and theirs.num_held == 4
        for seq, request_id in enumerate(("a0", "a1"), 1):  # router 7 chose this instance twice
            await stub.Admit(pb.AdmitRequest(request_id=request_id, num_prompt_tokens=200,
                                             num_predicted_output_tokens=100, router_id=7, admit_seq=seq), timeout=5)
        mine = await stub.Predict(ask_as(7, "a4"), timeout=5)
        assert mine.admits_seen == 2 and mine.num_running + mine.num_waiting == 2 + 2  # a0, a1 + b0, b1
        assert (await stub.Predict(ask_as(9, "b2"), timeout=5)).admits_seen == 0
        # a late Admit with an older number does not move it back
        await stub.Admit(pb.AdmitRequest(request_id="z", num_prompt_tokens=10, num_predicted_output_tokens=10,
                                         router_id=7, admit_seq=1), timeout=5)
        assert (await stub.Predict(ask_as(7, "a5"), timeout=5)).admits_seen == 2
    finally:
        await channel.close()
        await sidecar.stop()


async def test_an_answer_prices_one_more_request_like_it():
    """The figures come from predictor.sim.predict.marginal_cost_s (tested there); here: they reach the answer."""
    sidecar, channel, stub = await start_sidecar("127.0.0.1:1")
    try:
        idle = await stub.Predict(ask("p", hold_s=0.0), timeout=5)
        assert 0 < idle.ttft_s_per_request < idle.e2e_s and 0 < idle.e2e_s_per_request < idle.e2e_s
    finally:
        await channel.close()
        await sidecar.stop()


async def test_a_watching_router_gets_the_state_a_predict_would_simulate():
    """Protocol v1.2: Watch streams the state; a prediction from the decoded state equals the sidecar's Predict."""
    from predictor.instance_state import decode
    from predictor.sim.predict import predict
    from predictor.sim.snapshot import RequestState

    sidecar, channel, stub = await start_sidecar("127.0.0.1:1", watch_interval_s=0.01)
    try:
        for i in range(12):
            await stub.Admit(pb.AdmitRequest(request_id=f"r{i}", num_prompt_tokens=200, num_predicted_output_tokens=300,
                                             router_id=7, admit_seq=i + 1), timeout=5)
        await stub.Predict(pb.PredictRequest(request_id="mine", num_prompt_tokens=50, num_predicted_output_tokens=5,
                                             hold_s=5, router_id=7), timeout=5)
        call = stub.Watch(pb.WatchRequest(router_id=7), timeout=5)
        states = []
        async for message in call:
            states.append(decode(message))
            if len(states) == 3:
                break
        call.cancel()
        assert [s.seq for s in states] == [1, 2, 3] and all(s.admits_seen == 12 for s in states)
        state = states[-1]
        assert len(state.snapshot.running) + len(state.snapshot.waiting) == 12  # its own hold left out
        assert state.state_source == "ledger" and state.batch_time == sidecar.batch_time
        # the sidecar simulates the residual rule's expected length for a guess of 100 tokens, not the guess
        expected = sidecar.residual.for_source(0).expected_output_tokens(100, 0, None)
        new = RequestState("new", 200, expected)
        local = predict(state.snapshot, new, state.batch_time)
        reply = await stub.Predict(pb.PredictRequest(request_id="q", num_prompt_tokens=200,
                                                     num_predicted_output_tokens=100, router_id=7), timeout=5)
        # the engine moved on between the two by a few milliseconds of simulated steps at most
        assert local.e2e_s + state.lag_s == pytest.approx(reply.e2e_s, rel=0.05, abs=0.05)
        assert sidecar.num_states_sent >= 3
    finally:
        await channel.close()
        await sidecar.stop()
