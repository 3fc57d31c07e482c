import collections
import dataclasses
import random

import pytest

from extproc.policies.base import EndpointView, Prediction
from extproc.policies.power_of_k import Params, build
from extproc.request import RoutingRequest

REQ = RoutingRequest("r", "POST", "/v1/completions")
EPS = [EndpointView(f"10.0.0.{i}:80", predictor=f"10.0.1.{i}:90") for i in range(1, 6)]


def at(t_s: float) -> RoutingRequest:
    return RoutingRequest("r", "POST", "/v1/completions", arrival_time_s=t_s)


IDLE_TTFT_S = 0.02
"""Every test instance's own prefill, as its sidecar prices it: the rest of a predicted TTFT is queueing."""


def scored(*pairs):
    return [EndpointView(f"10.0.0.{i}:80", prediction=None if p is None else
                         Prediction(p[0], p[1], queue_s=max(p[0] - IDLE_TTFT_S, 0.0)))
            for i, p in enumerate(pairs, 1)]


@pytest.mark.parametrize(
    "params, predictions, expected",
    [
        ({"metric": "e2e"}, [(1.0, 5.0), (0.5, 3.0)], "10.0.0.2:80"),
        ({"metric": "e2e"}, [(0.2, 3.0), (0.9, 2.9)], "10.0.0.2:80"),
        ({"metric": "ttft"}, [(0.2, 9.0), (0.5, 3.0)], "10.0.0.1:80"),
        # blend: TTFT leads (a queued instance loses even with a shorter E2E) ...
        ({}, [(0.03, 2.94), (0.50, 2.90)], "10.0.0.1:80"),
        # ... and E2E breaks a near-tie in TTFT (0.03 + 0.294 > 0.031 + 0.25)
        ({}, [(0.030, 2.94), (0.031, 2.50)], "10.0.0.2:80"),
        ({"e2e_weight": 0}, [(0.030, 2.94), (0.031, 2.50)], "10.0.0.1:80"),
        ({}, [(1.0, 2.0)], "10.0.0.1:80"),
    ],
    ids=["e2e", "e2e-picks-full-instance", "ttft", "blend-ttft-leads", "blend-e2e-breaks-near-tie",
         "blend-weight-0", "one-endpoint"],
)
def test_choose_lowest_score(params, predictions, expected):
    policy = build({"probe_best": False, "tie_tolerance": 0, **params}, random.Random(0))
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
@pytest.mark.parametrize("probe_best", [False, True])
def test_candidates_sample_k_distinct(k, size, probe_best):
    policy = build({"k": k, "probe_best": probe_best}, random.Random(1))
    seen = set()
    for n in range(200):
        cands = policy.candidates(at(n * 0.01), EPS)
        assert len(cands) == size and len({c.address for c in cands}) == size
        seen.update(c.address for c in cands)
        # every candidate answers; the lowest address is always best, so memory would stick to it
        policy.choose(at(n * 0.01), [EndpointView(c.address, prediction=Prediction(float(c.address[-4]), 1.0))
                                     for c in cands])
    assert seen == {e.address for e in EPS}  # random probes still reach the whole fleet


def test_probe_best_probes_the_best_recent_answer_afresh():
    policy = build({"k": 2, "memory_s": 1.0, "probe_best": True}, random.Random(3))
    first = policy.candidates(at(0.0), EPS)
    good, bad = first
    policy.choose(at(0.0), [EndpointView(good.address, prediction=Prediction(0.01, 1.0)),
                            EndpointView(bad.address, prediction=Prediction(2.0, 5.0))])
    for n in range(20):  # within memory_s the best answer is one of the two probes, its fresh answer remembered
        cands = policy.candidates(at(0.5), EPS)
        assert cands[0].address == good.address and cands[1].address != good.address
        policy.choose(at(0.5), [EndpointView(c.address, prediction=Prediction(0.01 if c is cands[0] else 2.0, 1.0))
                                for c in cands])
    # once its fresh answer is worse than another's, that other endpoint becomes the remembered one
    cands = policy.candidates(at(0.6), EPS)
    assert cands[0].address == good.address
    other = cands[1]
    policy.choose(at(0.6), [EndpointView(good.address, prediction=Prediction(3.0, 6.0)),
                            EndpointView(other.address, prediction=Prediction(0.02, 1.0))])
    assert policy.candidates(at(0.7), EPS)[0].address == other.address
    # answers older than memory_s are forgotten: back to two random probes
    firsts = {policy.candidates(at(5.0), EPS)[0].address for _ in range(50)}
    assert len(firsts) > 2


