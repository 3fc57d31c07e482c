"""The three baseline policies (one table per behaviour; edge cases: one endpoint, all tied)."""

import collections
import random

import pytest

from extproc.policies.base import EndpointView, min_random_tie
from extproc.policies.registry import POLICY_NAMES, build_policy
from extproc.request import RoutingRequest

REQ = RoutingRequest("r", "POST", "/v1/completions")
EPS = [EndpointView("10.0.0.1:80", 3), EndpointView("10.0.0.2:80", 1), EndpointView("10.0.0.3:80", 1)]


def test_registry_names():
    assert set(POLICY_NAMES) == {"astrolabe", "random", "round-robin", "least-requests", "min-qpm", "infaas",
                                 "llumnix", "gie", "gie-prefix", "llm-d", "llm-d-precise",
                                 "sglang-cache-aware", "dynamo-kv", "dynamo-kv-precise"}


@pytest.mark.parametrize("name", ["random", "round-robin", "least-requests"])
def test_one_endpoint_is_always_chosen(name):
    policy = build_policy(name, {}, random.Random(1))
    assert {policy.choose(REQ, EPS[:1]).address for _ in range(10)} == {EPS[0].address}


@pytest.mark.parametrize("name", ["random", "round-robin", "least-requests"])
def test_rejects_unknown_params(name):
    with pytest.raises(ValueError, match="takes no parameters"):
        build_policy(name, {"k": 2}, random.Random(1))


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        build_policy("nope", {}, random.Random(1))


def test_round_robin_cycles_through_all_in_order():
    policy = build_policy("round-robin", {}, random.Random(7))
    picks = [policy.choose(REQ, EPS).address for _ in range(9)]
    assert collections.Counter(picks) == {e.address: 3 for e in EPS}
    start = [e.address for e in EPS].index(picks[0])
    assert picks[:3] == [EPS[(start + i) % 3].address for i in range(3)]


def test_round_robin_survives_pool_shrink():
    policy = build_policy("round-robin", {}, random.Random(7))
    for _ in range(5):
        policy.choose(REQ, EPS)
    assert policy.choose(REQ, EPS[:2]) in EPS[:2]


def test_least_requests_picks_minimum_and_breaks_ties_randomly():
    policy = build_policy("least-requests", {}, random.Random(3))
    picks = collections.Counter(policy.choose(REQ, EPS).address for _ in range(200))
    assert set(picks) == {"10.0.0.2:80", "10.0.0.3:80"}
    assert min(picks.values()) > 50


def test_least_requests_all_tied_uses_every_endpoint():
    policy = build_policy("least-requests", {}, random.Random(3))
    tied = [EndpointView(e.address, 0) for e in EPS]
    assert {policy.choose(REQ, tied).address for _ in range(100)} == {e.address for e in EPS}


def test_random_is_seeded_and_covers_all():
    picks_a = [build_policy("random", {}, random.Random(5)).choose(REQ, EPS).address for _ in range(1)]
    policy_a, policy_b = build_policy("random", {}, random.Random(5)), build_policy("random", {}, random.Random(5))
    seq_a = [policy_a.choose(REQ, EPS).address for _ in range(50)]
    seq_b = [policy_b.choose(REQ, EPS).address for _ in range(50)]
    assert seq_a == seq_b and set(seq_a) == {e.address for e in EPS} and picks_a[0] == seq_a[0]


def test_min_random_tie_empty():
    with pytest.raises(ValueError):
        min_random_tie([], lambda x: x, random.Random(0))
