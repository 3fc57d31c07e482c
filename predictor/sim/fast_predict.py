"""Event-driven simulation of one instance's scheduler, for fast predictions (`predictor.sim.predict.predict`).

Owns `simulate_until_finished`, a specialised re-implementation of `Scheduler.schedule()` /
`Scheduler.update_after_step()` that does O(1) or O(log n) work per event (a completion, an admission, a prefill
chunk, a preemption) instead of O(running requests) per engine step. Pure and synchronous: imports only the
standard library and `predictor.sim`.

VERIFIED against the scheduler: this module duplicates the rules of `predictor.sim.scheduler.Scheduler` on
purpose (STYLE.md 3.5 forbids duplicated scheduler logic; the exception is made because the scheduler costs
~80 us per step at 48 running requests, 40x the predictor's latency budget). The guard that the two never
diverge is the Hypothesis test `tests/predictor/sim/test_predict.py::
test_predict_equals_stepping_and_leaves_state_unchanged` (>= 1000 random states and configurations, every
divergence found pinned as an `@example`): `predict` (this module) must give the same TTFT, E2E, step count
and preemption count as `predict_by_stepping` (the real `Scheduler`, one step at a time). Any change to
`Scheduler.schedule()` must be mirrored here and pass that test.

NOTE: how the state is kept. Running requests are `_Rec` objects in a list in schedule order (= admission order;
`seq` grows with each admission, so seq order is schedule order). A request whose KV covers all but its newest
token is a DECODE (it computes exactly one token whenever it is scheduled); all others are PREFILLs (a first
prefill or a recomputation after preemption), kept also in `prefills`, in schedule order. `step` counts the
steps in which every decode was scheduled. A decode stores its counters at an anchor step `anchor`; at step
index G it has computed `computed + (G - anchor)` tokens. Its KV needs one more block exactly at the steps
`boundary, boundary + block_size, ...` (`boundary` = the first step whose token does not fit its blocks), so
a decode whose next boundary lies within `block_size` steps ("regular") is counted in `phase_counts[boundary %
block_size]` and the blocks all decodes need over the next k steps are `num_regular * (k // block_size)` plus
a slice sum of phase_counts. Finish steps sit in a heap (stale entries are skipped by `heap_id`). A decode
that is not scheduled in a step (the token budget ran out before it) is re-anchored one step later. That only
happens from snapshots the scheduler would not produce itself (e.g. a live state with prefills ahead of
decodes): from a scheduler-made state each request's next want is at most its current chunk, except the
last scheduled one's, so the budget is only ever cut at the last scheduled request.

A step where only decodes run and no waiting request can be admitted is followed by identical such steps until
the next completion or the first step whose block demand exceeds the free blocks (see `predictor.sim.predict`
for why admission cannot become possible in between); such a run is applied at once and priced in closed form.
Every other step is simulated exactly, walking only prefills, block requesters and preemption victims.

NOTE: prefix caching (requests with `RequestState.block_keys`) is modelled for keys of PROMPT blocks: from the first
keyed request on, a `predictor.sim.prefix_cache.PrefixCachePool` (the scheduler's own pool class) mirrors every
block change in the order `Scheduler` makes it (running reservations, then admissions with their hits; preemptions
at once; a step's finishes in schedule order; the snapshot's cached free blocks,
`InstanceSnapshot.cached_block_keys`, named after the running requests' blocks, behind the anonymous free blocks
(vLLM's free-queue order: anonymous free blocks first, cached ones in LRU order, see `predictor.sim.prefix_cache`), as
`InstanceSnapshot.to_scheduler` does: with no keyed request they are plain free blocks and no pool is made),
`num_free_blocks` follows its count after releases (blocks shared with running requests stay used), and a keyed
queue head is admitted by an exact step (its hits depend on what the decodes' blocks evict first). Keys of prompt
blocks are all cached by the end of a prefill, so a decode never names a block. Keys past the prompt's full blocks
(output blocks a driver knows) raise `PrefixCacheNotModelled` when the request is reached, and
`predictor.sim.predict.predict` then steps the `Scheduler` instead. Requests without keys cost what they did (one
`pool is None` test per event).

NOTE: vLLM's "priority" scheduling policy (`EngineConfig.scheduling_policy`): the waiting queue is kept in
(priority, arrival) order (the snapshot's waiting requests stably sorted, the new request and every preemption
victim inserted behind its equals), as `Scheduler` does. A preemption's victim is the running request with the
largest (priority, arrival), wherever it runs (`_FastScheduler.reserve_by_priority`): one scheduled earlier in the
step frees the blocks it took in it; a requester that is its own victim leaves the requests after it unscheduled
for the step, as `Scheduler._schedule_running` stops there. Two cases raise `PriorityPreemptionNotModelled` and
`predictor.sim.predict.predict` steps the `Scheduler` instead: a victim other than the last running request in a
step whose token budget binds (the tokens it gives back would change later requests' chunks), and a step that
preemptions left empty (`Scheduler.schedule`'s extra round). In `astrolabe bench goodput` at 2x capacity with
priority engines that is 1.8% of the predictions (it was 39% when every victim but the last fell back).

NOTE: identities only where a lookup can see them (the cost of keyed predictions). A block's identity matters only
to a lookup of its key; all lookups are by the simulated requests' own keys (admissions, re-admissions after
preemption). So the pool names a block only if its key is in two or more requests' keys (counted once per
prediction, `key_counts`): a chain's leading blocks up to its last such key (`num_shared`). Its other full blocks
are private: held as anonymous blocks (in the same places of the table, so counts are unchanged), freed when it
finishes into the cached section of the free queue WITHOUT identity (they carry a key, so vLLM appends them to the
LRU tail; no one will look them up: `PrefixCachePool.release` ``num_unnamed``), and named when it is preempted,
just before its blocks are freed (it looks them up again when re-admitted; no other request names those keys, so
the pool's state is the one naming them as they filled would give). Likewise a snapshot's cached free block whose
key no request has stays in its LRU place without identity (`PrefixCachePool.restore_cached_free` ``needed``).

NOTE: the module is also compiled as is with mypyc where the build can (see `predictor.sim.predict`): keep every
attribute typed (the `_Rec` annotations, `isinstance` rather than `__class__` checks) so mypy accepts it and the
compiled classes get native fields; the .py stays the reference and both must give identical results.

The module is longer than STYLE.md's ~400 lines: it is one state class whose methods share hot attributes;
splitting it would add indirections to the hot loop and scatter the rules mirrored from `Scheduler`.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter, deque
from itertools import chain
from dataclasses import dataclass
from typing import Protocol

from predictor.sim.prefix_cache import PrefixCachePool
from predictor.sim.scheduler import EngineConfig, check_request_fits
from predictor.sim.snapshot import NUM_EXTRA_OUTPUT_TOKENS_WHEN_OVERDUE, InstanceSnapshot, RequestState

logger = logging.getLogger(__name__)

_NO_SEQ = 1 << 62
"""A seq larger than any real one: "nobody is cut off"."""
_INF = float("inf")
_NONE: list = []
"""Shared empty list (no starved decodes); never mutated."""


class NotModelled(Exception):
    """A state this module does not model reached it (caller: step the `Scheduler` instead)."""


class PrefixCacheNotModelled(NotModelled):
    """A request whose block keys reach past its prompt's full blocks reached this module, which models only
    prompt keys."""


class PriorityPreemptionNotModelled(NotModelled):
    """Under the "priority" scheduling policy, a preemption this walk does not follow: a victim (the largest
    (priority, arrival)) other than the last running request in a step whose token budget binds, or a step the
    preemptions emptied."""


def _prompt_block_keys(state: RequestState, block_size: int) -> tuple[int, ...] | None:
    """The request's block keys (None if it has none); `PrefixCacheNotModelled` if they name output blocks."""
    keys = state.block_keys
    if not keys:
        return None
    if len(keys) > state.num_prompt_tokens // block_size:
        raise PrefixCacheNotModelled(f"request {state.request_id!r} has block keys past its prompt")
    return keys


