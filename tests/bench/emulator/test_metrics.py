"""Tests for bench/emulator/metrics.py: vLLM V1 names, live gauges from a real predictor.sim.Scheduler."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from bench.emulator.metrics import EmulatorMetrics
from predictor.sim import EngineConfig, Scheduler, SimRequest


def _samples(metrics: EmulatorMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def test_gauges_are_read_live_from_the_scheduler() -> None:
    scheduler = Scheduler(EngineConfig(max_num_seqs=1, num_gpu_blocks=100, block_size=16))
    metrics = EmulatorMetrics(scheduler, "m", {"block_size": "16", "num_gpu_blocks": "100"})
    assert _samples(metrics)["vllm:num_requests_waiting"] == [({"model_name": "m", "engine": "0"}, 0.0)]
    for i in range(3):
        scheduler.add_request(SimRequest(f"r{i}", 40, 5, arrival_time_s=0.0))
    scheduler.schedule()
    samples = _samples(metrics)
    assert samples["vllm:num_requests_running"][0][1] == 1.0
    assert samples["vllm:num_requests_waiting"][0][1] == 2.0
    assert samples["vllm:kv_cache_usage_perc"][0][1] == scheduler.kv_cache_usage_frac > 0
    assert samples["vllm:num_preemptions_total"][0][1] == 0.0
    assert samples["vllm:cache_config_info"] == [({"engine": "0", "block_size": "16", "num_gpu_blocks": "100"}, 1.0)]


def test_lifecycle_observations() -> None:
    metrics = EmulatorMetrics(Scheduler(EngineConfig()), "m", {})
    metrics.observe_step(num_scheduled_tokens=20, num_new_tokens=3)
    metrics.observe_first_token(num_prompt_tokens=17, ttft_s=0.05)
    metrics.observe_inter_token(0.02)
    metrics.observe_finished("stop", e2e_s=1.0, queue_s=0.1, prefill_s=0.05, decode_s=0.85)
    metrics.observe_finished("abort", e2e_s=2.0, queue_s=None, prefill_s=None, decode_s=None)
    samples = _samples(metrics)
    assert samples["vllm:prompt_tokens_total"][0][1] == 17
    assert samples["vllm:generation_tokens_total"][0][1] == 3
    reasons = {labels["finished_reason"]: value for labels, value in samples["vllm:request_success_total"]}
    assert reasons == {"stop": 1.0, "abort": 1.0}
    # An aborted request is counted but does not enter the latency histograms.
    assert samples["vllm:e2e_request_latency_seconds_count"][0][1] == 1
    assert samples["vllm:e2e_request_latency_seconds_sum"][0][1] == 1.0
    assert samples["vllm:request_queue_time_seconds_sum"][0][1] == 0.1
    assert samples["vllm:iteration_tokens_total_sum"][0][1] == 20
    assert samples["vllm:time_to_first_token_seconds_count"][0][1] == 1


def test_each_instance_has_its_own_registry() -> None:
    a = EmulatorMetrics(Scheduler(EngineConfig()), "m", {})
    b = EmulatorMetrics(Scheduler(EngineConfig()), "m", {})
    a.observe_step(5, 5)
    assert _samples(a)["vllm:generation_tokens_total"][0][1] == 5
    assert _samples(b)["vllm:generation_tokens_total"][0][1] == 0
