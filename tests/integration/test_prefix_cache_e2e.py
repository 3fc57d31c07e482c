"""Prefix caching on the request path, end to end: real Envoy -> real extproc (block keys from the prompt's token
ids) -> real sidecars whose ledgers keep the keys of the requests they admitted, in front of emulated vLLM
instances. A repeated long prompt's second prediction is a shorter TTFT on the instance that serves the first
(while the first runs there: its prompt's blocks are held) or served it (its ledger keeps them cached when the
first request ended), in both prediction modes."""

from __future__ import annotations

import json

import httpx
import pytest

from astrolabe.procs import ProcessGroup
from tests.integration.stack import Stack, poll_until

pytestmark = [pytest.mark.envoy]

MODEL = "llama-2-7b"
TIME_SCALE = "10"
ENGINE = ["--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--num-gpu-blocks", "1024", "--block-size", "16"]
PROMPT = " ".join(f"section {i} of the shared document describes prefill, decode and the KV cache."
                  for i in range(150))
"""About 2,400 WordPiece tokens: a prefill of several engine steps, so a cached prefix shows in the TTFT."""


@pytest.fixture(scope="module", params=["watch", "predict"])
def stack(request, tmp_path_factory):
    with ProcessGroup() as procs:
        s = Stack(procs, tmp_path_factory.mktemp(f"prefix-{request.param}"), "full-duplex")
        emulators = [s.start_emulator("--time-scale", TIME_SCALE, *ENGINE) for _ in range(2)]
        sidecars = {e: s.start_sidecar(e, "--time-scale", TIME_SCALE, *ENGINE) for e in emulators}
        s.decision_log = s.tmp / "decisions.jsonl"
        s.write_config([{"address": e, "models": [MODEL], "predictor": p} for e, p in sidecars.items()],
                       policy="astrolabe", policy_params={"k": 2},
                       output_length={"source": "fixed", "fixed_tokens": 4},
                       predictor_client={"mode": request.param, "predict_timeout_s": 2.0},  # a loaded box
                       prefix_cache={"enabled": True, "block_size": 16},
                       decision_log_path=str(s.decision_log))
        s.start_extproc()
        s.start_envoy()
        yield s


def _decisions(stack) -> list[dict]:
    if not stack.decision_log.exists():
        return []
    return [json.loads(line) for line in stack.decision_log.read_text().splitlines() if line.strip()]


def _decision(stack, max_tokens: int) -> dict | None:
    """The first logged decision of a request that asked for ``max_tokens`` (`_send`), or None."""
    return next((d for d in _decisions(stack) if d["max_tokens"] == max_tokens), None)


