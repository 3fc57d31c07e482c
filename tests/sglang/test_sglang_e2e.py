"""Real SGLang (0.5.23 on CPU, two servers): our /metrics reader, the sidecar's discovery and reconciliation, and
real Envoy -> extproc (astrolabe on predictions; gie on SGLang's gauges) -> the servers on /generate and the OpenAI
routes."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from bench.vllm_trace import tiny_trace
from deploy.sglang.launch import SERVED_MODEL_NAME, SglangSettings
from predictor.backend_metrics import SGLANG, parse_backend_metrics, parse_sglang_metrics
from predictor.server import sglang_engine_limits
from predictor.sim.scheduler import EngineConfig
from tests.integration.stack import poll_until, sidecar_state

pytestmark = [pytest.mark.sglang, pytest.mark.envoy, pytest.mark.slow]

SETTINGS = SglangSettings()
NUM_PAGES = SETTINGS.max_total_tokens // SETTINGS.page_size


def scrape(address: str) -> str:
    return httpx.get(f"http://{address}/metrics", timeout=10).text


def count(stack, series: str) -> float:
    """An extproc /metrics series (`Stack.metric`), 0 before its first sample."""
    try:
        return stack.metric(series)
    except KeyError:
        return 0.0


def logged_destinations(stack, request_ids: list[str]) -> dict[str, str] | None:
    """request id -> destination from the extproc's decision log (flushed at least once a second); None until it
    holds every one of ``request_ids``."""
    path = stack.tmp / "decisions.jsonl"
    if not path.is_file():
        return None
    found = {r["request_id"]: r["destination"] for r in map(json.loads, path.read_text().splitlines())}
    return found if all(i in found for i in request_ids) else None


def reconciled_state(sidecar: str) -> dict | None:
    """The sidecar's State once it has reconciled from the backend's /metrics at least once."""
    state = sidecar_state(sidecar)
    return state if state["reconcile"]["num_reconciliations"] else None


def idle_state(sidecar: str) -> dict | None:
    """The sidecar's State once its ledger holds no request."""
    state = sidecar_state(sidecar)
    return state if not state["running"] and not state["waiting"] else None


