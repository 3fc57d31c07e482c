import random

import pytest

from extproc.policies.base import EndpointMetrics, EndpointView
from extproc.policies.gie_prefix import build
from extproc.request import RoutingRequest


def m(waiting=0, usage=0.5):
    return EndpointMetrics(num_requests_running=5, num_requests_waiting=waiting, kv_cache_usage_frac=usage,
                           num_free_blocks=int((1 - usage) * 100), num_gpu_blocks=100)


def views(*metrics):
    return [EndpointView(f"10.0.0.{i}:80", metrics=x) for i, x in enumerate(metrics, 1)]


def req(keys, rid="r"):
    return RoutingRequest(rid, "POST", "/v1/completions", block_keys=keys)


def test_a_repeated_prefix_follows_the_first_choice():
    policy = build({}, random.Random(0))
    eps = views(m(), m(), m())
    first = policy.choose(req((1, 2, 3, 4)), eps)
    # equal load: prefix 3 * 1.0 decides; a request sharing half of the blocks still scores 1.5 more
    assert all(policy.choose(req((1, 2, 8, 9), f"x{i}"), eps) == first for i in range(20))


def test_prefix_weight_3_beats_a_full_queue_gap_but_not_queue_plus_kv():
    policy = build({}, random.Random(0))
    warm, cold = views(m(), m())
    policy.choose(req((1, 2)), [warm])
    # queue: warm waits 10, cold 0 -> 0 vs 2; prefix 3 vs 0; kv equal -> warm 3 + kv, cold 2 + kv
    warm, cold = views(m(10, 0.5), m(0, 0.5))
    assert policy.choose(req((1, 2), "b"), [warm, cold]) == warm
    # the cold one also has an empty cache: 2 + 2 = 4 > 3 + 2 * 0 = 3
    warm, cold = views(m(10, 1.0), m(0, 0.0))
    assert policy.choose(req((1, 2), "c"), [warm, cold]) == cold


def test_prefix_score_is_matched_over_total_capped_at_max_prefix_blocks():
    policy = build({"max_prefix_blocks": 4}, random.Random(0))
    eps = views(m(), m())
    policy.choose(req((1, 2, 3, 4, 5, 6)), eps[:1])
    assert policy.index.size(eps[0].address) == 4  # only the first 4 blocks are recorded
    assert policy.prefix_scores(req((1, 2, 7, 8, 9)), eps) == [0.5, 0.0]
    assert policy.prefix_scores(req(None), eps) == [0.0, 0.0]


def test_lru_capacity_forgets_old_prefixes():
    policy = build({"lru_capacity_per_server": 2}, random.Random(0))
    eps = views(m())
    policy.choose(req((1, 2)), eps)
    policy.choose(req((3, 4), "b"), eps)
    assert policy.prefix_scores(req((1, 2), "c"), eps) == [0.0]


def test_no_metrics_returns_none_and_feeds_nothing():
    policy = build({}, random.Random(0))
    eps = views(None, None)
    assert policy.choose(req((1, 2)), eps) is None
    assert policy.index.holders(1) == set()


@pytest.mark.parametrize("params", [{"prefix_weight": -1}, {"lru_capacity_per_server": 0},
                                    {"max_prefix_blocks": 1.5}, {"queue_weight": "x"}, {"hash_block_size": 64}])
def test_bad_params(params):
    with pytest.raises(ValueError):
        build(params, random.Random(0))
