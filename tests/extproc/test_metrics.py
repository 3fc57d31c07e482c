"""The extproc's /metrics over HTTP after real ext_proc streams: what the issue lists, and bounded cardinality."""

import asyncio
import json
import random
import string

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from astrolabe.procs import free_port
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_pb_grpc
from extproc.config import parse_config
from extproc.server import ExtprocServer
from predictor.server import Sidecar, SidecarConfig
from predictor.sim import EngineConfig
from tests.extproc.test_stream import body_msg, headers_msg
from tests.predictor.test_state_source import _state_text

ENGINE = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, block_size=16, num_gpu_blocks=512)


def idle_engine_state(path):
    """A plugin state file of an idle engine (current however old: predictions need no reconciliation)."""
    path.write_text(_state_text(engine={"max_num_seqs": 8, "max_num_batched_tokens": 512, "block_size": 16,
                                        "num_gpu_blocks": 512, "enable_chunked_prefill": True},
                                num_free_blocks=512))
    return path


@pytest.fixture
async def stack(tmp_path):
    sidecars = []
    for i in range(2):
        sidecar = Sidecar(SidecarConfig(backend="127.0.0.1:1", listen="127.0.0.1:0", engine=ENGINE,
                                        discover_kv_cache=False, state_source="vllm-plugin",
                                        vllm_state_path=str(idle_engine_state(tmp_path / f"state-{i}.json"))))
        await sidecar.start()
        sidecars.append(sidecar)
    endpoints = [{"address": f"10.0.0.{i}:8000", "models": ["m"], "predictor": f"127.0.0.1:{s.port}"}
                 for i, s in enumerate(sidecars, 1)]
    metrics_port = free_port()
    config = parse_config({"listen": "127.0.0.1:0", "metrics_listen": f"127.0.0.1:{metrics_port}",
                           "policy": "astrolabe", "policy_params": {"k": 2}, "seed": 1,
                           "health_check": {"enabled": False}, "endpoints": endpoints,
                           "output_length": {"source": "fixed", "fixed_tokens": 64}})
    server = ExtprocServer(config)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield server, ext_pb_grpc.ExternalProcessorStub(channel), f"http://127.0.0.1:{metrics_port}/metrics", endpoints
    await channel.close()
    await server.stop()
    for sidecar in sidecars:
        await sidecar.stop(0)


async def one_stream(stub, model: str, request_id: str = "abc") -> str:
    """Headers + body as Envoy sends them in buffered mode, then the stream's end; the answer's kind."""
    call = stub.Process()
    body = json.dumps({"model": model, "prompt": "hello there", "max_tokens": 16}).encode()
    await call.write(headers_msg(extra=(("x-tenant", model),)))
    await call.read()
    await call.write(body_msg(body))
    answer = await call.read()
    await call.done_writing()
    while await call.read() != grpc.aio.EOF:
        pass
    return answer.WhichOneof("response")


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def scrape(url: str) -> dict:
    async with httpx.AsyncClient() as client:
        return samples((await client.get(url, timeout=5)).text)


def total(found: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in found.items() if n == name and labels.items() <= dict(ls).items())


async def test_a_short_run_shows_decisions_predictions_and_prediction_error(stack):
    server, stub, url, endpoints = stack
    for _ in range(12):
        assert await one_stream(stub, "m") == "request_body"
    assert await one_stream(stub, "no-such-model") == "immediate_response"
    found = await scrape(url)
    assert total(found, "astrolabe_extproc_requests_total", policy="astrolabe", outcome="routed") == 12
    assert total(found, "astrolabe_extproc_requests_total", policy="astrolabe", outcome="model_not_found") == 1
    assert total(found, "astrolabe_extproc_routing_seconds_count") == 12
    assert total(found, "astrolabe_extproc_length_estimate_seconds_count") == 12
    assert total(found, "astrolabe_extproc_decisions_total", basis="prediction") == 12
    assert total(found, "astrolabe_extproc_fallbacks_total") == 0
    for endpoint in endpoints:  # k = 2 of 2: both sidecars asked every time
        assert total(found, "astrolabe_extproc_predict_seconds_count", predictor=endpoint["predictor"]) == 12
        assert total(found, "astrolabe_extproc_in_flight_requests", endpoint=endpoint["address"]) == 0
    # every completed request's prediction compared with its observed E2E (stream open -> closed), per endpoint
    assert total(found, "astrolabe_extproc_prediction_ratio_count", metric="e2e") == 12
    assert {dict(ls)["endpoint"] for (n, ls), _ in found.items()
            if n == "astrolabe_extproc_prediction_ratio_count"} <= {e["address"] for e in endpoints}


async def test_random_model_values_leave_the_series_count_unchanged(stack):
    """10,000 requests with random ``model`` values (and tenant headers): no label value comes from a request."""
    server, stub, url, _ = stack
    await one_stream(stub, "m")
    await one_stream(stub, "warm-up-unknown")
    before = await scrape(url)
    rng = random.Random(0)
    models = ["".join(rng.choices(string.ascii_letters + string.digits + "-_/.:", k=rng.randint(1, 40)))
              for _ in range(10_100)]
    models = [m for m in models if m != "m"][:10_000]  # "m" is the one served model
    semaphore = asyncio.Semaphore(64)

    async def one(model: str) -> str:
        async with semaphore:
            return await one_stream(stub, model, request_id=model)

    kinds = await asyncio.gather(*(one(m) for m in models))
    assert set(kinds) == {"immediate_response"}  # all refused: no such model
    after = await scrape(url)
    assert set(after) == set(before), set(after) ^ set(before)
    assert total(after, "astrolabe_extproc_requests_total", outcome="model_not_found") == 10_001
