import random

import pytest

from extproc.policies.base import EndpointMetrics, EndpointView
from extproc.policies.llumnix import build, score
from extproc.request import RoutingRequest

REQ = RoutingRequest("r", "POST", "/v1/completions")


def m(free, running, waiting_blocks=None):
    return EndpointMetrics(num_requests_running=running, num_requests_waiting=0 if not waiting_blocks else 3,
                           kv_cache_usage_frac=1 - free / 1000, num_free_blocks=free, num_gpu_blocks=1000,
                           num_waiting_prompt_blocks=waiting_blocks)


def views(*metrics):
    return [EndpointView(f"10.0.0.{i}:80", metrics=x) for i, x in enumerate(metrics, 1)]


@pytest.mark.parametrize(
    "metrics, expected",
    [
        ((m(900, 3, waiting_blocks=600), m(500, 3, waiting_blocks=0)), {"10.0.0.2:80"}),  # 300 vs 500 left
        ((m(900, 3), m(500, 3)), {"10.0.0.1:80"}),               # unknown waiting blocks count as 0
        ((m(100, 0), m(500, 10)), {"10.0.0.1:80"}),
        ((m(500, 5),), {"10.0.0.1:80"}),
        ((m(400, 4, 0), m(200, 2), m(150, 1, 50)), {"10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"}),
        ((None, m(10, 5)), {"10.0.0.2:80"}),
    ],
    ids=["queue-demand-subtracted", "unknown-queue-as-zero", "zero-running", "one-endpoint", "all-tied-random",
         "missing-metrics-skipped"],
)
def test_choose(metrics, expected):
    policy = build({}, random.Random(0))
    assert {policy.choose(REQ, views(*metrics)).address for _ in range(200)} == expected


def test_all_metrics_missing_returns_none():
    policy = build({}, random.Random(0))
    assert policy.needs_metrics and policy.choose(REQ, views(None)) is None


def test_score_formula():
    assert score(EndpointView("a", metrics=m(300, 4, waiting_blocks=100))) == -50.0


def test_rejects_params():
    with pytest.raises(ValueError):
        build({"k": 1}, random.Random(0))
