"""The cluster benchmark on keyed workloads: closed-loop sessions, block keys in engines, sidecar states and views,
Policy.on_finished, and the prefix-cache hit rate per point."""

import dataclasses
import random

import numpy as np
import pytest

from bench.cluster import build_sessions, main
from bench.cluster_sim import (
    ClusterConfig,
    ClusterRequest,
    ClusterSession,
    PolicySpec,
    _Cluster,
    simulate_point_latencies,
    simulate_sessions_latencies,
)
from bench.workloads import WorkloadError, pseudo_token_ids
from predictor.sim import EngineConfig
from predictor.sim.block_hash import block_keys
from tagger.sharegpt import SharegptConversation

ENGINE = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=256)


def keyed(name: str, prompt: int, output: int, arrival_s: float = 0.0, prefix: str | None = None,
          prefix_tokens: int = 0) -> ClusterRequest:
    ids = np.concatenate([pseudo_token_ids(prefix or "none", prefix_tokens),
                          pseudo_token_ids(name, prompt + output - prefix_tokens)])
    return ClusterRequest(arrival_s, prompt, output, output, block_keys=block_keys(ids.tolist(), 16))


def test_single_turn_sessions_equal_the_open_trace():
    rng = random.Random(3)
    requests = [ClusterRequest(0.02 * n + rng.random() * 0.01, rng.randint(20, 300), rng.randint(5, 200),
                               rng.randint(5, 200)) for n in range(80)]
    config = ClusterConfig(num_instances=3, engine=ENGINE, num_routers=2)
    spec = PolicySpec("k2", "astrolabe", {"k": 2})
    open_result, open_latencies = simulate_point_latencies(spec, 50.0, requests, config)
    sessions = [ClusterSession(r.arrival_time_s, (r,), ()) for r in requests]
    result, latencies = simulate_sessions_latencies(spec, 50.0, sessions, config)
    assert np.array_equal(latencies.ttfts_s, open_latencies.ttfts_s)
    assert np.array_equal(latencies.e2es_s, open_latencies.e2es_s)
    assert result.requests_per_instance == open_result.requests_per_instance


def test_next_turn_arrives_a_think_time_after_the_reply_ends_and_hits_the_cache(monkeypatch):
    first = keyed("t1", 100, 60)
    # turn 2's prompt = turn 1's prompt + reply (160 tokens = 10 full blocks) + a new 40-token message
    ids = np.concatenate([pseudo_token_ids("t1", 160), pseudo_token_ids("t2", 40 + 30)])
    second = ClusterRequest(0.0, 200, 30, 30, block_keys=block_keys(ids.tolist(), 16))
    assert second.block_keys[:10] == first.block_keys
    session = ClusterSession(0.5, (first, second), (0.7,))
    arrivals_s = []
    route = _Cluster.route
    monkeypatch.setattr(_Cluster, "route", lambda self, request_id, request: (arrivals_s.append(
        request.arrival_time_s), route(self, request_id, request))[1])
    result, latencies = simulate_sessions_latencies(PolicySpec("lr", "least-requests"), 1.0, [session],
                                                    ClusterConfig(num_instances=1, engine=ENGINE))
    assert arrivals_s == [0.5, pytest.approx(0.5 + latencies.e2es_s[0] + 0.7)]
    # the reply's last token never enters the KV cache (it is sampled, not computed), so 159 tokens were
    # computed: 9 full blocks cached, the 10th partial
    assert result.prefix_cache_queries == 300 and result.prefix_cache_hits == 144
    assert latencies.ttfts_s[1] < latencies.ttfts_s[0]  # 40 tokens to prefill instead of 100


