"""One step of a vLLM V1 engine's scheduler: THE model of an instance's queues and KV cache.

Owns `EngineConfig` (the vLLM knobs that shape scheduling), `ScheduledBatch` (what one step computes),
`StepOutput` (what it produced) and `Scheduler`. Pure and synchronous: imports only the standard library
and `predictor.sim`; no I/O, no asyncio, no grpc, no clock (callers pass the time).

Source: vllm/v1/core/sched/scheduler.py `Scheduler.schedule` and `Scheduler.update_from_output`
(vLLM V1, FCFS policy). Simplifications:
- no prefix caching (a request never finds its blocks cached), no block identities: KV is counted in blocks;
- no speculative decoding, no lookahead slots, no structured output, no multimodal encoder budget;
- no swapping (V1 has none either): preemption frees the blocks and the request recomputes later;
- no priorities beyond FCFS; no LoRA limits; no max_model_len cap (callers pass valid lengths);
- a step's tokens are applied when the caller calls `update_after_step` (vLLM advances
  `num_computed_tokens` at schedule time; the result after a step is the same).

NOTE: a second implementation of these rules, specialised for fast prediction, is `predictor.sim.fast_predict`
(event-driven; O(1)-O(log n) per event). It is verified against this class by the Hypothesis test
`tests/predictor/sim/test_predict.py::test_predict_equals_stepping_and_leaves_state_unchanged` (>= 1000 random
states and configurations: same TTFT/E2E, step and preemption counts as stepping this scheduler). A change to
`schedule()` or `update_after_step()` must be mirrored there and pass that test.

NOTE: invariants, asserted at the end of `schedule()` and checked by the property tests:
- total scheduled tokens <= max_num_batched_tokens and len(running) <= max_num_seqs;
- free + used blocks == num_gpu_blocks, and used blocks == sum over running requests of the blocks they hold;
- after `update_after_step`, a running request holds exactly blocks_for_tokens(num_computed_tokens) blocks.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

from predictor.sim.kv_blocks import BlockPool, blocks_for_tokens
from predictor.sim.request import RequestStatus, SimRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The vLLM engine settings that shape scheduling (vLLM names and meanings).

    Attributes:
        max_num_seqs: Most requests in the running list (vLLM `max_num_seqs`), >= 1.
        max_num_batched_tokens: Token budget of one step, i.e. the chunked-prefill chunk size
            (vLLM `max_num_batched_tokens`), >= max_num_seqs (vLLM requires it too).
        block_size: Tokens per KV block (vLLM `block_size`), >= 1.
        num_gpu_blocks: KV blocks of the instance (vLLM `num_gpu_blocks`), >= 1.
        enable_chunked_prefill: When False, a waiting request's prefill must fit whole in the remaining
            budget or admission stops for this step.
        long_prefill_token_threshold: 0 = off; else the most prefill tokens one request gets per step
            (vLLM `long_prefill_token_threshold`), >= 0.

    Raises:
        ValueError: On construction, with the offending field named, if a value is out of range.
    """

    max_num_seqs: int = 48
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_gpu_blocks: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_gpu_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}), as vLLM requires"
            )
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"EngineConfig.long_prefill_token_threshold must be an int >= 0, got "
                f"{self.long_prefill_token_threshold!r}"
            )


