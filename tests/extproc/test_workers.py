"""extproc.workers: the port check and hold, and the sum of the workers' /metrics (the processes themselves:
tests/integration/test_workers.py)."""

import socket

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.config import ConfigError
from extproc.workers import merge_expositions, reserve_port


def test_port_0_is_picked_and_held_against_plain_binds():
    reservation = reserve_port("127.0.0.1:0")
    try:
        assert reservation.port > 0 and reservation.listen == f"127.0.0.1:{reservation.port}"
        with socket.socket() as other, pytest.raises(OSError):  # another program, no SO_REUSEPORT
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            other.bind(("127.0.0.1", reservation.port))
        with socket.socket() as worker:  # what a worker's gRPC server does
            worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            worker.bind(("127.0.0.1", reservation.port))
            worker.listen()
            with pytest.raises(ConfigError, match=f"^listen: cannot listen on 127.0.0.1:{reservation.port}$"):
                reserve_port(reservation.listen)  # a second supervisor on a port in use
    finally:
        reservation.close()


@pytest.mark.parametrize("reuse_port", [False, True])
def test_a_port_another_program_listens_on_is_refused(reuse_port):
    with socket.socket() as other:
        if reuse_port:  # even one that would share it
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(ConfigError, match="cannot listen on"):
            reserve_port(f"127.0.0.1:{other.getsockname()[1]}")


def test_an_address_that_does_not_resolve_is_refused():
    with pytest.raises(ConfigError, match="^listen: cannot listen on no-such-host.invalid:0$"):
        reserve_port("no-such-host.invalid:0")


def _exposition(routed: int, healthy: int, age_s: float, routing_s: list[float]) -> str:
    registry = CollectorRegistry()
    Counter("astrolabe_extproc_requests", "", ["outcome"], registry=registry).labels("routed").inc(routed)
    Gauge("astrolabe_extproc_endpoint_healthy", "", ["endpoint"], registry=registry).labels("a").set(healthy)
    Gauge("astrolabe_extproc_watched_state_age_seconds", "", ["predictor"], registry=registry).labels("p").set(age_s)
    Gauge("astrolabe_extproc_in_flight_requests", "", ["endpoint"], registry=registry).labels("a").set(2)
    histogram = Histogram("astrolabe_extproc_routing_seconds", "", buckets=(0.001, 0.01), registry=registry)
    for value in routing_s:
        histogram.observe(value)
    return generate_latest(registry).decode()


def test_workers_metrics_are_summed_except_health_and_state_age():
    merged = merge_expositions([_exposition(3, 1, 0.02, [0.0005, 0.005]), _exposition(4, 0, 0.05, [0.05])])
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for m in merged for s in m.samples}
    assert samples[("astrolabe_extproc_requests_total", (("outcome", "routed"),))] == 7
    assert samples[("astrolabe_extproc_endpoint_healthy", (("endpoint", "a"),))] == 0  # healthy in every worker
    assert samples[("astrolabe_extproc_watched_state_age_seconds", (("predictor", "p"),))] == 0.05  # the oldest
    assert samples[("astrolabe_extproc_in_flight_requests", (("endpoint", "a"),))] == 4
    assert samples[("astrolabe_extproc_routing_seconds_bucket", (("le", "0.001"),))] == 1
    assert samples[("astrolabe_extproc_routing_seconds_bucket", (("le", "+Inf"),))] == 3
    assert samples[("astrolabe_extproc_routing_seconds_count", ())] == 3
    # The merged families expose as Prometheus text again, and parse back to the same.
    registry = CollectorRegistry()
    registry.register(type("Merged", (), {"collect": lambda self: merged})())
    again = {s.name: s.value for m in text_string_to_metric_families(generate_latest(registry).decode())
             for s in m.samples if s.name == "astrolabe_extproc_requests_total"}
    assert again == {"astrolabe_extproc_requests_total": 7}
