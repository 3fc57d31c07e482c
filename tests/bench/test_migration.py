"""Llumnix's live migration in the cluster simulation (bench/migration.py) and the engine hooks it uses."""

import csv
import dataclasses
import math
import random

import numpy as np
import pytest

from bench.cluster import at_rate, build_requests, main, policy_spec
from bench.cluster_report import SweepVerdict, pool_points, stops_paying, sweep_verdicts
from bench.cluster_sim import (
    ClusterConfig,
    ClusterRequest,
    LognormalLengthError,
    PointLatencies,
    PointResult,
    PolicySpec,
    SeedPoint,
    _Cluster,
    simulate_point_latencies,
)
from bench.migration import (
    LLAMA_2_7B_KV_BYTES_PER_TOKEN,
    MigrationController,
    MigrationParams,
    kv_bytes_per_token,
    migration_load,
    num_killed_requests,
    pair_instances,
    pick_request,
    stage_transfer_s,
)
from bench.stats import Interval
from predictor.sim import (
    Engine,
    EngineConfig,
    RequestStatus,
    SimRequest,
    blocks_for_tokens,
)
from tagger.sharegpt import SharegptPair


class ConstantStepTime:
    def __init__(self, step_s: float = 0.01) -> None:
        self.step_s = step_s

    def step_time_s(self, batch) -> float:
        return self.step_s if batch.num_scheduled_tokens else 0.0


SMALL = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=64)


def engines(n: int = 2, config: EngineConfig = SMALL) -> list[Engine]:
    return [Engine(config, ConstantStepTime()) for _ in range(n)]


def check_invariants(fleet: list[Engine], stalled: set[str] = frozenset()) -> None:
    """Blocks add up at every engine, and every unfinished request lives in exactly one place."""
    seen: list[str] = []
    for engine in fleet:
        s = engine.scheduler
        held = sum(s.num_blocks_held(r.request_id) for r in s.running)
        assert s.num_free_blocks + s.num_used_blocks == s.config.num_gpu_blocks
        assert s.num_used_blocks == held + engine.num_reserved_blocks
        assert all(r.status == RequestStatus.RUNNING for r in s.running)
        assert len(s.running) <= s.config.max_num_seqs
        seen += [r.request_id for r in (*s.running, *s.waiting)]
    assert len(seen) == len(set(seen)) and not stalled & set(seen)


def drive(controller: MigrationController, fleet: list[Engine], until_s: float = math.inf, on_event=None) -> None:
    """Advance the fleet event by event as bench.cluster_sim does, checking invariants after each event."""
    while controller.num_in_flight or any(e.has_work() for e in fleet):
        t = controller.next_event_s()
        if t > until_s:
            break
        for engine in fleet:
            engine.advance_to(t)
        controller.handle(t)
        check_invariants(fleet)
        if on_event is not None:
            on_event(t)


def overload(engine: Engine) -> list[SimRequest]:
    """4 decoding requests holding 52 of 64 blocks (15 each at most: no preemption) and a waiting head of 38 blocks
    that cannot start: migration load -(12 - 38) / 5 = 5.2 blocks per request, above Llumnix's threshold of 3."""
    requests = [SimRequest(f"r{n}", 200, 40, 0.0) for n in range(4)]
    for r in requests:
        engine.add_request(r)
    engine.advance_to(0.05)  # prefills done (4 steps of 256 tokens), decoding
    assert all(r.num_generated_tokens >= 1 for r in requests)
    head = SimRequest("head", 600, 20, engine.now_s)
    engine.add_request(head)
    return requests + [head]


# ---- cost model ----------------------------------------------------------------------------------------------
def test_llama_2_7b_block_is_8_mib():
    assert LLAMA_2_7B_KV_BYTES_PER_TOKEN == kv_bytes_per_token(32, 32, 128, 2) == 512 * 1024
    assert LLAMA_2_7B_KV_BYTES_PER_TOKEN * 16 == 8 * 2**20


@pytest.mark.parametrize(
    "num_blocks, bandwidth, overhead_s, expected_s",
    [(0, 1.0, 0.005, 0.005), (10, 1.0, 0.0, 10 * 8 * 2**20 / 1e9), (10, 25.0, 0.005, 0.005 + 10 * 8 * 2**20 / 25e9),
     (1, 400.0, 0.0, 8 * 2**20 / 400e9)],
    ids=["overhead-only", "1GBps", "25GBps-with-overhead", "one-block-nvlink"],
)
def test_stage_transfer_time(num_blocks, bandwidth, overhead_s, expected_s):
    params = MigrationParams(bandwidth_gbytes_per_s=bandwidth, stage_overhead_s=overhead_s)
    assert stage_transfer_s(num_blocks, 16, params) == pytest.approx(expected_s, rel=1e-12)


