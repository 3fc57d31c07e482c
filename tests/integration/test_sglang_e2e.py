"""An SGLang fleet (emulated: ``astrolabe emulator --api sglang``) behind real Envoy and the extproc.

Four SGLang-mode emulators with a sidecar each (ledger state, reconciled from SGLang's /metrics, engine limits from
``/get_server_info``); one extproc with the astrolabe policy (predictions) and one with GIE's scorers (reading
SGLang's gauges, ``metrics_format: sglang``). SGLang's native ``/generate`` and the OpenAI routes go through the
same picker. The real-SGLang tier (tests/sglang, ``make test-sglang``) runs the same checks on real SGLang 0.5.23.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from astrolabe.procs import ProcessGroup
from tests.integration.stack import Stack, poll_until, sidecar_state

pytestmark = [pytest.mark.envoy]

TIME_SCALE = "10"
ENGINE = ["--max-num-seqs", "4", "--max-num-batched-tokens", "512", "--num-gpu-blocks", "256"]
# SGLang's /health answers after ~1 s (it generates a token and polls once a second): a check needs more time.
HEALTH = {"interval_s": 1.0, "timeout_s": 3.0, "unhealthy_threshold": 1}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with ProcessGroup() as procs:
        tmp = tmp_path_factory.mktemp("sglang")
        s = Stack(procs, tmp, "full-duplex")
        emulators = [s.start_emulator("--api", "sglang", "--time-scale", TIME_SCALE, *ENGINE) for _ in range(4)]
        # The sidecars get vLLM-default flags: what they use must come from the backends.
        s.sidecars = {e: s.start_sidecar(e, "--time-scale", TIME_SCALE, "--backend-engine", "auto") for e in emulators}
        endpoints = [{"address": e, "predictor": p} for e, p in s.sidecars.items()]
        s.write_config(endpoints, policy="astrolabe", policy_params={"k": 2}, health_check=HEALTH,
                       predictor_client={"predict_timeout_s": 0.5})
        s.start_extproc()
        s.start_envoy()
        gie = Stack(procs, tmp / "gie", "buffered")
        gie.tmp.mkdir()
        gie.write_config([{"address": e} for e in emulators], policy="gie", metrics_format="sglang",
                         health_check=HEALTH)
        gie.start_extproc()
        gie.start_envoy()
        s.gie = gie
        yield s


async def _generate(client, url, i, stream):
    body = {"text": f"question {i} " * 20, "stream": stream,
            "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}
    async with client.stream("POST", f"{url}/generate", json=body) as response:
        raw = [line async for line in response.aiter_lines() if line]
        return response.status_code, response.headers.get("x-emulator-instance"), raw


async def _burst(url, n, stream=True):
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(_generate(client, url, i, stream) for i in range(n)))


def test_sidecars_take_the_engine_limits_and_kv_cache_from_the_sglang_servers(fleet):
    for sidecar in fleet.sidecars.values():
        state = poll_until(lambda a=sidecar: (lambda st: st if st["reconcile"]["num_reconciliations"] else None)(
            sidecar_state(a)), 10, "a reconciliation from SGLang's /metrics")
        engine = state["engine"]
        assert (engine["max_num_seqs"], engine["max_num_batched_tokens"], engine["num_gpu_blocks"],
                engine["block_size"]) == (4, 512, 256, 16)


def test_generate_bursts_are_routed_by_predictions(fleet):
    results = asyncio.run(_burst(fleet.envoy_url, 24))
    assert all(status == 200 for status, _, _ in results)
    assert all(raw[-1] == "data: [DONE]" for _, _, raw in results)
    last = [json.loads(raw[-2][len("data: "):]) for _, _, raw in results]
    assert all(chunk["meta_info"]["completion_tokens"] == 24 for chunk in last)
    assert len({instance for _, instance, _ in results}) >= 3
    assert fleet.metric('astrolabe_extproc_decisions_total{basis="prediction"}') >= 24
    with pytest.raises(KeyError):
        fleet.metric('astrolabe_extproc_requests_total{outcome="fallback"}')


def test_openai_routes_of_sglang_go_through_the_same_picker(fleet):
    before = fleet.metric('astrolabe_extproc_decisions_total{basis="prediction"}')
    r = httpx.post(f"{fleet.envoy_url}/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5
    assert fleet.metric('astrolabe_extproc_decisions_total{basis="prediction"}') == before + 1


def test_a_bad_generate_body_is_a_clear_400_from_the_picker(fleet):
    r = httpx.post(f"{fleet.envoy_url}/generate", json={"text": "x", "sampling_params": {"max_new_tokens": -1}}, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "sampling_params.max_new_tokens"


def test_a_request_the_backend_refuses_is_not_scored_by_the_sidecars(fleet):
    """The picker routes a batch of two prompts (SGLang serves it); the emulator refuses batches (400): the sidecar
    learns the request failed with its Release and leaves it out of its prediction error."""
    def checked():
        return sum(sidecar_state(p)["outcomes"]["e2e"]["count"] for p in fleet.sidecars.values())

    poll_until(lambda: fleet.metric("astrolabe_extproc_in_flight_requests") == 0, 30, "idle fleet")
    before = checked()
    r = httpx.post(f"{fleet.envoy_url}/generate", json={"text": ["a b", "c d"]}, timeout=30)
    assert r.status_code == 400 and "batched" in r.json()["error"]["message"]
    ok = httpx.post(f"{fleet.envoy_url}/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}},
                    timeout=30)
    assert ok.status_code == 200
    poll_until(lambda: checked() == before + 1, 10, "the successful request scored")
    assert checked() == before + 1


def test_gie_scorers_read_sglang_s_gauges(fleet):
    gie = fleet.gie
    results = asyncio.run(_burst(gie.envoy_url, 16, stream=False))
    assert all(status == 200 for status, _, _ in results)
    assert len({instance for _, instance, _ in results}) >= 3
    assert gie.metric('astrolabe_extproc_decisions_total{basis="policy"}') >= 16
    assert all(gie.metric(f'astrolabe_extproc_endpoint_healthy{{endpoint="{e}"}}') == 1 for e in fleet.sidecars)