async def generate(client: httpx.AsyncClient, url: str, text: str, max_new_tokens: int, *, stream: bool,
                   request_id: str | None = None):
    """POST /generate; returns (status, the last answer object or the error body, SSE events or None)."""
    body = {"text": text, "stream": stream, "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    headers = {"x-request-id": request_id} if request_id else {}
    if not stream:
        response = await client.post(f"{url}/generate", json=body, headers=headers)
        return response.status_code, response.json(), None
    async with client.stream("POST", f"{url}/generate", json=body, headers=headers) as response:
        events = [line[len("data: "):] async for line in response.aiter_lines() if line.startswith("data: ")]
    last = json.loads(events[-2]) if len(events) >= 2 else None
    return response.status_code, last, events


async def completion(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, *, stream: bool,
                     request_id: str):
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream}
    headers = {"x-request-id": request_id}
    if not stream:
        response = await client.post(f"{url}/v1/completions", json=body, headers=headers)
        return response.status_code, response.json(), None
    body["stream_options"] = {"include_usage": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        events = [line[len("data: "):] async for line in response.aiter_lines() if line.startswith("data: ")]
    usage = next((json.loads(e)["usage"] for e in reversed(events[:-1]) if json.loads(e).get("usage")), None)
    return response.status_code, {"usage": usage}, events


def test_our_metrics_reader_reads_the_real_server(sglang_stack):
    for server in sglang_stack.sglang:
        text = scrape(server.address)
        observed = parse_backend_metrics(text, "auto")
        assert observed.engine == SGLANG and observed == parse_sglang_metrics(text)
        # 0.5.23 has no sglang:cache_config_info: the KV pool comes from the page gauges.
        assert "sglang:cache_config_info" not in text
        assert (observed.block_size, observed.num_gpu_blocks) == (SETTINGS.page_size, NUM_PAGES)
        assert observed.num_running == observed.num_waiting == 0 and observed.kv_cache_usage_frac < 0.05


def test_the_sidecars_discover_the_kv_cache_and_engine_limits(sglang_stack):
    expected = {"max_num_seqs": SETTINGS.max_running_requests,
                "max_num_batched_tokens": SETTINGS.chunked_prefill_size,
                "block_size": SETTINGS.page_size, "num_gpu_blocks": NUM_PAGES}
    for server in sglang_stack.sglang:
        info = httpx.get(f"http://{server.address}/get_server_info", timeout=10).json()
        assert info["max_running_requests"] == SETTINGS.max_running_requests
        from_info = sglang_engine_limits(info, EngineConfig())
        assert {k: getattr(from_info, k) for k in expected} == expected
        sidecar = sglang_stack.sidecars[server.address]
        state = poll_until(lambda a=sidecar: reconciled_state(a), 30, "a reconciliation from SGLang's /metrics")
        assert state["state_source"] == "ledger"
        assert {k: state["engine"][k] for k in expected} == expected, state["engine"]
        log = (sglang_stack.tmp / f"sidecar-{sidecar.rsplit(':', 1)[1]}.log").read_text()
        assert "(from the backend's SGLang KV pool gauges)" in log and "(from the backend's /get_server_info)" in log


def test_a_burst_queues_on_the_server_and_the_sidecars_ledger_follows_it(sglang_stack):
    """24 requests sent straight to one server (past the picker): SGLang queues what its 8 running slots and 1,024
    KV tokens cannot hold; the sidecar learns them only from the gauges (phantom requests) and drops them after."""
    server = sglang_stack.sglang[0]
    sidecar = sglang_stack.sidecars[server.address]
    phantoms_before = sidecar_state(sidecar)["reconcile"]["num_phantoms_added"]
    seen = []

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            tasks = [asyncio.create_task(generate(client, f"http://{server.address}", f"burst {i} " * 20, 48,
                                                  stream=False)) for i in range(24)]
            while not all(t.done() for t in tasks):
                observed = parse_sglang_metrics((await client.get(f"http://{server.address}/metrics")).text)
                state = sidecar_state(sidecar)
                seen.append((observed.num_running, observed.num_waiting, len(state["running"]),
                             len(state["waiting"])))
                await asyncio.sleep(0.1)
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert [status for status, _, _ in results] == [200] * 24
    assert all(answer["meta_info"]["completion_tokens"] == 48 for _, answer, _ in results)
    trail = " ".join(f"{r}+{w}/{lr}+{lw}" for r, w, lr, lw in seen)  # server running+waiting / ledger's
    assert 0 < max(running for running, _, _, _ in seen) <= SETTINGS.max_running_requests, trail
    assert max(waiting for _, waiting, _, _ in seen) > 0, trail  # SGLang queued
    # The ledger learns the server's total (running + waiting), not its split: phantoms get the mean admitted lengths.
    assert max(waiting for _, _, _, waiting in seen) > 0, trail
    assert max(lr + lw for _, _, lr, lw in seen) >= 16, trail
    assert sidecar_state(sidecar)["reconcile"]["num_phantoms_added"] - phantoms_before >= 16
    idle = poll_until(lambda: idle_state(sidecar), 15, "the sidecar's ledger emptied after the burst")
    assert idle["num_free_blocks"] == NUM_PAGES
    observed = parse_sglang_metrics(scrape(server.address))
    assert observed.num_running == observed.num_waiting == 0


def test_generate_and_completions_through_envoy_are_routed_by_predictions(sglang_stack):
    """/generate (stream and not) and /v1/completions (stream and not), Poisson arrivals through Envoy: all answered
    in full, prompt tokens counted as the engine counts them, every decision made on predictions, both servers
    used."""
    trace = tiny_trace(24, 10.0, random.Random(3), max_prompt_tokens=64, max_output_tokens=24)
    predicted_before = count(sglang_stack, 'astrolabe_extproc_decisions_total{basis="prediction"}')
    fallbacks_before = count(sglang_stack, 'astrolabe_extproc_requests_total{outcome="fallback"}')

    async def send(client, i, request):
        await asyncio.sleep(request.arrival_offset_s)
        rid = f"routed-{i}"
        if i % 4 < 2:
            return await generate(client, sglang_stack.envoy_url, request.prompt, request.num_output_tokens,
                                  stream=i % 2 == 0, request_id=rid)
        return await completion(client, sglang_stack.envoy_url, request.prompt, request.num_output_tokens,
                                stream=i % 2 == 0, request_id=rid)

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(send(client, i, r) for i, r in enumerate(trace)))

    results = asyncio.run(run())
    assert [status for status, _, _ in results] == [200] * len(trace), results
    for i, ((_, answer, events), request) in enumerate(zip(results, trace, strict=True)):
        if events is not None:
            assert events[-1] == "[DONE]"
        counts = answer["meta_info"] if i % 4 < 2 else answer["usage"]
        assert counts["completion_tokens"] == request.num_output_tokens, (i, answer)
        assert counts["prompt_tokens"] == request.num_prompt_tokens, (i, answer)
        if i % 4 < 2:
            assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": request.num_output_tokens}
    assert sglang_stack.metric('astrolabe_extproc_decisions_total{basis="prediction"}') - predicted_before \
        >= len(trace)
    assert count(sglang_stack, 'astrolabe_extproc_requests_total{outcome="fallback"}') == fallbacks_before
    ids = [f"routed-{i}" for i in range(len(trace))]
    destinations = poll_until(lambda: logged_destinations(sglang_stack, ids), 10, "the decision log's records")
    per_server = {s.address: sum(destinations[i] == s.address for i in ids) for s in sglang_stack.sglang}
    assert min(per_server.values()) >= 4, per_server  # Po2 on the sidecars' predictions spread them


