"""extproc.pool: health transitions are logged once each, turning healthy at INFO and unhealthy at WARNING."""

import logging

import pytest

from extproc.config import EndpointConfig
from extproc.pool import EndpointPool

ADDRESS = "10.0.0.5:8000"


@pytest.mark.parametrize(("start_healthy", "healthy", "expected"), [
    (False, True, [("INFO", f"endpoint {ADDRESS} is now healthy")]),
    (True, False, [("WARNING", f"endpoint {ADDRESS} is now UNHEALTHY")]),
    (True, True, []),
], ids=["turns-healthy", "turns-unhealthy", "unchanged"])
def test_health_transitions_are_logged_at_their_level(caplog, start_healthy, healthy, expected):
    caplog.set_level(logging.DEBUG, logger="extproc.pool")
    pool = EndpointPool([EndpointConfig(ADDRESS)], new_endpoints_healthy=start_healthy)
    pool.set_healthy(ADDRESS, healthy)
    pool.set_healthy(ADDRESS, healthy)  # no change: nothing more
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == expected
    assert pool.is_healthy(ADDRESS) == healthy
