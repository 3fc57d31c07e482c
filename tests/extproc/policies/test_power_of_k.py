import collections
import random

import pytest

from extproc.policies.base import EndpointView, Prediction
from extproc.policies.power_of_k import Params, build
from extproc.request import RoutingRequest

REQ = RoutingRequest("r", "POST", "/v1/completions")
EPS = [EndpointView(f"10.0.0.{i}:80", predictor=f"10.0.1.{i}:90") for i in range(1, 6)]


def scored(*pairs):
    return [EndpointView(f"10.0.0.{i}:80", prediction=None if p is None else Prediction(p[0], p[1]))
            for i, p in enumerate(pairs, 1)]


@pytest.mark.parametrize(
    "params, predictions, expected",
    [
        ({}, [(1.0, 5.0), (0.5, 3.0)], "10.0.0.2:80"),
        ({"metric": "ttft"}, [(0.2, 9.0), (0.5, 3.0)], "10.0.0.1:80"),
        ({}, [(1.0, 2.0)], "10.0.0.1:80"),
    ],
    ids=["smaller-e2e", "ttft-metric", "one-endpoint"],
)
def test_choose_smaller_prediction(params, predictions, expected):
    policy = build(params, random.Random(0))
    assert policy.choose(REQ, scored(*predictions)).address == expected


def test_partial_predictions_compare_in_flight_counts():
    policy = build({}, random.Random(0))
    views = [EndpointView("10.0.0.1:80", num_in_flight=1),
             EndpointView("10.0.0.2:80", num_in_flight=5, prediction=Prediction(0.1, 0.2))]
    assert policy.choose(REQ, views).address == "10.0.0.1:80"  # the unpredicted one is not starved
    views[0] = EndpointView("10.0.0.1:80", num_in_flight=9)
    assert policy.choose(REQ, views).address == "10.0.0.2:80"


def test_every_prediction_failed_returns_none():
    assert build({}, random.Random(0)).choose(REQ, scored(None, None)) is None


def test_ties_broken_at_random():
    policy = build({}, random.Random(0))
    picks = collections.Counter(policy.choose(REQ, scored((1, 2), (1, 2), (1, 3))).address for _ in range(300))
    assert set(picks) == {"10.0.0.1:80", "10.0.0.2:80"} and min(picks.values()) > 100


@pytest.mark.parametrize("k, size", [(1, 1), (2, 2), (5, 5), (9, 5)], ids=["k1", "k2", "k=n", "k>n"])
def test_candidates_sample_k_distinct(k, size):
    policy = build({"k": k}, random.Random(1))
    seen = set()
    for _ in range(200):
        cands = policy.candidates(REQ, EPS)
        assert len(cands) == size and len({c.address for c in cands}) == size
        seen.update(c.address for c in cands)
    assert seen == {e.address for e in EPS}


@pytest.mark.parametrize("params", [{"k": 0}, {"k": 1.5}, {"k": True}, {"metric": "tpot"}, {"x": 1}])
def test_bad_params(params):
    with pytest.raises(ValueError):
        build(params, random.Random(0))


def test_params_defaults():
    assert Params() == Params(k=2, metric="e2e")
