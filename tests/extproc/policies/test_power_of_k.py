import collections
import random

import pytest

from extproc.policies.base import EndpointView, Prediction
from extproc.policies.power_of_k import Params, build
from extproc.request import RoutingRequest

REQ = RoutingRequest("r", "POST", "/v1/completions")
EPS = [EndpointView(f"10.0.0.{i}:80", predictor=f"10.0.1.{i}:90") for i in range(1, 6)]


def at(t_s: float) -> RoutingRequest:
    return RoutingRequest("r", "POST", "/v1/completions", arrival_time_s=t_s)


def scored(*pairs):
    return [EndpointView(f"10.0.0.{i}:80", prediction=None if p is None else Prediction(p[0], p[1]))
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
    policy = build({"probe_best": False, **params}, random.Random(0))
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
    policy = build({"k": 2, "memory_s": 1.0}, random.Random(3))
    first = policy.candidates(at(0.0), EPS)
    good, bad = first
    policy.choose(at(0.0), [EndpointView(good.address, prediction=Prediction(0.01, 1.0)),
                            EndpointView(bad.address, prediction=Prediction(2.0, 5.0))])
    for n in range(20):  # within memory_s the best answer is always one of the two probes
        cands = policy.candidates(at(0.5), EPS)
        assert cands[0].address == good.address and cands[1].address != good.address
    # once its fresh answer is worse than another's, that other endpoint becomes the remembered one
    other = policy.candidates(at(0.6), EPS)[1]
    policy.choose(at(0.6), [EndpointView(good.address, prediction=Prediction(3.0, 6.0)),
                            EndpointView(other.address, prediction=Prediction(0.02, 1.0))])
    assert policy.candidates(at(0.7), EPS)[0].address == other.address
    # answers older than memory_s are forgotten: back to two random probes
    firsts = {policy.candidates(at(5.0), EPS)[0].address for _ in range(50)}
    assert len(firsts) > 2


def test_probe_best_ignores_endpoints_that_left_the_pool():
    policy = build({"k": 2}, random.Random(0))
    policy.choose(at(0.0), [EndpointView("10.9.9.9:80", prediction=Prediction(0.0, 0.0))])
    cands = policy.candidates(at(0.1), EPS)
    assert "10.9.9.9:80" not in {c.address for c in cands} and len(cands) == 2


@pytest.mark.parametrize("params", [{"k": 0}, {"k": 1.5}, {"k": True}, {"metric": "tpot"}, {"x": 1},
                                    {"e2e_weight": -1}, {"e2e_weight": "a"}, {"probe_best": 1},
                                    {"memory_s": 0}, {"memory_s": True}, {"extra_probes": -1},
                                    {"extra_probes": 1.5}, {"queue_threshold_s": -0.1}, {"queue_threshold_s": "x"}])
def test_bad_params(params):
    with pytest.raises(ValueError):
        build(params, random.Random(0))


def test_params_defaults():
    assert Params() == Params(k=2, metric="blend", e2e_weight=0.1, probe_best=True, memory_s=1.0, extra_probes=4,
                              queue_threshold_s=0.05)


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