def test_transfer_time_rejects_disabled_and_bad_arguments():
    with pytest.raises(ValueError, match="disabled"):
        stage_transfer_s(1, 16, MigrationParams(bandwidth_gbytes_per_s=0))
    with pytest.raises(ValueError):
        stage_transfer_s(-1, 16, MigrationParams())
    with pytest.raises(ValueError, match="request_policy"):
        MigrationParams(request_policy="FCW")
    with pytest.raises(ValueError, match="bandwidth"):
        MigrationParams(bandwidth_gbytes_per_s=-1)


# ---- Llumnix's rules -------------------------------------------------------------------------------------------
def test_migration_load_is_minus_freeness_with_the_head_of_line_demand():
    (engine,) = engines(1)
    assert migration_load(engine.scheduler) == -math.inf
    overload(engine)
    s = engine.scheduler
    head_blocks = blocks_for_tokens(600, 16)
    assert migration_load(s) == pytest.approx(-(s.num_free_blocks - head_blocks) / (len(s.running) + 1))
    assert migration_load(s, watermark_blocks=2) == pytest.approx(-(s.num_free_blocks - 2 - head_blocks) / 5)
    assert migration_load(s) > 3.0 and num_killed_requests(s) == 0


@pytest.mark.parametrize(
    "loads, killed, expected",
    [((1.0, 9.0, -math.inf, 5.0), (0, 0, 0, 0), [(1, 2), (3, 0)]),
     ((1.0, 9.0, -2.0, 5.0), (0, 0, 0, 0), [(1, 2), (3, 0)]),
     ((9.0, 8.0, 7.0), (0, 0, 0), []),
     ((-5.0, -4.0, -3.0), (0, 0, 0), []),
     ((-5.0, 0.0, 9.0), (0, 1, 0), [(2, 0)]),
     ((3.0, -1.0), (0, 0), [])],
    ids=["most-with-least", "two-pairs", "all-overloaded", "all-free", "killed-is-a-source-not-a-destination",
         "at-threshold-is-neither"],
)
def test_pairing_matches_most_loaded_with_least_loaded(loads, killed, expected):
    assert pair_instances(loads, killed, 3.0) == expected


def test_pairing_with_killed_requests_orders_sources_by_load():
    # instance 1 has preempted requests waiting: a source even though its load is low; 2 is the most loaded
    assert pair_instances((-5.0, 0.0, 9.0, -6.0), (0, 1, 0, 0), 3.0) == [(2, 3), (1, 0)]


@pytest.mark.parametrize("policy, expected", [("LCR", "c"), ("SR", "b"), ("LR", "a")])
def test_request_policy_picks_among_decoding_requests(policy, expected):
    (engine,) = engines(1, EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, num_gpu_blocks=256))
    for rid, prompt in (("a", 300), ("b", 100), ("c", 200)):
        engine.add_request(SimRequest(rid, prompt, 50, 0.0))
    engine.advance_to(0.05)
    engine.add_request(SimRequest("prefilling", 400, 5, engine.now_s))
    engine.step()  # "prefilling" gets a 253-token chunk of 400: still in its prefill, never picked
    assert engine.scheduler.running[-1].request_id == "prefilling"
    assert pick_request(engine.scheduler, policy).request_id == expected


def test_no_request_to_pick_while_everything_prefills():
    (engine,) = engines(1)
    engine.add_request(SimRequest("p", 600, 5, 0.0))
    engine.step()
    assert pick_request(engine.scheduler, "LCR") is None


# ---- engine hooks ------------------------------------------------------------------------------------------------
def test_stall_holds_steps_back_and_factor_slows_them():
    a, b = engines(2)
    for engine in (a, b):
        engine.add_request(SimRequest("x", 16, 10, 0.0))
    a.stall_until(0.05)
    b.step_time_factor = 1.5
    first_a, first_b = a.step(), b.step()
    assert first_a.start_s == pytest.approx(0.05) and first_a.duration_s == pytest.approx(0.01)
    assert first_b.start_s == 0.0 and first_b.duration_s == pytest.approx(0.015)
    assert a.stalled_s == pytest.approx(0.05) and b.extra_step_time_s == pytest.approx(0.005)