class CountsBatchTimeModel(Protocol):
    """A batch-time model that prices a step from its counts (as `LinearBatchTimeModel` does)."""

    def step_time_from_counts_s(
        self, num_tokens: int, prefill_attention_work: int, decode_context_tokens: int, num_seqs: int
    ) -> float:
        """Time of one step with these `ScheduledBatch` totals, seconds."""
        ...

    def decode_run_time_from_counts_s(self, num_decode_seqs: int, decode_context_tokens: int, num_steps: int) -> float:
        """Time of num_steps pure-decode steps, the first with this decode context, seconds."""
        ...


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """What `simulate_until_finished` measured (see `predictor.sim.predict.Prediction` for the meanings)."""

    ttft_s: float
    e2e_s: float
    num_steps: int
    num_steps_simulated: int
    num_preemptions: int


class _Rec:
    """One unfinished request. In DECODE mode computed/generated/held are the values at step `anchor`."""

    __slots__ = (
        "seq", "num_prompt_tokens", "num_output_tokens", "num_computed_tokens", "num_generated_tokens",
        "num_blocks_held", "is_decode", "anchor", "boundary", "phase", "finish_step", "heap_id", "chunk",
        "is_target", "keys", "block_ids", "num_shared", "num_full", "priority", "arrival_time_s",
    )
    seq: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_generated_tokens: int
    num_blocks_held: int
    is_decode: bool
    anchor: int
    boundary: int
    phase: int
    finish_step: int
    heap_id: int
    chunk: int
    is_target: bool
    keys: tuple[int, ...] | None
    block_ids: list[int] | None
    num_shared: int
    num_full: int
    priority: int
    arrival_time_s: float

    def __init__(self, num_prompt_tokens: int, num_output_tokens: int, num_generated_tokens: int) -> None:
        # seq is set on admission; anchor, boundary, phase (-1: irregular, else boundary % block_size) and
        # finish_step by enter_decode; only what a waiting or prefilling request reads is set here.
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = num_output_tokens
        self.num_computed_tokens = 0
        self.num_generated_tokens = num_generated_tokens
        self.num_blocks_held = 0
        self.is_decode = False
        self.phase = -1
        self.heap_id = -1
        self.chunk = 0
        self.is_target = False
        self.keys = None
        self.block_ids = None
        self.num_shared = 0
        self.num_full = 0
        self.priority = 0
        self.arrival_time_s = 0.0


def _waiting_rec(config: EngineConfig, state: RequestState) -> _Rec:
    """A waiting snapshot request as a `_Rec`, validated as `Scheduler.add_request` would.

    Raises:
        ValueError: If it has computed tokens, a bad length, or could never fit (see `_check_fits`).
        PrefixCacheNotModelled: If its block keys reach past its prompt.
    """
    keys = _prompt_block_keys(state, config.block_size)
    if state.num_computed_tokens:
        raise ValueError(
            f"request {state.request_id!r} must be WAITING or PREEMPTED with no computed tokens, got "
            f"{state.num_computed_tokens}"
        )
    num_prompt_tokens = state.num_prompt_tokens
    num_generated_tokens = state.num_generated_tokens
    if num_prompt_tokens < 1 or num_generated_tokens < 0:
        raise ValueError(f"request {state.request_id!r}: invalid token counts")
    num_output_tokens = state.num_output_tokens
    if num_generated_tokens >= num_output_tokens:  # the overdue rule of RequestState.num_remaining_output_tokens
        num_output_tokens = num_generated_tokens + NUM_EXTRA_OUTPUT_TOKENS_WHEN_OVERDUE
    num_max_tokens = num_prompt_tokens + num_output_tokens
    if -(-num_max_tokens // config.block_size) > config.num_gpu_blocks or (
        num_max_tokens > config.max_num_batched_tokens + 1 and not config.enable_chunked_prefill
    ):
        check_request_fits(config, state.request_id, num_prompt_tokens, num_output_tokens)  # raises, with details
    rec = _Rec(num_prompt_tokens, num_output_tokens, num_generated_tokens)
    rec.keys = keys
    rec.priority = state.priority
    rec.arrival_time_s = state.arrival_time_s
    return rec


