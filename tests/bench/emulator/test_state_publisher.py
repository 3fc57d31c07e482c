"""Tests for bench/emulator/state_publisher.py: the emulator writes the vLLM plugin's state file.

From a bare ``predictor.sim.Scheduler`` (unit), from a running emulator over real HTTP, and read by a real sidecar
(``predictor.server.Sidecar``, state source ``vllm-plugin``) over real gRPC, beside an emulator process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest

from astrolabe.procs import free_port
from bench.emulator.server import EmulatorConfig, _parse_args, start_emulator
from bench.emulator.state_publisher import sim_state_publisher
from predictor.api import pb, pb_grpc
from predictor.server import Sidecar, SidecarConfig
from predictor.sim import EngineConfig, InstanceSnapshot, Scheduler, SimRequest, blocks_for_tokens
from predictor.state_source import parse_plugin_state, plugin_snapshot
from predictor.vllm_plugin.publisher import STATE_FORMAT_VERSION
from tagger.tokenizer import count_tokens

MODEL = "llama-2-7b"
SMALL = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_gpu_blocks=16)
_DEADLINE_S = 8.0  # bounds a failure only; no timing is asserted
_STARTUP_LIMIT_S = 60.0  # an emulator process importing numpy/aiohttp/tokenizers on a busy machine


def _publish_until_preempted(path: Path) -> tuple[Scheduler, dict[str, int]]:
    """Steps a scheduler until requests run while a preempted one and a never-scheduled one wait, publishing
    after every step (as the emulator does, so the preemption total is exact); returns it and the caps."""
    scheduler = Scheduler(SMALL)
    caps = {f"r{i}": 40 + i for i in range(5)}
    for request_id in caps:
        scheduler.add_request(SimRequest(request_id, 10, 30, arrival_time_s=0.0))
    publisher = sim_state_publisher(str(path), 0.0, caps.get, synchronous=True)
    for step in range(100):
        batch = scheduler.schedule()
        scheduler.update_after_step(batch, float(step))
        publisher.maybe_publish(scheduler)
        if scheduler.running and any(r.num_preemptions for r in scheduler.waiting):
            return scheduler, caps
    raise AssertionError("the scheduler never preempted")


def test_a_sim_scheduler_round_trips_through_the_reader_into_the_same_queues(tmp_path):
    path = tmp_path / "state.json"
    scheduler, caps = _publish_until_preempted(path)
    raw = json.loads(path.read_text())
    assert raw["version"] == STATE_FORMAT_VERSION and list(raw) == [
        "version", "pid", "seq", "published_monotonic_s", "engine", "num_free_blocks", "num_preemptions_total",
        "running", "waiting", "num_steps_total", "steps", "first_tokens", "arrivals"]
    state = parse_plugin_state(path.read_text())
    assert state.engine == SMALL  # num_gpu_blocks as is: the sim has no null block
    assert state.num_free_blocks == scheduler.num_free_blocks
    assert state.num_preemptions_total == scheduler.num_preemptions_total >= 1
    assert [row[4] for row in (*state.running, *state.waiting)] == [
        caps[r.request_id] for r in (*scheduler.running, *scheduler.waiting)]  # the cap, not the true length

    snapshot = plugin_snapshot(state, 5.0, lambda request_id, max_tokens, num_generated: num_generated + 30)
    expected = InstanceSnapshot.from_scheduler(scheduler, 5.0)

    def queue(states):
        return [(r.request_id, r.num_prompt_tokens, r.num_computed_tokens, r.num_generated_tokens,
                 r.num_blocks_held, r.num_preemptions) for r in states]

    assert queue(snapshot.running) == queue(expected.running)
    assert queue(snapshot.waiting) == queue(expected.waiting)
    assert [r.request_id for r in snapshot.waiting] == ["r3", "r4"]  # preempted at the front, then FCFS
    assert snapshot.waiting[0].num_preemptions == 1 and snapshot.waiting[1].num_preemptions == 0
    assert snapshot.num_free_blocks == scheduler.num_free_blocks
    rebuilt = snapshot.to_scheduler()  # a valid state for the simulator
    assert [r.request_id for r in rebuilt.running] == [r.request_id for r in scheduler.running]


def test_an_idle_sim_scheduler_publishes_empty_queues(tmp_path):
    path = tmp_path / "state.json"
    sim_state_publisher(str(path), 0.0, lambda _: None, synchronous=True).maybe_publish(Scheduler(SMALL))
    state = parse_plugin_state(path.read_text())
    assert state.num_unfinished == 0 and state.num_free_blocks == SMALL.num_gpu_blocks


def test_closing_writes_the_last_state_handed_over_and_ends_the_writer_thread(tmp_path):
    path = tmp_path / "state.json"
    scheduler = Scheduler(SMALL)
    publisher = sim_state_publisher(str(path), 0.0, lambda _: 16)  # the engine thread only hands states over
    for i in range(300):  # many hand-overs in a row: the newest is written, none is lost in between
        scheduler.add_request(SimRequest(f"r{i}", 10, 5, arrival_time_s=0.0))
        publisher.maybe_publish(scheduler)
        scheduler.abort_request(f"r{i}")
        publisher.maybe_publish(scheduler)
    publisher.close()
    assert not publisher._writer.is_alive()  # noqa: SLF001
    state = parse_plugin_state(path.read_text())
    assert state.num_unfinished == 0 and state.seq == publisher.num_published == 600
    scheduler.add_request(SimRequest("late", 10, 5, arrival_time_s=0.0))
    publisher.maybe_publish(scheduler)  # closed: publishes no more
    assert parse_plugin_state(path.read_text()).seq == 600


def test_state_flags_parse_and_default_to_off():
    config, _ = _parse_args(["--state-path", "/dev/shm/astrolabe-state.json", "--state-interval-s", "0"])
    assert (config.state_path, config.state_interval_s) == ("/dev/shm/astrolabe-state.json", 0.0)
    default, _ = _parse_args([])
    assert default.state_path is None and default.state_interval_s == 0.01  # the plugin's default
    with pytest.raises(ValueError, match="state_interval_s"):
        EmulatorConfig(state_interval_s=-1.0)


@contextlib.asynccontextmanager
async def _emulator(state_path: Path, **overrides) -> AsyncIterator[httpx.AsyncClient]:
    config = dataclasses.replace(EmulatorConfig(port=0, state_path=str(state_path), state_interval_s=0.0),
                                 **overrides)
    server = await start_emulator(config)
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30.0) as client:
            yield client
    finally:
        await server.stop()


async def _read_until(path: Path, done, limit_s: float = _DEADLINE_S) -> object:
    """The parsed state once ``done(state)`` holds (the writer thread writes shortly after each step)."""
    deadline_s = time.monotonic() + limit_s
    state = None
    while time.monotonic() < deadline_s:
        with contextlib.suppress(OSError):
            state = parse_plugin_state(path.read_text())
            if done(state):
                return state
        await asyncio.sleep(0.005)
    raise AssertionError(f"state never reached the expected shape; last: {state}")


async def test_streaming_requests_show_in_the_state_file_with_vllm_ids_then_it_empties(tmp_path):
    path = tmp_path / "state.json"
    prompts = {"alpha": "hello world", "beta": "one two three four five", "gamma": "x"}
    caps = {"alpha": 24, "beta": 30, "gamma": 36}
    async with _emulator(path, time_scale=3.0) as client:
        initial = await _read_until(path, lambda s: True)  # published at start: settings, empty queues
        assert initial.num_unfinished == 0 and initial.engine.max_num_seqs == EngineConfig().max_num_seqs

        async def stream(x_request_id: str | None, prompt: str, max_tokens: int, first: asyncio.Event):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            headers = {"x-request-id": x_request_id} if x_request_id else {}
            ids = set()
            async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        ids.add(json.loads(line[6:])["id"])
                        first.set()
            return ids

        firsts = {x: asyncio.Event() for x in (*prompts, None)}
        tasks = [asyncio.create_task(stream(x, prompts[x], caps[x], firsts[x])) for x in prompts]
        tasks.append(asyncio.create_task(stream(None, "no header", 20, firsts[None])))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts.values())), _DEADLINE_S)
        busy = await _read_until(path, lambda s: len(s.running) == 4)
        rows = {row[0]: row for row in busy.running}
        engine_ids = sorted(rows)
        # chatcmpl-/cmpl-<x-request-id>-<n>; cmpl-<n> without the header (n: arrival count, 0-based).
        assert [i.rsplit("-", 1)[0] for i in engine_ids] == ["cmpl", "cmpl-alpha", "cmpl-beta", "cmpl-gamma"]
        for engine_id, row in rows.items():
            _, num_prompt, num_computed, num_generated, max_tokens, num_blocks, num_preemptions = row
            x_request_id = engine_id.split("-")[1] if engine_id.count("-") == 2 else None
            assert num_prompt == count_tokens(prompts.get(x_request_id, "no header"))
            assert max_tokens == caps.get(x_request_id, 20)
            assert 1 <= num_generated < max_tokens and num_computed == num_prompt + num_generated - 1
            assert num_blocks == blocks_for_tokens(num_computed, 16) and num_preemptions == 0
        assert busy.waiting == () and busy.pid > 0
        replies = await asyncio.gather(*tasks)
        # The response id is vLLM's: <prefix>-<x-request-id>, without the engine's counter.
        assert replies[:3] == [{f"cmpl-{x}"} for x in prompts]
        assert replies[3] == {next(i for i in engine_ids if i.count("-") == 1)}  # without the header: the same
        idle = await _read_until(path, lambda s: s.num_unfinished == 0)
        assert idle.num_free_blocks == idle.engine.num_gpu_blocks and idle.seq > busy.seq


async def test_chat_requests_are_named_chatcmpl_and_an_abort_is_published(tmp_path):
    path = tmp_path / "state.json"
    async with _emulator(path, time_scale=5.0) as client:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"X-Request-Id": "r1"}) as response:
            lines = response.aiter_lines()  # held: a dropped iterator is closed, and the request with it
            async for line in lines:
                if line.startswith("data: {"):
                    assert json.loads(line[6:])["id"] == "chatcmpl-r1"
                    break
            busy = await _read_until(path, lambda s: len(s.running) == 1)
            assert busy.running[0][0] == "chatcmpl-r1-0" and busy.running[0][4] == 500
        # The client went away mid-stream: the emulator aborts the request and publishes at once.
        await _read_until(path, lambda s: s.num_unfinished == 0)
    assert not path.exists()  # a stopped emulator leaves no state file


_PROCESS_ENGINE = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=512)


def _emulator_process(path: Path, time_scale: float) -> tuple[subprocess.Popen, int]:
    """An emulator process with `_PROCESS_ENGINE`'s limits publishing its state to ``path``; (process, port)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "astrolabe", "emulator", "--port", str(port), "--log-level", "WARNING",
         "--time-scale", str(time_scale), "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
         "--num-gpu-blocks", "512", "--state-path", str(path), "--state-interval-s", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, port


