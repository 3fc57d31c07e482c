"""Reads an inference server's Prometheus text into a ``BackendObservation``: the only backend /metrics parser.

Two formats, one reader each (`parse_vllm_metrics`, `parse_sglang_metrics`), and `parse_backend_metrics`, which
takes a format name or detects it from the gauges the text carries (``auto``). Series of several engines, models
or data-parallel ranks are summed (usage fractions: averaged).

vLLM (V1; FACTS.md; vllm/v1/metrics/loggers.py): gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (older releases: ``vllm:gpu_cache_usage_perc``), info gauge ``vllm:cache_config_info``
(labels ``block_size``, ``num_gpu_blocks``), counter ``vllm:num_preemptions`` (exposed as
``vllm:num_preemptions_total``); when present, counters ``vllm:prefix_cache_queries_total`` /
``vllm:prefix_cache_hits_total`` (prompt tokens looked up in / found in the prefix cache; shown beside the
ledger's modelled figures, not used to correct it).

SGLang (python/sglang/srt/metrics/collector.py ``SchedulerMetricsCollector``): gauges ``sglang:num_running_reqs``,
``sglang:num_queue_reqs``, ``sglang:token_usage`` (used / total KV tokens, a fraction 0..1); the KV cache size as
the info gauge ``sglang:cache_config_info`` (labels ``page_size``, ``num_pages``; the names the Inference
Extension's model-server protocol reads), else the gauges ``sglang:page_size`` and ``sglang:num_pages``
(releases from v0.5.11 on), else ``sglang:max_total_num_tokens`` (tokens, i.e. pages of one token, SGLang's
default ``page_size``); counter ``sglang:num_retracted_requests_total`` (decode-time retractions: SGLang's
preemptions). SGLang counts KV in pages of ``page_size`` tokens: they are this project's KV blocks
(``block_size`` = ``page_size``, ``num_gpu_blocks`` = pages).

``histogram_totals`` reads the sum and count of any histogram (the profiler's iteration times).
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from predictor.ledger import BackendObservation

VLLM = "vllm"
SGLANG = "sglang"
AUTO = "auto"
METRICS_FORMATS = (AUTO, VLLM, SGLANG)
"""Accepted format names: ``auto`` detects the engine from the text."""

_VLLM_RUNNING, _VLLM_WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
_SGLANG_RUNNING, _SGLANG_WAITING = "sglang:num_running_reqs", "sglang:num_queue_reqs"
_INFO_GAUGES = ("vllm:cache_config_info", "sglang:cache_config_info")


class MetricsFormatError(ValueError):
    """The lines of the families read are not Prometheus exposition format, the text lacks the running/waiting
    gauges of its format, or it reports a count that is negative, NaN, infinite or above `MAX_REQUESTS`."""


MAX_REQUESTS = 100_000
"""Most running or waiting requests a scrape may report; more (or a negative, NaN or infinite count) makes the scrape
unreadable, not a fleet of phantoms (no engine holds that many)."""
MAX_KV_BLOCKS = 1 << 31
"""Most KV blocks (or tokens per block) a scrape may report; more is ignored as no KV size."""


def _label_int(labels: dict[str, str], key: str) -> int | None:
    value = labels.get(key, "")
    if not (value.isascii() and value.isdigit()):  # "²".isdigit() is True
        return None
    number = int(value)
    return number if 0 < number <= MAX_KV_BLOCKS else None


def _positive_int(value: float | None) -> int | None:
    return int(value) if value is not None and 1 <= value <= MAX_KV_BLOCKS else None  # NaN compares False


def _count(samples: _Samples, name: str, default: float | None = None) -> int:
    """A request count (a sum of gauges or a counter): an int in [0, `MAX_REQUESTS`] (counters: any finite >= 0).

    Raises:
        MetricsFormatError: absent without a default, negative, NaN, infinite or too large.
    """
    value = samples.sums.get(name, default)
    if value is None:
        raise MetricsFormatError(f"no {name}")
    limit = MAX_REQUESTS if default is None else float(1 << 62)
    if not 0 <= value <= limit:  # also NaN
        raise MetricsFormatError(f"{name} is {value!r}: not a count of requests")
    return int(value)


def _fraction(value: float) -> float:
    """A usage fraction: NaN reads 0, the rest is clamped to [0, 1]."""
    return min(max(value, 0.0), 1.0) if value == value else 0.0


_READ_FAMILIES = frozenset((
    _VLLM_RUNNING, _VLLM_WAITING, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:cache_config_info",
    "vllm:num_preemptions", "vllm:num_preemptions_total", "vllm:prefix_cache_queries",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total",
    _SGLANG_RUNNING, _SGLANG_WAITING, "sglang:token_usage", "sglang:cache_config_info", "sglang:page_size",
    "sglang:num_pages", "sglang:max_total_num_tokens", "sglang:num_retracted_requests",
    "sglang:num_retracted_requests_total"))
"""The metric families the readers use (a counter's ``# TYPE`` line names it without ``_total``)."""


def _family_lines(text: str) -> str:
    """The lines of ``text`` that belong to `_READ_FAMILIES` (samples, ``# HELP`` and ``# TYPE``): a server's
    /metrics is mostly histograms no reader uses, and Prometheus' parser costs ~17 us a line (a 200-line emulator
    scrape: 3.3 ms; a vLLM one is several times larger)."""
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            name = parts[2] if len(parts) > 2 else ""
        else:
            words = line.split("{", 1)[0].split(None, 1)
            name = words[0] if words else ""
        if name in _READ_FAMILIES:
            kept.append(line)
    return "\n".join(kept) + "\n" if kept else ""


class _Samples:
    """Every sample of one scrape that a reader uses (`_READ_FAMILIES`): sums and counts per name, and the labels
    of the cache info gauges."""

    def __init__(self, text: str) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.info: dict[str, dict[str, str]] = {}
        try:
            for family in text_string_to_metric_families(_family_lines(text)):
                for sample in family.samples:
                    name = sample.name
                    if name in _INFO_GAUGES:
                        self.info[name] = dict(sample.labels)
                        continue
                    self.sums[name] = self.sums.get(name, 0.0) + sample.value
                    self.counts[name] = self.counts.get(name, 0) + 1
        except ValueError as exc:
            raise MetricsFormatError(f"not Prometheus text: {exc}") from None

    def has(self, name: str) -> bool:
        return name in self.sums

    def mean(self, name: str) -> float:
        return self.sums.get(name, 0.0) / max(self.counts.get(name, 1), 1)


def _vllm(samples: _Samples) -> BackendObservation:
    if not (samples.has(_VLLM_RUNNING) and samples.has(_VLLM_WAITING)):
        raise MetricsFormatError(f"no {_VLLM_RUNNING} / {_VLLM_WAITING} gauges")
    usage_name = "vllm:kv_cache_usage_perc" if samples.has("vllm:kv_cache_usage_perc") else "vllm:gpu_cache_usage_perc"
    cache = samples.info.get("vllm:cache_config_info", {})
    return BackendObservation(
        num_running=_count(samples, _VLLM_RUNNING),
        num_waiting=_count(samples, _VLLM_WAITING),
        kv_cache_usage_frac=_fraction(samples.mean(usage_name)),
        num_preemptions_total=_count(samples, "vllm:num_preemptions_total", 0),
        num_gpu_blocks=_label_int(cache, "num_gpu_blocks"),
        block_size=_label_int(cache, "block_size"),
        engine=VLLM,
        prefix_cache_queries_total=_optional_total(samples, "vllm:prefix_cache_queries_total"),
        prefix_cache_hits_total=_optional_total(samples, "vllm:prefix_cache_hits_total"),
    )


def _optional_total(samples: _Samples, name: str) -> float | None:
    """A counter's value (its samples summed), or None when absent, negative or not finite (an engine's counter
    is no input to the ledger: a bad one is only not shown)."""
    value = samples.sums.get(name)
    return value if value is not None and 0 <= value < math.inf else None


def _sglang(samples: _Samples) -> BackendObservation:
    if not (samples.has(_SGLANG_RUNNING) and samples.has(_SGLANG_WAITING)):
        raise MetricsFormatError(f"no {_SGLANG_RUNNING} / {_SGLANG_WAITING} gauges")
    cache = samples.info.get("sglang:cache_config_info", {})
    page_size, num_pages = _label_int(cache, "page_size"), _label_int(cache, "num_pages")
    if page_size is None or num_pages is None:
        page_size = _positive_int(samples.sums.get("sglang:page_size"))
        num_pages = _positive_int(samples.sums.get("sglang:num_pages"))
    if page_size is None or num_pages is None:
        num_pages = _positive_int(samples.sums.get("sglang:max_total_num_tokens"))
        page_size = 1 if num_pages is not None else None
    return BackendObservation(
        num_running=_count(samples, _SGLANG_RUNNING),
        num_waiting=_count(samples, _SGLANG_WAITING),
        kv_cache_usage_frac=_fraction(samples.mean("sglang:token_usage")),
        num_preemptions_total=_count(samples, "sglang:num_retracted_requests_total", 0),
        num_gpu_blocks=num_pages,
        block_size=page_size,
        engine=SGLANG,
    )


def check_metrics_format(metrics_format: str, what: str = "metrics format") -> None:
    """Raises ValueError naming ``what`` unless ``metrics_format`` is one of `METRICS_FORMATS`."""
    if metrics_format not in METRICS_FORMATS:
        raise ValueError(f"unknown {what} {metrics_format!r}; known: {', '.join(METRICS_FORMATS)}")


def parse_vllm_metrics(text: str) -> BackendObservation:
    """Parses vLLM's /metrics text.

    Raises:
        MetricsFormatError: unparsable lines of the families read (`_READ_FAMILIES`; others are skipped unread),
            or no ``vllm:num_requests_running`` / ``_waiting`` gauge.
    """
    return _vllm(_Samples(text))


def parse_sglang_metrics(text: str) -> BackendObservation:
    """Parses SGLang's /metrics text (a server started with ``--enable-metrics``).

    Raises:
        MetricsFormatError: unparsable lines of the families read (`_READ_FAMILIES`; others are skipped unread),
            or no ``sglang:num_running_reqs`` / ``sglang:num_queue_reqs`` gauge.
    """
    return _sglang(_Samples(text))


def parse_backend_metrics(text: str, metrics_format: str = AUTO) -> BackendObservation:
    """Parses /metrics text of the named format; ``auto``: vLLM's when its gauges are there, else SGLang's.

    Returns:
        The observation; its ``engine`` says which reader read it.

    Raises:
        MetricsFormatError: unparsable lines of the families read (`_READ_FAMILIES`; others are skipped unread),
            or the gauges of the format (``auto``: of neither) are missing.
        ValueError: an unknown ``metrics_format`` (not in `METRICS_FORMATS`).
    """
    check_metrics_format(metrics_format)
    samples = _Samples(text)
    if metrics_format == VLLM:
        return _vllm(samples)
    if metrics_format == SGLANG:
        return _sglang(samples)
    if samples.has(_VLLM_RUNNING):
        return _vllm(samples)
    if samples.has(_SGLANG_RUNNING):
        return _sglang(samples)
    raise MetricsFormatError(f"neither vLLM's ({_VLLM_RUNNING}, {_VLLM_WAITING}) nor SGLang's ({_SGLANG_RUNNING}, "
                             f"{_SGLANG_WAITING}) running/waiting gauges")


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