@pytest.mark.parametrize(("body", "param"), [
    ({"sampling_params": {"max_new_tokens": 4}}, "text"),
    ({"text": "x", "sampling_params": {"max_new_tokens": "many"}}, "sampling_params.max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
], ids=["no-prompt", "max-new-tokens-not-a-number", "max-new-tokens-negative"])
def test_a_bad_generate_body_gets_the_pickers_400(sglang_stack, body, param):
    """Bodies SGLang itself refuses (400) are refused by the picker before routing, naming the field (SGLang's own
    answers name none)."""
    server = sglang_stack.sglang[0].address
    assert httpx.post(f"http://{server}/generate", json=body, timeout=30).status_code == 400
    answer = httpx.post(f"{sglang_stack.envoy_url}/generate", json=body, timeout=10)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def test_gie_reads_the_real_servers_gauges(sglang_stack):
    """The gie policy routes on SGLang's gauges (basis "policy", never the no-metrics fallback), and steers new
    requests away from a server whose gauges show a queue."""
    gie = sglang_stack.gie
    policy_before = count(gie, 'astrolabe_extproc_decisions_total{basis="policy"}')
    # Envoy's readiness GET may come before the first scrape (a no-metrics fallback): count from here.
    fallbacks_before = count(gie, 'astrolabe_extproc_requests_total{outcome="fallback"}')

    async def spread():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(generate(client, gie.envoy_url, f"gie {i} " * 10, 16, stream=i % 2 == 0,
                                                   request_id=f"gie-{i}") for i in range(8)))

    results = asyncio.run(spread())
    assert [status for status, _, _ in results] == [200] * 8
    assert all(answer["meta_info"]["completion_tokens"] == 16 for _, answer, _ in results)
    assert gie.metric('astrolabe_extproc_decisions_total{basis="policy"}') - policy_before >= 8
    assert count(gie, 'astrolabe_extproc_requests_total{outcome="fallback"}') == fallbacks_before
    assert all(gie.metric(f'astrolabe_extproc_endpoint_healthy{{endpoint="{s.address}"}}') == 1
               for s in sglang_stack.sglang)

    busy, idle = sglang_stack.sglang

    async def steer():
        async with httpx.AsyncClient(timeout=300) as client:
            load = [asyncio.create_task(generate(client, f"http://{busy.address}", f"load {i} " * 20, 96,
                                                 stream=False)) for i in range(24)]
            deadline_s = time.monotonic() + 30
            while parse_sglang_metrics((await client.get(f"http://{busy.address}/metrics")).text).num_waiting == 0:
                assert time.monotonic() < deadline_s, "the busy server never showed a queue"
                await asyncio.sleep(0.05)
            steered = [await generate(client, gie.envoy_url, f"steer {i}", 4, stream=False, request_id=f"steer-{i}")
                       for i in range(6)]
            await asyncio.gather(*load)
            return steered

    steered = asyncio.run(steer())
    assert [status for status, _, _ in steered] == [200] * 6
    assert count(gie, 'astrolabe_extproc_requests_total{outcome="fallback"}') == fallbacks_before
    ids = [f"steer-{i}" for i in range(6)]
    destinations = poll_until(lambda: logged_destinations(gie, ids), 10, "the gie decision log's records")
    to_idle = sum(destinations[i] == idle.address for i in ids)
    assert to_idle >= 5, destinations  # the queue gauge of the busy server kept them off it


def test_a_body_with_both_text_and_input_ids_is_served_from_input_ids(sglang_stack):
    """SGLang 0.5.23 takes the prompt from ``input_ids`` when a body carries both; the picker routes it so too."""
    body = {"text": "ignored words " * 10, "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}
    answer = httpx.post(f"{sglang_stack.envoy_url}/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["meta_info"]["prompt_tokens"] == 3
