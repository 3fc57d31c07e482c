"""Engine priority at the sidecar (protocol v1.5): the plugin state's priorities, the watched state's columns, and
predictions that queue a request by its priority where the engine runs vLLM's --scheduling-policy priority."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from extproc.fleet_state import predict_from_state
from predictor.api import pb, pb_grpc
from predictor.instance_state import Corrections, decode, encode
from predictor.server import Sidecar, SidecarConfig
from predictor.sim import EngineConfig, LinearBatchTimeModel
from predictor.sim.snapshot import InstanceSnapshot, RequestState
from predictor.state_source import PluginStateError, parse_plugin_state, plugin_snapshot
from predictor.vllm_plugin.publisher import StatePublisher, collect_vllm
from tests.predictor.vllm_plugin.fake_vllm import FakeRequest, FakeScheduler

PRIORITY = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=512,
                        scheduling_policy="priority")
MODEL = LinearBatchTimeModel("test", 0.01, 1e-4, 0.0, 1e-5, 1e-4)


def _published(scheduler) -> dict:
    return StatePublisher("/dev/null", 0.0, synchronous=True).collect(scheduler, time.monotonic())


def test_the_plugin_publishes_priorities_and_arrival_ages_only_under_the_priority_policy():
    now = time.time()
    running = [FakeRequest("r0", 100, 100, 5, priority=1, arrival_time=now - 3.0)]
    waiting = [FakeRequest("w0", 100, priority=0, arrival_time=now - 1.0),
               FakeRequest("w1", 100, priority=1, arrival_time=now - 2.0)]
    fcfs = _published(FakeScheduler(running, waiting))
    assert "priorities" not in fcfs and "scheduling_policy" not in fcfs["engine"]
    scheduler = FakeScheduler(running, waiting)
    scheduler.scheduler_config.policy = "priority"
    data = _published(scheduler)
    assert data["engine"]["scheduling_policy"] == "priority"
    assert [p for p, _ in data["priorities"]] == [1, 0, 1]
    assert [round(age) for _, age in data["priorities"]] == [3, 1, 2]
    state = parse_plugin_state(json.dumps(data))
    assert state.engine.scheduling_policy == "priority"
    snapshot = plugin_snapshot(state, 50.0, lambda _rid, _cap, generated: generated + 10)
    assert [r.priority for r in (*snapshot.running, *snapshot.waiting)] == [1, 0, 1]
    assert [round(r.arrival_time_s) for r in (*snapshot.running, *snapshot.waiting)] == [47, 49, 48]
    older = parse_plugin_state(json.dumps(fcfs))  # an older plugin (or fcfs): every request at 0, in row order
    assert older.priorities == () and older.engine.scheduling_policy == "fcfs"


@pytest.mark.parametrize("priorities, policy", [
    ([[0, 1.0]], "priority"),                 # one row short
    ([[True, 1.0], [0, 1.0]], "priority"),    # a boolean is no priority
    ([[0, -1.0], [0, 1.0]], "priority"),      # negative age
    ([[2 ** 31, 1.0], [0, 1.0]], "priority"),  # past int32
    ([[0, 1.0], [0, 1.0]], "lifo"),           # not a vLLM policy
])
def test_bad_priorities_or_policies_are_refused(priorities, policy):
    data = _published(FakeScheduler([FakeRequest("r", 10, 10)], [FakeRequest("w", 10)]))
    data["priorities"], data["engine"]["scheduling_policy"] = priorities, policy
    with pytest.raises(PluginStateError):
        parse_plugin_state(json.dumps(data))


def _encoded(snapshot: InstanceSnapshot) -> pb.InstanceState:
    return encode(snapshot, MODEL, Corrections(), seq=1, lag_s=0.0, state_age_s=0.0, admits_seen=0, model_error=0.0,
                  state_source="ledger")


def test_the_watched_state_carries_the_policy_priorities_and_arrivals():
    running = (RequestState("r", 100, 50, num_computed_tokens=100, num_generated_tokens=3, priority=1,
                            arrival_time_s=7.0),)
    waiting = (RequestState("a", 100, 50, priority=0, arrival_time_s=9.5), RequestState("b", 100, 50, priority=1,
                                                                                       arrival_time_s=8.0))
    message = _encoded(InstanceSnapshot(PRIORITY, 10.0, running=running, waiting=waiting))
    decoded = decode(message).snapshot
    assert decoded.config.scheduling_policy == "priority"
    assert [r.priority for r in (*decoded.running, *decoded.waiting)] == [1, 0, 1]
    assert [r.arrival_time_s for r in (*decoded.running, *decoded.waiting)] == [-3.0, -0.5, -2.0]
    fcfs = _encoded(InstanceSnapshot(EngineConfig(), 10.0, waiting=waiting))
    assert not fcfs.scheduling_policy and not fcfs.priorities and not fcfs.arrival_times_s
    assert decode(fcfs).snapshot.waiting[0].priority == 0  # an fcfs state carries none: nothing to read
    del message.priorities[-1]
    with pytest.raises(ValueError):
        decode(message)


def _busy(config: EngineConfig) -> InstanceSnapshot:
    """Four running requests and eight waiting sheddable ones (vLLM priority 1)."""
    running = tuple(RequestState(f"r{i}", 200, 400, num_computed_tokens=200, num_generated_tokens=10, priority=1)
                    for i in range(4))
    waiting = tuple(RequestState(f"w{i}", 200, 400, priority=1, arrival_time_s=-1.0) for i in range(8))
    return InstanceSnapshot(config, 0.0, running=running, waiting=waiting)


def test_a_local_prediction_queues_a_critical_request_ahead_of_sheddable_work_only_on_a_priority_engine():
    def ttft(config: EngineConfig, priority: int) -> float:
        unseen = [RequestState("u", 200, 400, priority=1)]
        return predict_from_state(_busy(config), RequestState("new", 200, 100, priority=priority), unseen, MODEL,
                                  0.0, 0.0).result.ttft_s

    assert ttft(PRIORITY, 0) < 0.5 * ttft(PRIORITY, 1)
    fcfs = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=512)
    assert ttft(fcfs, 0) == ttft(fcfs, 1)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
async def test_the_ledger_sidecar_predicts_by_the_priority_its_admits_and_predicts_carry(policy):
    engine = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=512,
                          scheduling_policy=policy)
    sidecar = Sidecar(SidecarConfig(backend="127.0.0.1:1", listen="127.0.0.1:0", engine=engine,
                                    discover_kv_cache=False))
    port = await sidecar.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.PredictorStub(channel)
            for i in range(12):  # sheddable work fills the slots and the queue
                await stub.Admit(pb.AdmitRequest(request_id=f"s{i}", num_prompt_tokens=200,
                                                 num_predicted_output_tokens=400, priority=1), timeout=5)

            async def ttft(priority: int) -> float:
                return (await stub.Predict(pb.PredictRequest(request_id="p", num_prompt_tokens=200,
                                                             num_predicted_output_tokens=50, priority=priority),
                                           timeout=5)).ttft_s

            critical_s, sheddable_s = await ttft(0), await ttft(1)
            reply = await stub.Watch(pb.WatchRequest(router_id=1), timeout=5).read()
        if policy == "priority":
            assert critical_s < 0.5 * sheddable_s
            assert reply.scheduling_policy == "priority" and set(reply.priorities) == {1}
        else:
            assert critical_s == pytest.approx(sheddable_s, rel=0.05)
            assert not reply.scheduling_policy and not reply.priorities
        assert sidecar.ledger.scheduler.get_request("s0").priority == 1
    finally:
        await sidecar.stop(0)


def test_a_state_file_that_names_no_policy_takes_the_sidecars_flag():
    data = _published(FakeScheduler([FakeRequest("r", 10, 10)], [FakeRequest("w", 10)]))  # an fcfs or older plugin
    assert parse_plugin_state(json.dumps(data)).engine.scheduling_policy == "fcfs"
    assert parse_plugin_state(json.dumps(data), "priority").engine.scheduling_policy == "priority"
    data["engine"]["scheduling_policy"] = "fcfs"  # one that names it wins
    assert parse_plugin_state(json.dumps(data), "priority").engine.scheduling_policy == "fcfs"
