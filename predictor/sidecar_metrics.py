"""The sidecar's Prometheus metrics: step-time calibration and prediction error, read at scrape time.

`SidecarCollector` yields the current figures of a running `predictor.server.Sidecar` on each scrape (nothing
is updated on the request path). Names (``astrolabe_predictor_*``; no label values from requests):

- ``astrolabe_predictor_calibration_samples``: measured steps in the calibration window (gauge);
- ``astrolabe_predictor_calibration_residual_ratio``: the step-time model's mean absolute relative error on them;
- ``astrolabe_predictor_calibration_prior_residual_ratio``: the shipped model's error on the same steps;
- ``astrolabe_predictor_calibration_refits_total`` / ``..._rejected_total``: refits accepted / rejected;
- ``astrolabe_predictor_calibrated``: 1 once the model was refitted from this engine, else 0;
- ``astrolabe_predictor_prediction_checked_total{metric}``: requests whose prediction was checked (ttft, e2e);
- ``astrolabe_predictor_prediction_mape_ratio{metric}``: their mean absolute percentage error (0.2 = 20%);
- ``astrolabe_predictor_prediction_bias_ratio{metric}``: geometric mean of predicted / observed;
- ``astrolabe_predictor_ttft_unobservable_total``: requests whose TTFT was not checked because the engine had
  them (received or answered) before their Admit was handled (``predictor.outcomes``);
- ``astrolabe_predictor_prediction_ratio{metric}``: histogram of predicted / observed per checked request
  (buckets ``predictor.outcomes.RATIO_BUCKETS``); the sidecar is one endpoint's, so this is per endpoint;
- ``astrolabe_predictor_state_age_seconds``: age of the state predictions start from;
- ``astrolabe_predictor_reconciliations_total``, ``..._reconciliation_corrections_total{kind=added|removed}``:
  the ledger's reconciliations with the backend's /metrics and the requests they corrected;
- ``astrolabe_predictor_late_admits_ignored_total``: Admits not counted because their request's Release was
  handled first (``predictor.early_releases``);
- ``astrolabe_predictor_simulation_seconds``: histogram of each Predict's work (state read and simulation);
- ``astrolabe_predictor_backend_restarts_total``: engine restarts seen in the backend's counters
  (``predictor.server.backend_restarted``): the ledger and its prefix-cache model start empty then;
- with ``--kv-events-endpoint`` (`predictor.kv_events`): ``astrolabe_predictor_kv_event_batches_total``,
  ``..._kv_events_total``, ``..._kv_event_problems_total{kind}`` (undecodable, gaps, missed_batches, reordered,
  orphans, overflow, late_join, subscriber_failures, restarts, cleared, ignored), ``..._kv_event_index_exact`` (gauge, 1/0) and
  ``..._kv_event_index_blocks`` (gauge, blocks), ``..._kv_event_last_message_age_seconds`` (gauge; NaN until
  the first message: a subscription nobody publishes to shows here);
- ``astrolabe_predictor_prefix_cache_queries_total{source}`` / ``..._hits_total{source}``: prompt tokens looked
  up in the prefix cache / found there (vLLM's ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``, tokens):
  ``source="ledger"`` as the ledger modelled them (its scheduler, from the block keys of the requests this sidecar
  admitted, ``predictor.ledger``; starts over when the ledger is rebuilt), ``source="engine"`` the engine's own
  counters at the last /metrics scrape (absent when the backend does not export them): the two side by side show
  how much of the engine's cache the ledger sees;
- ``astrolabe_predictor_ingress_delay_seconds``: the measured delay from Admit to the engine's scheduler, median
  of the last 10 s (``predictor.ingress``; 0 until enough measured), ``..._ingress_delays_measured_total``: how
  many measured.
"""

from __future__ import annotations

import math
import time

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from predictor.outcomes import RATIO_BUCKETS


