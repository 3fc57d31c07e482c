import random

import pytest

from extproc.policies.base import EndpointMetrics, EndpointView
from extproc.policies.infaas import build, score
from extproc.request import RoutingRequest

REQ = RoutingRequest("r", "POST", "/v1/completions")


def m(free, running, waiting=0, waiting_blocks=None):
    return EndpointMetrics(num_requests_running=running, num_requests_waiting=waiting,
                           kv_cache_usage_frac=1 - free / 1000, num_free_blocks=free, num_gpu_blocks=1000,
                           num_waiting_prompt_blocks=waiting_blocks)


def views(*metrics):
    return [EndpointView(f"10.0.0.{i}:80", metrics=x) for i, x in enumerate(metrics, 1)]


@pytest.mark.parametrize(
    "metrics, expected",
    [
        ((m(800, 4), m(600, 2), m(900, 9)), {"10.0.0.2:80"}),     # 200, 300, 100 free per running
        ((m(100, 0), m(500, 10)), {"10.0.0.1:80"}),              # running 0 counts as 1: 100 > 50
        ((m(500, 5),), {"10.0.0.1:80"}),
        ((m(400, 4), m(200, 2), m(100, 1)), {"10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"}),
        ((None, m(10, 5), None), {"10.0.0.2:80"}),
        ((m(900, 30, waiting=50, waiting_blocks=900), m(500, 30)), {"10.0.0.1:80"}),  # ignores the queue
    ],
    ids=["most-free-per-running", "zero-running", "one-endpoint", "all-tied-random", "missing-metrics-skipped",
         "waiting-ignored"],
)
def test_choose(metrics, expected):
    policy = build({}, random.Random(0))
    assert {policy.choose(REQ, views(*metrics)).address for _ in range(200)} == expected


def test_all_metrics_missing_returns_none():
    policy = build({}, random.Random(0))
    assert policy.needs_metrics and policy.choose(REQ, views(None, None)) is None


def test_score_formula():
    assert score(EndpointView("a", metrics=m(300, 3))) == -100.0


def test_rejects_params():
    with pytest.raises(ValueError):
        build({"x": 1}, random.Random(0))
