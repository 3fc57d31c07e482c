"""Tests for prefix caching in predictor.sim.scheduler (vllm-v1 rules): hits at admission, the prompt - 1 cap,
LRU eviction of freed blocks, recomputation hits after preemption, vLLM's counters, and the block accounting."""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from predictor.sim.block_hash import block_keys
from predictor.sim.request import RequestStatus, SimRequest
from predictor.sim.scheduler import EngineConfig, ScheduledBatch, Scheduler

BS = 4


def _keyed(request_id: str, tokens: list[int], num_output_tokens: int, block_size: int = BS) -> SimRequest:
    return SimRequest(request_id, len(tokens), num_output_tokens, arrival_time_s=0.0,
                      block_keys=block_keys(tokens, block_size))


def _run_to_completion(scheduler: Scheduler) -> list[ScheduledBatch]:
    batches = []
    while scheduler.has_unfinished_requests():
        batch = scheduler.schedule()
        scheduler.prefix_cache.check_invariants()
        batches.append(batch)
        scheduler.update_after_step(batch, float(len(batches)))
    return batches


def _warmed(tokens: list[int], num_gpu_blocks: int) -> Scheduler:
    """A scheduler that has served one keyed request "a" with these tokens (1 output token): its blocks are
    cached and free."""
    scheduler = Scheduler(EngineConfig(block_size=BS, num_gpu_blocks=num_gpu_blocks))
    scheduler.add_request(_keyed("a", tokens, 1))
    _run_to_completion(scheduler)
    return scheduler


def test_a_prompt_of_exactly_two_blocks_repeated_hits_one_block_not_two():
    scheduler = Scheduler(EngineConfig(block_size=16, num_gpu_blocks=64))
    tokens = list(range(32))
    first = _keyed("a", tokens, 3, block_size=16)
    scheduler.add_request(first)
    _run_to_completion(scheduler)
    assert first.num_cached_tokens == 0
    again = _keyed("b", tokens, 3, block_size=16)
    scheduler.add_request(again)
    batch = scheduler.schedule()
    # the last prompt token is always recomputed: at best floor(31 / 16) = 1 block is a hit
    assert batch.num_scheduled_tokens == {"b": 16}
    assert again.num_cached_tokens == 16 and again.num_computed_tokens == 16
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (64, 16)


def test_a_repeated_prompt_prefills_only_the_tokens_it_does_not_hit():
    config = EngineConfig(block_size=BS, num_gpu_blocks=64)
    tokens = list(range(41))
    cold = Scheduler(config)
    cold.add_request(_keyed("a", tokens, 2))
    cold_batch = cold.schedule()
    warm = Scheduler(config)
    warm.add_request(_keyed("a", tokens, 2))
    _run_to_completion(warm)
    repeat = _keyed("b", tokens, 2)
    warm.add_request(repeat)
    warm_batch = warm.schedule()
    num_hit = 40  # 10 full blocks, all of them below the prompt's last token
    assert repeat.num_cached_tokens == num_hit
    assert warm_batch.num_prefill_tokens == cold_batch.num_prefill_tokens - num_hit == 1
    # the chunk attends to the cached context: 1 new token over 41
    assert warm_batch.prefill_attention_work == 1 * 41
    assert warm.num_blocks_held("b") == 11  # 10 hit blocks + 1 new for the last token
    assert warm.num_free_blocks == 64 - 11


def test_a_hit_touches_the_freed_blocks_and_shares_blocks_in_use():
    tokens = list(range(12))
    scheduler = _warmed(tokens, num_gpu_blocks=16)
    pool = scheduler.prefix_cache
    assert pool.num_cached_free_blocks == 3 and scheduler.num_free_blocks == 16
    scheduler.add_request(_keyed("b", tokens + [99], 5))
    scheduler.schedule()
    hit_ids = scheduler.cached_block_ids("b")
    assert len(hit_ids) == 3 and all(pool.ref_count(b) == 1 for b in hit_ids)
    assert not set(hit_ids) & set(pool.free_queue())  # touched: out of the free queue
    scheduler.add_request(_keyed("c", tokens + [7], 5))
    scheduler.schedule()
    assert scheduler.cached_block_ids("c") == hit_ids
    assert all(pool.ref_count(b) == 2 for b in hit_ids)
    # 3 shared blocks are used once: b and c hold 4 blocks each, 5 blocks are used
    assert scheduler.num_blocks_held("b") == scheduler.num_blocks_held("c") == 4
    assert scheduler.num_used_blocks == 5