@dataclass(slots=True)
class ScheduledBatch:
    """What one engine step computes; the input of a `BatchTimeModel`.

    Attributes:
        num_scheduled_tokens: request_id -> tokens computed this step; insertion order = schedule order
            (running requests first, then newly admitted ones).
        num_prefill_tokens: Tokens of prefill chunks, including recomputation after preemption.
        prefill_attention_work: Sum over prefill chunks of chunk_len * (num_computed_before + chunk_len),
            in tokens² (= prefill_len² for a prefill with no earlier context).
        num_decode_seqs: Requests computing one token after their prompt (decodes).
        decode_context_tokens: Sum over decodes of their context length in tokens (KV incl. the new token).
        preempted_request_ids: Requests preempted while building this batch, preemption order.
    """

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    num_prefill_tokens: int = 0
    prefill_attention_work: int = 0
    num_decode_seqs: int = 0
    decode_context_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens in the step (prefill tokens + decodes)."""
        return self.num_prefill_tokens + self.num_decode_seqs

    @property
    def num_seqs(self) -> int:
        """Requests in the step."""
        return len(self.num_scheduled_tokens)


@dataclass(slots=True)
class StepOutput:
    """What one applied step produced.

    Attributes:
        new_token_request_ids: Requests that sampled one output token (prefill completed or decode),
            schedule order.
        first_token_request_ids: Subset of those that sampled their first output token.
        finished: Requests that sampled their last output token (status FINISHED, blocks freed).
    """

    new_token_request_ids: list[str] = field(default_factory=list)
    first_token_request_ids: list[str] = field(default_factory=list)
    finished: list[SimRequest] = field(default_factory=list)


def check_request_fits(config: EngineConfig, request_id: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
    """Checks that a request of these lengths can ever be served by an instance with ``config``.

    Raises:
        ValueError: prompt + output tokens need more KV blocks than ``num_gpu_blocks``, or (chunked prefill off) a
            recompute after a late preemption would need a prefill larger than ``max_num_batched_tokens``.
    """
    num_max_tokens = num_prompt_tokens + num_output_tokens
    num_blocks = blocks_for_tokens(num_max_tokens, config.block_size)
    if num_blocks > config.num_gpu_blocks:
        raise ValueError(
            f"request {request_id!r} needs {num_blocks} KV blocks for {num_max_tokens} tokens, "
            f"more than num_gpu_blocks={config.num_gpu_blocks}"
        )
    if not config.enable_chunked_prefill and num_max_tokens - 1 > config.max_num_batched_tokens:
        raise ValueError(
            f"request {request_id!r} may need a {num_max_tokens - 1}-token prefill, more than "
            f"max_num_batched_tokens={config.max_num_batched_tokens} with chunked prefill off"
        )


class Scheduler:
    """FCFS continuous-batching scheduler of one vLLM V1 instance (see the module docstring).

    Drive it with `schedule()` then `update_after_step(batch, now_s)`, once per engine step: every non-empty
    batch must be applied before the next `schedule()` (blocks are reserved at schedule time, tokens counted
    at update time). `add_request` and `abort_request` may be called at any point. Finished and aborted
    requests are forgotten (not returned by `get_request`). `restore_running` rebuilds a running request from a
    snapshot (`predictor.sim.snapshot`); `advance_decodes` applies a run of identical decode steps at once (the
    predictor's skip-ahead, `predictor.sim.predict`), equal to stepping them one by one.

    Args:
        config: Engine settings.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.waiting: collections.deque[SimRequest] = collections.deque()
        self.running: list[SimRequest] = []
        self.num_preemptions_total = 0
        self._pool = BlockPool(config.num_gpu_blocks)
        self._num_blocks_held: dict[str, int] = {}
        self._requests: dict[str, SimRequest] = {}

    # ---- read-only views -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """KV blocks not held by any request."""
        return self._pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """KV blocks held by running requests."""
        return self._pool.num_used_blocks

    @property
    def kv_cache_usage_frac(self) -> float:
        """Used / total KV blocks, in [0, 1] (vLLM `kv_cache_usage_perc` is this fraction too)."""
        return self._pool.num_used_blocks / self._pool.num_gpu_blocks

    def num_blocks_held(self, request_id: str) -> int:
        """KV blocks held by one request (0 if unknown or not running)."""
        return self._num_blocks_held.get(request_id, 0)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting) or bool(self.running)

    def get_request(self, request_id: str) -> SimRequest | None:
        """The unfinished request with this id, or None (unknown, finished or aborted)."""
        return self._requests.get(request_id)

    # ---- queue changes ---------------------------------------------------------------------------------
    def add_request(self, request: SimRequest) -> None:
        """Append a request to the waiting queue (FCFS).

        Args:
            request: A request with status WAITING (or PREEMPTED, e.g. restored from a snapshot), no
                computed tokens and fewer generated tokens than num_output_tokens.

        Raises:
            ValueError: If an unfinished request has the same id; if the request is in another state; if its
                prompt plus output tokens need more blocks than the cache has (it could never finish); or, with
                chunked prefill off, if its longest possible prefill (prompt + output - 1 tokens, after a
                late preemption) exceeds max_num_batched_tokens (vLLM demands max_model_len <= that budget).
        """
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        self.validate_request(request)
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def validate_request(self, request: SimRequest) -> None:
        """Check that `add_request` would accept `request`, apart from its id; change nothing.

        Raises:
            ValueError: For the reasons `add_request` gives, except a duplicate id.
        """
        cfg = self.config
        if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED) or request.num_computed_tokens:
            raise ValueError(
                f"request {request.request_id!r} must be WAITING or PREEMPTED with no computed tokens, got "
                f"{request.status.name} with {request.num_computed_tokens}"
            )
        if request.num_generated_tokens >= request.num_output_tokens:
            raise ValueError(f"request {request.request_id!r} has already generated all its output tokens")
        check_request_fits(cfg, request.request_id, request.num_prompt_tokens, request.num_output_tokens)

    def abort_request(self, request_id: str) -> SimRequest | None:
        """Remove an unfinished request from waiting or running and free its blocks.

        Args:
            request_id: Id of the request.

        Returns:
            The removed request (status ABORTED), or None if no unfinished request has this id.
        """
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._free_blocks(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.ABORTED
        return request

    def restore_running(self, request: SimRequest, num_blocks_held: int) -> None:
        """Append a request that is already RUNNING (e.g. rebuilt from a snapshot) to the running list.

        Args:
            request: A request with status RUNNING, fewer computed tokens than tokens (vLLM never leaves a
                running request with nothing to compute) and fewer generated tokens than num_output_tokens.
            num_blocks_held: KV blocks it holds, >= blocks_for_tokens(num_computed_tokens).

        Raises:
            ValueError: If the id is taken, the request is in another state, the running list is full
                (max_num_seqs), num_blocks_held is too small, or fewer blocks are free.
        """
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        if request.status != RequestStatus.RUNNING or request.num_computed_tokens >= request.num_tokens:
            raise ValueError(
                f"request {request.request_id!r} must be RUNNING with computed < total tokens, got "
                f"{request.status.name} with {request.num_computed_tokens}/{request.num_tokens}"
            )
        if request.num_generated_tokens >= request.num_output_tokens:
            raise ValueError(f"request {request.request_id!r} has already generated all its output tokens")
        if len(self.running) >= self.config.max_num_seqs:
            raise ValueError(f"running list is full (max_num_seqs={self.config.max_num_seqs})")
        num_needed = blocks_for_tokens(request.num_computed_tokens, self.config.block_size)
        if num_blocks_held < num_needed:
            raise ValueError(
                f"request {request.request_id!r} holds {num_blocks_held} blocks, fewer than the {num_needed} its "
                f"{request.num_computed_tokens} computed tokens need"
            )
        if not self._pool.allocate(num_blocks_held):
            raise ValueError(
                f"request {request.request_id!r}: {num_blocks_held} blocks wanted, {self._pool.num_free_blocks} free"
            )
        self._num_blocks_held[request.request_id] = num_blocks_held
        self._requests[request.request_id] = request
        self.running.append(request)

    # ---- one step --------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Decide the next step: which requests compute how many tokens, preempting if KV runs out.

        Running requests first (schedule order), then waiting ones in FCFS order, only if nothing was
        preempted. KV blocks are reserved here for the tokens scheduled.

        Returns:
            The batch; empty (no tokens) when there is nothing to run.

        Source: vllm/v1/core/sched/scheduler.py `Scheduler.schedule` (vLLM V1); see the module docstring.
        """
        batch = ScheduledBatch()
        token_budget = self.config.max_num_batched_tokens
        token_budget = self._schedule_running(batch, token_budget)
        if not batch.preempted_request_ids:
            self._schedule_waiting(batch, token_budget)
        self._check_invariants(batch)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, token_budget: int) -> int:
        """Schedule running requests in order; return the budget left."""
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new_tokens = self._num_new_tokens(request, token_budget)
            scheduled = True
            while not self._reserve_blocks(request, num_new_tokens):
                # Lowest priority under FCFS is the last running request; it may be this one.
                victim = self.running.pop()
                self._preempt(victim, batch)
                if victim is request:
                    scheduled = False
                    break
            if not scheduled:
                break
            self._add_to_batch(batch, request, num_new_tokens)
            token_budget -= num_new_tokens
            index += 1
        return token_budget

    def _schedule_waiting(self, batch: ScheduledBatch, token_budget: int) -> None:
        """Admit waiting requests in FCFS order while budget, max_num_seqs and blocks allow."""
        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new_tokens = request.num_tokens - request.num_computed_tokens
            threshold = self.config.long_prefill_token_threshold
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if not self.config.enable_chunked_prefill and num_new_tokens > token_budget:
                break
            num_new_tokens = min(num_new_tokens, token_budget)
            if not self._reserve_blocks(request, num_new_tokens):
                break  # strict FCFS: nobody behind it jumps the queue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_to_batch(batch, request, num_new_tokens)
            token_budget -= num_new_tokens

    def _num_new_tokens(self, request: SimRequest, token_budget: int) -> int:
        """Tokens a running request computes this step: the rest of its prefill (capped) or one decode."""
        num_new_tokens = request.num_tokens - request.num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        return min(num_new_tokens, token_budget)

    def _reserve_blocks(self, request: SimRequest, num_new_tokens: int) -> bool:
        """Hold blocks for num_computed + num_new_tokens tokens; False (nothing changed) if short."""
        num_needed = blocks_for_tokens(request.num_computed_tokens + num_new_tokens, self.config.block_size)
        num_held = self._num_blocks_held.get(request.request_id, 0)
        if num_needed <= num_held:
            # Most decodes stay inside their last block; this early exit is the scheduler's hot path.
            return True
        if not self._pool.allocate(num_needed - num_held):
            return False
        self._num_blocks_held[request.request_id] = num_needed
        return True

    def _free_blocks(self, request: SimRequest) -> None:
        self._pool.free(self._num_blocks_held.pop(request.request_id, 0))

    def _preempt(self, request: SimRequest, batch: ScheduledBatch) -> None:
        """Free all blocks of a (popped) running request and put it at the front of the waiting queue."""
        self._free_blocks(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)
        batch.preempted_request_ids.append(request.request_id)
        logger.debug("preempted %s (preemption %d)", request.request_id, request.num_preemptions)

    @staticmethod
    def _add_to_batch(batch: ScheduledBatch, request: SimRequest, num_new_tokens: int) -> None:
        batch.num_scheduled_tokens[request.request_id] = num_new_tokens
        num_computed = request.num_computed_tokens
        if num_new_tokens == 1 and num_computed >= request.num_prompt_tokens:
            batch.num_decode_seqs += 1
            batch.decode_context_tokens += num_computed + 1
        else:
            batch.num_prefill_tokens += num_new_tokens
            batch.prefill_attention_work += num_new_tokens * (num_computed + num_new_tokens)

    def _check_invariants(self, batch: ScheduledBatch) -> None:
        assert batch.total_num_scheduled_tokens == sum(batch.num_scheduled_tokens.values())
        assert batch.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(self.running) <= self.config.max_num_seqs
        assert self._pool.num_used_blocks == sum(self._num_blocks_held.values())
        assert self._pool.num_free_blocks + self._pool.num_used_blocks == self.config.num_gpu_blocks
        assert all(r.status == RequestStatus.RUNNING for r in self.running)

    # ---- apply a step ----------------------------------------------------------------------------------
    def update_after_step(self, batch: ScheduledBatch, now_s: float) -> StepOutput:
        """Apply a scheduled batch whose execution ended at `now_s`.

        Advances num_computed_tokens; a request whose KV then covers all its tokens samples one output token
        (the sampled token is not in the KV cache yet, as in vLLM); a request that sampled its last token
        finishes and frees its blocks. Requests aborted since `schedule()` are skipped.

        Args:
            batch: The batch returned by the latest `schedule()`.
            now_s: End time of the step, seconds on the driver's clock.

        Returns:
            Sampled, first-token and finished requests of this step.

        Source: vllm/v1/core/sched/scheduler.py `Scheduler.update_from_output` (vLLM V1).
        """
        output = StepOutput()
        finished_ids: set[str] = set()
        for request_id, num_new_tokens in batch.num_scheduled_tokens.items():
            request = self._requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += num_new_tokens
            assert request.num_computed_tokens <= request.num_tokens
            if request.num_computed_tokens < request.num_tokens:
                continue  # a partial prefill chunk samples nothing
            request.num_generated_tokens += 1
            output.new_token_request_ids.append(request_id)
            if request.num_generated_tokens == 1:
                request.first_token_time_s = now_s
                output.first_token_request_ids.append(request_id)
            if request.num_generated_tokens >= request.num_output_tokens:
                request.status = RequestStatus.FINISHED
                request.finish_time_s = now_s
                self._free_blocks(request)
                del self._requests[request_id]
                finished_ids.add(request_id)
                output.finished.append(request)
        if finished_ids:
            self.running = [r for r in self.running if r.request_id not in finished_ids]
        return output

    def advance_decodes(self, batch: ScheduledBatch, num_steps: int) -> None:
        """Apply `batch`, a pure-decode batch just returned by `schedule()`, and the `num_steps - 1` identical
        decode steps that would follow it, in one go (the predictor's skip-ahead over decode runs).

        The result equals `num_steps` rounds of `update_after_step` / `schedule()` / ... / `update_after_step`
        when none of those steps finishes a request, admits one or preempts one: each running request computes
        and samples `num_steps` tokens and holds blocks for its new context. Timestamps are untouched (no
        request samples its first or last token in such a run).

        Args:
            batch: The latest `schedule()` result: one decode per running request, nothing else.
            num_steps: Steps to apply, >= 1.

        Raises:
            ValueError: (state unchanged) If batch is not such a batch, num_steps < 1, a request would finish
                within num_steps, or the blocks for the new context are not free (the caller must stop the run
                before a preemption).
        """
        if (
            num_steps < 1
            or batch.num_prefill_tokens
            or batch.preempted_request_ids
            or batch.num_decode_seqs != len(self.running)
        ):
            raise ValueError("advance_decodes needs num_steps >= 1 and a batch of one decode per running request")
        block_size = self.config.block_size
        held = self._num_blocks_held
        num_new_blocks = 0
        for request in self.running:
            if request.num_output_tokens - request.num_generated_tokens <= num_steps:
                raise ValueError(f"request {request.request_id!r} would finish within {num_steps} steps")
            num_needed = blocks_for_tokens(request.num_computed_tokens + num_steps, block_size)
            num_new_blocks += max(0, num_needed - held.get(request.request_id, 0))
        if not self._pool.allocate(num_new_blocks):
            raise ValueError(f"{num_new_blocks} more blocks needed, {self._pool.num_free_blocks} free")
        for request in self.running:
            request.num_computed_tokens += num_steps
            request.num_generated_tokens += num_steps
            num_needed = blocks_for_tokens(request.num_computed_tokens, block_size)
            if num_needed > held.get(request.request_id, 0):
                held[request.request_id] = num_needed
