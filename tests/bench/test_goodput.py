"""Objectives and admission in the cluster simulation, and `astrolabe bench goodput`."""

import dataclasses
import random

import numpy as np
import pytest

from bench.cluster_sim import ClusterConfig, ClusterRequest, ClusterSession, PolicySpec, simulate_point_latencies, \
    simulate_sessions_latencies
from bench.goodput import main, spec_of, with_classes
from extproc.admission import AdmissionParams
from extproc.objectives import Objectives
from predictor.sim import EngineConfig

ENGINE = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=512)
CRITICAL = Objectives(1.0, None, 0)
SHEDDABLE = Objectives(5.0, None, -1)


def overload(n=400, rate_qps=60.0, seed=0):
    """Far more than 2 small instances serve: queues grow for the whole trace."""
    rng = random.Random(seed)
    requests = [ClusterRequest(i / rate_qps, rng.randint(100, 400), rng.randint(50, 300), rng.randint(50, 300))
                for i in range(n)]
    return with_classes(requests, random.Random(seed + 1), 0.4, CRITICAL, SHEDDABLE)


CONFIG = ClusterConfig(num_instances=2, engine=ENGINE, num_routers=2)


def test_labels_carry_the_admission_rule():
    assert spec_of("astrolabe-k2", 12, 0.5).admission is None
    spec = spec_of("astrolabe-k2+headroom", 12, 0.5)
    assert spec.label == "astrolabe-k2+headroom" and spec.name == "astrolabe" and spec.params["k"] == 2
    assert spec.admission == AdmissionParams("headroom") and spec.protect_ttft_s == 0.5
    assert spec_of("astrolabe-k2+headroom=0.25", 12, 0.5).protect_ttft_s == 0.25
    assert spec.pressure_window_s == 2.0 and spec_of("astrolabe-k2+headroom=0.3@0", 12, 0.5).pressure_window_s == 0
    assert spec_of("astrolabe-k2:prefer_meeting=false+slo", 12, 0.5).params["prefer_meeting"] is False
    assert not spec.engine_priority
    prio = spec_of("astrolabe-k2+slo/priority", 12, 0.5)
    assert prio.engine_priority and prio.admission == AdmissionParams("slo") and prio.label == "astrolabe-k2+slo/priority"
    assert spec_of("least-requests/priority", 12, 0.5).engine_priority
    for bad in ("astrolabe-k2+refuse", "astrolabe-k2+slo=1", "astrolabe-k2+headroom=x", "astrolabe-k2+headroom@x",
                "astrolabe-k2/lifo"):
        with pytest.raises(ValueError):
            spec_of(bad, 12, 0.5)


def test_classes_are_drawn_per_request():
    requests = with_classes([ClusterRequest(0.0, 10, 10, 10)] * 2000, random.Random(0), 0.4, CRITICAL, SHEDDABLE)
    share = sum(r.objectives is CRITICAL for r in requests) / len(requests)
    assert 0.37 < share < 0.43


def test_admission_refuses_sheddable_requests_only_and_protects_the_critical_ones():
    requests = overload()
    plain, plain_latencies = simulate_point_latencies(PolicySpec("k2", "astrolabe", {"k": 2}), 60.0, requests, CONFIG)
    spec = PolicySpec("k2+headroom", "astrolabe", {"k": 2}, admission=AdmissionParams("headroom"),
                      protect_ttft_s=0.5)
    result, latencies = simulate_point_latencies(spec, 60.0, requests, CONFIG)
    refused = np.isnan(latencies.ttfts_s)
    critical = np.array([r.objectives.priority >= 0 for r in requests])
    assert plain.num_shed == 0 and not np.isnan(plain_latencies.ttfts_s).any()
    assert result.num_shed == refused.sum() > 0 and result.num_completed == len(requests) - result.num_shed
    assert not (refused & critical).any()  # no critical request is ever refused
    assert 0 <= result.num_shed_unprobed_met <= result.num_shed
    # the critical requests' tail is what the refusals buy
    assert np.percentile(latencies.ttfts_s[critical], 99) < 0.5 * np.percentile(plain_latencies.ttfts_s[critical], 99)
    # a policy that does not predict cannot refuse
    unpredicted = dataclasses.replace(spec, name="least-requests", params={})
    assert simulate_point_latencies(unpredicted, 60.0, requests, CONFIG)[0].num_shed == 0