def test_sessions_under_load_route_every_turn_in_time_order(monkeypatch):
    conversations = [SharegptConversation(f"c{n}", tuple(random.Random(n).randint(10, 200) for _ in range(8)))
                     for n in range(30)]
    sessions = build_sessions(conversations, 90, random.Random(0), "poisson", 1.0, lambda n, rng: n,
                              block_size=16, max_model_len=1500, think_time_s=0.5, min_think_time_s=0.2)
    assert sum(len(s.turns) for s in sessions) >= 90
    config = ClusterConfig(num_instances=2, engine=ENGINE)
    cluster_arrivals = []
    original = _Cluster.route

    def route(self, request_id, request):
        cluster_arrivals.append((request.arrival_time_s, min(e.now_s for e in self.engines)))
        return original(self, request_id, request)

    monkeypatch.setattr(_Cluster, "route", route)
    result, _ = simulate_sessions_latencies(PolicySpec("k2", "astrolabe", {"k": 2}), 4.0, sessions, config)
    assert result.num_completed == result.num_requests == len(cluster_arrivals)
    # the request rate counts the turns that arrived while sessions were starting
    starts_s = sorted(s.start_s for s in sessions)  # unit rate: simulate_sessions_latencies records 4.0 only
    in_window = [t for t, _ in cluster_arrivals if starts_s[0] <= t <= starts_s[-1]]
    assert result.request_rate_qps == pytest.approx((len(in_window) - 1) / (starts_s[-1] - starts_s[0]))
    times = [t for t, _ in cluster_arrivals]
    assert times == sorted(times)
    # never routed after the engines had moved past the arrival by more than one step (steps are atomic)
    assert all(engines_s <= t_s + 0.2 for t_s, engines_s in cluster_arrivals)
    assert result.prefix_cache_hits > 0


def test_build_sessions_rejects_bad_think_times():
    with pytest.raises(WorkloadError):
        build_sessions([SharegptConversation("c", (5, 5))], 1, random.Random(0), "poisson", 1.0, lambda n, r: n,
                       block_size=16, max_model_len=100, think_time_s=1.0, min_think_time_s=2.0)


def test_sidecar_states_carry_prompt_keys_and_views_count_cached_blocks():
    config = ClusterConfig(num_instances=3, engine=ENGINE)
    cluster = _Cluster(config, PolicySpec("k2", "astrolabe", {"k": 2}))
    shared = keyed("a", 160, 200, prefix="doc", prefix_tokens=128)
    cluster.dispatch(0, 1, "r0", shared)
    cluster.advance_to(0.3)
    (state,) = cluster.snapshot(1).running
    assert len(shared.block_keys) == 22 and state.block_keys == shared.block_keys[:10]
    probe = keyed("b", 160, 10, arrival_s=0.3, prefix="doc", prefix_tokens=128)
    views = cluster.views(cluster.routers[0], 0.3, probe.prompt_block_keys(16))
    assert [v.num_prefix_blocks_cached for v in views] == [0, 8, 0]  # the shared 128-token document
    assert [v.num_prefix_blocks_in_use for v in views] == [0, 8, 0]  # r0, running, holds it
    assert all(v.num_prefix_blocks_cached is None for v in cluster.views(cluster.routers[0], 0.3))
    # the prediction prices the hit: a shorter TTFT than for the same prompt without keys
    assert cluster.predict(1, "p", probe).ttft_s < cluster.predict(1, "p", dataclasses.replace(
        probe, block_keys=None)).ttft_s
    cluster.advance_to(60.0)  # r0 has finished: its blocks stay cached, free, used by no request
    assert not cluster.has_work()
    views = cluster.views(cluster.routers[0], 60.0, probe.prompt_block_keys(16))
    assert [(v.num_prefix_blocks_cached, v.num_prefix_blocks_in_use) for v in views] == [(0, 0), (8, 0), (0, 0)]
    cluster.dispatch(0, 1, "r1", keyed("c", 160, 10, arrival_s=60.0, prefix="doc", prefix_tokens=128))
    views = cluster.views(cluster.routers[0], 60.0, probe.prompt_block_keys(16))  # r1 waits: its prompt counts
    assert [(v.num_prefix_blocks_cached, v.num_prefix_blocks_in_use) for v in views] == [(0, 0), (8, 8), (0, 0)]


