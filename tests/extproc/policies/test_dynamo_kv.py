import collections
import random

import pytest

from extproc.policies.base import EndpointView
from extproc.policies.dynamo_kv import build
from extproc.request import RoutingRequest

A, B = EndpointView("10.0.0.1:80"), EndpointView("10.0.0.2:80")


def req(rid, keys=None, t=0.0, **kw):
    return RoutingRequest(rid, "POST", "/v1/completions", block_keys=keys, arrival_time_s=t, **kw)


def test_logit_is_weighted_prefill_blocks_plus_active_blocks():
    policy = build({}, random.Random(0))
    r1 = req("r1", (1, 2, 3, 4))
    assert policy.choose(r1, [A]) == A  # A: 64 prefill tokens and blocks {1, 2, 3, 4} active
    r2 = req("r2", (1, 2, 3, 5, 6))
    # A: overlap 3 -> (64 + 80 - 48) / 16 = 6 prefill blocks, 4 active + 2 new = 6 -> 12
    # B: (0 + 80) / 16 = 5, 0 + 5 -> 10
    assert policy.logits(r2, [A, B]) == [12.0, 10.0]
    heavy = build({"overlap_score_weight": 2.0}, random.Random(0))
    heavy.choose(req("r1", (1, 2, 3, 4)), [A])
    assert heavy.logits(r2, [A, B]) == [18.0, 15.0]
    assert policy.choose(r2, [A, B]) == B
    policy.on_finished(r1, A.address)
    # A: (0 + 32) / 16 = 2, 0 + 5 = 5 -> 7; B carries r2 and caches all 5: (80 + 0) / 16 = 5, 5 + 0 -> 10
    assert policy.logits(req("r3", (1, 2, 3, 5, 6)), [A, B]) == [7.0, 10.0]


def test_overlap_is_each_endpoints_own_leading_run():
    policy = build({}, random.Random(0))
    policy.choose(req("a", (1, 2)), [A])
    policy.choose(req("b", (1, 2, 3, 4)), [B])
    assert policy.overlaps((1, 2, 3, 4), [A, B]) == {A.address: 2, B.address: 4}
    assert policy.overlaps((9, 10), [A, B]) == {}


def test_index_entries_expire_after_the_ttl():
    policy = build({"ttl_s": 120.0}, random.Random(0))
    r1 = req("r1", (1, 2, 3, 4), t=10.0)
    policy.choose(r1, [A])
    policy.on_finished(r1, A.address)
    later = req("r2", (1, 2, 3, 4), t=129.0)
    assert policy.logits(later, [A, B]) == [4.0, 8.0]  # A still credited with 4 cached blocks
    expired = req("r3", (1, 2, 3, 4), t=130.0)
    assert policy.logits(expired, [A, B]) == [8.0, 8.0] and policy.index_size() == 0


def test_routing_again_renews_the_ttl():
    policy = build({"ttl_s": 100.0}, random.Random(0))
    policy.choose(req("r1", (1, 2), t=0.0), [A])
    policy.choose(req("r2", (1, 2), t=90.0), [A])
    assert policy.overlaps((1, 2), [A]) == {A.address: 2}
    policy.logits(req("r3", (1, 2), t=150.0), [A])  # the first expiry (100 s) has passed, the renewal not
    assert policy.overlaps((1, 2), [A]) == {A.address: 2}


def test_index_is_pruned_to_the_target_ratio():
    policy = build({"max_tree_size": 10, "prune_target_ratio": 0.8}, random.Random(0))
    policy.choose(req("r1", tuple(range(6))), [A])
    assert policy.index_size() == 6
    policy.choose(req("r2", tuple(range(100, 106))), [B])
    # 12 > 10: whole decisions are forgotten, oldest first, until at most 8 entries are left
    assert policy.index_size() == 6
    assert policy.overlaps(tuple(range(6)), [A]) == {}
    assert policy.overlaps(tuple(range(100, 106)), [B]) == {B.address: 6}


def test_temperature_zero_is_argmin_and_positive_temperature_samples():
    cold = build({}, random.Random(0))
    cold.choose(req("busy", tuple(range(40))), [A])
    assert {cold.choose(req(f"x{i}", (900 + i,)), [A, B]).address for i in range(30)} == {B.address}
    warm = build({"router_temperature": 1.0}, random.Random(0))
    warm.choose(req("busy", tuple(range(40))), [A])
    picks = collections.Counter(warm.choose(req(f"x{i}", (900 + i,)), [A, B]).address for i in range(300))
    assert picks[B.address] > picks[A.address] > 0


def test_without_keys_cost_is_the_prompt_tokens_load():
    policy = build({}, random.Random(0))
    policy.choose(req("ids", prompt_token_ids=tuple(range(160))), [A])
    assert policy.logits(req("x", prompt_token_ids=tuple(range(32))), [A, B]) == [12.0, 2.0]


@pytest.mark.parametrize("params", [{"overlap_score_weight": -1}, {"router_temperature": float("nan")},
                                    {"ttl_s": 0}, {"prune_target_ratio": 1.5}, {"max_tree_size": 0},
                                    {"block_size": 2.0}, {"use_kv_events": True}])
def test_bad_params(params):
    with pytest.raises(ValueError):
        build(params, random.Random(0))


def test_precise_variant_takes_overlaps_from_the_published_cache_state():
    from extproc.policies.registry import build_policy
    policy = build_policy("dynamo-kv-precise", {}, random.Random(0))
    warm = EndpointView(A.address, num_prefix_blocks_cached=3)
    cold = EndpointView(B.address, num_prefix_blocks_cached=None)
    # A: (80 - 48) / 16 = 2 + 5 new blocks -> 7; B: 80 / 16 = 5 + 5 -> 10
    assert policy.logits(req("r", (1, 2, 3, 5, 6)), [warm, cold]) == [7.0, 10.0]
    assert policy.choose(req("r", (1, 2, 3, 5, 6)), [warm, cold]) == warm
    assert policy.index_size() == 0
    with pytest.raises(ValueError):
        build_policy("dynamo-kv-precise", {"precise": False}, random.Random(0))


def test_a_request_that_brought_nothing_can_finish_after_its_endpoint_emptied():
    """A record without blocks or tokens outliving the endpoint's active state (found on multi-turn sessions:
    KeyError)."""
    policy = build({}, random.Random(0))
    empty, r1 = req("e"), req("r1", (1, 2, 3, 4))
    assert policy.choose(empty, [A]) == A and policy.choose(r1, [A]) == A
    policy.on_finished(r1, A.address)
    policy.on_finished(empty, A.address)
    assert policy.logits(req("r2", (1, 2)), [A, B]) == [2.0, 4.0]  # A still caches 1, 2; nothing active
