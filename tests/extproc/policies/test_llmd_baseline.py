import random

import pytest

from extproc.policies.base import EndpointMetrics, EndpointView
from extproc.policies.llmd_baseline import build
from extproc.request import RoutingRequest

A, B = EndpointView("10.0.0.1:80"), EndpointView("10.0.0.2:80")
K = tuple(range(100, 116))      # 16 blocks of 16 tokens: 4 hashes of 64 tokens, 256 tokens
L = tuple(range(200, 232))      # an unrelated 512-token prompt


def req(rid, keys=None, **kw):
    return RoutingRequest(rid, "POST", "/v1/completions", block_keys=keys, **kw)


def loaded(params=None):
    """A holds K (256 uncached tokens) and L (512): 768 in-flight tokens; B is idle."""
    policy = build(params or {}, random.Random(0))
    policy.choose(req("k", K), [A])
    policy.choose(req("l", L), [A])
    assert policy.in_flight_tokens == {A.address: 768}
    return policy


def test_hashes_take_the_last_key_of_each_64_token_group():
    policy = build({"max_prefix_tokens_to_match": 128}, random.Random(0))
    assert tuple(policy.hashes(K)) == (103, 107)
    assert tuple(policy.hashes(K[:7])) == (103,)
    assert tuple(policy.hashes(None)) == ()


def test_sticks_to_the_cached_endpoint_below_the_release_threshold():
    policy = loaded()
    # token load alone would pick B (0 + 256 < 768 + 0); the filter keeps only A (match 4/4 >= 0.8)
    assert policy.choose(req("again", K), [A, B]) == A
    assert policy.in_flight_tokens[A.address] == 768  # fully cached: nothing uncached added


def test_releases_stickiness_past_the_in_flight_token_penalty():
    policy = loaded({"max_tokens_in_flight_penalty": 700})  # 768 - 0 > 700
    assert policy.choose(req("again", K), [A, B]) == B
    assert policy.in_flight_tokens[B.address] == 256


def test_below_the_affinity_threshold_token_load_decides():
    keys = K[:12] + (1, 2, 3, 4)  # 3 of 4 hashes match: 0.75 < 0.80
    assert loaded().choose(req("part", keys), [A, B]) == B
    assert loaded({"affinity_threshold": 0.75}).choose(req("part", keys), [A, B]) == A


def test_exploration_skips_the_filter():
    assert loaded({"exploration_probability": 1.0}).choose(req("again", K), [A, B]) == B


def test_on_finished_releases_the_requests_tokens():
    policy = loaded()
    policy.on_finished(req("l", L), A.address)
    assert policy.in_flight_tokens == {A.address: 256}
    policy.on_finished(req("l", L), A.address)  # twice, or a request it never routed: no effect
    policy.on_finished(req("zzz", L), B.address)
    policy.on_finished(req("k", K), A.address)
    assert policy.in_flight_tokens == {}


def test_without_block_keys_the_least_token_load_wins():
    policy = loaded()
    assert policy.choose(req("ids", prompt_token_ids=tuple(range(300))), [A, B]) == B
    assert policy.in_flight_tokens[B.address] == 300


def test_index_size_follows_the_endpoints_gpu_blocks():
    metrics = EndpointMetrics(num_requests_running=0, num_requests_waiting=0, kv_cache_usage_frac=0.0,
                              num_free_blocks=2, num_gpu_blocks=2)
    policy = build({}, random.Random(0))
    a = EndpointView(A.address, metrics=metrics)
    policy.choose(req("k", K), [a])
    assert policy.index.capacity(A.address) == 2 and policy.index.size(A.address) == 2
    policy.choose(req("l", L), [B])
    assert policy.index.capacity(B.address) == 31250


@pytest.mark.parametrize("params", [{"affinity_threshold": 0}, {"affinity_threshold": 1.2},
                                    {"exploration_probability": -0.1}, {"max_tokens_in_flight_penalty": -1},
                                    {"hash_block_tokens": 40}, {"block_size": 0}, {"queue_threshold_tokens": 1.5},
                                    {"tau": 0.8}])
def test_bad_params(params):
    with pytest.raises(ValueError):
        build(params, random.Random(0))


def test_precise_variant_matches_the_published_cache_state():
    from extproc.policies.registry import build_policy
    policy = build_policy("llm-d-precise", {}, random.Random(0))
    policy.choose(req("l", L), [A])  # A: 512 in-flight tokens, B idle
    warm = EndpointView(A.address, num_prefix_blocks_cached=16)
    cold = EndpointView(B.address, num_prefix_blocks_cached=None)
    assert policy.choose(req("k", K), [warm, cold]) == warm  # 4/4 hashes cached: sticky
    partly = EndpointView(A.address, num_prefix_blocks_cached=12)  # 3/4: not sticky; 512 + 64 > 0 + 256
    assert policy.choose(req("k2", K), [partly, cold]) == cold
    assert policy.index.size(A.address) == 0 and policy.in_flight_tokens == {A.address: 512, B.address: 256}
    with pytest.raises(ValueError):
        build_policy("llm-d-precise", {"precise": False}, random.Random(0))
    with pytest.raises(ValueError):
        build({"precise": "yes"}, random.Random(0))