def test_the_remembered_best_goes_to_one_concurrent_decision_only():
    """A burst's decisions all start before any of them answers: the remembered endpoint is probed by the first
    only (handed to all, it drew most of a burst)."""
    policy = build({"k": 2, "memory_s": 1.0, "probe_best": True}, random.Random(5))
    cands = policy.candidates(at(0.0), EPS)
    policy.choose(at(0.0), [EndpointView(cands[0].address, prediction=Prediction(0.01, 1.0)),
                            EndpointView(cands[1].address, prediction=Prediction(2.0, 5.0))])
    best = cands[0].address
    burst = [policy.candidates(at(0.1), EPS) for _ in range(40)]  # none has answered yet
    assert burst[0][0].address == best
    assert sum(best in {c.address for c in cands} for cands in burst) < 20  # 1 + random draws (2/5 of 39)
def test_probe_best_ignores_endpoints_that_left_the_pool():
    policy = build({"k": 2, "probe_best": True}, random.Random(0))
    policy.choose(at(0.0), [EndpointView("10.9.9.9:80", prediction=Prediction(0.0, 0.0))])
    cands = policy.candidates(at(0.1), EPS)
    assert "10.9.9.9:80" not in {c.address for c in cands} and len(cands) == 2


@pytest.mark.parametrize("params", [{"k": 0}, {"k": 1.5}, {"k": True}, {"metric": "tpot"}, {"x": 1},
                                    {"e2e_weight": -1}, {"e2e_weight": "a"}, {"probe_best": 1},
                                    {"memory_s": 0}, {"memory_s": True}, {"extra_probes": -1},
                                    {"extra_probes": 1.5}, {"queue_threshold_s": -0.1}, {"queue_threshold_s": "x"},
                                    {"tie_tolerance": -0.01}, {"tie_tolerance": 0.6}, {"tie_tolerance": True},
                                    {"max_load_ratio": 0.5}, {"max_load_ratio": float("inf")},
                                    {"max_load_ratio": "2"}, {"confirm_load_bound": 1}])
def test_bad_params(params):
    with pytest.raises(ValueError):
        build(params, random.Random(0))


def test_params_defaults():
    assert Params() == Params(k=2, metric="blend", e2e_weight=0.1, probe_best=False, memory_s=1.0, extra_probes=4,
                              queue_threshold_s=0.05, tie_tolerance=0.05, max_load_ratio=2.0)


def view(i: int, ttft_s: float, *, num_requests: int = 0, unseen: int = 0, in_flight: int = 0,
         mean_in_flight: float = 0.0, model_error: float = 0.0, idle_ttft_s: float = 0.005) -> EndpointView:
    return EndpointView(f"10.0.0.{i}:80", num_in_flight=in_flight, mean_in_flight=mean_in_flight,
                        num_unseen_dispatches=unseen,
                        prediction=Prediction(ttft_s, 1.0, queue_s=max(ttft_s - idle_ttft_s, 0.0),
                                              num_requests=num_requests, model_error=model_error))


@pytest.mark.parametrize("seed", range(20))
def test_a_near_tie_goes_to_the_fewest_requests(seed):
    """Two idle-looking instances whose calibrated models differ by a hair: the prediction does not decide,
    the load does (without it every decision of a burst went the same way)."""
    policy = build({"metric": "ttft"}, random.Random(seed))
    assert policy.choose(REQ, [view(1, 0.100, num_requests=3), view(2, 0.104, num_requests=1)]).address == \
        "10.0.0.2:80"
    # this replica's dispatches since the sidecar answered count as its requests too
    assert policy.choose(REQ, [view(1, 0.100, num_requests=1), view(2, 0.104, num_requests=0, unseen=2)]).address \
        == "10.0.0.1:80"


def test_a_clear_difference_is_decided_by_the_prediction():
    policy = build({"metric": "ttft"}, random.Random(0))
    assert policy.choose(REQ, [view(1, 0.100, num_requests=9), view(2, 0.110, num_requests=0)]).address == \
        "10.0.0.1:80"


def test_a_sidecars_model_error_widens_the_tie_up_to_a_cap():
    policy = build({"metric": "ttft"}, random.Random(0))
    # 20% apart, one sidecar's model 25% off: it cannot tell them apart
    assert policy.choose(REQ, [view(1, 0.100, num_requests=5, model_error=0.25),
                               view(2, 0.120, num_requests=0)]).address == "10.0.0.2:80"
    # twice as good stays decisive whatever error a sidecar reports
    assert policy.choose(REQ, [view(1, 0.100, num_requests=5, model_error=3.0),
                               view(2, 0.200, num_requests=0)]).address == "10.0.0.1:80"


def test_a_difference_only_the_models_see_is_a_tie():
    """Idle instances alike, two sidecars' calibrated models 20% apart on the request's prefill (measured through
    Envoy: 6.2 against 7.5 ms): not a reason to prefer one; with a queue the difference is decisive again."""
    policy = build({"metric": "ttft"}, random.Random(0))
    optimistic = view(1, 0.0062, idle_ttft_s=0.0062, num_requests=3)
    assert policy.choose(REQ, [optimistic, view(2, 0.0075, idle_ttft_s=0.0075, num_requests=1)]).address == \
        "10.0.0.2:80"
    assert policy.choose(REQ, [optimistic, view(2, 0.0500, idle_ttft_s=0.0075, num_requests=1)]).address == \
        "10.0.0.1:80"


