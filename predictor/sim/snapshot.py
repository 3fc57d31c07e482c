"""Frozen snapshots of one simulated instance: what the predictor simulates forward from.

Owns `RequestState` (one request's counters) and `InstanceSnapshot` (engine settings, queues, clock), with
`InstanceSnapshot.from_scheduler` (copy a live `Scheduler`) and `InstanceSnapshot.to_scheduler` (build a fresh,
independent `Scheduler` in that state). Copies are explicit, field by field: a prediction never deep-copies a
scheduler and never touches the caller's objects. Imports only the standard library and `predictor.sim`.

NOTE: KV blocks are stored per running request (`RequestState.num_blocks_held`); the free blocks are the rest
of `config.num_gpu_blocks`, so block accounting is consistent by construction. With prefix caching (requests
with `RequestState.block_keys`, vllm-v1 rules) a block shared by running requests is in each one's count, so
`num_used_blocks` is an upper bound there; `to_scheduler` shares such blocks again (a running request's full
computed blocks whose keys an earlier running request cached). The cached blocks no request holds (free but
reusable) are `InstanceSnapshot.cached_block_keys`, in eviction order; `to_scheduler` puts every anonymous free
block ahead of them, so they are taken first: vLLM's free queue is always in that order (block_pool.py
`BlockPool.free_blocks` prepends blocks without a hash and appends cached ones; `predictor.sim.prefix_cache`), so
the order is exact, and a defined state that the fast predictor (`predictor.sim.fast_predict`) reproduces exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from predictor.sim.kv_blocks import blocks_for_tokens
from predictor.sim.request import RequestStatus, SimRequest
from predictor.sim.scheduler import EngineConfig, Scheduler, SGLangState

logger = logging.getLogger(__name__)

NUM_EXTRA_OUTPUT_TOKENS_WHEN_OVERDUE = 10
"""Output tokens still assumed for a request that has generated at least its expected output length.

Source: the reference system's predictor (AKafakA/Astrolabe; see /work/shared/FACTS.md): "a request that has
already generated more than predicted is assumed to need 10 more tokens". Applied here also when generated
equals expected, since a live request at that count has not finished (else it would not be in the state).
"""


@dataclass(frozen=True, slots=True)
class RequestState:
    """One request's progress, as recorded in a snapshot.

    Attributes:
        request_id: Unique within the snapshot.
        num_prompt_tokens: Prompt length, tokens, >= 1.
        num_output_tokens: Expected output length, tokens, >= 1 (true or predicted); may be <= the generated
            count (see `NUM_EXTRA_OUTPUT_TOKENS_WHEN_OVERDUE`).
        arrival_time_s: Arrival time, seconds on the snapshot's clock.
        num_computed_tokens: Tokens whose KV is cached; 0 for a waiting request.
        num_generated_tokens: Output tokens sampled so far, >= 0.
        num_blocks_held: KV blocks held (running requests only); None = exactly those its computed tokens need.
        num_preemptions: Times it was preempted (SGLang: retracted); a waiting request with any is restored as
            PREEMPTED.
        max_new_tokens: Its output cap (OpenAI ``max_tokens``), tokens, >= 1; None = not set. Only the SGLang
            rules read it (`SimRequest.max_new_tokens`).
        block_keys: Keys of its full KV blocks (`SimRequest.block_keys`); None = unknown tokens (no prefix
            caching for it).
        priority: vLLM scheduling priority (`SimRequest.priority`: lower = earlier; read only under the
            "priority" scheduling policy).
    """

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_time_s: float = 0.0
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    num_blocks_held: int | None = None
    num_preemptions: int = 0
    max_new_tokens: int | None = None
    block_keys: tuple[int, ...] | None = None
    priority: int = 0

    @property
    def num_remaining_output_tokens(self) -> int:
        """Output tokens still to generate, with the overdue rule applied (>= 1)."""
        if self.num_generated_tokens >= self.num_output_tokens:
            return NUM_EXTRA_OUTPUT_TOKENS_WHEN_OVERDUE
        return self.num_output_tokens - self.num_generated_tokens

    def to_sim_request(self, status: RequestStatus) -> SimRequest:
        """A new `SimRequest` with these counters, whose output length obeys the overdue rule.

        Raises:
            ValueError: As `SimRequest` does for out-of-range counts.
        """
        return SimRequest(
            request_id=self.request_id,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_generated_tokens + self.num_remaining_output_tokens,
            arrival_time_s=self.arrival_time_s,
            num_computed_tokens=self.num_computed_tokens,
            num_generated_tokens=self.num_generated_tokens,
            status=status,
            num_preemptions=self.num_preemptions,
            max_new_tokens=self.max_new_tokens,
            block_keys=self.block_keys,
            priority=self.priority,
        )

    @classmethod
    def from_sim_request(cls, request: SimRequest, num_blocks_held: int | None = None) -> RequestState:
        """Record a `SimRequest`'s counters (the request is not kept)."""
        return cls(
            request_id=request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            arrival_time_s=request.arrival_time_s,
            num_computed_tokens=request.num_computed_tokens,
            num_generated_tokens=request.num_generated_tokens,
            num_blocks_held=num_blocks_held,
            num_preemptions=request.num_preemptions,
            max_new_tokens=request.max_new_tokens,
            block_keys=request.block_keys,
            priority=request.priority,
        )


