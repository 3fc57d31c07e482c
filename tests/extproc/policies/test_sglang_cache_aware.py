import collections
import random

import pytest

from extproc.policies.base import EndpointView
from extproc.policies.sglang_cache_aware import build
from extproc.request import RoutingRequest


def eps(*loads):
    return [EndpointView(f"10.0.0.{i}:80", load) for i, load in enumerate(loads, 1)]


def req(keys, rid="r"):
    return RoutingRequest(rid, "POST", "/generate", block_keys=keys)


def test_a_repeated_prompt_returns_to_its_endpoint_and_cold_ones_go_to_the_smallest_tree():
    policy = build({}, random.Random(0))
    pool = eps(0, 0, 0)
    homes = [policy.choose(req(tuple(range(10 * i, 10 * i + 10)), f"c{i}"), pool) for i in range(3)]
    assert len({h.address for h in homes}) == 3  # each cold prompt went to an empty tree
    for i in range(3):
        assert policy.choose(req(tuple(range(10 * i, 10 * i + 10)) + (1000 + i,), f"w{i}"), pool) == homes[i]


def test_match_rate_must_exceed_the_cache_threshold():
    policy = build({"cache_threshold": 0.5}, random.Random(0))
    a, b = eps(0, 0)
    policy.choose(req((1, 2, 3, 4)), [a])
    policy.choose(req((50, 51, 52, 53, 54)), [b])  # b's tree is now larger than a's
    # 2 of 4 keys walked: 0.5 is not > 0.5 -> smallest tree, a (4 blocks) over b (5)
    assert policy.choose(req((1, 2, 60, 61), "x"), [a, b]) == a
    # 3 of 4 keys walked at b: > 0.5 -> b, though its tree is larger
    assert policy.choose(req((50, 51, 52, 70), "y"), [a, b]) == b


def test_imbalance_sends_to_the_least_loaded_and_records_there():
    policy = build({}, random.Random(0))
    a, b = eps(0, 0)
    policy.choose(req((1, 2, 3)), [a])
    # loads 100 vs 10: diff 90 > 64 and 100 > 1.5 * 10 -> shortest queue despite the full match at a
    a, b = eps(100, 10)
    assert policy.choose(req((1, 2, 3), "x"), [a, b]) == b
    assert policy.trees.holders(3) == {a.address, b.address}
    # diff 60 <= 64 (or 100 <= 1.5 * 70): balanced, the cache decides even against a shorter queue
    policy = build({}, random.Random(0))
    policy.choose(req((1, 2, 3)), eps(0)[:1])
    for loads in ((60, 0), (100, 70)):
        a, b = eps(*loads)
        assert policy.choose(req((1, 2, 3, 4), "z"), [a, b]) == a


def test_the_deepest_node_picks_one_holder_consistently():
    policy = build({}, random.Random(0))
    pool = eps(0, 0, 0)
    for e in pool:
        policy.choose(req((1, 2, 3)), [e])
    picks = collections.Counter(policy.choose(req((1, 2, 3, 9), f"r{i}"), pool).address for i in range(20))
    assert len(picks) == 1


def test_tree_eviction_takes_leaves_first():
    policy = build({"max_tree_size": 4}, random.Random(0))
    a, = eps(0)
    policy.choose(req((1, 2, 3)), [a])
    policy.choose(req((1, 2, 7, 8)), [a])  # 5 blocks > 4: the least recent leaf, 3, goes; 1 and 2 stay
    assert [k for k in (1, 2, 3, 7, 8) if policy.trees.holders(k)] == [1, 2, 7, 8]


def test_without_keys_the_least_loaded_wins():
    policy = build({}, random.Random(0))
    pool = eps(3, 1, 1)
    assert policy.choose(req(None), pool) == pool[1]
    assert policy.choose(req(()), pool) == pool[1]


@pytest.mark.parametrize("params", [{"cache_threshold": 1.5}, {"balance_abs_threshold": -1},
                                    {"balance_rel_threshold": 0.5}, {"max_tree_size": 0}, {"eviction": 1}])
def test_bad_params(params):
    with pytest.raises(ValueError):
        build(params, random.Random(0))