def test_reservations_count_as_used_and_starve_then_release():
    (engine,) = engines(1)
    assert engine.reserve_blocks("m", 60) and not engine.reserve_blocks("m", 5)
    assert engine.scheduler.num_free_blocks == 4 and engine.num_reserved_blocks == 60
    engine.add_request(SimRequest("big", 200, 5, 0.0))  # needs 13 blocks for its prefill
    assert engine.advance_to(1.0) == [] and engine.has_work()  # starved, not an error
    assert engine.release_reserved_blocks("m") == 60 and engine.release_reserved_blocks("m") == 0
    engine.run_until_idle()
    assert not engine.has_work() and engine.scheduler.num_free_blocks == 64


# ---- the controller on a hand-built fleet ------------------------------------------------------------------------
def test_a_migration_moves_the_request_with_its_progress_and_stalls_both_ends():
    fleet = engines(2)
    requests = overload(fleet[0])
    params = MigrationParams(bandwidth_gbytes_per_s=1.0, copy_interference_frac=0.25)
    moved = []
    controller = MigrationController(params, fleet, lambda rid, src, dst: moved.append((rid, src, dst)))
    factors, progress = [], {}

    def watch(t):
        if controller.num_in_flight:
            factors.append(tuple(e.step_time_factor for e in fleet))
        victim = requests[3]
        running = {r.request_id for e in fleet for r in e.scheduler.running}
        if victim.status != RequestStatus.FINISHED and victim.request_id not in running:
            progress.setdefault("stalled", victim.num_generated_tokens)
            assert victim.num_generated_tokens == progress["stalled"]  # no progress in the last stage

    drive(controller, fleet, on_event=watch)
    stats = controller.stats
    assert stats.num_started >= 1 and stats.num_completed >= 1
    assert moved[0] == ("r3", 0, 1)  # LCR: the last running request, to the empty instance
    assert (1.25, 1.25) in factors  # the copy slowed BOTH engines
    assert all(e.step_time_factor == 1.0 for e in fleet)  # and stopped slowing them
    assert all(e.extra_step_time_s > 0 for e in fleet)
    r3 = requests[3]
    assert r3.status == RequestStatus.FINISHED and r3.num_generated_tokens == r3.num_output_tokens
    assert r3.first_token_time_s < 0.05 < r3.finish_time_s  # its first token came from the source
    for engine in fleet:
        assert engine.scheduler.num_free_blocks == SMALL.num_gpu_blocks and engine.num_reserved_blocks == 0
    assert all(r.status == RequestStatus.FINISHED for r in requests)
    counts = stats.per_request["r3"]
    assert counts[0] == counts[1] + counts[2] and stats.num_blocks_copied >= 13
    assert "stalled" in progress and stats.stall_s > 0


def test_a_blocking_copy_stalls_both_engines():
    fleet = engines(2)
    overload(fleet[0])
    controller = MigrationController(MigrationParams(bandwidth_gbytes_per_s=1.0, blocking_copy=True), fleet)
    stalls = []
    drive(controller, fleet, on_event=lambda t: stalls.append(tuple(e.stalled_until_s for e in fleet)))
    assert controller.stats.num_completed >= 1
    assert any(a > 0 and a == b for a, b in stalls)  # both held back until the same stage end
    assert fleet[0].stalled_s > 0 and all(e.step_time_factor == 1.0 for e in fleet)


def test_migration_aborts_when_the_destination_has_no_room():
    fleet = engines(2)
    # the destination's one request holds 54 blocks: 10 free at most, fewer than the 13 that the first stage
    # copies; its load -10 / 1 makes it a destination all the same
    resident = SimRequest("resident", 850, 150, 0.0)
    fleet[1].add_request(resident)
    requests = overload(fleet[0]) + [resident]
    fleet[1].advance_to(0.05)
    controller = MigrationController(MigrationParams(), fleet)
    drive(controller, fleet, until_s=0.3)
    stats = controller.stats
    assert stats.num_started >= 1 and stats.num_aborted_dst == stats.num_started and stats.num_completed == 0
    drive(controller, fleet)
    assert all(r.status == RequestStatus.FINISHED for r in requests)
    for engine in fleet:
        assert engine.num_reserved_blocks == 0 and engine.scheduler.num_free_blocks == SMALL.num_gpu_blocks