def _priority_key(rec: _Rec | RequestState) -> tuple[int, float]:
    return (rec.priority, rec.arrival_time_s)


def _seq_of(rec: _Rec) -> int:
    return rec.seq


class _FastScheduler:
    """The scheduler state of one prediction; see the module docstring. Not reusable."""

    def __init__(self, config: EngineConfig, batch_time: CountsBatchTimeModel) -> None:
        self.config = config
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.threshold = config.long_prefill_token_threshold
        self.chunked = config.enable_chunked_prefill
        self.by_priority = config.scheduling_policy == "priority"
        self.step_time = batch_time.step_time_from_counts_s
        self.run_time = batch_time.decode_run_time_from_counts_s
        # If more context never makes a step faster, a decode run's last step is its slowest and its first
        # its fastest, so checking the first step's time is enough (else the last one is checked too).
        self.check_last_run_step = self.step_time(1, 0, 2, 1) < self.step_time(1, 0, 1, 1)
        self.running: list[_Rec] = []
        self.prefills: list[_Rec] = []
        self.waiting: deque[_Rec | RequestState] = deque()
        self.num_free_blocks = config.num_gpu_blocks
        # Prefix caching: the pool is made when the first request with block keys appears (until then every
        # block is anonymous and num_free_blocks is the whole state); then it mirrors every block change.
        self.pool: PrefixCachePool | None = None
        # Occurrences of each block key among all requests' keys (made with the pool): a block whose key only one
        # request has is private (`cache_full_blocks`).
        self.key_counts: dict[int, int] = {}
        self.snapshot: InstanceSnapshot | None = None
        self.target_state: RequestState | None = None
        self.releases: list[_Rec] = []
        self.step = 0
        self.next_seq = 0
        self.next_heap_id = 0
        # Aggregates over decodes.
        self.num_decodes = 0
        self.sum_computed_minus_anchor = 0
        self.num_regular = 0
        self.phase_counts = [0] * config.block_size
        self.irregular: list[_Rec] = []
        self.finish_heap: list[tuple[int, int, _Rec]] = []
        # Results.
        self.elapsed_s = 0.0
        self.num_steps = 0
        self.num_steps_simulated = 0
        self.num_preemptions = 0
        self.ttft_s: float | None = None
        self.e2e_s: float | None = None

    # ---- decode bookkeeping ------------------------------------------------------------------------------
    def enter_decode(self, rec: _Rec) -> None:
        """Make a running rec (counters valid now, at `self.step`) a decode anchored at `self.step`."""
        step = self.step
        block_size = self.block_size
        rec.is_decode = True
        rec.anchor = step
        self.num_decodes += 1
        self.sum_computed_minus_anchor += rec.num_computed_tokens - step
        boundary = rec.num_blocks_held * block_size - rec.num_computed_tokens + step + 1
        rec.boundary = boundary
        if boundary <= step + block_size:
            phase = boundary % block_size
            rec.phase = phase
            self.phase_counts[phase] += 1
            self.num_regular += 1
        else:
            rec.phase = -1
            self.irregular.append(rec)
        rec.finish_step = step + rec.num_output_tokens - rec.num_generated_tokens
        heap_id = self.next_heap_id
        self.next_heap_id = heap_id + 1
        rec.heap_id = heap_id
        heapq.heappush(self.finish_heap, (rec.finish_step, heap_id, rec))

    def leave_decode(self, rec: _Rec) -> None:
        """Turn a decode back into explicit counters valid at `self.step` and drop it from the aggregates."""
        step = self.step
        num_steps = step - rec.anchor
        self.num_decodes -= 1
        self.sum_computed_minus_anchor -= rec.num_computed_tokens - rec.anchor
        if rec.boundary <= step:
            rec.num_blocks_held += (step - rec.boundary) // self.block_size + 1
        rec.num_computed_tokens += num_steps
        rec.num_generated_tokens += num_steps
        phase = rec.phase
        if phase >= 0:
            self.phase_counts[phase] -= 1
            self.num_regular -= 1
        else:
            self.irregular.remove(rec)
        rec.is_decode = False
        rec.phase = -1
        rec.heap_id = -1

    def promote_irregular(self) -> None:
        """Count decodes whose next block boundary is now within block_size steps in phase_counts."""
        limit = self.step + self.block_size
        for rec in [r for r in self.irregular if r.boundary <= limit]:
            self.irregular.remove(rec)
            phase = rec.boundary % self.block_size
            rec.phase = phase
            self.phase_counts[phase] += 1
            self.num_regular += 1

    def block_demand(self, num_steps: int) -> int:
        """New blocks all decodes reserve over the next num_steps steps (all scheduled)."""
        block_size = self.block_size
        num_cycles, num_rest = divmod(num_steps, block_size)
        total = self.num_regular * num_cycles
        if num_rest:
            start = (self.step + 1) % block_size
            end = start + num_rest
            counts = self.phase_counts
            if end <= block_size:
                total += sum(counts[start:end])
            else:
                total += sum(counts[start:]) + sum(counts[: end - block_size])
        if self.irregular:
            last = self.step + num_steps
            for rec in self.irregular:
                if rec.boundary <= last:
                    total += (last - rec.boundary) // block_size + 1
        return total

    def max_run_steps(self, num_limit: int) -> int:
        """Largest k <= num_limit whose decode block demand fits in the free blocks (0 if none); called when
        the demand of num_limit steps does not fit."""
        num_free = self.num_free_blocks
        if self.irregular or not self.num_regular:
            low, high = 0, num_limit  # demand(low) fits, demand(high) does not
            while high - low > 1:
                mid = (low + high) // 2
                if self.block_demand(mid) <= num_free:
                    low = mid
                else:
                    high = mid
            return low
        # Whole cycles of block_size steps each take num_regular blocks; then walk one partial cycle.
        block_size = self.block_size
        num_cycles = num_free // self.num_regular
        num_left = num_free - num_cycles * self.num_regular
        num_steps = num_cycles * block_size
        counts = self.phase_counts
        phase = (self.step + 1) % block_size
        while counts[phase] <= num_left:
            num_left -= counts[phase]
            num_steps += 1
            phase = (phase + 1) % block_size
        return min(num_steps, num_limit)

    # ---- queue changes -------------------------------------------------------------------------------------
    def head(self) -> _Rec:
        """The first waiting request, converted (and validated) on first look."""
        head = self.waiting[0]
        if not isinstance(head, _Rec):
            head = self.convert(head)
            self.waiting[0] = head
        return head

    def convert(self, state: RequestState) -> _Rec:
        """A waiting snapshot request as a `_Rec` (`_waiting_rec`), making the pool if it has block keys."""
        rec = _waiting_rec(self.config, state)
        keys = rec.keys
        if keys is not None:
            self.ensure_pool()
            rec.num_shared = self.num_shared_blocks(keys)
        return rec

    # ---- prefix caching (mirrors Scheduler: `_take_blocks`, `_cache_full_blocks`, `_free_blocks`) --------------
    def ensure_pool(self) -> PrefixCachePool:
        """The pool, made on first call with the blocks in use so far, and the key counts (`key_counts`)."""
        pool = self.pool
        if pool is None:
            pool = PrefixCachePool(self.config.num_gpu_blocks)
            pool.allocate(self.config.num_gpu_blocks - self.num_free_blocks)
            self.pool = pool
            snapshot = self.snapshot
            target = self.target_state
            assert snapshot is not None and target is not None
            states = (*snapshot.running, *snapshot.waiting, target)
            # Counter's C loop: ~1.5x a compiled dict loop (~0.15 ms for 4,000 keys).
            self.key_counts = Counter(chain.from_iterable(s.block_keys for s in states if s.block_keys))
        return pool

    def num_shared_blocks(self, keys: tuple[int, ...]) -> int:
        """Leading blocks of a chain that are named as they fill: up to its last key that another request (or
        another block of its own) has. Its blocks after those are private: no other request looks them up."""
        counts = self.key_counts
        index = len(keys)
        while index and counts[keys[index - 1]] < 2:
            index -= 1
        return index

    def cache_full_blocks(self, rec: _Rec, num_tokens: int) -> None:
        """Name the keyed blocks that `num_tokens` tokens of `rec` fill (`Scheduler._cache_full_blocks`); private
        ones (past `num_shared`) only count in `num_full` and are named if it is preempted (`release`)."""
        keys = rec.keys
        pool = self.pool
        assert keys is not None and pool is not None
        block_ids = rec.block_ids
        if block_ids is None:
            block_ids = rec.block_ids = []
        num_full = min(num_tokens // self.block_size, len(keys))
        if num_full > rec.num_full:
            rec.num_full = num_full
            num_named = len(block_ids)
            num_eager = min(num_full, rec.num_shared)
            if num_eager > num_named:
                block_ids.extend(pool.cache_blocks(keys[num_named:num_eager]))

    def release(self, rec: _Rec, pool: PrefixCachePool, preempted: bool) -> None:
        """Free a rec's blocks as `Scheduler._free_blocks` does. Its private full blocks (`cache_full_blocks`) have
        no identity: no other request looks them up, so when it finishes they go to the cached section of the free
        queue without one (`PrefixCachePool.release` ``num_unnamed``: evicted in their LRU place, never hit); when
        it is preempted it will look them up itself, so they are named first (in their place: the free queue's
        order and each key's list of blocks are those of naming them when they filled, since no other request
        names these keys)."""
        block_ids = rec.block_ids
        if block_ids is None:
            pool.free(rec.num_blocks_held)  # no keys: every block is anonymous
        else:
            num_full = rec.num_full
            if preempted and num_full > len(block_ids):
                keys = rec.keys
                assert keys is not None
                block_ids.extend(pool.cache_blocks(keys[len(block_ids):num_full]))
            pool.release(block_ids, rec.num_blocks_held - num_full, num_full - len(block_ids))
        rec.block_ids = None
        rec.num_full = 0

    def flush_releases(self) -> None:
        """Free the blocks of the requests that finished in this step, in schedule (seq) order as
        `Scheduler.update_after_step` does."""
        pool = self.pool
        releases = self.releases
        if pool is None or not releases:
            return
        releases.sort(key=_seq_of)
        for rec in releases:
            self.release(rec, pool, False)
        releases.clear()
        self.num_free_blocks = pool.num_free_blocks  # blocks shared with running requests stay used

    def enqueue_by_priority(self, rec: _Rec | RequestState) -> None:
        """Insert into the waiting queue behind every request of smaller or equal (priority, arrival), as
        `Scheduler._enqueue_by_priority` does."""
        waiting = self.waiting
        key = _priority_key(rec)
        index = len(waiting)
        while index and _priority_key(waiting[index - 1]) > key:
            index -= 1
        waiting.insert(index, rec)

    def preempt_last(self) -> _Rec:
        """FCFS: pop the last running request, free its blocks, put it at the front of the waiting queue."""
        return self.preempt_at(len(self.running) - 1, False)

    def priority_victim_index(self) -> int:
        """Index in `running` of the "priority" policy's victim: the largest (priority, arrival), of equal keys
        the last (`Scheduler._schedule_running`)."""
        running = self.running
        best = len(running) - 1
        best_key = _priority_key(running[best])
        for index in range(best - 1, -1, -1):
            key = _priority_key(running[index])
            if key > best_key:
                best, best_key = index, key
        return best

    def preempt_at(self, index: int, reserved_now: bool) -> _Rec:
        """Take running request ``index`` out, free its blocks (``reserved_now``: a decode that already reserved
        this step's block, which its counters do not show yet, frees it too), put it back in the waiting queue:
        at the front (FCFS) or at its (priority, arrival) place."""
        victim = self.running.pop(index)
        if victim.is_decode:
            self.leave_decode(victim)
            if reserved_now:
                victim.num_blocks_held += 1
        else:
            self.prefills.remove(victim)
        if self.pool is not None:
            self.release(victim, self.pool, True)  # blocks it shares with running requests stay used
            self.num_free_blocks = self.pool.num_free_blocks
        else:
            self.num_free_blocks += victim.num_blocks_held
        victim.num_blocks_held = 0
        victim.num_computed_tokens = 0
        victim.chunk = 0
        if self.by_priority:
            self.enqueue_by_priority(victim)
        else:
            self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim

    def finish(self, rec: _Rec) -> None:
        """Remove a running request that sampled its last token (counters explicit, not a decode);
        inlined in `finish_decodes`."""
        self.running.remove(rec)
        if self.pool is not None:
            self.releases.append(rec)  # freed by flush_releases
        else:
            self.num_free_blocks += rec.num_blocks_held
        if rec.is_target:
            self.e2e_s = self.elapsed_s

    # ---- pure-decode runs ----------------------------------------------------------------------------------
    def decode_admit_step(self) -> bool:
        """If no prefill is running and the next step admits the first waiting request, simulate that step
        (decodes plus admissions) and return True; else change nothing and return False.

        The common event of a busy instance: a completion freed a slot and the queue head takes it.
        """
        waiting = self.waiting
        if not waiting or len(self.running) >= self.max_num_seqs:
            return False
        num_decodes = self.num_decodes
        budget = self.max_num_batched_tokens - num_decodes  # > 0: decodes < max_num_seqs <= the budget
        head = waiting[0]
        if not isinstance(head, _Rec):
            head = self.convert(head)
            waiting[0] = head
        if head.keys is not None:
            # Its hits depend on what the decodes' blocks evict first: the exact step does it in that order.
            self.step_exact()
            return True
        num_new_tokens = head.num_prompt_tokens + head.num_generated_tokens
        threshold = self.threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        if num_new_tokens > budget:
            if not self.chunked:
                return False
            num_new_tokens = budget
        step = self.step
        # Decodes reserve first; irregular decodes never need a block within block_size steps.
        num_free = self.num_free_blocks - self.phase_counts[(step + 1) % self.block_size]
        num_new_blocks = -(-num_new_tokens // self.block_size)
        if num_new_blocks > num_free:
            return False
        # Admit the head (as `admit` would), then any more that fit.
        self.num_free_blocks = num_free - num_new_blocks
        if self.pool is not None:
            self.pool.allocate(self.phase_counts[(step + 1) % self.block_size] + num_new_blocks)
        waiting.popleft()
        head.seq = self.next_seq
        self.next_seq += 1
        head.num_blocks_held = num_new_blocks
        head.chunk = num_new_tokens
        self.running.append(head)
        self.prefills.append(head)
        num_tokens = num_new_tokens
        attention_work = num_new_tokens * num_new_tokens
        budget -= num_new_tokens
        context = self.sum_computed_minus_anchor + num_decodes * (step + 1)
        if budget > 0 and waiting and len(self.running) < self.max_num_seqs:
            num_more_tokens, more_work, more_context = self.admit(budget)
            num_tokens += num_more_tokens
            attention_work += more_work
            context += more_context
        num_seqs = num_decodes + len(self.prefills)
        duration_s = self.step_time(num_decodes + num_tokens, attention_work, context, num_seqs)
        if not (duration_s > 0 and duration_s != _INF):
            raise ValueError(f"batch-time model returned {duration_s!r} s for a batch of {num_seqs} seqs")
        self.elapsed_s += duration_s
        self.num_steps += 1
        self.num_steps_simulated += 1
        self.apply_step(_NONE)
        return True

    def run_decodes(self) -> bool:
        """Apply the pure-decode steps from now up to the next completion (included), or up to the step
        before the first one whose blocks are not free; False (nothing applied) if that is the next step.

        Precondition: only decodes run and `decode_admit_step()` declined; then admission stays impossible
        until a completion (budget, sequence cap and queue head are fixed, free blocks only shrink).
        """
        heap = self.finish_heap
        while heap[0][2].heap_id != heap[0][1]:
            heapq.heappop(heap)  # stale: its rec left decode mode or was re-anchored
        step = self.step
        num_limit = heap[0][0] - step
        demand = self.block_demand(num_limit)
        num_steps = num_limit
        if demand > self.num_free_blocks:
            num_steps = self.max_run_steps(num_limit)
            if num_steps == 0:
                return False
            demand = self.block_demand(num_steps)
        num_decodes = self.num_decodes
        context = self.sum_computed_minus_anchor + num_decodes * (step + 1)
        duration_s = self.run_time(num_decodes, context, num_steps)
        if self.check_last_run_step:
            last_s = self.step_time(num_decodes, 0, context + num_decodes * (num_steps - 1), num_decodes)
        else:
            last_s = duration_s
        if not (duration_s > 0 and last_s > 0 and duration_s != _INF):
            raise ValueError(f"batch-time model returned {duration_s!r} s for a decode run of {num_decodes} seqs")
        self.num_free_blocks -= demand
        if self.pool is not None:
            self.pool.allocate(demand)
        self.step = step + num_steps
        self.num_steps += num_steps
        self.num_steps_simulated += 1
        self.elapsed_s += duration_s
        if num_steps == num_limit:
            self.finish_decodes()
        return True

    def finish_decodes(self) -> None:
        """Finish every decode whose last token was sampled in step `self.step`."""
        heap = self.finish_heap
        step = self.step
        while heap and heap[0][0] <= step:
            _, heap_id, rec = heapq.heappop(heap)
            if rec.heap_id != heap_id:
                continue  # stale: the rec left decode mode or was re-anchored
            assert rec.finish_step == step
            self.leave_decode(rec)
            self.running.remove(rec)
            if self.pool is not None:
                self.releases.append(rec)  # freed by flush_releases
            else:
                self.num_free_blocks += rec.num_blocks_held
            if rec.is_target:
                self.e2e_s = self.elapsed_s
        self.flush_releases()

    # ---- one exact step ------------------------------------------------------------------------------------
    def cut_budget(self, budget: int) -> int:
        """Token budget walk when running requests want more than `budget`; sets each prefill's chunk.

        Returns:
            Index into `running` of the first request that gets no token this step.
        """
        running = self.running
        num_used = 0
        prev = -1
        stop = -1
        for rec in self.prefills:
            if stop >= 0:
                rec.chunk = 0
                continue
            pos = running.index(rec)
            num_decodes_between = pos - prev - 1
            if num_used + num_decodes_between >= budget:
                stop = prev + 1 + budget - num_used
                rec.chunk = 0
                continue
            num_used += num_decodes_between
            rec.chunk = min(rec.chunk, budget - num_used)
            num_used += rec.chunk
            prev = pos
            if num_used == budget:
                stop = pos + 1
        if stop < 0:
            # Every prefill got all it wanted, so the overflow is among the decodes after the last one.
            stop = prev + 1 + budget - num_used
        return stop

    def prefill_new_blocks(self, rec: _Rec) -> int:
        return -(-(rec.num_computed_tokens + rec.chunk) // self.block_size) - rec.num_blocks_held

    def reserve_running(self, stop: int, budget_bound: bool) -> tuple[bool, int]:
        """Reserve KV blocks for the scheduled running requests (those before index `stop`), preempting the
        last running request (FCFS; "priority": `reserve_by_priority`) while short, as
        `Scheduler._schedule_running` does. ``budget_bound``: the token budget cut this step's chunks.

        Returns:
            (True if anything was preempted, the index in `running` of the first request not scheduled now).
        """
        running = self.running
        block_size = self.block_size
        phase = (self.step + 1) % block_size
        if stop >= len(running):
            num_needed = self.phase_counts[phase]
        else:
            num_needed = sum(1 for r in running[:stop] if r.phase == phase)  # phase is -1 unless a decode
        prefill_needs = []
        for rec in self.prefills:
            chunk = rec.chunk
            if chunk:
                num_new = -(-(rec.num_computed_tokens + chunk) // block_size) - rec.num_blocks_held
                if num_new > 0:
                    num_needed += num_new
                    prefill_needs.append((rec, num_new))
        if num_needed <= self.num_free_blocks:
            self.num_free_blocks -= num_needed
            for rec, num_new in prefill_needs:
                rec.num_blocks_held += num_new
            if self.pool is not None:
                self.pool.allocate(num_needed)
                self.cache_prefill_blocks()
            return False, stop
        requesters = [r for r in running[:stop] if r.phase == phase]
        if prefill_needs:
            requesters.extend(rec for rec, _ in prefill_needs)
            requesters.sort(key=_seq_of)
        if self.by_priority:
            return self.reserve_by_priority(requesters, stop, budget_bound)
        # Short of blocks: replay the reservations in schedule order. Block requesters: decodes at a block
        # boundary now (phase match; prefills and irregular decodes have phase -1), prefills needing blocks.
        cutoff_seq = _NO_SEQ
        for rec in requesters:
            if rec.seq >= cutoff_seq:
                break  # it and everyone after it were preempted
            num_new = 1 if rec.is_decode else self.prefill_new_blocks(rec)
            while num_new > self.num_free_blocks:
                victim = self.preempt_last()
                cutoff_seq = victim.seq
                if victim is rec:
                    if self.pool is not None:
                        self.cache_prefill_blocks()
                    return True, stop
            self.num_free_blocks -= num_new
            if self.pool is not None:
                self.pool.allocate(num_new)
            if not rec.is_decode:
                rec.num_blocks_held += num_new
        if self.pool is not None:
            self.cache_prefill_blocks()
        return cutoff_seq != _NO_SEQ, stop

    def reserve_by_priority(self, requesters: list[_Rec], stop: int, budget_bound: bool) -> tuple[bool, int]:
        """`reserve_running`'s replay under the "priority" policy, short of blocks: each requester in schedule order
        reserves its blocks; while short, the running request with the largest (priority, arrival) is preempted
        (`priority_victim_index`), wherever it runs. One scheduled before the requester already took this step's
        blocks: they are freed with it (its tokens go back to the budget, which changes nothing unless the budget
        bound this step: `PriorityPreemptionNotModelled` then, and for any victim not last). A requester that
        is its own victim ends the running requests' turn (`Scheduler._schedule_running` stops there): those
        after it are not scheduled this step (the returned index, and their prefill chunks are cleared).
        """
        running = self.running
        gone: set[int] = set()  # seqs of the requests preempted this step
        reserved: set[int] = set()  # seqs of the requesters that took their blocks this step
        preempted = False
        for rec in requesters:
            if rec.seq in gone:
                continue
            num_new = 1 if rec.is_decode else self.prefill_new_blocks(rec)
            while num_new > self.num_free_blocks:
                index = self.priority_victim_index()
                victim = running[index]
                if budget_bound and index != len(running) - 1:
                    raise PriorityPreemptionNotModelled("a priority preemption in a step whose token budget binds")
                self.preempt_at(index, victim.seq in reserved and victim.is_decode)
                gone.add(victim.seq)
                preempted = True
                if victim is rec:
                    # Requests after it in `running` are not scheduled this step: the first of them is at `index`.
                    after = running[index:]
                    for other in after:
                        other.chunk = 0
                    if self.pool is not None:
                        self.cache_prefill_blocks()
                    return True, index if after else len(running)
            self.num_free_blocks -= num_new
            if self.pool is not None:
                self.pool.allocate(num_new)
            if not rec.is_decode:
                rec.num_blocks_held += num_new
            reserved.add(rec.seq)
        if self.pool is not None:
            self.cache_prefill_blocks()
        return preempted, min(stop, len(running))

    def cache_prefill_blocks(self) -> None:
        """Cache the keyed blocks the scheduled prefill chunks fill (preempted ones have no chunk), schedule order:
        a prefill before every preemption victim, so naming its blocks after the preemptions changes nothing."""
        for rec in self.prefills:
            if rec.chunk and rec.keys is not None:
                self.cache_full_blocks(rec, rec.num_computed_tokens + rec.chunk)

    def admit(self, num_budget_tokens: int) -> tuple[int, int, int]:
        """Admit waiting requests FCFS as `Scheduler._schedule_waiting` does.

        Returns:
            (tokens scheduled, prefill attention work, decode context) of the admitted requests: a recomputation
            whose prefix-cache hit leaves one token past its prompt counts as a decode (`Scheduler._add_to_batch`).
        """
        block_size = self.block_size
        threshold = self.threshold
        waiting = self.waiting
        running = self.running
        num_tokens = 0
        attention_work = 0
        context = 0
        while waiting and num_budget_tokens > 0 and len(running) < self.max_num_seqs:
            head = self.head()
            num_new_tokens = head.num_prompt_tokens + head.num_generated_tokens
            keys = head.keys
            pool = self.pool
            hits = _NONE
            if keys is not None:
                assert pool is not None
                hits = pool.lookup(keys, (num_new_tokens - 1) // block_size)  # the last token is recomputed
            num_hit_tokens = len(hits) * block_size
            num_new_tokens -= num_hit_tokens
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if not self.chunked and num_new_tokens > num_budget_tokens:
                break
            num_new_tokens = min(num_new_tokens, num_budget_tokens)
            num_blocks = -(-(num_hit_tokens + num_new_tokens) // block_size)
            if keys is None:
                if num_blocks > self.num_free_blocks:
                    break  # strict FCFS
                self.num_free_blocks -= num_blocks
                if pool is not None:
                    pool.allocate(num_blocks)
            else:
                assert pool is not None
                num_taken = num_blocks - len(hits) + pool.num_free_among(hits)
                if num_taken > self.num_free_blocks:
                    break  # strict FCFS
                self.num_free_blocks -= num_taken
                pool.touch(hits)
                pool.allocate(num_blocks - len(hits))
                head.block_ids = hits
                head.num_full = len(hits)
                head.num_computed_tokens = num_hit_tokens
                self.cache_full_blocks(head, num_hit_tokens + num_new_tokens)
            waiting.popleft()
            head.seq = self.next_seq
            self.next_seq += 1
            head.num_blocks_held = num_blocks
            head.chunk = num_new_tokens
            running.append(head)
            self.prefills.append(head)
            num_tokens += num_new_tokens
            if num_new_tokens == 1 and num_hit_tokens >= head.num_prompt_tokens:
                context += num_hit_tokens + 1
            else:
                attention_work += num_new_tokens * (num_hit_tokens + num_new_tokens)
            num_budget_tokens -= num_new_tokens
        return num_tokens, attention_work, context

    def step_exact(self) -> None:
        """Simulate one engine step exactly (`Scheduler.schedule` then `update_after_step`)."""
        budget = self.max_num_batched_tokens
        threshold = self.threshold
        total = self.num_decodes
        for rec in self.prefills:
            num_new_tokens = rec.num_prompt_tokens + rec.num_generated_tokens - rec.num_computed_tokens
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            rec.chunk = num_new_tokens
            total += num_new_tokens
        stop = len(self.running)
        budget_bound = total > budget
        if budget_bound:
            last = self.prefills[-1]
            if last is self.running[-1] and total - last.chunk < budget:
                last.chunk -= total - budget  # only the last running request is cut: nobody is starved
            else:
                stop = self.cut_budget(budget)
        preempted, stop = self.reserve_running(stop, budget_bound)
        # Batch totals (ScheduledBatch fields) of the running part.
        step = self.step
        running = self.running
        num_decodes = self.num_decodes
        context = self.sum_computed_minus_anchor + num_decodes * step
        starved = _NONE
        if stop < len(running):
            starved = [r for r in running[stop:] if r.is_decode]
            for rec in starved:
                num_decodes -= 1
                context -= rec.num_computed_tokens + step - rec.anchor
        context += num_decodes
        num_tokens = num_seqs = num_decodes
        attention_work = 0
        for rec in self.prefills:
            chunk = rec.chunk
            if chunk:
                num_seqs += 1
                num_tokens += chunk
                num_computed = rec.num_computed_tokens
                if chunk == 1 and num_computed >= rec.num_prompt_tokens:
                    context += num_computed + 1  # counts as a decode, as in Scheduler._add_to_batch
                else:
                    attention_work += chunk * (num_computed + chunk)
        if not preempted and self.waiting and len(running) < self.max_num_seqs and num_tokens < budget:
            num_admitted_seqs = len(self.prefills)
            num_admitted_tokens, admitted_work, admitted_context = self.admit(budget - num_tokens)
            num_seqs += len(self.prefills) - num_admitted_seqs
            num_tokens += num_admitted_tokens
            attention_work += admitted_work
            context += admitted_context
        if not num_seqs and self.by_priority:
            raise PriorityPreemptionNotModelled("a priority preemption emptied the step (Scheduler.schedule rounds)")
        assert num_seqs, "scheduler made no progress with unfinished requests"
        duration_s = self.step_time(num_tokens, attention_work, context, num_seqs)
        if not (duration_s > 0 and duration_s != _INF):
            raise ValueError(f"batch-time model returned {duration_s!r} s for a batch of {num_seqs} seqs")
        self.elapsed_s += duration_s
        self.num_steps += 1
        self.num_steps_simulated += 1
        self.apply_step(starved)

    def apply_step(self, starved: list[_Rec]) -> None:
        """Advance counters after an exact step (`Scheduler.update_after_step`); starved decodes stay put."""
        for rec in starved:
            self.leave_decode(rec)
        self.step += 1
        for rec in starved:
            self.enter_decode(rec)
        still_prefilling: list[_Rec] = []
        for rec in self.prefills:
            chunk = rec.chunk
            if not chunk:
                still_prefilling.append(rec)
                continue
            rec.chunk = 0
            rec.num_computed_tokens += chunk
            num_tokens = rec.num_prompt_tokens + rec.num_generated_tokens
            if rec.num_computed_tokens == num_tokens:
                rec.num_generated_tokens += 1
                if rec.is_target and rec.num_generated_tokens == 1:
                    self.ttft_s = self.elapsed_s
                if rec.num_generated_tokens >= rec.num_output_tokens:
                    self.finish(rec)
                else:
                    self.enter_decode(rec)
            elif rec.num_computed_tokens == num_tokens - 1 and rec.num_generated_tokens:
                self.enter_decode(rec)  # a recomputation with one token left is a decode from now on
            else:
                still_prefilling.append(rec)
        self.prefills = still_prefilling
        heap = self.finish_heap
        if heap and heap[0][0] <= self.step:
            self.finish_decodes()
        self.flush_releases()

    # ---- setup ---------------------------------------------------------------------------------------------
    def load(self, snapshot: InstanceSnapshot, request: RequestState) -> None:
        """Take the snapshot's queues and append the new request (validated as `to_scheduler` would).

        Raises:
            ValueError: For the snapshot errors `InstanceSnapshot.to_scheduler` reports and the request errors
                `Scheduler.add_request` reports; waiting requests are checked when they reach the queue head
                (all of them do before the new request is admitted).
        """
        config = self.config
        ids = {s.request_id for s in snapshot.running}
        ids.update(s.request_id for s in snapshot.waiting)
        ids.add(request.request_id)
        if len(ids) != len(snapshot.running) + len(snapshot.waiting) + 1:
            raise ValueError("duplicate request_id in the snapshot or the new request")
        if len(snapshot.running) > config.max_num_seqs:
            raise ValueError(f"running list is full (max_num_seqs={config.max_num_seqs})")
        self.snapshot = snapshot
        self.target_state = request
        for state in snapshot.running:
            self.restore_running(state)
        cached = snapshot.cached_block_keys
        if cached:
            if len(cached) > self.num_free_blocks:
                raise ValueError(f"{len(cached)} cached free blocks to restore, {self.num_free_blocks} blocks free")
            # Only a request with keys can hit them; without one they are free blocks like the others.
            if self.pool is not None or request.block_keys or any(s.block_keys for s in snapshot.waiting):
                pool = self.ensure_pool()
                pool.restore_cached_free(cached, self.key_counts)  # keys no request has: no identity
        target = self.convert(request)
        target.is_target = True
        if self.by_priority:
            # Scheduler.add_request inserts each by key: a stable sort; the new request arrives now.
            self.waiting.extend(sorted(snapshot.waiting, key=_priority_key))
            target.arrival_time_s = snapshot.new_arrival_time_s()
            self.enqueue_by_priority(target)
        else:
            self.waiting.extend(snapshot.waiting)
            self.waiting.append(target)

    def restore_running(self, state: RequestState) -> None:
        """Append one running snapshot request (checks of `Scheduler.restore_running`, which it mirrors: its full
        computed blocks already cached by a request restored before it are shared; `PrefixCacheNotModelled` if its
        block keys reach past its prompt)."""
        keys = _prompt_block_keys(state, self.block_size)
        block_size = self.block_size
        num_computed = state.num_computed_tokens
        num_generated = state.num_generated_tokens
        num_tokens = state.num_prompt_tokens + num_generated
        if state.num_prompt_tokens < 1 or num_generated < 0 or not 0 <= num_computed < num_tokens:
            raise ValueError(
                f"request {state.request_id!r} must be RUNNING with computed < total tokens, got "
                f"{num_computed}/{num_tokens}"
            )
        num_needed = -(-num_computed // block_size)
        num_held = num_needed if state.num_blocks_held is None else state.num_blocks_held
        if num_held < num_needed:
            raise ValueError(
                f"request {state.request_id!r} holds {num_held} blocks, fewer than the {num_needed} its "
                f"{num_computed} computed tokens need"
            )
        hits = _NONE
        pool = self.pool
        if keys is not None:
            pool = self.ensure_pool()
            hits = pool.lookup(keys, num_computed // block_size)
        num_taken = num_held - len(hits) + (pool.num_free_among(hits) if pool is not None and hits else 0)
        if num_taken > self.num_free_blocks:
            raise ValueError(f"request {state.request_id!r}: {num_held} blocks wanted, {self.num_free_blocks} free")
        self.num_free_blocks -= num_taken
        rec = _Rec(state.num_prompt_tokens, num_generated + state.num_remaining_output_tokens, num_generated)
        rec.priority = state.priority
        rec.arrival_time_s = state.arrival_time_s
        if pool is not None:
            pool.touch(hits)
            pool.allocate(num_held - len(hits))
            if keys is not None:
                rec.keys = keys
                rec.num_shared = self.num_shared_blocks(keys)
                rec.block_ids = list(hits)
                rec.num_full = len(hits)
                rec.num_blocks_held = num_held
                self.cache_full_blocks(rec, num_computed)
        rec.num_computed_tokens = num_computed
        rec.num_blocks_held = num_held
        rec.seq = self.next_seq
        self.next_seq += 1
        self.running.append(rec)
        if num_generated and num_computed == state.num_prompt_tokens + num_generated - 1:
            self.enter_decode(rec)
        else:
            self.prefills.append(rec)


def simulate_until_finished(
    snapshot: InstanceSnapshot, request: RequestState, batch_time: CountsBatchTimeModel
) -> SimulationResult:
    """Simulate the instance from `snapshot` with `request` appended to its waiting queue until it finishes.

    Equal to stepping `Scheduler` one iteration at a time (see the module docstring for the test that
    guards this), in O(1)-O(log n) work per event.

    Args:
        snapshot: Instance state; not modified.
        request: The new request, no progress; its id must not be in the snapshot.
        batch_time: A model that prices steps from counts (`LinearBatchTimeModel`).

    Returns:
        TTFT and E2E measured from the snapshot's time, steps, and preemptions during the interval.

    Raises:
        ValueError: For an invalid snapshot or request (as `InstanceSnapshot.to_scheduler` and
            `Scheduler.add_request`), or a non-positive step time from the model.
        PrefixCacheNotModelled: A request in the snapshot or the new one has block keys past its prompt.
        PriorityPreemptionNotModelled: Under the "priority" policy, a preemption's victim is not the last running
            request.
    """
    sim = _FastScheduler(snapshot.config, batch_time)
    sim.load(snapshot, request)
    while sim.e2e_s is None:
        if sim.irregular:
            sim.promote_irregular()
        if not sim.prefills and (
            (sim.waiting and len(sim.running) < sim.max_num_seqs and sim.decode_admit_step())
            or (sim.running and sim.run_decodes())
        ):
            continue
        sim.step_exact()
    assert sim.ttft_s is not None
    return SimulationResult(sim.ttft_s, sim.e2e_s, sim.num_steps, sim.num_steps_simulated, sim.num_preemptions)