def test_equal_load_near_ties_are_random():
    policy = build({"metric": "ttft"}, random.Random(0))
    picks = collections.Counter(policy.choose(REQ, [view(1, 0.100), view(2, 0.101)]).address for _ in range(300))
    assert min(picks.values()) > 100


def test_an_optimistic_sidecar_cannot_pull_past_the_load_bound():
    """However good its prediction, a candidate that would hold more than max_load_ratio x the fleet's mean in
    flight (+1 both sides) is passed over for one within the bound, when its sidecar's count confirms it."""
    policy = build({"metric": "ttft"}, random.Random(0))
    # mean 2: bound (2 + 1) x 2 = 6 with this request, so 5 in flight is the most it may have
    # (each sidecar counts what this replica sent it: 6 + 1 > 2 x (1 + 1) confirms the bound)
    assert policy.choose(REQ, [view(1, 0.01, in_flight=6, mean_in_flight=2.0, num_requests=6),
                               view(2, 0.90, in_flight=1, mean_in_flight=2.0, num_requests=1)]).address == "10.0.0.2:80"
    assert policy.choose(REQ, [view(1, 0.01, in_flight=5, mean_in_flight=2.0, num_requests=5),
                               view(2, 0.90, in_flight=1, mean_in_flight=2.0, num_requests=1)]).address == "10.0.0.1:80"
    # over this replica's bound, but its sidecar counts no more than 2 x the other's (+1 both sides): other
    # replicas' requests fill the fleet, so the count of this replica alone does not pass it over
    assert policy.choose(REQ, [view(1, 0.01, in_flight=6, mean_in_flight=2.0, num_requests=7),
                               view(2, 0.90, in_flight=1, mean_in_flight=2.0, num_requests=3)]).address == "10.0.0.1:80"
    assert build({"metric": "ttft", "confirm_load_bound": False}, random.Random(0)).choose(
        REQ, [view(1, 0.01, in_flight=6, mean_in_flight=2.0, num_requests=7),
              view(2, 0.90, in_flight=1, mean_in_flight=2.0, num_requests=3)]).address == "10.0.0.2:80"
    # ... unless its sidecar counts more requests than the one over the bound (traffic this replica cannot see)
    assert policy.choose(REQ, [view(1, 0.01, in_flight=6, mean_in_flight=2.0, num_requests=6),
                               view(2, 0.90, in_flight=1, mean_in_flight=2.0, num_requests=40)]).address == \
        "10.0.0.1:80"
    # every candidate over the bound: the prediction decides among them
    assert policy.choose(REQ, [view(1, 0.01, in_flight=9, mean_in_flight=2.0),
                               view(2, 0.90, in_flight=8, mean_in_flight=2.0)]).address == "10.0.0.1:80"
    # 0 = no bound
    assert build({"metric": "ttft", "max_load_ratio": 0}, random.Random(0)).choose(
        REQ, [view(1, 0.01, in_flight=60, mean_in_flight=2.0), view(2, 0.9, in_flight=1, mean_in_flight=2.0)]
    ).address == "10.0.0.1:80"


def queued(address, queue_s, ttft_s=None):
    return EndpointView(address, prediction=Prediction(ttft_s or queue_s + 0.03, 3.0, 0.0, queue_s))


@pytest.mark.parametrize("queues, expected", [
    ((0.5, 0.9), 3),      # both would queue: up to 4 more of the 3 left
    ((0.5, 0.01), 0),     # one would start the request at once
    ((0.05, 0.05), 0),    # at the threshold: not "would wait"
], ids=["both-queue", "one-free", "at-threshold"])
def test_second_round_only_when_every_candidate_would_queue(queues, expected):
    policy = build({}, random.Random(0))
    first = [queued(EPS[0].address, queues[0]), queued(EPS[1].address, queues[1])]
    more = policy.more_candidates(REQ, first, EPS)
    assert len(more) == expected and not {e.address for e in more} & {EPS[0].address, EPS[1].address}
    assert len({e.address for e in more}) == len(more)


def test_no_second_round_when_disabled_or_a_sidecar_did_not_answer():
    first = [queued(EPS[0].address, 1.0), queued(EPS[1].address, 1.0)]
    assert build({"extra_probes": 0}, random.Random(0)).more_candidates(REQ, first, EPS) == ()
    partial = [first[0], EndpointView(EPS[1].address)]
    assert build({}, random.Random(0)).more_candidates(REQ, partial, EPS) == ()
    assert len(build({"extra_probes": 2}, random.Random(0)).more_candidates(REQ, first, EPS)) == 2


def keyed(keys, t_s: float = 0.0) -> RoutingRequest:
    return RoutingRequest("r", "POST", "/v1/completions", arrival_time_s=t_s, block_keys=tuple(keys))