def test_disabled_params_are_refused_by_the_controller():
    with pytest.raises(ValueError):
        MigrationController(MigrationParams(bandwidth_gbytes_per_s=0), engines(2))


# ---- in the cluster simulation ------------------------------------------------------------------------------------
def trace(num_requests: int = 300, rate_qps: float = 16.0, seed: int = 1) -> list[ClusterRequest]:
    pairs = [SharegptPair(str(i), "p", 40 + 37 * i % 700, 20 + 53 * i % 600) for i in range(60)]
    _, requests = build_requests(pairs, num_requests, random.Random(seed), "poisson", 1.0, LognormalLengthError())
    return at_rate(requests, rate_qps)


FLEET = ClusterConfig(num_instances=3, num_routers=2,
                      engine=EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, num_gpu_blocks=400))


def run(spec: PolicySpec, requests, config: ClusterConfig = FLEET) -> tuple[_Cluster, object, object]:
    """simulate_point_latencies by hand, keeping the cluster to inspect."""
    cluster = _Cluster(config, spec)
    for n, request in enumerate(requests):
        cluster.advance_to(request.arrival_time_s)
        cluster.dispatch(*cluster.route(f"r{n}", request), f"r{n}", request)
    cluster.drain()
    return cluster, *simulate_point_latencies(spec, 0.0, requests, config)


def test_conservation_under_migration():
    requests = trace()
    cluster, result, latencies = run(PolicySpec("m", "llumnix", migration=MigrationParams(bandwidth_gbytes_per_s=5)),
                                     requests)
    stats = cluster.migration.stats
    assert stats.num_completed >= 5 and stats.num_aborted >= 1  # the fleet is loaded enough to exercise both
    ids = [r.request_id for r in cluster.finished]
    assert sorted(ids) == sorted(f"r{n}" for n in range(len(requests)))  # each exactly once
    for r in cluster.finished:
        n = int(r.request_id[1:])
        assert r.num_generated_tokens == r.num_output_tokens == requests[n].num_output_tokens
        assert r.arrival_time_s <= r.first_token_time_s <= r.finish_time_s
    migrated = {rid for rid, (s, c, a) in stats.per_request.items() if c}
    assert migrated and all(s == c + a for s, c, a in stats.per_request.values())
    assert sum(c for _, c, _ in stats.per_request.values()) == stats.num_completed
    for engine in cluster.engines:
        assert engine.num_reserved_blocks == 0 and engine.scheduler.num_free_blocks == FLEET.engine.num_gpu_blocks
    assert all(sum(router.in_flight) == 0 for router in cluster.routers)
    assert not any(cluster.predicted)
    assert result.num_completed == len(requests) and result.num_migrations_completed == stats.num_completed
    assert result.num_migrations_started == stats.num_started and result.engine_time_lost_s > 0
    assert len(latencies.ttfts_s) == len(requests)


def comparable(result) -> dict:
    return {k: v for k, v in dataclasses.asdict(result).items() if k not in ("wall_s", "policy")}


@pytest.mark.parametrize(
    "migration",
    [None, MigrationParams(bandwidth_gbytes_per_s=0), MigrationParams(migrate_out_threshold=-math.inf)],
    ids=["no-params", "zero-bandwidth", "controller-on-no-destination-ever"],
)
def test_without_migrations_the_point_equals_plain_llumnix_exactly(migration):
    requests = trace()
    _, plain, plain_lat = run(PolicySpec("llumnix", "llumnix"), requests)
    _, other, other_lat = run(PolicySpec("x", "llumnix", migration=migration), requests)
    assert plain.num_preemptions > 0  # loaded: the comparison means something
    assert comparable(other) == comparable(plain)
    assert np.array_equal(other_lat.ttfts_s, plain_lat.ttfts_s) and np.array_equal(other_lat.e2es_s, plain_lat.e2es_s)


def test_migration_changes_a_loaded_point():
    requests = trace()
    _, plain, _ = run(PolicySpec("llumnix", "llumnix"), requests)
    _, migrating, _ = run(PolicySpec("m", "llumnix", migration=MigrationParams()), requests)
    assert migrating.num_migrations_completed > 0 and comparable(migrating) != comparable(plain)


def test_migrate_labels():
    spec = policy_spec("llumnix-migrate", 12)
    assert (spec.name, spec.migration) == ("llumnix", MigrationParams())
    spec = policy_spec("llumnix-migrate-bw2.5", 12, migration=MigrationParams(stage_overhead_s=0.0))
    assert spec.migration == MigrationParams(bandwidth_gbytes_per_s=2.5, stage_overhead_s=0.0)
    assert policy_spec("llumnix", 12).migration is None
    with pytest.raises(ValueError, match="unknown policy"):
        policy_spec("llumnix-migrate-fast", 12)


