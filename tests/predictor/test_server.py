"""The predictor sidecar over real gRPC, reconciling against a real emulated vLLM's /metrics."""

import asyncio
import dataclasses
import io
import json
import logging
import time

import aiohttp
import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from astrolabe.logs import build_handler
from astrolabe.tracing import setup_tracing
from bench.emulator.server import EmulatorConfig, start_emulator
from predictor.api import pb, pb_grpc
from predictor.server import Sidecar, SidecarConfig, load_batch_time
from predictor.sim import EngineConfig

ENGINE = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=512)
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


@pytest.fixture
async def emulator():
    emu = await start_emulator(EmulatorConfig(port=0, engine=ENGINE, time_scale=20.0))
    yield emu
    await emu.stop()


async def start_sidecar(backend, **kwargs):
    sidecar = Sidecar(SidecarConfig(backend=backend, listen="127.0.0.1:0", engine=ENGINE, **kwargs))
    port = await sidecar.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return sidecar, channel, pb_grpc.PredictorStub(channel)


async def test_admit_makes_the_next_prediction_include_the_request():
    sidecar, channel, stub = await start_sidecar("127.0.0.1:1")  # no backend: ledger only
    try:
        ask = pb.PredictRequest(request_id="x", num_prompt_tokens=200, num_predicted_output_tokens=100)
        idle = await stub.Predict(ask, timeout=5)
        assert 0 < idle.ttft_s < idle.e2e_s and idle.num_running + idle.num_waiting == 0
        for i in range(12):
            reply = await stub.Admit(pb.AdmitRequest(request_id=f"r{i}", num_prompt_tokens=200,
                                                     num_predicted_output_tokens=300), timeout=5)
            assert not reply.duplicate
        assert (await stub.Admit(pb.AdmitRequest(request_id="r0", num_prompt_tokens=200,
                                                 num_predicted_output_tokens=300), timeout=5)).duplicate
        busy = await stub.Predict(ask, timeout=5)
        assert busy.num_running + busy.num_waiting == 12
        assert busy.e2e_s > idle.e2e_s and busy.ttft_s > idle.ttft_s
        assert busy.state_source == "ledger" and busy.state_age_s == float("inf")  # never reconciled
        assert (await stub.Release(pb.ReleaseRequest(request_id="r3"), timeout=5)).known
        assert not (await stub.Release(pb.ReleaseRequest(request_id="nope"), timeout=5)).known
        state = json.loads((await stub.State(pb.StateRequest(), timeout=5)).state_json)
        assert len(state["running"]) + len(state["waiting"]) == 11
    finally:
        await channel.close()
        await sidecar.stop()


async def test_an_admit_handled_after_its_requests_release_is_not_counted():
    """A short request's Release can be handled before its Admit (they travel on different calls): the late Admit
    must not add a request that nothing will release again (predictor/early_releases.py)."""
    sidecar, channel, stub = await start_sidecar("127.0.0.1:1")  # no backend: nothing would reconcile a ghost
    try:
        assert not (await stub.Release(pb.ReleaseRequest(request_id="quick"), timeout=5)).known
        admit = pb.AdmitRequest(request_id="quick", num_prompt_tokens=200, num_predicted_output_tokens=300,
                                router_id=7, admit_seq=1)
        assert (await stub.Admit(admit, timeout=5)).duplicate  # changed nothing ...
        ask = pb.PredictRequest(request_id="x", num_prompt_tokens=200, num_predicted_output_tokens=100, router_id=7)
        answer = await stub.Predict(ask, timeout=5)
        assert answer.admits_seen == 1  # ... but the router learns its Admit was handled
        assert answer.num_running + answer.num_waiting == 0
        assert sidecar.early_releases.num_ignored_admits == 1
        # a hold dropped (a candidate not chosen), then Admitted under the same id because Envoy served the request
        # here (Router.served): that Admit counts
        await stub.Predict(pb.PredictRequest(request_id="held", num_prompt_tokens=200, num_predicted_output_tokens=100,
                                             hold_s=5), timeout=5)
        assert (await stub.Release(pb.ReleaseRequest(request_id="held"), timeout=5)).known
        held = pb.AdmitRequest(request_id="held", num_prompt_tokens=200, num_predicted_output_tokens=300)
        assert not (await stub.Admit(held, timeout=5)).duplicate
        state = json.loads((await stub.State(pb.StateRequest(), timeout=5)).state_json)
        assert len(state["running"]) + len(state["waiting"]) == 1
        assert (await stub.Release(pb.ReleaseRequest(request_id="held"), timeout=5)).known
    finally:
        await channel.close()
        await sidecar.stop()