def fleet(cached: dict[int, int] | None = None, n: int = 12) -> list[EndpointView]:
    """n endpoints; ``cached``: endpoint index -> num_prefix_blocks_cached (the rest 0)."""
    cached = cached or {}
    return [EndpointView(f"10.0.0.{i}:80", num_prefix_blocks_cached=cached.get(i, 0)) for i in range(n)]


def test_prefix_probe_goes_to_the_endpoint_with_the_most_cached_blocks():
    policy = build({"k": 2}, random.Random(0))
    endpoints = fleet({3: 5, 7: 9, 9: 2})
    for _ in range(50):
        candidates = policy.candidates(keyed([11, 12, 13]), endpoints)
        assert len(candidates) == 2 and candidates[0].address == "10.0.0.7:80"
        assert candidates[1].address != "10.0.0.7:80"
    others = collections.Counter(policy.candidates(keyed([11]), endpoints)[1].address for _ in range(600))
    assert len(others) == 11  # the other probe still explores the whole rest of the fleet


def test_prefix_probe_breaks_ties_by_in_flight_then_at_random():
    policy = build({"k": 2}, random.Random(0))
    homes = collections.Counter(policy.candidates(keyed([1]), fleet({2: 4, 5: 4}))[0].address for _ in range(200))
    assert set(homes) == {"10.0.0.2:80", "10.0.0.5:80"} and min(homes.values()) > 60
    # two homes hold the prefix alike: the probe goes to the one with fewer requests in flight from this replica
    endpoints = [dataclasses.replace(e, num_in_flight=3 if e.address == "10.0.0.2:80" else 1)
                 for e in fleet({2: 4, 5: 4, 8: 3})]
    assert {policy.candidates(keyed([1]), endpoints)[0].address for _ in range(50)} == {"10.0.0.5:80"}


def test_cold_prompt_goes_to_one_rendezvous_home_shared_by_replicas_and_bursts():
    replicas = [build({"k": 2}, random.Random(seed)) for seed in range(4)]
    endpoints = fleet()
    homes = {r.candidates(keyed([42, 43]), endpoints)[0].address for r in replicas for _ in range(20)}
    assert len(homes) == 1  # every replica, every request of the burst: the same home
    # the address order does not matter, and other first keys spread over the fleet
    assert replicas[0].candidates(keyed([42]), endpoints[::-1])[0].address in homes
    spread = collections.Counter(replicas[0].candidates(keyed([key]), endpoints)[0].address for key in range(1200))
    assert len(spread) == 12 and max(spread.values()) < 2 * 1200 / 12


def test_rendezvous_home_moves_only_the_keys_of_a_removed_endpoint():
    from extproc.policies.power_of_k import rendezvous_home

    endpoints = fleet()
    before = {key: rendezvous_home(key, endpoints).address for key in range(600)}
    after = {key: rendezvous_home(key, endpoints[1:]).address for key in range(600)}
    moved = [key for key in before if before[key] != after[key]]
    assert moved and all(before[key] == endpoints[0].address for key in moved)


@pytest.mark.parametrize("params, request_keys", [({"k": 2, "prefix_probe": False}, [1]), ({"k": 2}, None),
                                                  ({"k": 2}, []), ({"k": 1}, [1])],
                         ids=["off", "no-keys", "no-full-block", "k1"])
def test_no_prefix_probe_draws_the_same_as_plain_random(params, request_keys):
    request = REQ if request_keys is None else keyed(request_keys)
    endpoints = fleet({4: 10})
    policy, plain = build(params, random.Random(7)), build({"k": params["k"], "prefix_probe": False}, random.Random(7))
    for _ in range(20):
        assert policy.candidates(request, endpoints) == plain.candidates(REQ, endpoints)


def test_prefix_probe_and_memory_each_take_one_probe_leaving_one_random():
    policy = build({"k": 3, "probe_best": True}, random.Random(0))
    endpoints = [EndpointView(f"10.0.0.{i}:80", num_prefix_blocks_cached=3 if i == 1 else 0,
                              prediction=Prediction(0.02 + 0.1 * i, 1.0, queue_s=0.1 * i)) for i in range(6)]
    policy.choose(keyed([5], 0.0), endpoints)  # remembers every answer: 10.0.0.0 queues least
    candidates = policy.candidates(keyed([5], 0.1), endpoints)
    assert [c.address for c in candidates[:2]] == ["10.0.0.1:80", "10.0.0.0:80"] and len(candidates) == 3
    assert len({c.address for c in candidates}) == 3


def test_prefix_probe_must_be_a_bool():
    with pytest.raises(ValueError, match="prefix_probe"):
        Params(prefix_probe="yes")