class SidecarCollector:
    """Prometheus collector over one sidecar (see the module docstring)."""

    def __init__(self, sidecar) -> None:
        self._sidecar = sidecar

    def collect(self):
        sidecar = self._sidecar
        calibrator = sidecar.calibrator
        if calibrator is not None:
            status = calibrator.status()
            for name, value, help_text in (
                    ("calibration_samples", status.num_samples, "measured steps in the calibration window"),
                    ("calibration_residual_ratio", status.residual, "step-time model's mean abs. relative error"),
                    ("calibration_prior_residual_ratio", status.prior_residual, "shipped model's error, same steps"),
                    ("calibrated", 1.0 if status.num_refits else 0.0, "1 once refitted from this engine")):
                yield GaugeMetricFamily(f"astrolabe_predictor_{name}", help_text, value=_finite(value))
            yield CounterMetricFamily("astrolabe_predictor_calibration_refits", "refits accepted",
                                      value=status.num_refits)
            yield CounterMetricFamily("astrolabe_predictor_calibration_rejected", "refits rejected (fallback)",
                                      value=status.num_rejected)
        ingress = sidecar.ingress
        yield GaugeMetricFamily("astrolabe_predictor_ingress_delay_seconds", "predicted delay from Admit to the "
                                "engine's scheduler (median of the measured ones; 0 until enough)",
                                value=ingress.delay_at(time.monotonic()))
        yield CounterMetricFamily("astrolabe_predictor_ingress_delays_measured", "Admit -> engine delays measured",
                                  value=ingress.num_observed)
        checked = CounterMetricFamily("astrolabe_predictor_prediction_checked", "predictions checked against "
                                      "the outcome", labels=["metric"])
        mape = GaugeMetricFamily("astrolabe_predictor_prediction_mape_ratio", "mean absolute percentage error",
                                 labels=["metric"])
        bias = GaugeMetricFamily("astrolabe_predictor_prediction_bias_ratio", "geometric mean of predicted / "
                                 "observed", labels=["metric"])
        for metric, stats in (("ttft", sidecar.outcomes.ttft), ("e2e", sidecar.outcomes.e2e)):
            checked.add_metric([metric], stats.count)
            mape.add_metric([metric], _finite(stats.mape))
            bias.add_metric([metric], _finite(stats.bias))
        yield checked
        yield mape
        yield bias
        yield CounterMetricFamily("astrolabe_predictor_ttft_unobservable", "requests whose TTFT was not checked: "
                                  "the engine had them before their Admit was handled (predictor/outcomes.py)",
                                  value=sidecar.outcomes.num_ttft_unobservable)
        ratio = HistogramMetricFamily("astrolabe_predictor_prediction_ratio", "predicted / observed of every "
                                      "checked request (1 = exact; < 1 = predicted too short)", labels=["metric"])
        for metric, stats in (("ttft", sidecar.outcomes.ttft), ("e2e", sidecar.outcomes.e2e)):
            cumulative, buckets = 0, []
            for bound, count in zip((*map(str, RATIO_BUCKETS), "+Inf"), stats.ratio_counts):
                cumulative += count
                buckets.append((bound, cumulative))
            ratio.add_metric([metric], buckets, stats.sum_ratio)
        yield ratio
        now_s = time.monotonic()
        # The plugin's last state read (0 s for an idle engine, as Predict reports it), else the ledger's.
        plugin_state = sidecar.plugin.last_state
        age_s = plugin_state.age_s(now_s) if plugin_state is not None else sidecar.state_age_s(now_s)
        yield GaugeMetricFamily("astrolabe_predictor_state_age_seconds", "age of the state predictions start "
                                "from (the plugin's file, else the last /metrics reconciliation)",
                                value=_finite(age_s))
        stats = sidecar.ledger.stats
        yield CounterMetricFamily("astrolabe_predictor_reconciliations", "ledger reconciliations with /metrics",
                                  value=stats.num_reconciliations)
        corrections = CounterMetricFamily("astrolabe_predictor_reconciliation_corrections", "requests the "
                                          "reconciliation added (unseen by this sidecar) or removed (lost "
                                          "Releases)", labels=["kind"])
        corrections.add_metric(["added"], stats.num_phantoms_added)
        corrections.add_metric(["removed"], stats.num_requests_removed)
        yield corrections
        yield CounterMetricFamily("astrolabe_predictor_late_admits_ignored", "Admits not counted because their "
                                  "request's Release came first (predictor/early_releases.py)",
                                  value=sidecar.early_releases.num_ignored_admits)
        yield from sidecar.simulation_seconds.collect()
        ledger = sidecar.ledger
        observed = sidecar.last_observed
        for name, modelled, engine, help_text in (
                ("queries", ledger.prefix_cache_queries,
                 None if observed is None else observed.prefix_cache_queries_total,
                 "prompt tokens looked up in the prefix cache, tokens (vllm:prefix_cache_queries)"),
                ("hits", ledger.prefix_cache_hits,
                 None if observed is None else observed.prefix_cache_hits_total,
                 "prompt tokens found in the prefix cache, tokens (vllm:prefix_cache_hits)")):
            family = CounterMetricFamily(f"astrolabe_predictor_prefix_cache_{name}", help_text + ": ledger = as the "
                                         "ledger modelled them, engine = the engine's own at the last scrape",
                                         labels=["source"])
            family.add_metric(["ledger"], modelled)
            if engine is not None:
                family.add_metric(["engine"], engine)
            yield family
        yield CounterMetricFamily("astrolabe_predictor_backend_restarts", "engine restarts seen in the backend's "
                                  "counters (the ledger and its prefix cache model then start empty)",
                                  value=getattr(sidecar, "num_backend_restarts", 0))
        index = getattr(sidecar, "kv_index", None)
        if index is not None:
            counts = index.counts
            yield CounterMetricFamily("astrolabe_predictor_kv_event_batches", "KV event batches decoded and applied",
                                      value=counts.batches)
            yield CounterMetricFamily("astrolabe_predictor_kv_events", "KV events applied", value=counts.events)
            problems = CounterMetricFamily(
                "astrolabe_predictor_kv_event_problems", "KV event stream problems (each makes the index approximate, "
                "but restart, cleared and ignored)", labels=["kind"])
            for kind in ("undecodable", "gaps", "missed_batches", "reordered", "orphans", "overflow", "late_join",
                         "subscriber_failures", "restarts", "cleared", "ignored"):
                problems.add_metric([kind], getattr(counts, kind))
            yield problems
            yield GaugeMetricFamily("astrolabe_predictor_kv_event_index_exact",
                                    "1 while the index has applied every KV event batch since the engine started",
                                    value=1.0 if index.exact else 0.0)
            last_s = index.last_message_s
            yield GaugeMetricFamily("astrolabe_predictor_kv_event_last_message_age_seconds",
                                    "seconds since the last KV event message (NaN: none yet: check the endpoint and "
                                    "the engine's --kv-events-config)",
                                    value=float("nan") if last_s is None else time.monotonic() - last_s)
            yield GaugeMetricFamily("astrolabe_predictor_kv_event_index_blocks",
                                    "cached KV blocks the index knows, blocks", value=index.num_blocks)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else float("nan")


def start_metrics_server(sidecar, listen: str):
    """Serve /metrics on ``listen`` (``host:port``, port 0 = any) in a daemon thread; returns (server, port).

    Raises:
        OSError: the address cannot be bound. ValueError: ``listen`` is not host:port.
    """
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"metrics address must be host:port, got {listen!r}")
    registry = CollectorRegistry()
    registry.register(SidecarCollector(sidecar))
    server, _ = start_http_server(int(port), addr=host, registry=registry)
    return server, server.server_address[1]