@pytest.mark.parametrize("prompt, output", [(0, 10), (10, 0)])
async def test_bad_predict_arguments_are_invalid_argument(prompt, output):
    sidecar, channel, stub = await start_sidecar("127.0.0.1:1")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Predict(pb.PredictRequest(num_prompt_tokens=prompt, num_predicted_output_tokens=output),
                               timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Admit(pb.AdmitRequest(request_id="", num_prompt_tokens=1, num_predicted_output_tokens=1),
                             timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await channel.close()
        await sidecar.stop()


async def _wait(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_reconciliation_corrects_the_ledger(emulator):
    backend = f"127.0.0.1:{emulator.port}"
    sidecar, channel, stub = await start_sidecar(backend, visibility_grace_s=0.3, time_scale=20.0)
    try:
        await _wait(lambda: sidecar.last_reconciled_s is not None)
        # KV cache discovered from vllm:cache_config_info
        assert sidecar.ledger.scheduler.config.num_gpu_blocks == ENGINE.num_gpu_blocks
        # 1) admitted here but never sent to the backend (e.g. lost): reconciled away after the grace period
        for i in range(5):
            await stub.Admit(pb.AdmitRequest(request_id=f"ghost{i}", num_prompt_tokens=50,
                                             num_predicted_output_tokens=2000), timeout=5)
        assert sidecar.ledger.num_unfinished() == 5
        await _wait(lambda: sidecar.ledger.num_unfinished() == 0)
        # 2) requests sent to the backend by someone else: appear in the ledger as phantoms
        async with aiohttp.ClientSession() as session:
            body = {"model": "llama-2-7b", "prompt": "hi", "max_tokens": 400, "ignore_eos": True}
            tasks = [asyncio.create_task(session.post(f"{emulator.base_url}/v1/completions", json=body))
                     for _ in range(6)]
            await _wait(lambda: sidecar.ledger.num_unfinished() >= 6)
            assert sidecar.ledger.stats.num_phantoms_added >= 6
            reply = await stub.Predict(pb.PredictRequest(num_prompt_tokens=10, num_predicted_output_tokens=10),
                                       timeout=5)
            assert reply.state_age_s < 1.0
            for task in tasks:
                task.cancel()
    finally:
        await channel.close()
        await sidecar.stop()


def test_load_batch_time_scales_every_coefficient():
    base, scaled = load_batch_time("llama-2-7b"), load_batch_time("llama-2-7b", 4.0)
    assert scaled.c0_s == pytest.approx(4 * base.c0_s) and scaled.c3_s_per_token == pytest.approx(4 * base.c3_s_per_token)
    with pytest.raises(ValueError):
        load_batch_time("llama-2-7b", 0.0)
    with pytest.raises(ValueError):
        load_batch_time("no-such-model")


async def test_a_request_that_can_never_fit_is_invalid_argument():
    sidecar, channel, stub = await start_sidecar("127.0.0.1:1")
    try:
        too_big = ENGINE.num_gpu_blocks * ENGINE.block_size + 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Predict(pb.PredictRequest(num_prompt_tokens=too_big, num_predicted_output_tokens=1),
                               timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cannot be served" in info.value.details()
    finally:
        await channel.close()
        await sidecar.stop()


def _start_line(caplog) -> str:
    (line,) = [r.getMessage() for r in caplog.records
               if r.name == "predictor.server" and r.getMessage().startswith("backend ")]
    return line


@pytest.mark.parametrize(("kwargs", "kv"), [
    ({}, "KV cache 512 blocks x 16 tokens (from the backend's vllm:cache_config_info)"),
    ({"discover_kv_cache": False}, "KV cache 100 blocks x 16 tokens (from the flags (--no-discover-kv-cache))"),
], ids=["discovered", "flags"])
async def test_the_start_line_says_what_was_discovered_from_the_backend(emulator, caplog, kwargs, kv):
    caplog.set_level("INFO", logger="predictor.server")
    backend = f"127.0.0.1:{emulator.port}"
    flags = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=100)
    sidecar = Sidecar(SidecarConfig(backend=backend, listen="127.0.0.1:0", engine=flags, **kwargs))
    await sidecar.start()
    try:
        await _wait(lambda: any(r.getMessage().startswith("backend ") for r in caplog.records))
    finally:
        await sidecar.stop()
    assert _start_line(caplog) == (
        f"backend {backend}: {kv}; engine limits max_num_seqs 8, max_num_batched_tokens 256, chunked prefill on "
        "(from the flags); scheduler rules vllm-v1; state source ledger; step-time model llama-2-7b (calibration "
        "online, idle without the plugin's state file)")


async def test_the_start_line_names_the_plugin_state_file_and_what_it_reports(tmp_path, caplog):
    caplog.set_level("INFO", logger="predictor.server")
    path = tmp_path / "state.json"
    engine = EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, block_size=32, num_gpu_blocks=64,
                          enable_chunked_prefill=False)
    emu = await start_emulator(EmulatorConfig(port=0, engine=engine, state_path=str(path)))
    await _wait(path.exists)
    sidecar = Sidecar(SidecarConfig(backend=f"127.0.0.1:{emu.port}", listen="127.0.0.1:0", engine=ENGINE,
                                    vllm_state_path=str(path)))
    await sidecar.start()
    try:
        await _wait(lambda: any(r.getMessage().startswith("backend ") for r in caplog.records))
    finally:
        await sidecar.stop()
        await emu.stop()
    line = _start_line(caplog)
    assert f"KV cache 64 blocks x 32 tokens (from the plugin's state file {path})" in line
    assert "max_num_seqs 4, max_num_batched_tokens 128, chunked prefill off" in line
    assert "state source vllm-plugin (--state-source auto)" in line and f"the plugin's state file {path}" in line


async def test_a_line_logged_while_a_call_is_handled_names_its_request_and_trace(tmp_path):
    buffer, logger = io.StringIO(), logging.getLogger("predictor.state_source")
    logger.addHandler(build_handler("json", buffer))
    exporter = InMemorySpanExporter()
    tracing = setup_tracing("astrolabe-predictor", environ={}, exporter=exporter)
    # No state file yet: the first Predict logs the switch to the ledger, inside the call.
    sidecar = Sidecar(SidecarConfig(backend="127.0.0.1:1", listen="127.0.0.1:0", engine=ENGINE,
                                    vllm_state_path=str(tmp_path / "absent.json")), tracing)
    port = await sidecar.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await pb_grpc.PredictorStub(channel).Predict(
                pb.PredictRequest(request_id="abc/1", num_prompt_tokens=10, num_predicted_output_tokens=10),
                metadata=(("traceparent", TRACEPARENT),), timeout=5)
    finally:
        logger.handlers.clear()
        await sidecar.stop()
        tracing.shutdown()
    (line,) = [json.loads(text) for text in buffer.getvalue().splitlines()]
    assert line["message"].startswith("state source: ledger") and line["level"] == "WARNING"
    assert (line["request_id"], line["trace_id"]) == ("abc/1", TRACE_ID)


async def test_beside_sglang_the_sidecar_reads_its_limits_and_reconciles_from_its_metrics(caplog):
    caplog.set_level("INFO", logger="predictor.server")
    emu = await start_emulator(EmulatorConfig(port=0, engine=ENGINE, time_scale=20.0, api="sglang"))
    backend = f"127.0.0.1:{emu.port}"
    flags = EngineConfig(max_num_seqs=48, max_num_batched_tokens=512, block_size=16, num_gpu_blocks=100)
    sidecar = Sidecar(SidecarConfig(backend=backend, listen="127.0.0.1:0", engine=flags, visibility_grace_s=0.3,
                                    time_scale=20.0))
    await sidecar.start()
    try:
        await _wait(lambda: sidecar.last_reconciled_s is not None)
        # Limits from /get_server_info, KV from /metrics, SGLang's scheduler rules (the backend is SGLang)
        assert sidecar.ledger.scheduler.config == dataclasses.replace(ENGINE, scheduling="sglang")
        assert _start_line(caplog).startswith(
            f"backend {backend}: KV cache 512 blocks x 16 tokens (from the backend's SGLang KV pool gauges); "
            "engine limits max_num_seqs 8, max_num_batched_tokens 256, chunked prefill on (from the backend's "
            "/get_server_info); scheduler rules sglang")
        async with aiohttp.ClientSession() as session:
            body = {"text": "hi", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
            tasks = [asyncio.create_task(session.post(f"{emu.base_url}/generate", json=body)) for _ in range(5)]
            await _wait(lambda: sidecar.ledger.num_unfinished() >= 5)  # phantoms from sglang:num_running_reqs
            for task in tasks:
                task.cancel()
    finally:
        await sidecar.stop()
        await emu.stop()


async def test_a_vllm_backend_named_sglang_is_never_reconciled(emulator):
    sidecar, channel, stub = await start_sidecar(f"127.0.0.1:{emulator.port}", backend_engine="sglang")
    try:
        await asyncio.sleep(0.5)
        assert sidecar.last_reconciled_s is None  # every scrape lacks SGLang's gauges
        reply = await stub.Predict(pb.PredictRequest(num_prompt_tokens=10, num_predicted_output_tokens=10), timeout=5)
        assert reply.e2e_s > 0  # the ledger still answers
    finally:
        await channel.close()
        await sidecar.stop()


@pytest.mark.parametrize(("info", "expected"), [
    ({"max_running_requests": 8, "chunked_prefill_size": 256, "page_size": 16, "max_total_num_tokens": 1600},
     EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=100)),
    ({"max_running_requests": None, "chunked_prefill_size": -1, "max_prefill_tokens": 16384, "page_size": 1,
      "internal_states": [{"max_total_num_tokens": 5000}]},
     EngineConfig(max_num_batched_tokens=16384, enable_chunked_prefill=False, block_size=1, num_gpu_blocks=5000)),
    ({"unrelated": True}, EngineConfig()),
])
def test_sglang_server_info_maps_onto_the_engine_limits(info, expected):
    from predictor.server import sglang_engine_limits
    assert sglang_engine_limits(info, EngineConfig()) == expected


def test_server_info_that_is_not_an_object_or_makes_bad_limits_is_a_value_error():
    from predictor.server import sglang_engine_limits
    with pytest.raises(ValueError, match="not an object"):
        sglang_engine_limits([1], EngineConfig())
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sglang_engine_limits({"max_running_requests": 1024, "chunked_prefill_size": 512}, EngineConfig())


def test_a_real_sglang_0_5_23_server_info_gives_its_limits():
    """Captured from a real SGLang 0.5.23 (bench/README-sglang.md): max_running_requests null, the scheduler's
    choice in internal_states."""
    from pathlib import Path

    from predictor.server import sglang_engine_limits
    info = json.loads((Path(__file__).parent / "data" / "sglang-0.5.23-server-info.json").read_text())
    assert sglang_engine_limits(info, EngineConfig()) == EngineConfig(
        max_num_seqs=2048, max_num_batched_tokens=4096, block_size=1, num_gpu_blocks=4096)


async def test_a_sidecar_started_before_its_sglang_server_discovers_it_once_it_answers(caplog, monkeypatch):
    """A native sidecar starts before its server (Kubernetes): the limits, the KV cache and SGLang's scheduler rules
    are taken when the server first answers, and the start line is logged again then."""
    caplog.set_level("INFO", logger="predictor.server")
    import predictor.server
    monkeypatch.setattr(predictor.server, "REDISCOVER_INTERVAL_S", 0.1)  # 5 s by default
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    flags = EngineConfig(max_num_seqs=48, max_num_batched_tokens=512, block_size=16, num_gpu_blocks=100)
    sidecar = Sidecar(SidecarConfig(backend=f"127.0.0.1:{port}", listen="127.0.0.1:0", engine=flags,
                                    reconcile_interval_s=0.05))
    await sidecar.start()
    emu = None
    try:
        await _wait(lambda: sum(r.getMessage().startswith("backend ") for r in caplog.records) == 1)
        assert "not readable yet" in _start_line(caplog) and sidecar.ledger.scheduler.config == flags
        emu = await start_emulator(EmulatorConfig(port=port, engine=ENGINE, api="sglang",
                                                  time_scale=20.0))
        await _wait(lambda: sidecar.ledger.scheduler.config == dataclasses.replace(ENGINE, scheduling="sglang"))
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("backend ")]
        assert len(lines) == 2 and "(from the backend's /get_server_info); scheduler rules sglang" in lines[1]
        # The wait was said once (discovery), and the failing reconciliation once
        assert [r.levelname for r in caplog.records].count("WARNING") == 2
    finally:
        await sidecar.stop()
        if emu is not None:
            await emu.stop()


async def test_a_sidecar_told_its_backend_is_sglang_models_sglang_before_it_answers():
    sidecar = Sidecar(SidecarConfig(backend="127.0.0.1:9", listen="127.0.0.1:0", engine=ENGINE,
                                    backend_engine="sglang"))
    assert sidecar.ledger.scheduler.config.scheduling == "sglang"
