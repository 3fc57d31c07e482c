import collections
import random

import pytest

from extproc.policies.base import EndpointView
from extproc.policies.min_qpm import build
from extproc.policies.registry import build_policy
from extproc.request import RoutingRequest

REQ = RoutingRequest("r", "POST", "/v1/completions")


def views(*recent):
    return [EndpointView(f"10.0.0.{i}:80", num_in_flight=9 - i, num_recent_requests=n)
            for i, n in enumerate(recent, 1)]


@pytest.mark.parametrize(
    "recent, expected",
    [((5, 2, 7), {"10.0.0.2:80"}), ((3,), {"10.0.0.1:80"}), ((4, 4, 4), {"10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"}),
     ((0, 1), {"10.0.0.1:80"})],
    ids=["fewest-recent", "one-endpoint", "all-tied-random", "ignores-in-flight"],
)
def test_choose(recent, expected):
    policy = build({}, random.Random(0))
    picks = {policy.choose(REQ, views(*recent)).address for _ in range(200)}
    assert picks == expected


def test_ties_spread_evenly():
    policy = build({}, random.Random(3))
    counts = collections.Counter(policy.choose(REQ, views(1, 1, 1)).address for _ in range(600))
    assert min(counts.values()) > 120


def test_window_param_and_default():
    assert build_policy("min-qpm", {}, random.Random(0)).recent_window_s == 60.0
    policy = build_policy("min-qpm", {"window_s": 5}, random.Random(0))
    assert policy.recent_window_s == 5.0 and not policy.needs_metrics and not policy.needs_predictions


@pytest.mark.parametrize("params", [{"window_s": 0}, {"window_s": -1}, {"window_s": True}, {"k": 2}])
def test_bad_params(params):
    with pytest.raises(ValueError):
        build(params, random.Random(0))
