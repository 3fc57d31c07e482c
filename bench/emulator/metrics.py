"""Prometheus metrics of one emulated instance, under vLLM V1's names or (SGLang mode) SGLang's.

Owns a private ``CollectorRegistry`` per instance (several instances may share a process in tests). Gauges and
the preemption counter are read from the live scheduler at scrape time by a custom collector, so they are never
stale; latency histograms and token counters are fed by the engine loop. Every duration is in the emulator's
own wall-clock seconds (``time.monotonic()``), i.e. already multiplied by the time scale.

Must not import aiohttp. Source: vllm/v1/metrics/loggers.py PrometheusStatLogger (vLLM 0.x) for names, labels
and histogram buckets; python/sglang/srt/metrics/collector.py (``SchedulerMetricsCollector``,
``TokenizerMetricsCollector``) for SGLang's: gauges ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
``sglang:num_used_tokens``, ``sglang:token_usage``, ``sglang:max_total_num_tokens``, ``sglang:page_size`` and
``sglang:num_pages`` (the emulator's KV blocks; as SGLang 0.5.23 exports them, seen on a real server here), the
counters
``sglang:num_retracted_requests_total`` (the emulator's preemptions), ``sglang:prompt_tokens_total``,
``sglang:generation_tokens_total``, ``sglang:num_requests_total`` and the latency histograms (label
``model_name``; the real server adds ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``).
``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (tokens; vLLM's ``record_prefix_cache_stats``
in vllm/v1/core/kv_cache_manager.py) are the scheduler's counters.
Known differences: no ``vllm:prompt_tokens_cached``, external (KV connector) prefix-cache, spec-decode or LoRA
metrics; ``server.main`` turns off
``_created`` series process-wide; the ``iteration_tokens_total`` buckets are a fixed list, not derived from
cudagraph sizes; SGLang mode has no per-phase (queue/prefill/decode) request histograms but its queue time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

ENGINE_LABEL = "0"
"""vLLM's ``engine`` label of a single-engine server."""
APIS = ("vllm", "sglang")
"""Whose metric names an instance exports."""

_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0)
_REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                              120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _SchedulerCollector(Collector):
    """Reads live gauges (and the preemption counter) from a ``predictor.sim.Scheduler`` on every scrape."""

    def __init__(self, scheduler: Any, model_name: str, cache_info: dict[str, str], api: str = "vllm",
                 prefix_caching: bool = False) -> None:
        self._scheduler = scheduler
        self._prefix_caching = prefix_caching
        self._api = api
        self._label_names = ["model_name", "engine"] if api == "vllm" else ["model_name"]
        self._labels = [model_name, ENGINE_LABEL][:len(self._label_names)]
        self._cache_info = cache_info

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=self._label_names)
        family.add_metric(self._labels, value)
        return family

    def collect(self) -> Iterator[Metric]:
        if self._api == "sglang":
            yield from self._collect_sglang()
            return
        sched = self._scheduler
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          len(sched.running))
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                          len(sched.waiting))
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          float(sched.kv_cache_usage_frac))
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["engine", *self._cache_info])
        info.add_metric([ENGINE_LABEL, *self._cache_info.values()], 1.0)
        yield info
        preempt = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                      labels=["model_name", "engine"])
        preempt.add_metric(self._labels, float(sched.num_preemptions_total))
        yield preempt
        # Prompt tokens looked up at first admissions and those found cached (recomputations after a preemption
        # are not counted); both stay 0 with prefix caching off, as vLLM's do (no lookup, no record).
        for name, doc, value in (
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                 sched.prefix_cache_queries),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                 sched.prefix_cache_hits)):
            family = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
            family.add_metric(self._labels, float(value) if self._prefix_caching else 0.0)
            yield family

    def _collect_sglang(self) -> Iterator[Metric]:
        sched = self._scheduler
        config = sched.config
        yield self._gauge("sglang:num_running_reqs", "The number of running requests.", len(sched.running))
        yield self._gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", len(sched.waiting))
        yield self._gauge("sglang:num_used_tokens", "The number of used tokens.",
                          float(sched.num_used_blocks * config.block_size))
        yield self._gauge("sglang:token_usage", "The token usage.", float(sched.kv_cache_usage_frac))
        yield self._gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
                          float(config.num_gpu_blocks * config.block_size))
        # SGLang 0.5.23 states its KV pool as these gauges (older releases: labels of sglang:cache_config_info).
        yield self._gauge("sglang:page_size", "The page size of the KV cache.", float(config.block_size))
        yield self._gauge("sglang:num_pages", "The number of pages in the KV cache.", float(config.num_gpu_blocks))
        retracted = CounterMetricFamily("sglang:num_retracted_requests", "Total number of retracted requests.",
                                        labels=self._label_names)
        retracted.add_metric(self._labels, float(sched.num_preemptions_total))
        yield retracted


