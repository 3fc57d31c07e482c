import pytest

from predictor.backend_metrics import MetricsFormatError, parse_vllm_metrics

VLLM_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 4.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="2048",engine="0"} 1.0
"""


def test_parses_vllm_v1_names_and_sums_engines():
    obs = parse_vllm_metrics(VLLM_TEXT)
    assert (obs.num_running, obs.num_waiting, obs.num_preemptions_total) == (5, 7, 4)
    assert obs.kv_cache_usage_frac == pytest.approx(0.375)
    assert (obs.num_gpu_blocks, obs.block_size) == (2048, 16)


def test_older_gpu_cache_name():
    text = VLLM_TEXT.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert parse_vllm_metrics(text).kv_cache_usage_frac == pytest.approx(0.375)


@pytest.mark.parametrize("text", ["", "up 1\n", "vllm:num_requests_running 1\n", "{{{ not prometheus"])
def test_rejects_text_without_the_gauges(text):
    with pytest.raises(MetricsFormatError):
        parse_vllm_metrics(text)