def test_a_finished_requests_tail_block_is_evicted_first():
    tokens = list(range(12))
    scheduler = _warmed(tokens, num_gpu_blocks=5)
    # free queue, head first: the 2 never-used blocks, then a's blocks tail first
    pool = scheduler.prefix_cache
    assert pool.free_queue()[:2] == [None, None] and [pool.key_of(b) for b in pool.free_queue()[2:]] == list(
        reversed(block_keys(tokens, BS)))
    keyless = SimRequest("c", 12, 1, arrival_time_s=0.0)
    scheduler.add_request(keyless)
    _run_to_completion(scheduler)  # takes the 2 never-used blocks and a's LAST block
    repeat = _keyed("b", tokens + [1, 2, 3, 4], 1)
    scheduler.add_request(repeat)
    batch = scheduler.schedule()
    assert repeat.num_cached_tokens == 8  # blocks 0 and 1 survived, block 2 was evicted
    assert batch.num_scheduled_tokens == {"b": 8}
    assert scheduler.prefix_cache.num_evicted_blocks == 1


def test_a_preempted_request_hits_its_own_blocks_when_it_recomputes():
    # b (keyless) is admitted first, so the keyed a is the last running request and the preemption victim.
    scheduler = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=BS, num_gpu_blocks=8))
    scheduler.add_request(SimRequest("b", 8, 12, arrival_time_s=0.0))
    victim = _keyed("a", list(range(8)), 20)
    scheduler.add_request(victim)
    now = 0.0
    readmitted: ScheduledBatch | None = None
    num_tokens = 0
    while readmitted is None:
        batch = scheduler.schedule()
        scheduler.prefix_cache.check_invariants()
        if victim.num_preemptions and "a" in batch.num_scheduled_tokens:
            readmitted, num_tokens = batch, victim.num_tokens
        now += 1.0
        scheduler.update_after_step(batch, now)
    assert victim.num_preemptions == 1 and num_tokens > 9
    # its two prompt blocks were freed to the cache and not evicted before it came back
    assert readmitted.num_scheduled_tokens["a"] == num_tokens - 8
    assert scheduler.prefix_cache_preempted_hits == 8
    assert scheduler.prefix_cache_preempted_queries == num_tokens
    assert victim.num_cached_tokens == 0  # set at its first admission only
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (16, 0)


def test_keys_past_the_request_are_rejected_and_sglang_ignores_keys():
    scheduler = Scheduler(EngineConfig(block_size=BS))
    too_many = SimRequest("a", 8, 1, arrival_time_s=0.0, block_keys=tuple(range(3)))
    try:
        scheduler.add_request(too_many)
    except ValueError as exc:
        assert "block keys" in str(exc)
    else:
        raise AssertionError("3 keys for 9 tokens of 4-token blocks must be rejected")
    sglang = Scheduler(EngineConfig(block_size=BS, max_num_batched_tokens=64, scheduling="sglang"))
    tokens = list(range(16))
    sglang.add_request(_keyed("a", tokens, 1))
    _run_to_completion(sglang)
    sglang.add_request(_keyed("b", tokens, 1))
    assert sglang.schedule().num_scheduled_tokens == {"b": 16}
    assert sglang.prefix_cache.num_cached_blocks == 0 and sglang.prefix_cache_queries == 0


def _schedules(requests: list[SimRequest], config: EngineConfig) -> list[tuple[dict[str, int], list[str]]]:
    scheduler = Scheduler(config)
    for request in requests:
        scheduler.add_request(request)
    return [(dict(b.num_scheduled_tokens), list(b.preempted_request_ids)) for b in _run_to_completion(scheduler)]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=10), st.integers(8, 40))