def test_a_cache_hit_is_not_cancelled_by_the_idle_cost_allowance():
    """The home prices the request 0.2 s cheaper because its prefill hits the cache: the cold instance, whose score
    is worse by exactly that, is a near-tie only when both hold the same blocks (then the difference is the models')."""
    policy = build({"k": 2, "tie_tolerance": 0}, random.Random(0))

    def pair(cached_home: int, cached_cold: int) -> list[EndpointView]:
        return [EndpointView("10.0.0.1:80", num_in_flight=1, num_prefix_blocks_cached=cached_home,
                             prediction=Prediction(0.1, 1.0, queue_s=0.0, idle_e2e_s=1.0)),
                EndpointView("10.0.0.2:80", num_in_flight=0, num_prefix_blocks_cached=cached_cold,
                             prediction=Prediction(0.3, 1.2, queue_s=0.0, idle_e2e_s=1.2))]

    assert {policy.choose(keyed([1]), pair(8, 0)).address for _ in range(20)} == {"10.0.0.1:80"}
    # same cache state: the difference counts as the models', and the less loaded one wins the tie
    assert {policy.choose(keyed([1]), pair(8, 8)).address for _ in range(20)} == {"10.0.0.2:80"}


def _home_and_cold(home_queue_s: float) -> list[EndpointView]:
    """The home holds the prompt's 128 blocks (idle TTFT 0.05 s) behind a queue; the cold instance holds none (idle
    TTFT 0.45 s: the whole prefill), runs one request and queues nothing."""
    return [EndpointView("10.0.0.1:80", num_prefix_blocks_cached=128,
                         prediction=Prediction(0.05 + home_queue_s, 1.0, queue_s=home_queue_s)),
            EndpointView("10.0.0.2:80", num_prefix_blocks_cached=0,
                         prediction=Prediction(0.45, 1.4, queue_s=0.0, num_requests=1))]


@pytest.mark.parametrize("home_queue_s, home", [(0.0, True), (0.5, True), (3.9, True), (4.1, False), (60.0, False)])
def test_cache_affinity_keeps_the_home_until_its_ttft_passes_affinity_max_ttft_s(home_queue_s, home):
    """A miss copies the prefix onto a cold instance and evicts another there: the home keeps the request however
    much shorter the cold instance's predicted TTFT is, until the home's passes 4 s (a frozen or far slower one)."""
    policy = build({"metric": "ttft", "tie_tolerance": 0}, random.Random(0))
    chosen = {policy.choose(keyed([1]), _home_and_cold(home_queue_s)).address for _ in range(10)}
    assert chosen == {"10.0.0.1:80" if home else "10.0.0.2:80"}


def test_affinity_does_not_yield_when_no_candidate_is_within_the_ttft_bound():
    """Past the knee every candidate predicts a TTFT past affinity_max_ttft_s: a copy on the cold one would only add
    its prefill and evict another prefix there, so the home keeps the request."""
    views = _home_and_cold(6.0)
    views[1] = EndpointView("10.0.0.2:80", num_prefix_blocks_cached=0,
                            prediction=Prediction(4.5, 5.4, queue_s=4.05, num_requests=1))
    policy = build({"metric": "ttft", "tie_tolerance": 0}, random.Random(0))
    assert {policy.choose(keyed([1]), views).address for _ in range(10)} == {"10.0.0.1:80"}
    views[1] = dataclasses.replace(views[1], prediction=Prediction(3.9, 4.8, queue_s=3.45, num_requests=1))
    assert {policy.choose(keyed([1]), views).address for _ in range(10)} == {"10.0.0.2:80"}  # within: it yields


def test_affinity_max_ttft_s_0_never_releases_the_home():
    policy = build({"metric": "ttft", "tie_tolerance": 0, "affinity_max_ttft_s": 0}, random.Random(0))
    assert policy.choose(keyed([1]), _home_and_cold(60.0)).address == "10.0.0.1:80"


def test_a_candidate_without_a_cache_state_stays_in_the_comparison():
    """num_prefix_blocks_cached None (a sidecar that publishes no state): its own prediction prices the hit, so it
    is compared, not passed over as cold."""
    views = _home_and_cold(0.5)
    views[1] = dataclasses.replace(views[1], num_prefix_blocks_cached=None)
    policy = build({"metric": "ttft", "tie_tolerance": 0}, random.Random(0))
    assert {policy.choose(keyed([1]), views).address for _ in range(10)} == {"10.0.0.2:80"}


@pytest.mark.parametrize("num_prompt_blocks, home", [(8, True), (25, False)])
def test_a_lead_under_an_eighth_of_the_prompt_leaves_the_choice_to_the_score(num_prompt_blocks, home):
    """The home holds 1 more block than the cold instance: on an 8-block prompt that is an eighth (kept); on a
    25-block prompt, the score decides."""
    policy = build({"metric": "ttft", "tie_tolerance": 0}, random.Random(0))
    views = [dataclasses.replace(v, num_prefix_blocks_cached=n) for v, n in zip(_home_and_cold(0.5), (1, 0))]
    chosen = {policy.choose(keyed(list(range(num_prompt_blocks))), views).address for _ in range(10)}
    assert chosen == {"10.0.0.1:80" if home else "10.0.0.2:80"}