def test_stale_views_count_what_the_published_state_shows():
    config = ClusterConfig(num_instances=2, engine=ENGINE, staleness_s=0.05)
    cluster = _Cluster(config, PolicySpec("k2", "astrolabe", {"k": 2}))
    request = keyed("a", 100, 300)
    cluster.dispatch(0, 0, "r0", request)
    keys = request.prompt_block_keys(16)
    assert [v.num_prefix_blocks_cached for v in cluster.views(cluster.routers[0], 0.0, keys)] == [0, 0]
    cluster.advance_to(0.2)  # every instance has published since
    assert [v.num_prefix_blocks_cached for v in cluster.views(cluster.routers[0], 0.2, keys)] == [6, 0]
    assert [v.num_prefix_blocks_in_use for v in cluster.views(cluster.routers[0], 0.2, keys)] == [6, 0]
    cluster.advance_to(60.0)  # finished, and published since: cached free blocks, held by no request
    assert [(v.num_prefix_blocks_cached, v.num_prefix_blocks_in_use)
            for v in cluster.views(cluster.routers[0], 60.0, keys)] == [(6, 0), (0, 0)]


def test_the_policy_hears_of_every_request_it_routed_finishing():
    cluster = _Cluster(ClusterConfig(num_instances=3, engine=ENGINE), PolicySpec("lr", "least-requests"))
    heard = []
    cluster.routers[0].policy.on_finished = lambda request, address: heard.append((request.request_id, address))
    for n in range(6):
        request = keyed(f"q{n}", 50, 20, arrival_s=0.01 * n)
        cluster.advance_to(request.arrival_time_s)
        r, i = cluster.route(f"r{n}", request)
        assert cluster.routing_requests[f"r{n}"].block_keys == request.prompt_block_keys(16)
        cluster.dispatch(r, i, f"r{n}", request)
    cluster.drain()
    assert sorted(heard) == sorted((f"r{n}", cluster.addresses[cluster.dispatched_to[f"r{n}"]]) for n in range(6))


def test_prefix_probe_raises_the_hit_rate_on_multi_turn_sessions():
    conversations = [SharegptConversation(f"c{n}", tuple(random.Random(n).randint(30, 300) for _ in range(10)))
                     for n in range(40)]
    sessions = build_sessions(conversations, 150, random.Random(0), "poisson", 1.0, lambda n, rng: n,
                              block_size=16, max_model_len=2000, think_time_s=1.0, min_think_time_s=0.5)
    config = ClusterConfig(num_instances=8, engine=ENGINE)
    rates = {}
    for probe in (True, False):
        spec = PolicySpec("k2", "astrolabe", {"k": 2, "prefix_probe": probe})
        result, _ = simulate_sessions_latencies(spec, 2.0, sessions, config)
        rates[probe] = result.prefix_cache_hits / result.prefix_cache_queries
    assert rates[True] > rates[False] + 0.1