def test_engine_priority_serves_the_critical_requests_first():
    """vLLM's --scheduling-policy priority in the simulated engines: with no admission at all, the critical
    requests' tail falls far below FCFS's, the sheddable ones wait longer, and nothing is refused."""
    requests = overload()
    critical = np.array([r.objectives.priority >= 0 for r in requests])
    fcfs = PolicySpec("k2", "astrolabe", {"k": 2})
    _, plain = simulate_point_latencies(fcfs, 60.0, requests, CONFIG)
    result, prio = simulate_point_latencies(dataclasses.replace(fcfs, engine_priority=True), 60.0, requests, CONFIG)
    assert result.num_shed == 0 and result.num_completed == len(requests)
    assert np.percentile(prio.ttfts_s[critical], 99) < 0.5 * np.percentile(plain.ttfts_s[critical], 99)
    assert np.mean(prio.ttfts_s[~critical]) > np.mean(plain.ttfts_s[~critical])


def test_a_refused_turn_is_followed_by_the_next_one_a_think_time_later():
    requests = overload(n=120)
    sessions = [ClusterSession(r.arrival_time_s, (r, dataclasses.replace(r, objectives=SHEDDABLE)), (0.5,))
                for r in requests]
    spec = PolicySpec("k2+headroom", "astrolabe", {"k": 2}, admission=AdmissionParams("headroom"),
                      protect_ttft_s=0.2)
    result, latencies = simulate_sessions_latencies(spec, 60.0, sessions, CONFIG)
    assert result.num_requests == 240 and result.num_shed > 0
    assert result.num_completed + result.num_shed == 240 and len(latencies.ttfts_s) == 240


def test_goodput_bench_prints_goodput_attainment_and_ratios(tmp_path, capsys):
    code = main(["--num-requests", "150", "--seeds", "0", "--multiples", "1,2", "--capacity", "40",
                 "--num-instances", "2", "--num-routers", "1", "--workers", "1", "--no-progress",
                 "--policies", "least-requests,astrolabe-k2+slo,astrolabe-k2+headroom", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "goodput req/s" in out and "critical P99 TTFT s" in out
    assert "goodput / astrolabe-k2+slo's" in out and "own goodput at 1x" in out
    lines = (tmp_path / "goodput.csv").read_text().splitlines()
    assert lines[0].startswith("policy,multiple,rate_qps,goodput_qps") and len(lines) == 1 + 3 * 2
    assert main(["--multiples", "0", "--no-progress"]) == 2
    assert main(["--policies", "astrolabe-k2+nope", "--no-progress"]) == 2


def test_a_tpot_objective_is_checked_with_the_estimate_capped_by_max_tokens():
    """As extproc.router: a reply estimated at 128 tokens under max_tokens 2 is priced at 2 tokens, so its TPOT is
    the decode time over 1 token, not over 127: an objective of a tenth of that is refused, three times it is met
    (on busy instances: an idle one admits a sheddable request whatever its prediction)."""
    from bench.cluster_sim import _Cluster

    spec = PolicySpec("k2+slo", "astrolabe", {"k": 2}, admission=AdmissionParams("slo"))
    cluster = _Cluster(CONFIG, spec)
    for n in range(8):
        cluster.dispatch(*cluster.route(f"load{n}", ClusterRequest(0.0, 200, 200, 200)), f"load{n}",
                         ClusterRequest(0.0, 200, 200, 200))
    capped = ClusterRequest(0.0, 200, 2, 128, max_tokens=2)
    decode_s = min(p.e2e_s - p.ttft_s for p in (cluster.predict(i, "probe", capped) for i in range(2)))
    assert decode_s > 0
    assert cluster.route("out", dataclasses.replace(capped, objectives=Objectives(None, decode_s / 10, -1))) is None
    assert cluster.shed == {"out": "slo_unreachable"}
    assert cluster.route("met", dataclasses.replace(capped, objectives=Objectives(None, decode_s * 3, -1)))


def test_the_policy_hears_only_of_the_requests_it_chose():
    """A request the policy did not place (it returned None: least-requests placed it) is not reported to its
    ``on_finished``, as extproc.router.Router.release; the ones it chose are."""
    from bench.cluster_sim import _Cluster

    cluster = _Cluster(CONFIG, PolicySpec("llm-d", "llm-d-precise", {}))
    finished = []
    for router in cluster.routers:
        choose = router.policy.choose
        router.policy.choose = lambda request, views, choose=choose: \
            None if request.request_id.startswith("fallback") else choose(request, views)
        router.policy.on_finished = lambda request, address: finished.append(request.request_id)
    for n, name in enumerate(("fallback-0", "chosen-0", "fallback-1", "chosen-1")):
        request = ClusterRequest(n * 0.01, 100, 5, 5)
        cluster.advance_to(request.arrival_time_s)
        cluster.dispatch(*cluster.route(name, request), name, request)
    cluster.drain()
    assert cluster.num_fallbacks == 2 and sorted(finished) == ["chosen-0", "chosen-1"]
