"""The cluster benchmark: quick mode end to end, capacity, arrivals, and prediction = simulation with oracle lengths."""

import csv
import math
import random
import statistics

import pytest

from bench.cluster import at_rate, build_requests, main, policy_spec
from bench.cluster_report import PooledPoint, capacities, crossing_rates
from bench.cluster_sim import (
    ENVOY_LEAST_REQUEST,
    ClusterConfig,
    ClusterRequest,
    EnvoyLeastRequest,
    LognormalLengthError,
    PolicySpec,
    _Cluster,
    oracle_lengths,
    simulate_point,
)
from extproc.policies.base import EndpointView
from predictor.sim.residual import ExactLengths, FixedExtraTokens
from bench.workloads import WorkloadError, arrival_offsets_s
from predictor.sim import EngineConfig
from tagger.sharegpt import SharegptPair

QUICK_POLICIES = "random,least-requests,envoy-least-request,min-qpm,infaas,llumnix,gie,astrolabe-paper,astrolabe-k2"


def test_quick_mode_end_to_end(tmp_path, capsys):
    out = tmp_path / "cluster"
    assert main(["--num-instances", "3", "--num-requests", "200", "--rates", "15,40", "--policies", QUICK_POLICIES,
                 "--out", str(out), "--workers", "1", "--no-progress", "--seeds", "3,4", "--num-routers", "2"]) == 0
    printed = capsys.readouterr().out
    assert "SIMULATED" in printed and "KV cache 1024 blocks x 16 tokens" in printed
    assert "2 router replica(s)" in printed and "seeds 3,4" in printed
    assert "capacity qps (P99 TTFT <= 2 s)" in printed and "requests per wall second" in printed
    assert "astrolabe-k2 / best baseline" in printed
    with (out / "cluster.csv").open() as fp:
        rows = list(csv.DictReader(fp))
    policies = QUICK_POLICIES.split(",")
    assert len(rows) == len(policies) * 2
    assert {(r["policy"], float(r["rate_qps"])) for r in rows} == {(p, rate) for p in policies for rate in (15.0, 40.0)}
    for row in rows:
        assert row["num_completed"] == row["num_requests"] == "400" and row["num_seeds"] == "2"
        assert 0 < float(row["ttft_mean_s"]) <= float(row["ttft_p99_s"])
        assert float(row["ttft_p99_low_s"]) <= float(row["ttft_p99_high_s"])
        assert float(row["ttft_mean_s"]) < float(row["e2e_mean_s"]) and float(row["tpot_mean_s"]) > 0
        assert float(row["predictor_calls_per_request"]) == (2.0 if row["policy"].startswith("astrolabe") else 0.0)
        assert row["num_gpu_blocks"] == "1024" and row["slo_ttft_s"] == "2.0" and row["num_routers"] == "2"
    assert (out / "p99_ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capacity_table = printed.split("capacity qps (P99 TTFT <= 2 s)")[1]
    for policy in QUICK_POLICIES.split(","):
        assert any(line.startswith(policy) for line in capacity_table.splitlines())


def test_same_trace_gives_same_result():
    pairs = [SharegptPair(str(i), "p", 50 + 7 * i, 30 + 11 * i) for i in range(40)]
    _, requests = build_requests(pairs, 60, random.Random(1), "poisson", 1.0, LognormalLengthError())
    config = ClusterConfig(num_instances=2)
    a = simulate_point(PolicySpec("k2", "astrolabe", {"k": 2}), 20.0, at_rate(requests, 20.0), config)
    b = simulate_point(PolicySpec("k2", "astrolabe", {"k": 2}), 20.0, at_rate(requests, 20.0), config)
    assert a.num_completed == 60 and (a.ttft_p99_s, a.e2e_mean_s) == (b.ttft_p99_s, b.e2e_mean_s)


def test_oracle_prediction_equals_the_simulated_outcome():
    """Cross-consumer check: with true lengths and no later arrivals, the predictor's E2E for a request on an
    instance equals what that instance's engine then does with it."""
    config = ClusterConfig(num_instances=1, engine=EngineConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                                                num_gpu_blocks=64), residual=ExactLengths())
    cluster = _Cluster(config, PolicySpec("full", "astrolabe", {"k": 1}))
    rng = random.Random(5)
    for n in range(12):  # enough to queue and preempt on 64 blocks
        p, o = rng.randint(20, 200), rng.randint(5, 150)
        cluster.dispatch(0, 0, f"r{n}", ClusterRequest(0.01 * n, p, o, o))
    cluster.advance_to(0.3)
    new = ClusterRequest(0.3, 120, 80, 80)
    predicted = cluster.predict(0, "new", new)
    now_s = cluster.engines[0].now_s
    cluster.dispatch(0, 0, "new", new)
    cluster._collect(0, cluster.engines[0].run_until_idle())
    done = next(r for r in cluster.finished if r.request_id == "new")
    assert cluster.engines[0].scheduler.num_preemptions_total > 0
    assert done.finish_time_s - now_s == pytest.approx(predicted.e2e_s, rel=1e-9)
    assert done.first_token_time_s - now_s == pytest.approx(predicted.ttft_s, rel=1e-9)