@pytest.mark.parametrize("home_queue_s, home", [(0.30, True), (0.50, False)])
def test_without_cache_affinity_the_requests_own_ttft_decides(home_queue_s, home):
    policy = build({"metric": "ttft", "tie_tolerance": 0, "cache_affinity": False}, random.Random(0))
    chosen = {policy.choose(keyed([1]), _home_and_cold(home_queue_s)).address for _ in range(10)}
    assert chosen == {"10.0.0.1:80" if home else "10.0.0.2:80"}


def test_cache_affinity_compares_the_instances_holding_the_most_by_their_predictions():
    """Two homes hold the whole prefix, one holds part of it: the partial one is out, and the prediction picks the
    home that starts the request sooner."""
    views = [EndpointView("10.0.0.1:80", num_prefix_blocks_cached=128, prediction=Prediction(0.9, 2.0, queue_s=0.8)),
             EndpointView("10.0.0.2:80", num_prefix_blocks_cached=128, prediction=Prediction(0.1, 1.0, queue_s=0.0)),
             EndpointView("10.0.0.3:80", num_prefix_blocks_cached=64,
                          prediction=Prediction(0.05, 1.0, queue_s=0.0, num_requests=2))]
    policy = build({"metric": "ttft", "tie_tolerance": 0}, random.Random(0))
    assert {policy.choose(keyed([1]), views).address for _ in range(10)} == {"10.0.0.2:80"}


@pytest.mark.parametrize("unseen, idle_wins", [(0, True), (1, False)])
def test_cache_affinity_keeps_an_idle_instance_in_the_comparison(unseen, idle_wins):
    """An instance with no request at all (its sidecar counts none and this replica sent it none unseen) is
    compared beside the homes: a copy there delays nobody, and a prefix every request shares spreads that way."""
    views = _home_and_cold(0.5)
    views[1] = EndpointView("10.0.0.2:80", num_prefix_blocks_cached=0, num_unseen_dispatches=unseen,
                            prediction=Prediction(0.45, 1.4, queue_s=0.0, num_requests=0))
    policy = build({"metric": "ttft", "tie_tolerance": 0}, random.Random(0))
    chosen = {policy.choose(keyed([1]), views).address for _ in range(10)}
    assert chosen == {"10.0.0.2:80" if idle_wins else "10.0.0.1:80"}


@pytest.mark.parametrize("seed", range(10))
def test_cache_affinity_yields_to_the_load_bound(seed):
    """A home whose in-flight count is past max_load_ratio x the mean is passed over for a cold instance within
    the bound that counts no more requests: affinity never makes one instance draw every request of a prefix."""
    views = [EndpointView("10.0.0.1:80", num_in_flight=9, mean_in_flight=2.0, num_prefix_blocks_cached=128,
                          prediction=Prediction(0.2, 1.0, queue_s=0.1, num_requests=9)),
             EndpointView("10.0.0.2:80", num_in_flight=1, mean_in_flight=2.0, num_prefix_blocks_cached=0,
                          prediction=Prediction(0.45, 1.4, queue_s=0.0, num_requests=1))]
    policy = build({"metric": "ttft"}, random.Random(seed))
    assert policy.choose(keyed([1]), views).address == "10.0.0.2:80"


def _over_bound_home(in_use: int, home_requests: int, cached: int = 128) -> list[EndpointView]:
    """A home just past this replica's load bound (6 in flight, mean 2: 6 + 1 > 2 x (2 + 1)) holding ``cached`` of
    the prompt's 128 blocks, ``in_use`` of them held by its requests, its sidecar counting ``home_requests`` (every
    replica's); a cold stand-in counting 3 (1 of them this replica's). The sidecar's count confirms the bound from 8
    up: 8 + 1 > 2 x (3 + 1)."""
    return [EndpointView("10.0.0.1:80", num_in_flight=6, mean_in_flight=2.0, num_prefix_blocks_cached=cached,
                         num_prefix_blocks_in_use=in_use,
                         prediction=Prediction(0.2, 1.0, queue_s=0.1, num_requests=home_requests)),
            EndpointView("10.0.0.2:80", num_in_flight=1, mean_in_flight=2.0, num_prefix_blocks_cached=0,
                         num_prefix_blocks_in_use=0, prediction=Prediction(0.45, 1.4, queue_s=0.0, num_requests=3))]