def _send(stack, prompt: str = PROMPT, max_tokens: int = 4) -> str:
    """One completion through Envoy; its ``max_tokens`` tells its decision apart in the log (the log is flushed once
    a second, so a record's position says nothing about which request it is)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    response = httpx.post(f"{stack.envoy_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.headers["x-emulator-instance"]


def test_a_repeated_long_prompt_is_predicted_shorter_where_its_prefix_is_cached(stack):
    _send(stack)
    first = poll_until(lambda: [d for d in _decisions(stack) if d["num_prompt_tokens"] > 1000], 10,
                       "the first decision in the log")[-1]
    ttft = {c["endpoint"]: c["ttft_s"] for c in first["candidates"]}
    assert len(ttft) == 2 and None not in ttft.values()
    other = next(e for e in ttft if e != first["destination"])
    # both instances idle and cold: the same prediction
    assert ttft[first["destination"]] == pytest.approx(ttft[other], rel=0.05)
    cold_s = ttft[first["destination"]]

    # The extproc released the first request (its stream ended): its sidecar's ledger freed its blocks and keeps
    # them cached. Within a watch interval the watched state shows them too.
    def second_decision():
        _send(stack)
        decisions = [d for d in _decisions(stack) if d["num_prompt_tokens"] > 1000]
        return decisions[-1] if len(decisions) >= 2 else None

    second = poll_until(second_decision, 10, "the second decision in the log", interval_s=0.2)
    ttft = {c["endpoint"]: c["ttft_s"] for c in second["candidates"]}
    warm_s = ttft[first["destination"]]
    assert warm_s < 0.5 * cold_s, (warm_s, cold_s)  # ~2,400 tokens, of which all but the last block cached
    assert ttft[other] == pytest.approx(cold_s, rel=0.1)  # the other instance never saw the prompt
    assert second["destination"] == first["destination"]


def test_a_long_prompt_repeated_while_the_first_runs_is_predicted_shorter_where_it_runs(stack):
    prompt = PROMPT.replace("section", "chapter")

    body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{stack.envoy_url}/v1/completions", json=body, timeout=60) as running:
        assert running.status_code == 200
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # its first token: its prompt is prefilled
        _send(stack, prompt, max_tokens=5)
        first = poll_until(lambda: _decision(stack, 200), 10, "the running request's decision in the log")
        second = poll_until(lambda: _decision(stack, 5), 10, "the repeated request's decision in the log")
    ttft = {c["endpoint"]: c["ttft_s"] for c in second["candidates"]}
    other = next(e for e in ttft if e != first["destination"])
    assert ttft[first["destination"]] < 0.5 * ttft[other], ttft
    assert second["destination"] == first["destination"]


def test_an_engine_restarted_at_the_same_address_loses_its_cache_credit(tmp_path):
    """Ledger mode: the sidecar sees the restart in the backend's counters (``vllm:prefix_cache_queries_total``
    went back) and starts its ledger empty; the router's next prediction for the repeated prompt there is cold."""
    from astrolabe.procs import free_port

    with ProcessGroup() as procs:
        s = Stack(procs, tmp_path, "full-duplex")
        port = free_port()
        emulator = s.start_emulator("--time-scale", TIME_SCALE, *ENGINE, port=port)
        metrics_port = free_port()
        sidecar = s.start_sidecar(emulator, "--time-scale", TIME_SCALE, *ENGINE, "--reconcile-interval-s", "0.05",
                                  "--metrics-listen", f"127.0.0.1:{metrics_port}")
        s.decision_log = s.tmp / "decisions.jsonl"
        s.write_config([{"address": emulator, "models": [MODEL], "predictor": sidecar}],
                       policy="astrolabe", policy_params={"k": 1}, output_length={"source": "fixed", "fixed_tokens": 4},
                       predictor_client={"mode": "watch", "predict_timeout_s": 0.5},
                       prefix_cache={"enabled": True, "block_size": 16}, decision_log_path=str(s.decision_log))
        s.start_extproc()
        s.start_envoy()

        def ttfts() -> list[float]:
            return [d["candidates"][0]["ttft_s"] for d in _decisions(s) if d["num_prompt_tokens"] > 1000]

        _send(s)
        cold_s = poll_until(ttfts, 10, "the first decision")[0]
        warm = poll_until(lambda: _send(s) and len(ttfts()) >= 2 and ttfts(), 10, "the second decision")
        assert warm[1] < 0.5 * cold_s
        s.backends[emulator].stop()
        s.start_emulator("--time-scale", TIME_SCALE, *ENGINE, port=port)

        def restarts() -> bool:
            text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
            return "astrolabe_predictor_backend_restarts_total 1.0" in text

        poll_until(restarts, 15, "the sidecar to see the restart", interval_s=0.1)

        def after_restart():
            # 503 until the extproc's health checks take the restarted instance back; max_tokens 3 marks these
            # requests' decisions (the log is flushed once a second: late records of the requests above may follow)
            httpx.post(f"{s.envoy_url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
            decision = _decision(s, 3)
            return decision and decision["candidates"][0]["ttft_s"]

        after_s = poll_until(after_restart, 10, "a decision after the restart", interval_s=0.2)
        assert after_s == pytest.approx(cold_s, rel=0.1), (after_s, cold_s, warm)