class EmulatorMetrics:
    """The metric set of one instance; methods are called by the engine loop after each step.

    Args:
        scheduler: the instance's ``predictor.sim.Scheduler`` (read at scrape time).
        model_name: served model name, the ``model_name`` label.
        cache_info: labels of ``vllm:cache_config_info`` (e.g. block_size, num_gpu_blocks), values as strings
            (unused in SGLang mode: its KV pool is the page gauges).
        api: ``vllm`` or ``sglang``: whose metric names (module docstring).
        prefix_caching: whether the instance caches prefixes (else the prefix-cache counters stay 0).

    Raises:
        ValueError: an unknown ``api``.
    """

    def __init__(self, scheduler: Any, model_name: str, cache_info: dict[str, str], api: str = "vllm",
                 prefix_caching: bool = False) -> None:
        if api not in APIS:
            raise ValueError(f"unknown api {api!r}; known: {', '.join(APIS)}")
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SchedulerCollector(scheduler, model_name, cache_info, api, prefix_caching))
        sglang = api == "sglang"
        labels = ["model_name"] if sglang else ["model_name", "engine"]
        self._label_values = {"model_name": model_name} if sglang else {"model_name": model_name,
                                                                          "engine": ENGINE_LABEL}
        prefix = "sglang:" if sglang else "vllm:"

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(**self._label_values)

        def counter(name: str, doc: str) -> Any:
            # prometheus_client appends "_total" itself.
            return Counter(name, doc, labels, registry=self.registry).labels(**self._label_values)

        self._prompt_tokens = counter(f"{prefix}prompt_tokens", "Number of prefill tokens processed.")
        self._generation_tokens = counter(f"{prefix}generation_tokens", "Number of generation tokens processed.")
        if sglang:
            self._success = Counter("sglang:num_requests", "The number of processed requests.", labels,
                                    registry=self.registry)
        else:
            self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                    [*labels, "finished_reason"], registry=self.registry)
        self._ttft = hist(f"{prefix}time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                          _TTFT_BUCKETS_S)
        self._itl = hist(f"{prefix}inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                         _ITL_BUCKETS_S)
        self._e2e = hist(f"{prefix}e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                         _REQUEST_LATENCY_BUCKETS_S)
        self._queue = hist("sglang:queue_time_seconds" if sglang else "vllm:request_queue_time_seconds",
                           "Histogram of time spent in WAITING phase for request.", _REQUEST_LATENCY_BUCKETS_S)
        self._prefill = self._decode = self._iteration_tokens = None
        if not sglang:
            self._prefill = hist("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", _REQUEST_LATENCY_BUCKETS_S)
            self._decode = hist("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", _REQUEST_LATENCY_BUCKETS_S)
            self._iteration_tokens = hist("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", _ITERATION_TOKENS_BUCKETS)

    def observe_step(self, num_scheduled_tokens: int, num_new_tokens: int) -> None:
        """One engine step: tokens in the batch (prefill + decode) and output tokens it produced."""
        if self._iteration_tokens is not None:
            self._iteration_tokens.observe(num_scheduled_tokens)
        if num_new_tokens:
            self._generation_tokens.inc(num_new_tokens)

    def observe_first_token(self, num_prompt_tokens: int, ttft_s: float) -> None:
        """A request's prefill finished: its prompt length (tokens) and time to first token (s)."""
        self._prompt_tokens.inc(num_prompt_tokens)
        self._ttft.observe(ttft_s)

    def observe_inter_token(self, gap_s: float) -> None:
        """Seconds between two consecutive output tokens of one request."""
        self._itl.observe(gap_s)

    def observe_finished(self, finished_reason: str, e2e_s: float, queue_s: float | None,
                         prefill_s: float | None, decode_s: float | None) -> None:
        """A request ended ("stop", "length" or "abort"); phase durations in seconds, None if never reached."""
        if "engine" in self._label_values:
            self._success.labels(finished_reason=finished_reason, **self._label_values).inc()
        else:
            self._success.labels(**self._label_values).inc()
        if finished_reason == "abort":
            return
        self._e2e.observe(e2e_s)
        for hist, value in ((self._queue, queue_s), (self._prefill, prefill_s), (self._decode, decode_s)):
            if hist is not None and value is not None:
                hist.observe(max(0.0, value))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric of this instance."""
        return generate_latest(self.registry)