@pytest.mark.parametrize("in_use, home_requests, cached, params, released", [
    (0, 7, 128, {}, True),  # a private home (its copy sits in free cache, a conversation between turns): it moves
    (128, 7, 128, {}, False),  # requests on it hold the prefix: its sidecar counts 7 + 1 <= 2 x (3 + 1), kept
    (128, 8, 128, {}, True),  # 8 + 1 > 2 x (3 + 1): the sidecar confirms the bound
    (64, 7, 128, {}, False),  # half the prefix held is still at least an eighth of the prompt's 128 blocks
    (15, 7, 128, {}, True),  # under an eighth held: a private home
    (0, 7, 15, {}, False),  # not a home (a lead under an eighth): confirmed by the sidecar's count or kept
    (0, 8, 15, {}, True),
    (128, 7, 128, {"confirm_load_bound": False}, True)])  # this replica's count alone
def test_the_load_bound_is_confirmed_by_the_sidecars_count_except_for_a_private_home(
        in_use, home_requests, cached, params, released):
    """Past this replica's load bound a candidate is passed over for one within it only when its sidecar's count,
    every replica's requests, is past the bound too; a home whose prefix no other request shares is released on
    this replica's count alone."""
    policy = build({"metric": "ttft", **params}, random.Random(0))
    chosen = policy.choose(keyed(range(128)), _over_bound_home(in_use, home_requests, cached)).address
    assert chosen == ("10.0.0.2:80" if released else "10.0.0.1:80")


def test_a_home_whose_deepest_hit_an_earlier_decision_found_is_not_private():
    """The same deepest cached block found by an earlier decision (a tenant's context, many users): the prefix is
    shared, so its home is kept until its sidecar's count confirms the bound; a conversation's next turn hits its
    previous reply, a block no earlier prompt hit, and its home is released. Remembered per policy object."""
    policy = build({"metric": "ttft"}, random.Random(0))
    tenant = keyed(range(128))
    assert policy.choose(tenant, _over_bound_home(0, 7)).address == "10.0.0.2:80"  # first hit on block 127
    assert policy.choose(tenant, _over_bound_home(0, 7)).address == "10.0.0.1:80"  # seen: shared, kept
    assert policy.choose(keyed(range(1000, 1128)), _over_bound_home(0, 7)).address == "10.0.0.2:80"  # another
    assert build({"metric": "ttft"}, random.Random(0)).choose(tenant, _over_bound_home(0, 7)).address == \
        "10.0.0.2:80"


def test_hits_are_learnt_while_the_load_bound_does_not_matter():
    """A decision within the bound records its deepest hit too: the next one, over the bound, finds it seen."""
    policy = build({"metric": "ttft"}, random.Random(0))
    within = [dataclasses.replace(v, num_in_flight=1) for v in _over_bound_home(0, 7)]
    assert policy.choose(keyed(range(128)), within).address == "10.0.0.1:80"
    assert policy.choose(keyed(range(128)), _over_bound_home(0, 7)).address == "10.0.0.1:80"  # seen: kept


@pytest.mark.parametrize("reported", [0, 2])
@pytest.mark.parametrize("confirm", [True, False])
def test_a_sidecar_that_under_reports_its_count_cannot_escape_the_load_bound(reported, confirm):
    """A sidecar counting fewer requests than this replica alone has in flight there (a bug, a restarted engine)
    counts as this replica's in-flight count: past the bound, its optimistic prediction does not keep it."""
    views = [view(1, 0.01, in_flight=6, mean_in_flight=2.0, num_requests=reported),
             view(2, 0.90, in_flight=1, mean_in_flight=2.0, num_requests=1)]
    policy = build({"metric": "ttft", "confirm_load_bound": confirm}, random.Random(0))
    assert policy.choose(REQ, views).address == "10.0.0.2:80"


def test_a_sidecar_counting_none_while_this_replica_has_requests_there_is_not_idle():
    """Cache affinity keeps an idle candidate beside the homes; one whose sidecar reports no request while this
    replica has requests in flight there is not idle (an under-report), so the home wins."""
    views = _home_and_cold(0.5)
    views[1] = EndpointView("10.0.0.2:80", num_prefix_blocks_cached=0, num_in_flight=3,
                            prediction=Prediction(0.45, 1.4, queue_s=0.0, num_requests=0))
    policy = build({"metric": "ttft", "tie_tolerance": 0}, random.Random(0))
    assert {policy.choose(keyed([1]), views).address for _ in range(10)} == {"10.0.0.1:80"}
    views[1] = dataclasses.replace(views[1], num_in_flight=0)  # idle indeed: compared, and its TTFT wins
    assert {policy.choose(keyed([1]), views).address for _ in range(10)} == {"10.0.0.2:80"}


def test_the_memory_of_hits_keeps_the_most_recently_found(monkeypatch):
    """At most MAX_HIT_KEYS deepest hits are remembered; a hit found again moves to the newest, so the oldest
    that nobody found since is forgotten first (it then counts as unseen: its home can be private again)."""
    import extproc.policies.power_of_k as power_of_k

    monkeypatch.setattr(power_of_k, "MAX_HIT_KEYS", 2)
    policy = build({"metric": "ttft"}, random.Random(0))
    within = [dataclasses.replace(v, num_in_flight=1) for v in _over_bound_home(0, 7)]
    for keys in (range(128), range(1000, 1128), range(128), range(2000, 2128)):  # a, b, a again, c: b goes
        policy.choose(keyed(keys), within)
    assert policy.choose(keyed(range(128)), _over_bound_home(0, 7)).address == "10.0.0.1:80"  # a: seen, kept
    assert policy.choose(keyed(range(1000, 1128)), _over_bound_home(0, 7)).address == "10.0.0.2:80"  # b: forgotten


