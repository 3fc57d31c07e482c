"""Prometheus metrics of the extproc (served on ``metrics_port`` when set).

- ``astrolabe_extproc_requests_total{outcome}``: streams by outcome (``routed`` or an error code).
- ``astrolabe_extproc_predictions_total{outcome}``: predictor calls per outcome (``ok`` or ``failed``, which
  includes deadlines missed and sidecars skipped while backing off).
- ``astrolabe_extproc_decisions_total{basis}``: routing decisions by what decided them: ``prediction`` (every
  probed sidecar answered), ``partial``, ``fallback`` (no prediction: least-requests) or ``policy`` (a policy
  that does not predict).
- ``astrolabe_extproc_routing_seconds``: time from the last needed message to the routing decision.
- ``astrolabe_extproc_predictor_calls_total{predictor, outcome}``: Predict calls per sidecar by outcome
  (``extproc.predictor_client.OUTCOMES``: ok, late, down, invalid, skipped_backoff, stale_state), read from the
  client at scrape time; ``astrolabe_extproc_predictor_late_excused_total``: late calls blamed on this
  replica's own event-loop lag. Label values are configured sidecar addresses (bounded), never request data.
- ``astrolabe_extproc_in_flight_requests{endpoint}``: this replica's in-flight count per endpoint (read live
  from the pool at scrape time).
- ``astrolabe_extproc_endpoint_healthy{endpoint}``: 1 if the endpoint passes health checks.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.pool import EndpointPool


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


class ExtprocMetrics:
    """The extproc's metrics in a private registry.

    Args:
        pool: read at scrape time for in-flight and health gauges.
    """

    def __init__(self, pool: EndpointPool) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("astrolabe_extproc_requests", "ext_proc streams by outcome",
                                ["outcome"], registry=self.registry)
        self.predictions = Counter("astrolabe_extproc_predictions", "Predictor calls by outcome",
                                   ["outcome"], registry=self.registry)
        self.decisions = Counter("astrolabe_extproc_decisions", "Routing decisions by basis",
                                 ["basis"], registry=self.registry)
        self.routing_seconds = Histogram(
            "astrolabe_extproc_routing_seconds", "Time to choose an endpoint, seconds",
            buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
            registry=self.registry)
        self.registry.register(_PoolCollector(pool))

    def watch_predictors(self, predictors) -> None:
        """Export ``predictors``' per-sidecar outcome counts (an ``extproc.predictor_client.PredictorClient``)."""
        self.registry.register(_PredictorCollector(predictors))