def test_cli_shared_prefix_reports_the_hit_rate(tmp_path, capsys):
    assert main(["--workload", "shared-prefix", "--num-requests", "120", "--rates", "20", "--seeds", "0",
                 "--policies", "least-requests,astrolabe-k2", "--num-instances", "3", "--num-gpu-blocks", "256",
                 "--context-tokens", "512", "--workers", "1", "--no-progress", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "shared-prefix: 24 tenants x 512-token shared context (working set 12288 tokens = 1.00 x" in out and "cache hit" in out
    assert (tmp_path / "cluster.csv").read_text().splitlines()[0].count("prefix_cache_hit_rate") == 1
    for name in ("cluster.csv", "p99_ttft.png"):
        (tmp_path / name).unlink()


def test_noprefix_label_turns_the_prefix_probe_off():
    from bench.cluster import policy_spec

    assert policy_spec("astrolabe-k2-noprefix", 12).params == {"k": 2, "prefix_probe": False}
    assert "prefix_probe" not in policy_spec("astrolabe-k2", 12).params


def _shares(spec: PolicySpec, requests: list[ClusterRequest], num_instances: int) -> tuple[int, ...]:
    result, _ = simulate_point_latencies(spec, 1.0, requests, ClusterConfig(num_instances=num_instances,
                                                                           engine=ENGINE))
    return result.requests_per_instance


def test_a_hot_prefix_spreads_once_its_homes_queue_outweighs_the_hit():
    """One shared document for every request (a hot prefix): at a low rate the hit keeps them on few instances;
    at a rate one instance cannot serve, the queue at the home outweighs the hit and they spread. (With the home
    probe on the least loaded holder, five of the six instances share them evenly: P99 TTFT 0.021 s, against
    0.054 s on all six with a random holder probed; the sixth's whole prefill is not worth the shorter queue.)"""
    def trace(gap_s: float) -> list[ClusterRequest]:
        return [keyed(f"q{n}", 400, 60, arrival_s=n * gap_s, prefix="hot", prefix_tokens=352) for n in range(240)]

    spec = PolicySpec("k2", "astrolabe", {"k": 2})
    quiet = _shares(spec, trace(1.0), 6)
    busy = _shares(spec, trace(0.01), 6)
    assert max(quiet) >= 0.5 * sum(quiet)  # affinity: half or more at one home
    assert max(busy) <= 0.4 * sum(busy) and sum(1 for n in busy if n) >= 4  # under load it spreads


def test_a_burst_of_identical_cold_prompts_goes_home_not_everywhere():
    """Eight identical 1,024-token prompts at once on 12 idle instances: the rendezvous home takes them (the
    router's own queued dispatches there are priced with their hits), instead of one per instance."""
    burst = [keyed("same", 1024, 20, arrival_s=0.0001 * n, prefix="doc", prefix_tokens=1024) for n in range(8)]
    with_probe = _shares(PolicySpec("k2", "astrolabe", {"k": 2}), burst, 12)
    assert sum(1 for n in with_probe if n) <= 3, with_probe
    assert sum(1 for n in _shares(PolicySpec("lr", "least-requests"), burst, 12) if n) == 8  # what scattering is


def test_a_request_with_its_own_distribution_is_priced_by_it_unless_the_policy_has_its_own_rule():
    from predictor.sim.residual import ExactLengths, FixedExtraTokens, QuantileResidual

    own = QuantileResidual((0.1, 0.5, 0.9), (800, 1000, 1200))  # the request's own: ~1,000 tokens
    request = dataclasses.replace(keyed("a", 64, 300), num_predicted_output_tokens=40, length_residual=own)
    cluster = _Cluster(ClusterConfig(num_instances=1, engine=ENGINE, residual=ExactLengths()),
                       PolicySpec("k2", "astrolabe", {"k": 2}))
    cluster.dispatch(0, 0, "r0", request)
    cluster.advance_to(0.05)
    (state,) = cluster.snapshot(0).running + cluster.snapshot(0).waiting
    assert state.num_output_tokens == own.expected_output_tokens(40, state.num_generated_tokens) > 700
    paper = _Cluster(ClusterConfig(num_instances=1, engine=ENGINE, residual=ExactLengths()),
                     PolicySpec("paper", "astrolabe", {"k": 2}, FixedExtraTokens()))
    paper.dispatch(0, 0, "r0", request)
    paper.advance_to(0.05)
    (state,) = paper.snapshot(0).running + paper.snapshot(0).waiting
    assert state.num_output_tokens == 40  # the paper's rule: the point estimate, not the request's distribution


def test_with_length_distributions_gives_later_turns_the_history_quantiles():
    from bench.cluster import _with_length_distributions
    from bench.cluster_sim import ClusterSession
    from predictor.sim.residual import FixedExtraTokens, TaggerQuantileResidual
    from tagger.quantiles import LengthQuantiles

    rng = np.random.default_rng(0)
    s = rng.uniform(3, 6, 4000)
    history = np.arange(4000) % 2 == 1
    quantiles = LengthQuantiles.fit(s, np.maximum(1, np.expm1(s + rng.normal(0, np.where(history, 1.0, 0.1)))),
                                    history)
    turns = (keyed("a", 64, 100), keyed("b", 64, 100))
    turns = tuple(dataclasses.replace(t, num_predicted_output_tokens=100) for t in turns)
    sessions = {0: [ClusterSession(0.0, turns, (1.0,))]}
    beyond = FixedExtraTokens()
    (session,) = _with_length_distributions(sessions, quantiles, beyond)[0]
    first, later = (t.length_residual for t in session.turns)
    assert isinstance(first, TaggerQuantileResidual) and isinstance(later, TaggerQuantileResidual)
    assert (first.has_history, later.has_history) == (False, True) and first.beyond is later.beyond is beyond
    # a later turn's spread is wider: more tokens expected once it has outlived its median
    assert later.expected_output_tokens(100, 160) > first.expected_output_tokens(100, 160)
    (single,) = _with_length_distributions({0: [turns[0]]}, quantiles, beyond)[0]
    assert single.length_residual.expected_output_tokens(100, 0) == first.expected_output_tokens(100, 0)
