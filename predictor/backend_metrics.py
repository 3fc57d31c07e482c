"""Reads a vLLM server's Prometheus text into a ``BackendObservation``; the only vLLM /metrics parser.

Names (vLLM V1; FACTS.md): gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (older releases: ``vllm:gpu_cache_usage_perc``), info gauge
``vllm:cache_config_info`` (labels ``block_size``, ``num_gpu_blocks``), counter ``vllm:num_preemptions``
(exposed as ``vllm:num_preemptions_total``). Series of several engines or models are summed (usage: averaged).
``histogram_totals`` reads the sum and count of any histogram (the profiler's iteration times).
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from predictor.ledger import BackendObservation


class MetricsFormatError(ValueError):
    """The text is not Prometheus exposition format or lacks the running/waiting gauges."""


def _label_int(labels: dict[str, str], key: str) -> int | None:
    value = labels.get(key, "")
    return int(value) if value.isdigit() else None


def parse_vllm_metrics(text: str) -> BackendObservation:
    """Parses vLLM's /metrics text.

    Raises:
        MetricsFormatError: unparsable text, or no ``vllm:num_requests_running`` / ``_waiting`` gauge.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    cache_labels: dict[str, str] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name
                if name == "vllm:cache_config_info":
                    cache_labels = dict(sample.labels)
                    continue
                sums[name] = sums.get(name, 0.0) + sample.value
                counts[name] = counts.get(name, 0) + 1
    except ValueError as exc:
        raise MetricsFormatError(f"not Prometheus text: {exc}") from None
    if "vllm:num_requests_running" not in sums or "vllm:num_requests_waiting" not in sums:
        raise MetricsFormatError("no vllm:num_requests_running / vllm:num_requests_waiting gauges")
    usage_name = "vllm:kv_cache_usage_perc" if "vllm:kv_cache_usage_perc" in sums else "vllm:gpu_cache_usage_perc"
    usage = sums.get(usage_name, 0.0) / max(counts.get(usage_name, 1), 1)
    return BackendObservation(
        num_running=int(sums["vllm:num_requests_running"]),
        num_waiting=int(sums["vllm:num_requests_waiting"]),
        kv_cache_usage_frac=usage,
        num_preemptions_total=int(sums.get("vllm:num_preemptions_total", 0)),
        num_gpu_blocks=_label_int(cache_labels, "num_gpu_blocks"),
        block_size=_label_int(cache_labels, "block_size"),
    )


def histogram_totals(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of one Prometheus histogram, summed over its label sets (engines, models).

    Raises:
        ValueError: unparsable text.
    """
    total_s, count = 0.0, 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_sum":
                total_s += sample.value
            elif sample.name == f"{name}_count":
                count += sample.value
    return total_s, count
