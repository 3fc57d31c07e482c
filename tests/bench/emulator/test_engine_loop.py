"""Tests for bench/emulator/engine_loop.py: the real-time driver around predictor.sim.Scheduler."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.emulator.engine_loop import EngineLoop
from bench.emulator.metrics import EmulatorMetrics
from predictor.sim import EngineConfig, LinearBatchTimeModel, ScheduledBatch, Scheduler


def _engine(time_scale: float = 1.0, step_noise_frac: float = 0.0, seed: int = 0,
            config: EngineConfig | None = None) -> tuple[EngineLoop, EmulatorMetrics]:
    scheduler = Scheduler(config or EngineConfig())
    metrics = EmulatorMetrics(scheduler, "m", {"block_size": "16"})
    loop = EngineLoop(scheduler, LinearBatchTimeModel.default("llama-2-7b"), metrics, time_scale=time_scale,
                      step_noise_frac=step_noise_frac, rng=random.Random(seed))
    return loop, metrics


def _num_steps(metrics: EmulatorMetrics) -> float:
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == "vllm:iteration_tokens_total_count":
                return sample.value
    raise AssertionError("no iteration histogram")


async def test_requests_finish_with_their_lengths_then_engine_idles() -> None:
    loop, metrics = _engine()
    loop.start()
    try:
        handles = [loop.add_request(f"r{i}", 10 + i, 5 + i, "length", stream_interval=0) for i in range(3)]
        for handle in handles:
            while handle.finish_reason is None:
                await handle.wait_progress(0)
        assert [h.finish_reason for h in handles] == ["length"] * 3
        assert [h.num_generated_tokens for h in handles] == [5, 6, 7]
        assert loop.num_unfinished_requests == 0
        steps = _num_steps(metrics)
        await asyncio.sleep(0.05)
        assert _num_steps(metrics) == steps  # idle: no steps without work
    finally:
        await loop.stop()


async def test_streaming_handle_wakes_on_first_token_then_every_interval() -> None:
    loop, _ = _engine(time_scale=5.0)
    loop.start()
    try:
        handle = loop.add_request("s", 4, 12, "stop", stream_interval=4)
        seen = []
        consumed = 0
        while handle.finish_reason is None:
            await handle.wait_progress(consumed)
            consumed = handle.num_generated_tokens
            seen.append(consumed)
        assert seen[0] >= 1 and seen[-1] == 12 and handle.finish_reason == "stop"
        assert all(b - a >= 4 for a, b in zip(seen[:-2], seen[1:-1]))  # between first and final wake-ups
    finally:
        await loop.stop()


async def test_abort_and_stop() -> None:
    loop, _ = _engine(time_scale=5.0)
    loop.start()
    try:
        first = loop.add_request("a", 4, 1000, "length", stream_interval=1)
        second = loop.add_request("b", 4, 1000, "length", stream_interval=0)
        await first.wait_progress(0)
        loop.abort("a")
        loop.abort("a")  # second abort is a no-op
        assert first.finish_reason == "abort" and loop.scheduler.get_request("a") is None
    finally:
        await loop.stop()
    assert second.finish_reason == "abort" and not loop.scheduler.has_unfinished_requests()


async def test_add_request_that_never_fits_raises() -> None:
    loop, _ = _engine(config=EngineConfig(num_gpu_blocks=2, block_size=16))
    with pytest.raises(ValueError):
        loop.add_request("big", 100, 10, "length", stream_interval=0)
    assert loop.num_unfinished_requests == 0


def test_step_noise_is_seeded_and_scaled() -> None:
    batch = ScheduledBatch()
    batch.num_scheduled_tokens["x"] = 64
    batch.num_prefill_tokens = 64
    plain, _ = _engine(time_scale=3.0)
    base_s = LinearBatchTimeModel.default("llama-2-7b").step_time_s(batch)
    assert plain._step_duration_s(batch) == pytest.approx(3.0 * base_s)
    a, _ = _engine(step_noise_frac=0.2, seed=7)
    b, _ = _engine(step_noise_frac=0.2, seed=7)
    durations_a = [a._step_duration_s(batch) for _ in range(20)]
    assert durations_a == [b._step_duration_s(batch) for _ in range(20)]
    assert len(set(durations_a)) > 1 and min(durations_a) >= 0.0


@pytest.mark.parametrize(("time_scale", "noise"), [(0.0, 0.0), (-1.0, 0.0), (1.0, -0.1)],
                         ids=["zero-scale", "negative-scale", "negative-noise"])
def test_bad_settings_raise(time_scale: float, noise: float) -> None:
    with pytest.raises(ValueError):
        _engine(time_scale=time_scale, step_noise_frac=noise)