def test_predictor_sees_predicted_not_true_lengths():
    config = ClusterConfig(num_instances=1, engine=EngineConfig(max_num_seqs=4, max_num_batched_tokens=256))
    short, long_ = (_Cluster(config, PolicySpec("k1", "astrolabe", {"k": 1})) for _ in range(2))
    for cluster, predicted_tokens in ((short, 10), (long_, 1000)):
        for n in range(4):  # same true lengths (500), different predicted lengths
            cluster.dispatch(0, 0, f"r{n}", ClusterRequest(0.0, 100, 500, predicted_tokens))
        cluster.advance_to(0.05)
    new = ClusterRequest(0.05, 100, 50, 50)
    assert short.predict(0, "x", new).ttft_s < long_.predict(0, "x", new).ttft_s


def point(policy, rate, p99):
    return PooledPoint(policy, rate, 1, 10, 10, 0.1, p99, p99, p99, 1.0, 2.0, 0.01, 0, 0.0, 0, 1, 0.1)


@pytest.mark.parametrize(
    "p99s, expected",
    [((0.5, 1.0, 3.0), (20.0, False)), ((0.5, 1.0, 1.9), (30.0, True)), ((2.5, 1.0, 1.0), (None, False)),
     ((0.5, 3.0, 1.0), (10.0, False)), ((0.5, math.nan, 1.0), (10.0, False))],
    ids=["crosses", "all-meet", "none-meet", "first-miss-ends-it", "nan-is-a-miss"],
)
def test_capacity(p99s, expected):
    results = [point("x", rate, p99) for rate, p99 in zip((30.0, 10.0, 20.0), (p99s[2], p99s[0], p99s[1]))]
    (cap,) = capacities(results, 2.0)
    assert (cap.capacity_qps, cap.at_max_rate) == expected


def test_crossing_rate_interpolates_in_log_p99():
    results = [point("x", 10.0, 1.0), point("x", 20.0, 4.0), point("y", 10.0, 3.0), point("z", 10.0, 1.0)]
    crossings = crossing_rates(results, 2.0)
    assert crossings["x"] == pytest.approx(15.0) and crossings["y"] is None and crossings["z"] is None


