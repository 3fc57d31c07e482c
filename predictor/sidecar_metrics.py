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
- ``astrolabe_predictor_prediction_bias_ratio{metric}``: geometric mean of predicted / observed.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


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