async def _tear_down(channel, sidecar: Sidecar, proc: subprocess.Popen) -> tuple[int | None, str]:
    """Close the channel and the sidecar, then stop the emulator even if that failed; returns `_stop`'s result."""
    try:
        if channel is not None:
            await channel.close()
        await sidecar.stop()
    finally:
        result = _stop(proc)  # never leave the emulator behind
    return result


def _stop(proc: subprocess.Popen) -> tuple[int | None, str]:
    """SIGTERM (SIGKILL after 20 s); returns (exit code or None if killed, stderr)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    if proc.stderr:
        proc.stderr.close()
    return code, stderr


async def test_a_sidecar_in_plugin_mode_predicts_from_an_emulator_process(tmp_path):
    path = tmp_path / "state.json"
    proc, port = _emulator_process(path, 5)
    sidecar = Sidecar(SidecarConfig(backend=f"127.0.0.1:{port}", listen="127.0.0.1:0", engine=_PROCESS_ENGINE,
                                    time_scale=5.0, state_source="vllm-plugin", vllm_state_path=str(path),
                                    discover_kv_cache=False))
    channel = None
    try:
        # The emulator's first state, written at start.
        started = await _read_until(path, lambda s: True, _STARTUP_LIMIT_S)
        assert started.pid == proc.pid and started.num_unfinished == 0
        grpc_port = await sidecar.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = pb_grpc.PredictorStub(channel)
        ask = pb.PredictRequest(request_id="new", num_prompt_tokens=50, num_predicted_output_tokens=20)
        idle = await stub.Predict(ask, timeout=5)
        assert idle.state_source == "vllm-plugin" and idle.num_running + idle.num_waiting == 0
        assert idle.num_gpu_blocks == 512
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30.0) as client:
            async with contextlib.AsyncExitStack() as streams:
                held = []  # a dropped line iterator is closed, and its request with it
                for i in range(3):
                    body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 2000, "ignore_eos": True,
                            "stream": True}
                    response = await streams.enter_async_context(
                        client.stream("POST", "/v1/completions", json=body, headers={"x-request-id": f"q{i}"}))
                    held.append(response.aiter_lines())
                    async for line in held[-1]:
                        if line.startswith("data: {"):
                            break
                await _read_until(path, lambda s: len(s.running) == 3)
                busy = await stub.Predict(ask, timeout=5)
                assert busy.state_source == "vllm-plugin" and (busy.num_running, busy.num_waiting) == (3, 0)
                assert busy.e2e_s > idle.e2e_s and busy.state_age_s < 2.0
                state = json.loads((await stub.State(pb.StateRequest(), timeout=5)).state_json)
                assert sorted(r["request_id"] for r in state["running"]) == ["cmpl-q0-0", "cmpl-q1-1", "cmpl-q2-2"]
        # The clients went away: the emulator aborted their requests and published its empty queues.
        await _read_until(path, lambda s: s.num_unfinished == 0)
        after = await stub.Predict(ask, timeout=5)
        assert after.state_source == "vllm-plugin" and after.num_running + after.num_waiting == 0
    finally:
        code, stderr = await _tear_down(channel, sidecar, proc)
    assert code == 0, stderr
    assert list(tmp_path.iterdir()) == []  # SIGTERM: the emulator deleted its state file


async def test_a_sidecar_calibrates_to_an_engine_it_has_never_seen_and_checks_every_prediction(tmp_path):
    """The emulator's steps take 3x what the sidecar's model says (time scale 6 against 2): the sidecar refits
    from the measured steps in the state file, its E2E error falls, and every admitted request's prediction is
    checked against its observed TTFT and E2E."""
    path = tmp_path / "state.json"
    proc, port = _emulator_process(path, 6)
    sidecar = Sidecar(SidecarConfig(backend=f"127.0.0.1:{port}", listen="127.0.0.1:0", engine=_PROCESS_ENGINE,
                                    time_scale=2.0, state_source="vllm-plugin", vllm_state_path=str(path),
                                    discover_kv_cache=False, calibration_min_samples=32))
    channel = None
    try:
        await _read_until(path, lambda s: True, _STARTUP_LIMIT_S)
        grpc_port = await sidecar.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = pb_grpc.PredictorStub(channel)
        first = await stub.Predict(pb.PredictRequest(request_id="x", num_prompt_tokens=20,
                                                     num_predicted_output_tokens=30), timeout=5)
        assert first.calibration_source == "prior" and first.calibration_num_samples == 0

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60.0) as client:
            async def one(name: str) -> None:
                prompt = f"calibration request {name}"
                ask = pb.PredictRequest(request_id=name, num_prompt_tokens=count_tokens(prompt),
                                        num_predicted_output_tokens=30, length_source=pb.LENGTH_SOURCE_EXACT)
                answer = await stub.Predict(ask, timeout=5)
                await stub.Admit(pb.AdmitRequest(request_id=f"{name}/s", num_prompt_tokens=ask.num_prompt_tokens,
                                                 num_predicted_output_tokens=30, max_tokens=30,
                                                 length_source=pb.LENGTH_SOURCE_EXACT,
                                                 predicted_ttft_s=answer.ttft_s, predicted_e2e_s=answer.e2e_s),
                                 timeout=5)
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 30, "ignore_eos": True}
                response = await client.post("/v1/completions", json=body, headers={"x-request-id": name})
                assert response.status_code == 200
                await stub.Release(pb.ReleaseRequest(request_id=f"{name}/s"), timeout=5)

            async def wave(tag: str) -> None:
                await asyncio.gather(*(one(f"{tag}-{i}") for i in range(8)))

            async def quality() -> dict:
                state = json.loads((await stub.State(pb.StateRequest(), timeout=5)).state_json)
                return state

            await wave("w0")  # predicted on the prior: about a third of what happens
            before = (await quality())["outcomes"]
            deadline_s = time.monotonic() + 60.0
            n = 1
            while True:
                calibration = (await quality())["calibration"]
                if calibration["source"] == "online" and calibration["scale_vs_prior"] > 2.7:
                    break
                assert time.monotonic() < deadline_s, f"never calibrated: {calibration}"
                await wave(f"w{n}")
                n += 1
            await wave("last")
            after = await quality()
        calibration, outcomes = after["calibration"], after["outcomes"]
        assert calibration["scale_vs_prior"] < 4.0 and calibration["residual"] < calibration["prior_residual"]
        assert outcomes["e2e"]["count"] == outcomes["ttft"]["count"] == 8 * (n + 1)  # every request checked
        # every request's delay from Admit to the emulator's scheduler measured (loopback HTTP: well under 1 s)
        assert after["ingress"]["num_observed"] == 8 * (n + 1) and 0 <= after["ingress"]["delay_s"] < 1.0
        first_wave = [r for r in outcomes["recent"] if r[0].startswith("w0-")]
        last_wave = [r for r in outcomes["recent"] if r[0].startswith("last-")]

        def mape(records, predicted, observed):
            return sum(abs(r[predicted] - r[observed]) / r[observed] for r in records) / len(records)

        assert before["e2e"]["bias"] < 0.6 and mape(first_wave, 3, 4) > 0.4  # the prior: ~3x too short
        assert mape(last_wave, 3, 4) < 0.25  # calibrated
        answer = await stub.Predict(pb.PredictRequest(request_id="y", num_prompt_tokens=20,
                                                      num_predicted_output_tokens=30), timeout=5)
        assert answer.calibration_source == "online" and answer.calibration_num_samples >= 32
        assert 0 <= answer.calibration_residual < 0.5
    finally:
        await _tear_down(channel, sidecar, proc)


def test_a_priority_scheduler_publishes_its_policy_and_each_requests_priority_in_arrival_order(tmp_path):
    path = tmp_path / "state.json"
    scheduler = Scheduler(dataclasses.replace(SMALL, scheduling_policy="priority"))
    for i, priority in enumerate((1, 0, 1, 0, 1)):
        scheduler.add_request(SimRequest(f"r{i}", 10, 30, arrival_time_s=float(i), priority=priority))
    batch = scheduler.schedule()
    scheduler.update_after_step(batch, 1.0)
    sim_state_publisher(str(path), 0.0, lambda _: None, synchronous=True).maybe_publish(scheduler)
    state = parse_plugin_state(path.read_text())
    assert state.engine.scheduling_policy == "priority"
    snapshot = plugin_snapshot(state, 100.0, lambda _rid, _cap, generated: generated + 30)
    expected = InstanceSnapshot.from_scheduler(scheduler, 100.0)
    requests = [*snapshot.running, *snapshot.waiting]
    assert [(r.request_id, r.priority) for r in requests] == [
        (r.request_id, r.priority) for r in (*expected.running, *expected.waiting)]
    assert [r.request_id for r in sorted(requests, key=lambda r: r.arrival_time_s)] == ["r0", "r1", "r2", "r3", "r4"]
    fcfs = tmp_path / "fcfs.json"
    sim_state_publisher(str(fcfs), 0.0, lambda _: None, synchronous=True).maybe_publish(Scheduler(SMALL))
    assert "priorities" not in json.loads(fcfs.read_text())