@dataclass(frozen=True, slots=True)
class InstanceSnapshot:
    """State of one instance at one time: settings, waiting queue (FCFS order), running list (schedule order).

    Attributes:
        config: Engine settings.
        now_s: Time of the snapshot, seconds on the driver's clock; predictions are measured from it.
        waiting: Waiting requests, front first; each with no computed tokens.
        running: Running requests in schedule order; each with computed < prompt + generated tokens.
        num_preemptions_total: Preemptions so far (carried over, informational).
        sglang: SGLang's admission state (new_token_ratio, batch_is_full, finished requests not yet filtered);
            None = the state after idle (`SGLangState()`). Read only when `config.scheduling` is "sglang".
        cached_block_keys: keys of the cached blocks no request holds (free but reusable, vllm-v1 rules), in
            eviction order (least recently freed first); the other free blocks are anonymous and are taken
            before these. () = none (or not known). At most `num_free_blocks` of them. In the engine's order a
            block comes before its chain parent (a request frees its blocks tail first; the simulations skip
            decode runs on that premise, see `predictor.sim.predict`); a sub-sequence of such an order keeps it.
    """

    config: EngineConfig
    now_s: float
    waiting: tuple[RequestState, ...] = ()
    running: tuple[RequestState, ...] = ()
    num_preemptions_total: int = 0
    sglang: SGLangState | None = None
    cached_block_keys: tuple[int, ...] = ()

    @property
    def num_used_blocks(self) -> int:
        """KV blocks held by running requests."""
        return sum(self._num_blocks_held(r) for r in self.running)

    @property
    def num_free_blocks(self) -> int:
        """KV blocks held by nobody (negative only for an invalid snapshot, which `to_scheduler` rejects)."""
        return self.config.num_gpu_blocks - self.num_used_blocks

    def _num_blocks_held(self, state: RequestState) -> int:
        if state.num_blocks_held is not None:
            return state.num_blocks_held
        return blocks_for_tokens(state.num_computed_tokens, self.config.block_size)

    def fit_to_kv_cache(self) -> InstanceSnapshot:
        """A copy whose expected output lengths fit the KV cache (others unchanged, same objects when nothing moves).

        An expected length is an estimate (a tagger's guess, a residual rule): on a small instance prompt +
        estimate can exceed ``num_gpu_blocks * block_size``, which no real request can reach (the engine would
        stop it at ``max_model_len`` long before), and which would make the whole snapshot unservable. Each request
        keeps at least one token more than it has generated.
        """
        states = (*self.waiting, *self.running)
        capacity = self.config.num_gpu_blocks * self.config.block_size
        if all(r.num_prompt_tokens + r.num_output_tokens <= capacity for r in states):
            return self

        def fit(r: RequestState) -> RequestState:
            limit = max(capacity - r.num_prompt_tokens, r.num_generated_tokens + 1, 1)
            return r if r.num_output_tokens <= limit else replace(r, num_output_tokens=limit)

        return replace(self, waiting=tuple(map(fit, self.waiting)), running=tuple(map(fit, self.running)))

    def without(self, request_ids) -> InstanceSnapshot:
        """This snapshot less the requests whose ids are in ``request_ids`` (a set; running ones free their KV
        blocks, which are per request). Returns ``self`` when none is there."""
        if not request_ids:
            return self
        running = tuple(r for r in self.running if r.request_id not in request_ids)
        waiting = tuple(r for r in self.waiting if r.request_id not in request_ids)
        if len(running) == len(self.running) and len(waiting) == len(self.waiting):
            return self
        return replace(self, running=running, waiting=waiting)

    def fit_request(self, request: RequestState) -> RequestState:
        """``request`` with its expected output length cut to what this instance's KV cache can hold beside its
        prompt (at least 1 token; a prompt that cannot fit stays unservable)."""
        limit = self.config.max_output_tokens(request.num_prompt_tokens)
        return request if request.num_output_tokens <= limit else replace(request, num_output_tokens=limit)

    def new_arrival_time_s(self) -> float:
        """When a new request arrives on this state, seconds: its time, or the latest arrival in it if later (a
        state with unseen dispatches queued in, `extproc.fleet_state.predict_from_state`, holds requests sent after
        it was taken). Under vLLM's "priority" policy a new request queues behind every request of its priority."""
        return max((self.now_s, *(r.arrival_time_s for r in self.waiting), *(r.arrival_time_s for r in self.running)))

    @classmethod
    def from_scheduler(cls, scheduler: Scheduler, now_s: float) -> InstanceSnapshot:
        """Copy a live scheduler's queues, block holdings and free cached blocks (the scheduler is only read).

        Take it between steps: during a step in flight the batch's blocks are already reserved but its tokens
        not yet counted, and the snapshot records exactly that.

        Args:
            scheduler: The scheduler to copy.
            now_s: Its driver's current time, seconds.
        """
        return cls(
            config=scheduler.config,
            now_s=now_s,
            waiting=tuple(RequestState.from_sim_request(r) for r in scheduler.waiting),
            running=tuple(
                RequestState.from_sim_request(r, scheduler.num_blocks_held(r.request_id)) for r in scheduler.running
            ),
            num_preemptions_total=scheduler.num_preemptions_total,
            sglang=scheduler.sglang_state,
            cached_block_keys=tuple(scheduler.prefix_cache.cached_free_keys()),
        )

    def to_scheduler(self) -> Scheduler:
        """A new `Scheduler` in this state, sharing no mutable object with the snapshot or its source.

        Output lengths obey the overdue rule (`NUM_EXTRA_OUTPUT_TOKENS_WHEN_OVERDUE`). The cached free blocks
        (`cached_block_keys`, vllm-v1 rules only) go to the tail of the free queue in their order, behind the
        anonymous free blocks (`Scheduler.restore_cached_free_blocks`).

        Raises:
            ValueError: If the snapshot is invalid: duplicate ids, a waiting request with computed tokens, a
                running request with nothing left to compute, more running requests than max_num_seqs, more
                blocks held than exist, more cached free blocks than free blocks, or a request that could never
                fit (see `Scheduler.add_request`).
        """
        scheduler = Scheduler(self.config)
        scheduler.num_preemptions_total = self.num_preemptions_total
        if self.sglang is not None and self.config.scheduling == "sglang":
            scheduler.restore_sglang_state(self.sglang)
        for state in self.running:
            request = state.to_sim_request(RequestStatus.RUNNING)
            scheduler.restore_running(request, self._num_blocks_held(state))
        scheduler.restore_cached_free_blocks(self.cached_block_keys)
        for state in self.waiting:
            status = RequestStatus.PREEMPTED if state.num_preemptions else RequestStatus.WAITING
            scheduler.add_request(state.to_sim_request(status))
        return scheduler
