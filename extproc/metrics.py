"""Prometheus metrics of the extproc (served on ``metrics_port`` when set).

- ``astrolabe_extproc_requests_total{policy, outcome}``: streams by the configured policy and outcome (``routed``,
  ``fallback`` or an error code).
- ``astrolabe_extproc_fallbacks_total{reason}``: decisions the least-requests fallback made, by reason
  (``extproc.router.FALLBACK_REASONS``).
- ``astrolabe_extproc_predictions_total{outcome}``: predictor calls per outcome (``ok`` or ``failed``, which
  includes deadlines missed and sidecars skipped while backing off).
- ``astrolabe_extproc_decisions_total{basis}``: routing decisions by what decided them: ``prediction`` (every
  probed sidecar answered), ``partial``, ``fallback`` (no prediction: least-requests) or ``policy`` (a policy
  that does not predict).
- ``astrolabe_extproc_routing_seconds``: time from the last needed message to the routing decision.
- ``astrolabe_extproc_length_estimate_seconds``: time of the output-length estimate of a predicted decision.
- ``astrolabe_extproc_predict_seconds{predictor}``: Predict round trips per sidecar (answered or not, up to the
  deadline).
- ``astrolabe_extproc_prediction_ratio{endpoint, metric}``: predicted / observed E2E (``metric="e2e"``) of every
  completed request the chosen endpoint's prediction decided, observed from the decision to the end of the
  ext_proc stream (the response's last byte through Envoy); 1 = exact, < 1 = predicted too short. TTFT is
  checked by the sidecars (``astrolabe_predictor_prediction_ratio``), which see the engine's first token.
- ``astrolabe_extproc_predictor_calls_total{predictor, outcome}``: Predict calls per sidecar by outcome
  (``extproc.predictor_client.OUTCOMES``: ok, late, down, invalid, skipped_backoff, stale_state), read from the
  client at scrape time; ``astrolabe_extproc_predictor_late_excused_total``: late calls blamed on this
  replica's own event-loop lag.
- ``astrolabe_extproc_served_elsewhere_total``: requests the gateway reported served by another endpoint than the
  chosen one; ``astrolabe_extproc_connect_failures_total``: requests whose endpoint refused the connection (the
  gateway's local 503) or let a per-try timeout fire (its 504), each taking the endpoint out of the pool until its
  next passing health check.
- ``astrolabe_extproc_notices_total{predictor, outcome}``: Admit and Release notices on each sidecar's notice
  stream (``extproc.notices.NOTICE_OUTCOMES``: sent, lost), read at scrape time.
- Label values come only from configuration (policy, endpoint and sidecar addresses) and fixed sets (outcomes,
  error codes, reasons, metrics), never from request fields (model, headers): a client cannot grow the series.
- ``astrolabe_extproc_in_flight_requests{endpoint}``: this replica's in-flight count per endpoint (read live
  from the pool at scrape time).
- ``astrolabe_extproc_endpoint_healthy{endpoint}``: 1 if the endpoint passes health checks.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.notices import NOTICE_OUTCOMES
from extproc.pool import EndpointPool
from predictor.outcomes import RATIO_BUCKETS


class _PoolCollector(Collector):
    def __init__(self, pool: EndpointPool) -> None:
        self._pool = pool

    def collect(self):
        in_flight = GaugeMetricFamily("astrolabe_extproc_in_flight_requests",
                                      "Requests routed by this replica whose ext_proc stream is open",
                                      labels=["endpoint"])
        healthy = GaugeMetricFamily("astrolabe_extproc_endpoint_healthy",
                                    "1 if the endpoint passes health checks", labels=["endpoint"])
        for endpoint in self._pool.endpoints:
            in_flight.add_metric([endpoint.address], self._pool.in_flight(endpoint.address))
            healthy.add_metric([endpoint.address], int(self._pool.is_healthy(endpoint.address)))
        yield in_flight
        yield healthy


class _PredictorCollector(Collector):
    def __init__(self, predictors) -> None:
        self._predictors = predictors

    def collect(self):
        calls = CounterMetricFamily("astrolabe_extproc_predictor_calls", "Predict calls per sidecar by outcome",
                                    labels=["predictor", "outcome"])
        for address, counts in list(self._predictors.outcomes.items()):
            for outcome, count in counts.items():
                calls.add_metric([address, outcome], count)
        yield calls
        yield CounterMetricFamily("astrolabe_extproc_predictor_late_excused",
                                  "Late Predict calls blamed on this replica's event-loop lag",
                                  value=self._predictors.num_late_excused)
        notices = CounterMetricFamily(
            "astrolabe_extproc_notices",
            "Admit and Release notices on each sidecar's notice stream (extproc/notices.py) "
            "by outcome: sent, or lost (queued on a stream that broke, or beyond the queue's cap while the sidecar did "
            "not read); a lost notice heals when the sidecar reconciles", labels=["predictor", "outcome"])
        for address, stream in list(self._predictors.notice_streams.items()):
            for outcome, count in zip(NOTICE_OUTCOMES, (stream.num_notices, stream.num_lost)):
                notices.add_metric([address, outcome], count)
        yield notices


class _FleetCollector(Collector):
    def __init__(self, fleet) -> None:
        self._fleet = fleet

    def collect(self):
        predictions = CounterMetricFamily(
            "astrolabe_extproc_local_predictions", "Predictions made in this replica from a sidecar's streamed state "
            "(predictor_client.mode watch), per sidecar by outcome", labels=["predictor", "outcome"])
        ages = GaugeMetricFamily("astrolabe_extproc_watched_state_age_seconds",
                                 "Time since each watched sidecar's last state arrived, seconds",
                                 labels=["predictor"])
        for address, counts in list(self._fleet.outcomes.items()):
            for outcome, count in counts.items():
                predictions.add_metric([address, outcome], count)
            state = self._fleet.state(address)
            if state is not None:
                ages.add_metric([address], state[1])
        yield predictions
        yield ages


class ExtprocMetrics:
    """The extproc's metrics in a private registry.

    Args:
        pool: read at scrape time for in-flight and health gauges.
    """

    def __init__(self, pool: EndpointPool) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter("astrolabe_extproc_requests", "ext_proc streams by policy and outcome",
                                 ["policy", "outcome"], registry=self.registry)
        self.fallbacks = Counter("astrolabe_extproc_fallbacks", "Decisions the least-requests fallback made, by "
                                 "reason", ["reason"], registry=self.registry)
        self.predictions = Counter("astrolabe_extproc_predictions", "Predictor calls by outcome",
                                   ["outcome"], registry=self.registry)
        self.decisions = Counter("astrolabe_extproc_decisions", "Routing decisions by basis",
                                 ["basis"], registry=self.registry)
        self.shed = Counter("astrolabe_extproc_shed", "Requests refused with 429 to protect latency objectives, by "
                            "reason and priority (extproc/admission.py)", ["reason", "priority"],
                            registry=self.registry)
        self.objective_headers_invalid = Counter(
            "astrolabe_extproc_objective_headers_invalid", "Objective header values ignored (not a number, not "
            "finite, <= 0) or clamped (past an hour), by header", ["header"], registry=self.registry)
        self.engine_priority_bodies = Counter(
            "astrolabe_extproc_engine_priority_bodies", "objectives.engine_priority: routed request bodies by what "
            "became of their priority field: written, or left alone because the body is compressed "
            "(extproc/engine_priority.py)", ["outcome"], registry=self.registry)
        self.routing_seconds = Histogram(
            "astrolabe_extproc_routing_seconds", "Time to choose an endpoint, seconds",
            buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
            registry=self.registry)
        self.length_estimate_seconds = Histogram(
            "astrolabe_extproc_length_estimate_seconds", "Output-length estimate of a predicted decision, seconds",
            buckets=(0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05), registry=self.registry)
        self.predict_seconds = Histogram(
            "astrolabe_extproc_predict_seconds", "Predict round trip per sidecar, seconds", ["predictor"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5), registry=self.registry)
        self.prediction_ratio = Histogram(
            "astrolabe_extproc_prediction_ratio", "Predicted / observed latency of completed requests",
            ["endpoint", "metric"], buckets=RATIO_BUCKETS, registry=self.registry)
        self.served_elsewhere = Counter(
            "astrolabe_extproc_served_elsewhere", "Requests the gateway reported served by a fallback endpoint, not "
            "the chosen one (x-gateway-destination-endpoint-served)", registry=self.registry)
        self.connect_failures = Counter(
            "astrolabe_extproc_connect_failures", "Requests whose endpoint refused the gateway's connection or let "
            "a per-try timeout fire (passive failure detection: the endpoint leaves the pool until its next passing "
            "health check)",
            registry=self.registry)
        self.consecutive_5xx_ejections = Counter(
            "astrolabe_extproc_consecutive_5xx_ejections", "Endpoints taken out of the pool after 5 answers in a "
            "row with 5xx, until their next passing health check", registry=self.registry)
        self.registry.register(_PoolCollector(pool))

    def forget_endpoint(self, address: str, predictor: str | None) -> None:
        """Drops the per-endpoint series of an endpoint that left the pool (discovery: pods come and go, and
        their series must not pile up)."""
        for metric in ("e2e", "ttft"):
            with contextlib.suppress(KeyError):
                self.prediction_ratio.remove(address, metric)
        if predictor:
            with contextlib.suppress(KeyError):
                self.predict_seconds.remove(predictor)

    def count_request(self, policy: str, outcome: str) -> None:
        """Count one ext_proc stream of the configured ``policy`` (its ``TYPE``) with ``outcome`` (``routed``,
        ``fallback`` or an ``ErrorCode`` value)."""
        self._requests.labels(policy, outcome).inc()

    def watch_predictors(self, predictors) -> None:
        """Export ``predictors``' per-sidecar outcome counts (an ``extproc.predictor_client.PredictorClient``)."""
        self.registry.register(_PredictorCollector(predictors))

    def watch_fleet(self, fleet) -> None:
        """Export ``fleet``'s local prediction outcomes and state ages (an ``extproc.fleet_state.FleetState``)."""
        self.registry.register(_FleetCollector(fleet))