@pytest.mark.parametrize(
    "label, name, params",
    [("astrolabe-full", "astrolabe", {"k": 12}), ("astrolabe-k4", "astrolabe", {"k": 4}), ("gie", "gie", {}),
     ("min-qpm", "min-qpm", {}), (ENVOY_LEAST_REQUEST, ENVOY_LEAST_REQUEST, {}),
     ("astrolabe-k2-e2e-nomem", "astrolabe", {"k": 2, "metric": "e2e", "probe_best": False}),
     ("astrolabe-paper", "astrolabe", {"k": 2, "metric": "e2e", "probe_best": False, "extra_probes": 0}),
     ("astrolabe-k2-noextra", "astrolabe", {"k": 2, "extra_probes": 0})],
)
def test_policy_labels(label, name, params):
    spec = policy_spec(label, 12)
    assert (spec.name, dict(spec.params)) == (name, params)
    assert isinstance(spec.residual, FixedExtraTokens) == (label == "astrolabe-paper")


def test_envoy_least_request_model():
    """Envoy's N_CHOICES pick: draws with replacement, the first draw wins ties, fewer active requests wins."""
    views = [EndpointView("a", 0), EndpointView("b", 5), EndpointView("c", 5)]
    policy = EnvoyLeastRequest(random.Random(0))
    picks = [policy.choose(None, views).address for _ in range(9000)]
    # "a" loses only when both draws miss it: 1 - (2/3)^2 = 5/9 of picks
    assert picks.count("a") / len(picks) == pytest.approx(5 / 9, abs=0.02)
    equal = [EndpointView("a", 1), EndpointView("b", 1)]
    assert {policy.choose(None, equal).address for _ in range(100)} == {"a", "b"}


def test_several_routers_count_only_their_own_dispatches():
    config = ClusterConfig(num_instances=2, num_routers=2, engine=EngineConfig(max_num_seqs=4))
    cluster = _Cluster(config, PolicySpec("lr", "least-requests"))
    for n in range(6):
        r, i = cluster.route(f"r{n}", ClusterRequest(0.0, 50, 100, 100))
        cluster.dispatch(r, i, f"r{n}", ClusterRequest(0.0, 50, 100, 100))
    counts = [router.in_flight for router in cluster.routers]
    assert sum(map(sum, counts)) == 6 and all(sum(c) > 0 for c in counts)
    # each router balances its own traffic, not the fleet's
    assert all(max(c) - min(c) <= 1 for c in counts)


def test_mixed_fleet_sidecars_predict_with_their_own_instance_speed():
    config = ClusterConfig(num_instances=2, instance_time_scales=(1.0, 2.0), residual=ExactLengths())
    cluster = _Cluster(config, PolicySpec("k2", "astrolabe", {"k": 2}))
    new = ClusterRequest(0.0, 100, 50, 50)
    fast, slow = cluster.predict(0, "x", new), cluster.predict(1, "x", new)
    assert slow.e2e_s == pytest.approx(2 * fast.e2e_s)
    with pytest.raises(ValueError):
        ClusterConfig(num_instances=2, instance_time_scales=(1.0,))


@pytest.mark.parametrize("label", ["astrolabe-fast", "astrolabe-k2-slow", "astrolabe"])
def test_unknown_policy_label_is_an_error(label):
    with pytest.raises(ValueError, match="unknown policy"):
        policy_spec(label, 12)


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0])
def test_gamma_arrivals_have_the_requested_rate_and_cv(cv):
    offsets = arrival_offsets_s(20000, 50.0, random.Random(2), "gamma", cv=cv)
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 50.0, rel=0.05)
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.1)


def test_gamma_arrivals_reject_bad_cv():
    with pytest.raises(WorkloadError, match="cv must be > 0"):
        arrival_offsets_s(3, 1.0, random.Random(0), "gamma", cv=0)


@pytest.mark.parametrize("model, expected", [(oracle_lengths, 200), (LognormalLengthError(0.0), 200)])
def test_error_models_without_error_are_exact(model, expected):
    assert model(200, random.Random(0)) == expected


def test_lognormal_error_spread():
    model, rng = LognormalLengthError(0.5), random.Random(4)
    logs = [math.log(model(1000, rng) / 1000) for _ in range(4000)]
    assert abs(statistics.fmean(logs)) < 0.03 and statistics.pstdev(logs) == pytest.approx(0.5, rel=0.05)
