import random

import pytest

from extproc.policies.base import EndpointMetrics, EndpointView
from extproc.policies.gie import Params, build, scores
from extproc.request import RoutingRequest

REQ = RoutingRequest("r", "POST", "/v1/completions")


def m(waiting, usage):
    return EndpointMetrics(num_requests_running=5, num_requests_waiting=waiting, kv_cache_usage_frac=usage,
                           num_free_blocks=int((1 - usage) * 100), num_gpu_blocks=100)


def views(*metrics):
    return [EndpointView(f"10.0.0.{i}:80", metrics=x) for i, x in enumerate(metrics, 1)]


@pytest.mark.parametrize(
    "metrics, expected",
    [
        ((m(4, 0.5), m(0, 0.5), m(2, 0.5)), {"10.0.0.2:80"}),        # shortest queue
        ((m(1, 0.9), m(1, 0.2)), {"10.0.0.2:80"}),                     # equal queues: emptiest cache
        # queue 0 vs 10 -> scores 2*1 + 2*0.1 = 2.2 and 2*0 + 2*1 = 2.0: the queue wins at equal weights
        ((m(0, 0.9), m(10, 0.0)), {"10.0.0.1:80"}),
        ((m(3, 0.3),), {"10.0.0.1:80"}),
        ((m(2, 0.4), m(2, 0.4), m(2, 0.4)), {"10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"}),
        ((None, m(50, 0.99), None), {"10.0.0.2:80"}),
    ],
    ids=["shortest-queue", "emptiest-cache", "weighted-sum", "one-endpoint", "all-tied-random",
         "missing-metrics-skipped"],
)
def test_choose(metrics, expected):
    policy = build({}, random.Random(0))
    assert {policy.choose(REQ, views(*metrics)).address for _ in range(200)} == expected


def test_scores_match_gie_normalisation():
    # queue-scorer: (max - q) / (max - min); kv-cache-utilization-scorer: 1 - usage; weights 2 and 2.
    got = scores(views(m(0, 0.25), m(4, 0.5), m(8, 0.0)), Params())
    assert got == pytest.approx([2 * 1.0 + 2 * 0.75, 2 * 0.5 + 2 * 0.5, 2 * 0.0 + 2 * 1.0])


def test_weights_are_params():
    policy = build({"queue_weight": 0, "kv_cache_weight": 1}, random.Random(0))
    assert policy.choose(REQ, views(m(0, 0.9), m(10, 0.0))).address == "10.0.0.2:80"


def test_all_metrics_missing_returns_none():
    assert build({}, random.Random(0)).choose(REQ, views(None, None)) is None


@pytest.mark.parametrize("params", [{"queue_weight": -1}, {"kv_cache_weight": "x"}, {"prefix_weight": 3}])
def test_bad_params(params):
    with pytest.raises(ValueError):
        build(params, random.Random(0))
