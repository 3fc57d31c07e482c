from pathlib import Path

import pytest

from predictor.backend_metrics import MetricsFormatError, parse_backend_metrics, parse_sglang_metrics, parse_vllm_metrics

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


# The shape of SGLang's /metrics (python/sglang/srt/metrics/collector.py; docs/references/production_metrics.md):
# label model_name, two data-parallel ranks here (dp_rank), the KV pool as cache_config_info pages.
SGLANG_TEXT = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
sglang:num_running_reqs{dp_rank="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
sglang:num_queue_reqs{dp_rank="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
sglang:token_usage{dp_rank="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.12
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{dp_rank="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 161721.0
# TYPE sglang:cache_config_info gauge
sglang:cache_config_info{model_name="meta-llama/Llama-3.1-8B-Instruct",num_pages="10000",page_size="16"} 1.0
# TYPE sglang:num_retracted_requests counter
sglang:num_retracted_requests_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 6.0
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="meta-llama/Llama-3.1-8B-Instruct"} 912.5
"""


def test_parses_sglang_names_and_sums_ranks():
    obs = parse_sglang_metrics(SGLANG_TEXT)
    assert (obs.num_running, obs.num_waiting, obs.num_preemptions_total) == (16, 3, 6)
    assert obs.kv_cache_usage_frac == pytest.approx(0.20)
    assert (obs.num_gpu_blocks, obs.block_size, obs.engine) == (10000, 16, "sglang")


def test_sglang_kv_cache_from_page_gauges_then_from_the_token_pool():
    without_info = "\n".join(line for line in SGLANG_TEXT.splitlines() if "cache_config_info" not in line) + "\n"
    gauges = without_info + "# TYPE sglang:page_size gauge\nsglang:page_size 64\n" \
                            "# TYPE sglang:num_pages gauge\nsglang:num_pages 2500\n"
    assert (parse_sglang_metrics(gauges).num_gpu_blocks, parse_sglang_metrics(gauges).block_size) == (2500, 64)
    obs = parse_sglang_metrics(without_info)  # page size 1: the pool's tokens are its pages
    assert (obs.num_gpu_blocks, obs.block_size) == (161721, 1)
    bare = "\n".join(line for line in without_info.splitlines() if "max_total_num_tokens" not in line) + "\n"
    assert (parse_sglang_metrics(bare).num_gpu_blocks, parse_sglang_metrics(bare).block_size) == (None, None)


def test_auto_reads_each_format_by_its_gauges():
    assert parse_backend_metrics(VLLM_TEXT).engine == "vllm"
    assert parse_backend_metrics(SGLANG_TEXT).engine == "sglang"
    assert parse_backend_metrics(SGLANG_TEXT, "sglang").num_running == 16
    assert parse_backend_metrics(VLLM_TEXT, "vllm").num_running == 5


@pytest.mark.parametrize(("text", "metrics_format", "names"), [
    ("up 1\n", "auto", "neither vLLM's"),
    (SGLANG_TEXT, "vllm", "vllm:num_requests_running"),
    (VLLM_TEXT, "sglang", "sglang:num_running_reqs"),
    ("sglang:num_running_reqs 1\n", "sglang", "sglang:num_queue_reqs"),
])
def test_a_format_without_its_gauges_is_refused_with_their_names(text, metrics_format, names):
    with pytest.raises(MetricsFormatError, match=names):
        parse_backend_metrics(text, metrics_format)


def test_an_unknown_format_name_is_a_value_error():
    with pytest.raises(ValueError, match="unknown metrics format 'tgi'"):
        parse_backend_metrics(VLLM_TEXT, "tgi")


def test_a_real_sglang_0_5_23_scrape():
    """Captured from a real SGLang 0.5.23 server on this CPU (bench/README-sglang.md): no cache_config_info, the KV
    pool as sglang:page_size / sglang:num_pages gauges, labels engine_type, tp_rank, pp_rank, moe_ep_rank."""
    text = (Path(__file__).parent / "data" / "sglang-0.5.23-metrics.txt").read_text()
    obs = parse_backend_metrics(text)
    assert (obs.engine, obs.num_running, obs.num_waiting, obs.num_gpu_blocks, obs.block_size) == \
        ("sglang", 0, 0, 4096, 1)
