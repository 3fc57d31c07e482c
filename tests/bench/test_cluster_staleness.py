"""The cluster simulation's decision path: stale sidecar states, a replica's own unseen dispatches, decision latency,
per-instance request shares, and the exact simulation left as it was when both are 0."""

import random

import pytest

import bench.cluster_sim as cluster_sim
from bench.cluster import at_rate, build_requests, policy_spec
from bench.cluster_sim import (
    ClusterConfig,
    ClusterRequest,
    LognormalLengthError,
    PolicySpec,
    simulate_point,
    simulate_point_latencies,
)
from extproc.policies.base import Policy
from predictor.sim import EngineConfig
from tagger.sharegpt import SharegptPair


class Emptiest(Policy):
    """Asks every sidecar and picks the instance whose state holds the fewest requests, the first address on ties:
    a policy that herds on whatever state its decisions share."""

    TYPE = "emptiest"
    needs_predictions = True

    def choose(self, request, endpoints):
        return min(endpoints, key=lambda e: (e.prediction.num_requests, e.address))


@pytest.fixture
def emptiest(monkeypatch):
    build = cluster_sim.build_sim_policy
    monkeypatch.setattr(cluster_sim, "build_sim_policy",
                        lambda spec, rng: Emptiest() if spec.name == "emptiest" else build(spec, rng))
    return PolicySpec("emptiest", "emptiest")


def burst_counts(spec, *, num_routers, staleness_s, latency_s=0.0, num_requests=16):
    """Requests per instance after ``num_requests`` simultaneous arrivals on 4 idle instances."""
    burst = [ClusterRequest(0.0, 50, 20, 20) for _ in range(num_requests)]
    config = ClusterConfig(num_instances=4, num_routers=num_routers, staleness_s=staleness_s,
                           decision_latency_s=latency_s, engine=EngineConfig(max_num_seqs=32))
    result = simulate_point(spec, 1.0, burst, config)
    assert result.num_completed == num_requests
    return list(result.requests_per_instance)


def test_decisions_sharing_a_stale_state_herd_across_replicas(emptiest):
    # 64 replicas, 16 requests: nearly every request is its replica's first, and every replica's state says that
    # instance 0 is empty, so each first request goes there
    counts = burst_counts(emptiest, num_routers=64, staleness_s=1.0)
    assert counts[0] >= 12 and sum(counts) == 16


def test_a_replica_sees_its_own_dispatches_within_a_stale_state(emptiest):
    # one replica: its own dispatches are queued into the stale state, so the burst spreads evenly
    assert burst_counts(emptiest, num_routers=1, staleness_s=1.0) == [4, 4, 4, 4]


def test_exact_state_sees_every_replicas_dispatches(emptiest):
    assert burst_counts(emptiest, num_routers=64, staleness_s=0.0) == [4, 4, 4, 4]


def test_decision_latency_hides_other_replicas_dispatches_on_the_way(emptiest):
    # exact states, but the requests reach their instances 50 ms after the decisions: until then only the replica
    # that sent one knows of it
    counts = burst_counts(emptiest, num_routers=64, staleness_s=0.0, latency_s=0.05)
    assert counts[0] >= 12
    assert burst_counts(emptiest, num_routers=1, staleness_s=0.0, latency_s=0.05) == [4, 4, 4, 4]


def test_a_new_state_shows_other_replicas_dispatches(emptiest):
    # two bursts of 8 on 4 instances, 2 s apart, long requests: after the state refreshed (every 0.5 s), the second
    # burst sees the first one's requests and avoids instance 0, which the first burst filled
    requests = [ClusterRequest(0.0, 50, 2000, 2000) for _ in range(8)]
    requests += [ClusterRequest(2.0, 50, 2000, 2000) for _ in range(8)]
    config = ClusterConfig(num_instances=4, num_routers=64, staleness_s=0.5, engine=EngineConfig(max_num_seqs=32))
    cluster = cluster_sim._Cluster(config, emptiest)
    chosen = []
    for n, request in enumerate(requests):
        cluster.advance_to(request.arrival_time_s)
        r, i = cluster.route(f"r{n}", request)
        cluster.dispatch(r, i, f"r{n}", request)
        chosen.append(i)
    assert chosen[:8].count(0) >= 6
    assert chosen[8:].count(0) == 0


def test_decision_latency_adds_to_ttft():
    request = [ClusterRequest(0.0, 200, 10, 10)]
    spec = PolicySpec("lr", "least-requests")
    fast = simulate_point(spec, 1.0, request, ClusterConfig(num_instances=2))
    slow = simulate_point(spec, 1.0, request, ClusterConfig(num_instances=2, decision_latency_s=0.05))
    assert slow.ttft_mean_s == pytest.approx(fast.ttft_mean_s + 0.05, abs=1e-9)
    assert slow.e2e_mean_s == pytest.approx(fast.e2e_mean_s + 0.05, abs=1e-9)


def test_exact_decisions_give_the_numbers_they_always_gave():
    """Staleness and latency 0 (the defaults) are the simulation as it was before the decision path existed: these
    figures come from bench/cluster_sim.py at commit b409e4a (same seed, same trace), to the last bit."""
    pairs = [SharegptPair(str(i), "p", 40 + 17 * i, 20 + 13 * i) for i in range(40)]
    _, requests = build_requests(pairs, 300, random.Random(7), "poisson", 1.0, LognormalLengthError())
    expected = {1: (4040.3139193413926, 4715.2236645130715, 31.12939309232729, 2617),
                3: (4037.2390034752225, 4709.564222964165, 31.947713049373053, 2703)}
    for num_routers, (ttft_sum_s, e2e_sum_s, ttft_p99_s, num_preemptions) in expected.items():
        config = ClusterConfig(num_instances=3, num_routers=num_routers, seed=7,
                               engine=EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, num_gpu_blocks=256))
        result, latencies = simulate_point_latencies(PolicySpec("k2", "astrolabe", {"k": 2}), 60.0,
                                                     at_rate(requests, 60.0), config)
        assert (float(latencies.ttfts_s.sum()), float(latencies.e2es_s.sum()), result.ttft_p99_s,
                result.num_preemptions) == (ttft_sum_s, e2e_sum_s, ttft_p99_s, num_preemptions)


def test_request_shares():
    requests = [ClusterRequest(0.1 * n, 50, 20, 20) for n in range(40)]
    result = simulate_point(PolicySpec("rr", "round-robin"), 10.0, requests, ClusterConfig(num_instances=4))
    assert result.requests_per_instance == (10, 10, 10, 10)
    assert result.num_windows == 4 and result.window_max_over_mean == pytest.approx(1.2)  # 10 per window: 3/3/2/2


def test_stale_label_and_bad_settings():
    assert policy_spec("astrolabe-k2-stale0.1", 12).staleness_s == 0.1
    assert policy_spec("astrolabe-k2-noextra-stale0", 12).params == {"k": 2, "extra_probes": 0}
    assert policy_spec("astrolabe-k2", 12).staleness_s is None
    for bad in ({"staleness_s": -0.1}, {"decision_latency_s": float("nan")}, {"staleness_s": float("inf")}):
        with pytest.raises(ValueError, match="must be a finite number >= 0"):
            ClusterConfig(**bad)