def _candidate(i: int, cached: int, in_flight: int, requests: int, ttft_s: float) -> EndpointView:
    return EndpointView(f"10.0.0.{i}:80", num_in_flight=in_flight, mean_in_flight=2.0, num_prefix_blocks_cached=cached,
                        num_prefix_blocks_in_use=0,
                        prediction=Prediction(ttft_s, 1.0, queue_s=0.0, num_requests=requests))


def test_each_candidate_is_private_or_shared_by_its_own_deepest_hit():
    """A conversation's home (200 of 256 blocks, its tail never hit before) and a home of its shared system prompt
    (the first 64 blocks, another user's decision hit them), both past this replica's bound, neither confirmed by
    its sidecar's count: the conversation's home is private and released; the system prompt's is shared and kept,
    and wins over the cold stand-in by affinity (it would go to the stand-in were it private as well)."""
    policy = build({"metric": "ttft"}, random.Random(0))
    other_user = keyed([*range(64), *range(5000, 5192)])
    assert policy.choose(other_user, [_candidate(1, 64, 1, 3, 0.1), _candidate(2, 0, 1, 3, 0.5)]).address == \
        "10.0.0.1:80"  # records block 63 as a hit
    candidates = [_candidate(1, 200, 6, 7, 0.05), _candidate(2, 64, 6, 7, 0.2), _candidate(3, 0, 1, 3, 0.5)]
    assert policy.choose(keyed(range(256)), candidates).address == "10.0.0.2:80"


def test_a_home_is_private_only_by_its_lead_over_the_candidates_within_the_bound():
    """The home's lead is measured against the stand-ins within the bound, not against every candidate: a home 8 of
    128 blocks ahead of the stand-in is no private home (an eighth is 16), though another candidate past the bound
    holds nothing, so its unconfirmed count keeps it, and it wins on its prediction."""
    policy = build({"metric": "ttft", "tie_tolerance": 0}, random.Random(0))
    candidates = [_candidate(1, 128, 6, 7, 0.05), _candidate(2, 120, 1, 3, 0.2), _candidate(3, 0, 6, 7, 0.5)]
    assert policy.choose(keyed(range(128)), candidates).address == "10.0.0.1:80"


@pytest.mark.parametrize("value", [1, 0, "true", None])
def test_cache_affinity_must_be_true_or_false(value):
    with pytest.raises(ValueError, match="cache_affinity"):
        Params(cache_affinity=value)


def test_a_request_with_an_objective_goes_where_it_is_predicted_to_meet_it():
    from extproc.objectives import Objectives

    # the blend prefers the second (0.30 + 0.1 x 1.0 < 0.25 + 0.1 x 9.0), whose TTFT misses the 0.28 s objective
    candidates = scored((0.25, 9.0), (0.30, 1.0))
    plain = RoutingRequest("r", "POST", "/v1/completions")
    tight = RoutingRequest("r", "POST", "/v1/completions", objectives=Objectives(0.28, None, 0),
                           num_predicted_output_tokens=100)
    policy = build({}, random.Random(0))
    assert policy.choose(plain, candidates).address == "10.0.0.2:80"
    assert policy.choose(tight, candidates).address == "10.0.0.1:80"
    assert build({"prefer_meeting": False}, random.Random(0)).choose(tight, candidates).address == "10.0.0.2:80"
    # none meets it: the score decides among all
    impossible = dataclasses.replace(tight, objectives=Objectives(0.1, None, 0))
    assert policy.choose(impossible, candidates).address == "10.0.0.2:80"
    with pytest.raises(ValueError):
        build({"prefer_meeting": "yes"}, random.Random(0))


def test_a_second_round_when_no_first_round_candidate_meets_the_objective():
    from extproc.objectives import Objectives

    first = scored((0.03, 1.0), (0.04, 1.0))  # no queue: no second round for a plain request
    rest = [EndpointView(f"10.0.0.{i}:80") for i in range(3, 9)]
    plain = RoutingRequest("r", "POST", "/v1/completions")
    tight = dataclasses.replace(plain, objectives=Objectives(0.02, None, 0), num_predicted_output_tokens=10)
    policy = build({"extra_probes": 2}, random.Random(0))
    assert policy.more_candidates(plain, first, first + rest) == ()
    assert len(policy.more_candidates(tight, first, first + rest)) == 2
    loose = dataclasses.replace(tight, objectives=Objectives(0.05, None, 0))
    assert policy.more_candidates(loose, first, first + rest) == ()
