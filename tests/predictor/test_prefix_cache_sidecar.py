"""Block keys at the sidecar (protocol v1.4): the watched state's key columns, the ledger's keyed requests (its
model of the prefix cache), and the modelled and engine prefix-cache counters on its /metrics."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from predictor.api import pb, pb_grpc
from predictor.backend_metrics import parse_vllm_metrics
from predictor.instance_state import Corrections, decode, encode
from predictor.ledger import BackendObservation
from predictor.server import Sidecar, SidecarConfig
from predictor.sidecar_metrics import SidecarCollector
from predictor.sim import EngineConfig, LinearBatchTimeModel
from predictor.sim.block_hash import block_keys
from predictor.sim.snapshot import InstanceSnapshot, RequestState

BS = 16
ENGINE = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, block_size=BS, num_gpu_blocks=4096)
MODEL = LinearBatchTimeModel("test", 0.01, 1e-4, 0.0, 1e-5, 1e-4)


def _keys(system: int, user: int, num_system: int = 512, num_user: int = 256) -> tuple[int, ...]:
    """A prompt of a shared system prompt ``system`` and a user part ``user``: its block keys."""
    tokens = [1000 + system] * num_system + list(range(user * 1000, user * 1000 + num_user))
    return block_keys(tokens, BS)


def _encoded(snapshot: InstanceSnapshot) -> pb.InstanceState:
    return encode(snapshot, MODEL, Corrections(), seq=1, lag_s=0.0, state_age_s=0.0, admits_seen=0, model_error=0.0,
                  state_source="ledger")


def test_a_state_carries_each_requests_keys_prefix_shared_and_the_cached_free_keys():
    requests = [RequestState(f"q{i}", 768, 100, block_keys=_keys(i % 2, i)) for i in range(8)]
    requests.append(RequestState("keyless", 300, 100))
    snapshot = InstanceSnapshot(ENGINE, 0.0, waiting=tuple(requests), cached_block_keys=_keys(5, 99)[:10])
    message = _encoded(snapshot)
    decoded = decode(message).snapshot
    assert [r.block_keys for r in decoded.waiting] == [r.block_keys for r in requests]
    assert decoded.cached_block_keys == snapshot.cached_block_keys
    # the system prompts' 32 blocks are sent once each (first user of each); every request's own 16 once
    assert len(message.block_keys) == 2 * 32 + 8 * 16
    assert list(message.shared_block_keys) == [0, 0, *[32] * 6, 0]
    unkeyed = _encoded(InstanceSnapshot(ENGINE, 0.0, waiting=(RequestState("a", 300, 100),)))
    assert not unkeyed.block_keys_from and decode(unkeyed).snapshot.waiting[0].block_keys is None


@pytest.mark.parametrize("breakage", ["short_column", "forward_reference", "long_share", "extra_keys",
                                      "missing_keys"])
def test_key_columns_that_do_not_add_up_are_refused(breakage):
    requests = (RequestState("a", 768, 10, block_keys=_keys(0, 1)), RequestState("b", 768, 10, block_keys=_keys(0, 2)))
    message = _encoded(InstanceSnapshot(ENGINE, 0.0, waiting=requests))
    if breakage == "short_column":
        del message.own_block_keys[-1]
    elif breakage == "forward_reference":
        message.block_keys_from[0] = 2
    elif breakage == "long_share":
        message.shared_block_keys[1] = 100
    elif breakage == "extra_keys":
        message.block_keys.append(7)
    else:
        del message.block_keys[-1]
    with pytest.raises(ValueError):
        decode(message)


async def test_the_ledger_keeps_admitted_keys_so_a_repeated_prefix_predicts_shorter_and_is_counted():
    sidecar = Sidecar(SidecarConfig(backend="127.0.0.1:1", listen="127.0.0.1:0", engine=ENGINE,
                                    discover_kv_cache=False))
    port = await sidecar.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.PredictorStub(channel)
            keys = _keys(0, 1)

            async def ttft(keys_):
                return (await stub.Predict(pb.PredictRequest(
                    request_id="p", num_prompt_tokens=770, num_predicted_output_tokens=50, block_keys=keys_,
                    block_keys_block_size=BS), timeout=5)).ttft_s

            cold_s = await ttft(keys)
            await stub.Admit(pb.AdmitRequest(request_id="a", num_prompt_tokens=770, num_predicted_output_tokens=500,
                                             block_keys=keys, block_keys_block_size=BS), timeout=5)
            await asyncio.sleep(0.3)  # its prefill runs in the ledger's simulated instance
            assert await ttft(keys) < 0.5 * cold_s  # same prompt: all of it cached (but the last token)
            shared_s, other_s = await ttft(_keys(0, 2)), await ttft(_keys(1, 2))
            assert shared_s < other_s  # the shared system prompt is cached, another one is not
            # a second admitted request with the same system prompt hits it in the ledger's own scheduler
            await stub.Admit(pb.AdmitRequest(request_id="b", num_prompt_tokens=770, num_predicted_output_tokens=500,
                                             block_keys=_keys(0, 2), block_keys_block_size=BS), timeout=5)
            await asyncio.sleep(0.2)
        sidecar.ledger.advance(time.monotonic())  # reconciliation does it with a backend; this one has none
        scheduler = sidecar.ledger.scheduler
        scheduler_hits = scheduler.prefix_cache_hits
        assert scheduler.prefix_cache_queries == 2 * 770 and scheduler_hits == 512
        families = {f.name: f for f in SidecarCollector(sidecar).collect()}
        hits = families["astrolabe_predictor_prefix_cache_hits"]
        assert [(s.labels, s.value) for s in hits.samples] == [({"source": "ledger"}, 512)]
        sidecar.last_observed = BackendObservation(0, 0, prefix_cache_queries_total=3000.0,
                                                   prefix_cache_hits_total=1200.0)
        families = {f.name: f for f in SidecarCollector(sidecar).collect()}
        assert {s.labels["source"]: s.value for s in families["astrolabe_predictor_prefix_cache_queries"].samples} \
            == {"ledger": 1540, "engine": 3000.0}
    finally:
        await sidecar.stop(0)


def test_the_engines_prefix_cache_counters_are_read_when_it_exports_them():
    base = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
    counters = ("# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{engine=\"0\"} 4096\n"
                "# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{engine=\"0\"} 1024\n")
    observed = parse_vllm_metrics(base + counters)
    assert (observed.prefix_cache_queries_total, observed.prefix_cache_hits_total) == (4096.0, 1024.0)
    observed = parse_vllm_metrics(base)
    assert (observed.prefix_cache_queries_total, observed.prefix_cache_hits_total) == (None, None)


async def test_a_held_request_gets_its_keys_only_when_confirmed_so_a_dropped_hold_caches_nothing():
    sidecar = Sidecar(SidecarConfig(backend="127.0.0.1:1", listen="127.0.0.1:0", engine=ENGINE,
                                    discover_kv_cache=False))
    port = await sidecar.start()
    keys = _keys(0, 1)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.PredictorStub(channel)

            async def predict(request_id, hold_s=0.0):
                return (await stub.Predict(pb.PredictRequest(
                    request_id=request_id, num_prompt_tokens=770, num_predicted_output_tokens=50, hold_s=hold_s,
                    router_id=7, block_keys=keys, block_keys_block_size=BS), timeout=5)).ttft_s

            cold_s = await predict("dropped", hold_s=5.0)
            assert sidecar.ledger.scheduler.get_request("dropped").block_keys is None  # held, keyless
            await asyncio.sleep(0.3)  # its simulated prefill runs meanwhile
            await stub.Release(pb.ReleaseRequest(request_id="dropped"), timeout=5)  # routed elsewhere
            assert await predict("probe") >= 0.95 * cold_s  # nothing of it stayed cached (a step may be in progress)
            await predict("kept", hold_s=5.0)
            await stub.Admit(pb.AdmitRequest(request_id="kept", num_prompt_tokens=770, num_predicted_output_tokens=50,
                                             router_id=7, admit_seq=1, block_keys=keys, block_keys_block_size=BS),
                             timeout=5)
            assert sidecar.ledger.scheduler.get_request("kept").block_keys == keys  # confirmed: keyed
            await asyncio.sleep(0.3)
            assert await predict("probe") < 0.5 * cold_s
        assert sidecar.ledger.prefix_cache_queries == 770  # the confirmed request's lookup only
    finally:
        await sidecar.stop(0)