def seed_point(policy: str, rate: float, ttfts: np.ndarray) -> SeedPoint:
    result = PointResult(policy, rate, len(ttfts), len(ttfts), float(ttfts.mean()), float(np.percentile(ttfts, 99)),
                         1.0, 2.0, 0.01, 0, 0.0, 0, 0.0)
    return SeedPoint(0, result, PointLatencies(ttfts, ttfts + 1.0))


def test_a_better_tail_does_not_pay_when_capacity_is_lower():
    rng = np.random.default_rng(3)
    base = rng.exponential(0.2, 600)  # P99 ~0.9 s
    ref = {10.0: base, 20.0: base, 30.0: base * 1.5, 40.0: base * 5}  # capacity 30 (SLO 2 s), crossing in (30, 40)
    # misses the SLO at 20 (capacity 10), same requests reshuffled at 30, half the tail at 40
    slow = {10.0: base, 20.0: base * 4, 30.0: rng.permutation(base * 1.5), 40.0: base * 2.5}
    points = [seed_point("llumnix", r, v) for r, v in ref.items()] + [seed_point("m", r, v) for r, v in slow.items()]
    (v,) = sweep_verdicts(points, pool_points(points), {"m": 1.0}, "llumnix", 2.0)
    assert [rate for rate, _ in v.p99_ratios] == [30.0, 40.0]
    assert v.p99_ratios[1][1].high < 1  # the tail is better at 40 ...
    assert not v.capacity_not_worse and not v.pays  # ... but capacity is lower: no pay
    fast = {**slow, 20.0: base}
    points = [p for p in points if p.result.policy == "llumnix"] + [seed_point("m", r, v) for r, v in fast.items()]
    (v,) = sweep_verdicts(points, pool_points(points), {"m": 1.0}, "llumnix", 2.0)
    assert v.capacity_not_worse and v.pays


def verdict_at(bandwidth: float, pays: bool) -> SweepVerdict:
    return SweepVerdict(f"bw{bandwidth:g}", bandwidth, ((1.0, Interval(1.0, 0.9, 1.1)),), None, None, pays, pays)


@pytest.mark.parametrize(
    "paying, expected",
    [((False, True, True), "stops paying below 5 GB/s"), ((True, True, True), "pays at every swept"),
     ((False, False, False), "never pays"), ((True, False, True), "not monotone")],
    ids=["threshold", "always", "never", "not-monotone"],
)
def test_stops_paying_sentence(paying, expected):
    assert expected in stops_paying([verdict_at(b, p) for b, p in zip((1.0, 5.0, 25.0), paying)])


def test_tiny_sweep_end_to_end(tmp_path, capsys):
    out = tmp_path / "cluster"
    assert main(["--num-instances", "3", "--num-requests", "300", "--rates", "12,16", "--policies", "llumnix",
                 "--migration-bandwidths", "1,100", "--num-gpu-blocks", "400", "--max-num-seqs", "16",
                 "--out", str(out), "--workers", "1", "--no-progress", "--seeds", "1", "--num-routers", "2"]) == 0
    printed = capsys.readouterr().out
    assert "migration (llumnix-migrate): 12.5 GB/s" in printed and "migration bandwidth sweep" in printed
    assert "llumnix-migrate / llumnix P99 TTFT" in printed and "migr/req" in printed
    assert any(s in printed for s in ("stops paying", "pays at every", "never pays", "not monotone"))
    with (out / "cluster.csv").open() as fp:
        rows = list(csv.DictReader(fp))
    policies = {r["policy"] for r in rows}
    assert policies == {"llumnix", "astrolabe-k2", "llumnix-migrate-bw1", "llumnix-migrate-bw100"}
    for row in rows:
        assert row["num_completed"] == row["num_requests"] == "300"
        migrated = int(row["num_migrations_completed"])
        assert row["policy"].startswith("llumnix-migrate") or migrated == 0
        assert float(row["migrations_per_request"]) == pytest.approx(migrated / 300)
        assert row["migration_bandwidth_gbytes_per_s"] == "12.5"
    assert all(int(r["num_migrations_completed"]) > 0 for r in rows if r["policy"].startswith("llumnix-migrate"))