def test_keys_that_never_hit_change_nothing(shapes, num_gpu_blocks):
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=BS, num_gpu_blocks=num_gpu_blocks)
    shapes = [(p, o) for p, o in shapes if (p + o + BS - 1) // BS <= num_gpu_blocks]
    plain = [SimRequest(f"r{i}", p, o, arrival_time_s=0.0) for i, (p, o) in enumerate(shapes)]
    # each request's own tokens (distinct first token): cached blocks exist but no other request hits them
    keyed = [_keyed(f"r{i}", [1000 + i] + [0] * (p - 1), o) for i, (p, o) in enumerate(shapes)]
    expected, got = _schedules(plain, config), _schedules(keyed, config)
    # up to the first preemption: after it a keyed request recomputes only what its own cached blocks miss
    preempted = [i for i, (_, ids) in enumerate(expected) if ids]
    event("preempted" if preempted else "no preemption")
    if preempted:
        expected, got = expected[:preempted[0] + 1], got[:preempted[0] + 1]
    assert got == expected


PREFIXES = [list(range(100, 124)), list(range(200, 216)), [5] * 20]


@st.composite
def mixed_workloads(draw):
    num_gpu_blocks = draw(st.integers(6, 40))
    config = EngineConfig(max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.integers(6, 48)),
                          block_size=BS, num_gpu_blocks=num_gpu_blocks,
                          long_prefill_token_threshold=draw(st.sampled_from([0, 0, 5])))
    requests = []
    for i in range(draw(st.integers(1, 14))):
        prefix = draw(st.sampled_from(PREFIXES))[:draw(st.integers(1, 24))]
        tokens = prefix + draw(st.lists(st.integers(0, 9), max_size=10))
        num_output = draw(st.integers(1, 10))
        if (len(tokens) + num_output + BS - 1) // BS > num_gpu_blocks:
            continue
        keyed = draw(st.booleans())
        output_known = draw(st.booleans())
        seq = tokens + [7] * num_output if output_known else tokens
        keys = block_keys(seq, BS) if keyed else None
        arrival = draw(st.integers(0, 12))
        requests.append((arrival, SimRequest(f"r{i}", len(tokens), num_output, arrival_time_s=float(arrival),
                                             block_keys=keys)))
    aborts = draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 13)), max_size=3))
    return config, requests, aborts


@settings(max_examples=300, deadline=None)
@given(mixed_workloads())
def test_block_accounting_holds_under_mixed_keyed_and_keyless_requests(workload):
    config, requests, aborts = workload
    scheduler = Scheduler(config)
    pool = scheduler.prefix_cache
    pending = sorted(requests, key=lambda item: item[0])
    step = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            scheduler.add_request(pending.pop(0)[1])
        for at, index in aborts:
            if at == step:
                scheduler.abort_request(f"r{index}")
        batch = scheduler.schedule()
        step += 1
        scheduler.update_after_step(batch, float(step))
        pool.check_invariants()
        holdings = {r.request_id: scheduler.num_blocks_held(r.request_id) for r in scheduler.running}
        assert pool.num_free_blocks + pool.num_used_blocks == config.num_gpu_blocks
        assert pool.num_used_blocks == sum(holdings.values()) - pool.num_extra_refs
        referenced = {b for r in scheduler.running for b in scheduler.cached_block_ids(r.request_id)}
        assert not referenced & set(pool.free_queue()), "a block is both free and referenced"
        for request in scheduler.running:
            ids = scheduler.cached_block_ids(request.request_id)
            assert [pool.key_of(b) for b in ids] == list((request.block_keys or ())[:len(ids)])
            assert len(ids) <= holdings[request.request_id]
        assert step < 2000, "no progress"
    assert pool.num_used_blocks == 0
    assert 0 <= scheduler.prefix_cache_hits <= scheduler.prefix_cache_queries
    for _, request in requests:
        if request.status == RequestStatus.FINISHED:
            assert request.num_cached_tokens is not None
            assert request.num_cached_tokens % BS == 0 and request.num_cached_tokens < request.num_prompt_tokens
