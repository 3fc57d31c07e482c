"""One step of an LLM engine's scheduler: THE model of an instance's queues and KV cache, in two rule sets.

Owns `EngineConfig` (the engine knobs that shape scheduling), `ScheduledBatch` (what one step computes),
`StepOutput` (what it produced), `SGLangState` (SGLang's admission state outside the queues) and `Scheduler`.
Pure and synchronous: imports only the standard library and `predictor.sim`; no I/O, no asyncio, no grpc, no
clock (callers pass the time).

`EngineConfig.scheduling` picks the rule set; both act on the same queues, requests and KV blocks:

- ``"vllm-v1"`` (default). Source: vllm/v1/core/sched/scheduler.py `Scheduler.schedule` and
  `Scheduler.update_from_output` (vLLM V1, FCFS policy). One step mixes the running requests (prefill chunks and
  decodes) and newly admitted prefills under one token budget; when KV blocks run out the LAST running request is
  preempted (recomputed later, from the FRONT of the waiting queue); admission needs only the blocks of the chunk.
- ``"sglang"``. Source: sgl-project/sglang python/sglang/srt/managers/scheduler.py `Scheduler.get_next_batch_to_run`,
  `_get_new_batch_prefill_raw`, `update_running_batch`; schedule_policy.py `PrefillAdder` (`add_one_req`,
  `add_chunked_req`, `budget_state`, `rem_total_tokens`); schedule_batch.py `ScheduleBatch.check_decode_mem`,
  `retract_decode`; scheduler_components/new_token_ratio_tracker.py `NewTokenRatioTracker` (the index's newest
  versions, 2025). Prefill first and never mixed (`enable_mixed_chunk` is off by default): a step is either a
  prefill ("extend") batch (the unfinished chunked prefill first, then waiting requests FCFS, under
  `chunked_prefill_size` tokens) or a decode batch of every running request. A waiting request is admitted only if
  its prompt plus its clipped output cap fit the KV tokens left after reserving, for every running request,
  ``min(max_new_tokens - generated, CLIP) * new_token_ratio`` tokens; a refusal marks the batch full
  (`batch_is_full`) and no admission is tried again until a request leaves the running batch. When a decode step
  finds too few free KV tokens, requests are RETRACTED (fewest output tokens first, longest prompt breaking
  ties) to the END of the waiting queue and recomputed later, and new_token_ratio is re-estimated from the
  survivors; every decode step without retraction lowers it by a fixed decay, down to a floor; it is reset
  when the engine goes idle. Details and constants: the `SGLANG_*` constants and `Scheduler._schedule_sglang`.

Prefix caching (vllm-v1 only): a request that carries block keys (`SimRequest.block_keys`) is looked up in the
instance's prefix cache when it is admitted (`predictor.sim.prefix_cache.PrefixCachePool`): the longest run of
cached keys from its first block, at most num_tokens - 1 tokens, is taken as computed (its prefill starts there
and it needs new blocks only for the rest); its blocks are cached as they fill; when it finishes, is preempted
or aborted, its blocks stay cached but free (reverse order) until an allocation evicts them, least recently
freed first. Requests without keys behave as without prefix caching (they never hit and leave nothing cached)
but take blocks from the same pool, evicting cached ones. The counters `prefix_cache_queries` /
`prefix_cache_hits` (tokens; vLLM's ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``) count every
admission, keyed or not, except recomputations of preempted requests (`prefix_cache_preempted_*`).
Source: vllm/v1/core/kv_cache_manager.py `KVCacheManager.get_computed_blocks`, `allocate_slots`.

Simplifications (both styles):
- SGLang rules: no prefix caching (its radix cache is not modelled; block keys are ignored); vllm-v1: only the
  blocks a request's keys name can be hit (the driver decides how far they reach into the output);
- KV is counted in blocks (SGLang: pages of `page_size` tokens, `block_size` here); only cached blocks have
  identities;
- no speculative decoding, no lookahead slots, no structured output, no multimodal encoder budget, no LoRA;
- no swapping (neither engine swaps by default): preemption / retraction frees the KV and the request recomputes;
- priorities: vllm-v1 models vLLM's ``--scheduling-policy priority`` (`EngineConfig.scheduling_policy`: the waiting
  queue by (priority, arrival), the preemption victim the largest (priority, arrival); a waiting request never
  preempts a running one, as in vLLM V1); SGLang only FCFS (its default `schedule_policy` is "fcfs"; "lpm" keeps
  FCFS order too when no prompts share a prefix); no max_model_len cap (callers pass valid lengths);
- a step's tokens are applied when the caller calls `update_after_step` (vLLM advances `num_computed_tokens` at
  schedule time; the result after a step is the same).
SGLang rules left out: `enable_mixed_chunk`, priority preemption, `max_prefill_tokens` while chunked prefill is
on (it is >= `chunked_prefill_size` by default), `schedule_conservativeness` other than 1.0, the overlap
scheduler's one-step lag, dynamic chunk sizing, hierarchical / SWA / Mamba pools, the context-length bound of
`init_req_max_new_tokens` (only the KV-pool bound is applied, `Scheduler.sglang_max_new_tokens`), and
`SGLANG_RETRACT_DECODE_STEPS` head-room of older retraction loops (the newest stops as soon as the next decode
step fits; the constant is still used by the ratio estimate).

NOTE: a second implementation of the vLLM V1 rules, specialised for fast prediction, is
`predictor.sim.fast_predict` (event-driven; O(1)-O(log n) per event). It is verified against this class by the
Hypothesis test `tests/predictor/sim/test_predict.py::test_predict_equals_stepping_and_leaves_state_unchanged`
(>= 1000 random states and configurations: same TTFT/E2E, step and preemption counts as stepping this scheduler).
A change to the V1 path of `schedule()` or `update_after_step()` must be mirrored there and pass that test. The
SGLang rules exist only here (`predictor.sim.predict` steps this class for SGLang configs, and for states whose
block keys reach past a prompt, which fast_predict refuses); prefix caching for prompt keys is mirrored there
(verified by `tests/predictor/sim/test_predict_prefix_cache.py::test_predict_from_keyed_states_equals_stepping`).

NOTE: invariants, asserted at the end of `schedule()` and checked by the property tests:
- both styles: len(running) <= max_num_seqs; free + used blocks == num_gpu_blocks, and used blocks == sum over
  running requests of the blocks they hold, less the extra references on shared cached blocks; after
  `update_after_step`, a running request holds exactly blocks_for_tokens(num_computed_tokens) blocks (or more,
  if a snapshot gave it more);
- vllm-v1: total scheduled tokens <= max_num_batched_tokens;
- sglang: a batch is prefill-only (num_decode_seqs == 0, and with chunked prefill on, total tokens <=
  max_num_batched_tokens) or decode-only (num_prefill_tokens == 0, one token per running request, at most
  max_num_seqs tokens: a decode batch is NOT bounded by max_num_batched_tokens); 0 < new_token_ratio <= 1.

The module is longer than STYLE.md's ~400 lines: one `Scheduler` holds both rule sets over the same state (the
predictor, emulator and cluster benchmark drive one class whichever engine they model); splitting the SGLang
rules into another class would duplicate the queue, KV and snapshot plumbing that both share.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

from predictor.sim.kv_blocks import blocks_for_tokens
from predictor.sim.prefix_cache import PrefixCachePool
from predictor.sim.request import RequestStatus, SimRequest

logger = logging.getLogger(__name__)

_HELD = "held"
"""First element of the tuple key of a holding no request owns (`Scheduler.hold_blocks`): a tuple never equals a
request id (a str)."""


SCHEDULING_STYLES = ("vllm-v1", "sglang")
"""The rule sets `Scheduler` implements, the values of `EngineConfig.scheduling` (see the module docstring)."""

SCHEDULING_POLICIES = ("fcfs", "priority")
"""vLLM's scheduling policies (``--scheduling-policy``), the values of `EngineConfig.scheduling_policy`.

Source: vllm/v1/core/sched/request_queue.py `SchedulingPolicy` (FCFS, PRIORITY)."""

SGLANG_CLIP_MAX_NEW_TOKENS = 4096
"""Most output tokens SGLang assumes a request may still need when it reserves KV for it, tokens.

Source: sglang python/sglang/srt/managers/schedule_policy.py ``CLIP_MAX_NEW_TOKENS`` (env
``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION``, default 4096). It clips only the estimate, not the stop condition.
"""
SGLANG_INIT_NEW_TOKEN_RATIO = min(0.7 * 1.0, 1.0)
"""SGLang's new_token_ratio at start and after idle, in (0, 1]: the share of each running request's remaining
(clipped) output cap that admission reserves in KV.

Source: sglang python/sglang/srt/environ.py ``SGLANG_INIT_NEW_TOKEN_RATIO`` = 0.7, times
server_args.py ``schedule_conservativeness`` (default 1.0), capped at 1
(scheduler_components/new_token_ratio_tracker.py ``NewTokenRatioTracker.from_server_args``).
"""
SGLANG_MIN_NEW_TOKEN_RATIO = min(SGLANG_INIT_NEW_TOKEN_RATIO * 0.14, 1.0)
"""Floor that the per-step decay of new_token_ratio stops at (0.098).

Source: environ.py ``SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR`` = 0.14 times the initial ratio
(``NewTokenRatioTracker.from_server_args``).
"""
SGLANG_NEW_TOKEN_RATIO_DECAY = (SGLANG_INIT_NEW_TOKEN_RATIO - SGLANG_MIN_NEW_TOKEN_RATIO) / 600
"""Decrease of new_token_ratio per decode step without retraction (from init to floor in 600 steps).

Source: environ.py ``SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS`` = 600; ``NewTokenRatioTracker.decay_step``
(``current = max(current - decay, min)``), called by ``Scheduler.update_running_batch``.
"""
SGLANG_RETRACT_DECODE_STEPS = 20
"""Decode steps per surviving request that the post-retraction ratio estimate adds, tokens per request.

Source: environ.py ``SGLANG_RETRACT_DECODE_STEPS`` = 20; the estimate is
``min(1, (sum generated + 20 * n) / (sum max_new_tokens + 1))`` over the n requests left after a retraction
(``NewTokenRatioTracker.estimate_new_token_ratio_after_retract``, ``ScheduleBatch.retract_decode``).
"""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine settings that shape scheduling (vLLM names and meanings; SGLang's equivalents named).

    Attributes:
        max_num_seqs: Most requests in the running list (vLLM `max_num_seqs`; SGLang `max_running_requests`),
            requests, >= 1.
        max_num_batched_tokens: Token budget of one step, i.e. the chunked-prefill chunk size
            (vLLM `max_num_batched_tokens`, >= max_num_seqs as vLLM requires; SGLang `chunked_prefill_size`,
            the budget of a prefill step only, a multiple of block_size as SGLang asserts, or SGLang
            `max_prefill_tokens` with chunked prefill off), tokens, >= 1.
        block_size: Tokens per KV block (vLLM `block_size`; SGLang `page_size`, default 1), tokens, >= 1.
        num_gpu_blocks: KV blocks of the instance (vLLM `num_gpu_blocks`; SGLang `max_total_num_tokens` /
            `page_size`), blocks, >= 1.
        enable_chunked_prefill: When False, a waiting request's prefill must fit whole in the remaining
            budget or admission stops for this step (SGLang `--chunked-prefill-size -1`: the first request of a
            step is admitted whatever its length).
        long_prefill_token_threshold: 0 = off; else the most prefill tokens one request gets per step
            (vLLM `long_prefill_token_threshold`), tokens, >= 0; must be 0 with "sglang" (SGLang has no such
            knob).
        scheduling: Rule set, one of `SCHEDULING_STYLES`: "vllm-v1" (default) or "sglang".
        scheduling_policy: vLLM's ``--scheduling-policy``, one of `SCHEDULING_POLICIES`: "fcfs" (default) or
            "priority" (vllm-v1 rules only): the waiting queue ordered by (`SimRequest.priority`, arrival time),
            lower first, ties in arrival order; a preemption takes the running request with the largest
            (priority, arrival time) instead of the last one (of equal keys, the last admitted). Source:
            vllm/v1/core/sched/scheduler.py `Scheduler.schedule` (``if self.policy == SchedulingPolicy.PRIORITY``),
            request_queue.py `PriorityRequestQueue`.

    Raises:
        ValueError: On construction, with the offending field named, if a value is out of range.
    """

    max_num_seqs: int = 48
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_gpu_blocks: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling: str = "vllm-v1"
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_gpu_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")
        if self.scheduling not in SCHEDULING_STYLES:
            raise ValueError(f"EngineConfig.scheduling must be one of {', '.join(SCHEDULING_STYLES)}, "
                             f"got {self.scheduling!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"EngineConfig.scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.scheduling_policy == "priority" and self.scheduling != "vllm-v1":
            raise ValueError("EngineConfig.scheduling_policy='priority' is modelled for scheduling='vllm-v1' only")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"EngineConfig.long_prefill_token_threshold must be an int >= 0, got "
                f"{self.long_prefill_token_threshold!r}"
            )
        if self.scheduling == "sglang":
            if self.long_prefill_token_threshold:
                raise ValueError("EngineConfig.long_prefill_token_threshold must be 0 with scheduling='sglang' "
                                 "(SGLang has no such knob)")
            if self.enable_chunked_prefill and self.max_num_batched_tokens % self.block_size:
                raise ValueError(
                    f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be a multiple of "
                    f"block_size ({self.block_size}) with scheduling='sglang' (SGLang asserts chunked_prefill_size "
                    f"% page_size == 0)"
                )
        elif self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}), as vLLM requires"
            )

    def max_output_tokens(self, num_prompt_tokens: int) -> int:
        """The most output tokens the KV cache could ever hold beside a prompt of ``num_prompt_tokens`` tokens: its
        whole ``num_gpu_blocks * block_size`` tokens less the prompt, at least 1 (a prompt that cannot fit stays
        unservable; the scheduler says so)."""
        return max(self.num_gpu_blocks * self.block_size - num_prompt_tokens, 1)


@dataclass(frozen=True, slots=True)
class SGLangState:
    """SGLang's admission state that the queues do not show; what a snapshot must carry to continue exactly.

    Attributes:
        new_token_ratio: Current ratio, in (0, 1] (`SGLANG_INIT_NEW_TOKEN_RATIO` after idle).
        batch_is_full: SGLang's ``running_batch.batch_is_full``: an admission was refused for KV or the request
            cap and no request has left the running batch since, so no admission is tried.
        stale_reserved_tokens: One entry per request that finished in the last decode step and is still in
            SGLang's running batch (the next decode step filters it out): its clipped remaining output cap,
            tokens; prefill attempts before that filter still reserve it (times the ratio) and count it as running.

    Raises:
        ValueError: On construction, if new_token_ratio is outside (0, 1] or a reserved count is negative.
    """

    new_token_ratio: float = SGLANG_INIT_NEW_TOKEN_RATIO
    batch_is_full: bool = False
    stale_reserved_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 < self.new_token_ratio <= 1.0:
            raise ValueError(f"SGLangState.new_token_ratio must be in (0, 1], got {self.new_token_ratio!r}")
        if any(n < 0 for n in self.stale_reserved_tokens):
            raise ValueError(f"SGLangState.stale_reserved_tokens must be >= 0, got {self.stale_reserved_tokens!r}")


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
        ValueError: prompt + output tokens need more KV blocks than ``num_gpu_blocks``, or (vllm-v1, chunked
            prefill off) a recompute after a late preemption would need a prefill larger than
            ``max_num_batched_tokens`` (SGLang admits the first prefill of a step whatever its length).
    """
    num_max_tokens = num_prompt_tokens + num_output_tokens
    num_blocks = blocks_for_tokens(num_max_tokens, config.block_size)
    if num_blocks > config.num_gpu_blocks:
        raise ValueError(
            f"request {request_id!r} needs {num_blocks} KV blocks for {num_max_tokens} tokens, "
            f"more than num_gpu_blocks={config.num_gpu_blocks}"
        )
    if (
        not config.enable_chunked_prefill
        and config.scheduling == "vllm-v1"
        and num_max_tokens - 1 > config.max_num_batched_tokens
    ):
        raise ValueError(
            f"request {request_id!r} may need a {num_max_tokens - 1}-token prefill, more than "
            f"max_num_batched_tokens={config.max_num_batched_tokens} with chunked prefill off"
        )


def _priority_key(request: SimRequest) -> tuple[int, float]:
    return (request.priority, request.arrival_time_s)


class Scheduler:
    """FCFS (or vLLM priority) continuous-batching scheduler of one instance, vLLM V1 or SGLang rules (see the
    module docstring).

    Drive it with `schedule()` then `update_after_step(batch, now_s)`, once per engine step: every non-empty
    batch must be applied before the next `schedule()` (blocks are reserved at schedule time, tokens counted
    at update time). `add_request` and `abort_request` may be called at any point. Finished and aborted
    requests are forgotten (not returned by `get_request`). `restore_running` rebuilds a running request from a
    snapshot (`predictor.sim.snapshot`), `restore_sglang_state` the SGLang admission state; `advance_decodes`
    applies a run of identical decode steps at once (the predictor's skip-ahead, `predictor.sim.predict`), equal
    to stepping them one by one. SGLang's retractions are counted as preemptions (`num_preemptions_total`,
    `SimRequest.num_preemptions`, status PREEMPTED while waiting).

    Args:
        config: Engine settings; `config.scheduling` picks the rule set.

    Attributes:
        prefix_cache_queries: Tokens looked up in the prefix cache at admissions (first admissions only), tokens
            (vLLM ``vllm:prefix_cache_queries``); 0 under the SGLang rules.
        prefix_cache_hits: Of those, tokens found cached, tokens (vLLM ``vllm:prefix_cache_hits``).
        prefix_cache_preempted_queries, prefix_cache_preempted_hits: The same for re-admissions of preempted
            requests (vLLM's `PrefixCacheStats` counts them apart).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.waiting: collections.deque[SimRequest] = collections.deque()
        self.running: list[SimRequest] = []
        self.num_preemptions_total = 0
        self._pool = PrefixCachePool(config.num_gpu_blocks)
        self._num_blocks_held: dict[str, int] = {}
        # vLLM V1 prefix caching (requests with block keys): the ids of the cached blocks that start each keyed
        # request's block table (the rest of its held blocks are anonymous), and vLLM's prefix-cache counters.
        self._prefix_caching = config.scheduling == "vllm-v1"
        self._block_ids: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache_preempted_queries = 0
        self.prefix_cache_preempted_hits = 0
        self._requests: dict[str, SimRequest] = {}
        # SGLang rules only (see SGLangState): admission state, and what the last schedule() decided.
        self._sglang = config.scheduling == "sglang"
        self._by_priority = config.scheduling_policy == "priority"
        self._new_token_ratio = SGLANG_INIT_NEW_TOKEN_RATIO
        self._batch_is_full = False
        self._stale_reserved_tokens: list[int] = []
        self._last_batch_is_prefill = False
        self._prefill_keeps_full = False

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
        """Used / total KV blocks, in [0, 1] (vLLM `kv_cache_usage_perc` is this fraction too: cached blocks that
        no request holds count as free)."""
        return self._pool.num_used_blocks / self._pool.num_gpu_blocks

    @property
    def prefix_cache(self) -> PrefixCachePool:
        """The instance's block pool with its prefix cache (read it; do not change it)."""
        return self._pool

    def num_blocks_held(self, request_id: str) -> int:
        """KV blocks in one request's block table (0 if unknown or not running); blocks it shares with other
        requests (prefix-cache hits) count for each of them."""
        return self._num_blocks_held.get(request_id, 0)

    def cached_block_ids(self, request_id: str) -> tuple[int, ...]:
        """Ids of the cached (keyed) blocks that start a running request's block table (`PrefixCachePool`)."""
        return tuple(self._block_ids.get(request_id, ()))

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting) or bool(self.running)

    def get_request(self, request_id: str) -> SimRequest | None:
        """The unfinished request with this id, or None (unknown, finished or aborted)."""
        return self._requests.get(request_id)

    @property
    def sglang_state(self) -> SGLangState | None:
        """SGLang's admission state now (a copy), or None under the vLLM V1 rules."""
        if not self._sglang:
            return None
        return SGLangState(self._new_token_ratio, self._batch_is_full, tuple(self._stale_reserved_tokens))

    def restore_sglang_state(self, state: SGLangState) -> None:
        """Set the SGLang admission state (e.g. from a snapshot).

        Raises:
            ValueError: If this scheduler runs the vLLM V1 rules.
        """
        if not self._sglang:
            raise ValueError("restore_sglang_state needs EngineConfig.scheduling='sglang'")
        self._new_token_ratio = state.new_token_ratio
        self._batch_is_full = state.batch_is_full
        self._stale_reserved_tokens = list(state.stale_reserved_tokens)

    def sglang_max_new_tokens(self, request: SimRequest) -> int:
        """The output cap SGLang holds for `request` (its ``sampling_params.max_new_tokens``), tokens, >= 0.

        The request's own cap (`SimRequest.max_new_tokens`; None = unset, 1 << 30 as SGLang puts it), bounded so
        that its page-rounded prompt, its cap and one page stay below the KV pool (so it can always be admitted on
        an idle instance). Not the context-length bound (EngineConfig has no max_model_len).

        Source: sglang scheduler.py ``Scheduler.init_req_max_new_tokens`` (newest: ``ceil_page(input_len) +
        max_new_tokens + page_size`` strictly below ``max_total_num_tokens``).
        """
        page = self.config.block_size
        limit = self.config.num_gpu_blocks * page - blocks_for_tokens(request.num_prompt_tokens, page) * page - page - 1
        cap = (1 << 30) if request.max_new_tokens is None else request.max_new_tokens
        return max(0, min(cap, limit))

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
        if self._by_priority:
            self._enqueue_by_priority(request)
        else:
            self.waiting.append(request)

    def _enqueue_by_priority(self, request: SimRequest) -> None:
        """Insert into the waiting queue behind every request whose (priority, arrival time) is <= its own (vLLM's
        `PriorityRequestQueue` pops the smallest; equal keys here keep their insertion order, where vLLM then
        compares request ids)."""
        waiting = self.waiting
        key = _priority_key(request)
        index = len(waiting)
        while index and _priority_key(waiting[index - 1]) > key:
            index -= 1
        waiting.insert(index, request)

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
        self._check_block_keys(request)

    def _check_block_keys(self, request: SimRequest) -> None:
        keys = request.block_keys
        if keys and len(keys) * self.config.block_size > request.num_prompt_tokens + request.num_output_tokens:
            raise ValueError(
                f"request {request.request_id!r} has {len(keys)} block keys, more than the full blocks of its "
                f"{request.num_prompt_tokens + request.num_output_tokens} tokens (block_size={self.config.block_size})"
            )

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
            if self._sglang and self._is_decoding(request):
                # SGLang finishes it at its next step and filters it out at the next decode step (as a finish).
                self._stale_reserved_tokens.append(self._sglang_remaining_tokens(request))
            self.running.remove(request)
            self._free_blocks(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.ABORTED
        if self._sglang:
            self._sglang_reset_if_idle()
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
        self._check_block_keys(request)
        hit_ids: list[int] = []
        if request.block_keys and self._prefix_caching:
            # Rebuild sharing: its computed full blocks already cached (by a request restored before it) are shared.
            hit_ids = self._pool.lookup(request.block_keys, request.num_computed_tokens // self.config.block_size)
        if not self._take_blocks(request, hit_ids, num_blocks_held):
            raise ValueError(
                f"request {request.request_id!r}: {num_blocks_held} blocks wanted, {self._pool.num_free_blocks} free"
            )
        if request.block_keys and self._prefix_caching:
            self._cache_full_blocks(request, request.num_computed_tokens)
        self._requests[request.request_id] = request
        self.running.append(request)

    def restore_cached_free_blocks(self, keys: tuple[int, ...]) -> None:
        """Name free blocks as cached blocks no request holds (free but reusable), rebuilt from a snapshot
        (`InstanceSnapshot.cached_block_keys`): they go to the tail of the free queue in this order, behind the
        anonymous free blocks (`PrefixCachePool.restore_cached_free`). Ignored under the SGLang rules (no prefix
        caching there).

        Args:
            keys: Block keys, eviction order (least recently freed first).

        Raises:
            ValueError: If fewer anonymous blocks are free than keys are given.
        """
        if keys and self._prefix_caching:
            self._pool.restore_cached_free(keys)

    def hold_blocks(self, holder: str, num_blocks: int) -> bool:
        """Move ``num_blocks`` KV blocks from the free pool into a holding that no request owns (negative: back).

        A driver's work that occupies KV outside any request (the cluster benchmark's migrations:
        ``predictor.sim.engine.Engine.reserve_blocks``). Held blocks count as used (``num_free_blocks``,
        ``kv_cache_usage_frac``) and the invariant "used == sum of holdings" includes them.

        Args:
            holder: names the holding (a key of its own: it never collides with a request id).
            num_blocks: blocks to take (> 0) or give back (< 0; at most what ``holder`` holds).

        Returns:
            True if done; False (nothing changed) if fewer blocks are free than asked.

        Raises:
            ValueError: giving back more than ``holder`` holds.
        """
        key = (_HELD, holder)
        held = self._num_blocks_held.get(key, 0)  # type: ignore[call-overload]
        if num_blocks < 0 and -num_blocks > held:
            raise ValueError(f"holder {holder!r} holds {held} blocks, cannot give back {-num_blocks}")
        if num_blocks >= 0:
            if not self._pool.allocate(num_blocks):
                return False
        else:
            self._pool.free(-num_blocks)
        if held + num_blocks:
            self._num_blocks_held[key] = held + num_blocks  # type: ignore[index]
        else:
            self._num_blocks_held.pop(key, None)  # type: ignore[call-overload]
        return True

    def blocks_held_by(self, holder: str) -> int:
        """KV blocks the holding ``holder`` has (`hold_blocks`); 0 if none."""
        return self._num_blocks_held.get((_HELD, holder), 0)  # type: ignore[call-overload]

    @property
    def num_held_blocks(self) -> int:
        """KV blocks of every holding no request owns (`hold_blocks`)."""
        return sum(n for key, n in self._num_blocks_held.items() if isinstance(key, tuple))

    # ---- one step --------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Decide the next step: which requests compute how many tokens, preempting if KV runs out.

        Running requests first (schedule order), then waiting ones in FCFS order, only if nothing was
        preempted. KV blocks are reserved here for the tokens scheduled.

        Under the SGLang rules: a prefill batch if one can be formed, else a decode batch of every running
        request, retracting requests if the KV cache cannot take the step (`_schedule_sglang`).

        Returns:
            The batch; empty (no tokens) when there is nothing to run.

        Source: vllm/v1/core/sched/scheduler.py `Scheduler.schedule` (vLLM V1); see the module docstring.
        """
        if self._sglang:
            batch = self._schedule_sglang()
            self._check_invariants_sglang(batch)
            return batch
        batch = ScheduledBatch()
        preempted_before: list[str] = []
        while True:
            token_budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
            if not batch.preempted_request_ids:
                self._schedule_waiting(batch, token_budget)
            if batch.num_scheduled_tokens or not (self._by_priority and batch.preempted_request_ids):
                break
            # Priority policy only: the first running request's reservation preempted itself (it had the largest
            # key) and nothing ran. vLLM's engine runs no model for an empty schedule and calls schedule() again
            # (which may then admit waiting requests); here that next round is this step's batch, with the
            # preemptions of the empty rounds first. Each round preempts or schedules, so this ends.
            preempted_before.extend(batch.preempted_request_ids)
            batch = ScheduledBatch()
        if preempted_before:
            batch.preempted_request_ids[:0] = preempted_before
        self._check_invariants(batch)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, token_budget: int) -> int:
        """Schedule running requests in order; return the budget left."""
        index = 0
        running = self.running
        while index < len(running) and token_budget > 0:
            request = running[index]
            num_new_tokens = self._num_new_tokens(request, token_budget)
            scheduled = True
            while not self._reserve_blocks(request, num_new_tokens):
                if self._by_priority:
                    # The largest (priority, arrival). Of equal keys (vLLM's clock never gives two requests one
                    # arrival time; snapshots may) the last admitted, as under FCFS: taking the first, as max()
                    # would, lets two equal requests preempt each other's recomputation forever. One already
                    # scheduled this step gives its tokens back and the walk steps back over it.
                    victim_index = max(range(len(running)), key=lambda i: (_priority_key(running[i]), i))
                    victim = running.pop(victim_index)
                    if victim_index < index:
                        token_budget += self._remove_from_batch(batch, victim)
                        index -= 1
                else:
                    # Lowest priority under FCFS is the last running request; it may be this one.
                    victim = running.pop()
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
        block_size = self.config.block_size
        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit_ids: list[int] = []
            if request.block_keys and self._prefix_caching:
                # The last token is always recomputed (its logits are needed): hits stop at num_tokens - 1.
                hit_ids = self._pool.lookup(request.block_keys, (request.num_tokens - 1) // block_size)
            num_hit_tokens = len(hit_ids) * block_size
            num_new_tokens = request.num_tokens - num_hit_tokens
            threshold = self.config.long_prefill_token_threshold
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if not self.config.enable_chunked_prefill and num_new_tokens > token_budget:
                break
            num_new_tokens = min(num_new_tokens, token_budget)
            if hit_ids or request.block_keys:
                if not self._admit_with_hits(request, hit_ids, num_new_tokens):
                    break
            elif not self._reserve_blocks(request, num_new_tokens):
                break  # strict FCFS: nobody behind it jumps the queue
            self._record_prefix_cache_lookup(request, num_hit_tokens)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_to_batch(batch, request, num_new_tokens)
            token_budget -= num_new_tokens

    def _admit_with_hits(self, request: SimRequest, hit_ids: list[int], num_new_tokens: int) -> bool:
        """Blocks for a keyed waiting request: take its hit blocks and new ones for `num_new_tokens` more tokens,
        cache its newly full blocks, and start it at the hit; False (nothing changed) if the blocks are short.

        Source: kv_cache_manager.py `KVCacheManager.allocate_slots` (blocks to allocate = new blocks + hit blocks
        that are free, checked against the free blocks; hits touched before new blocks are taken, so the request
        never evicts its own hits; `cache_full_blocks` up to the tokens scheduled).
        """
        block_size = self.config.block_size
        num_hit_tokens = len(hit_ids) * block_size
        if not self._take_blocks(request, hit_ids, blocks_for_tokens(num_hit_tokens + num_new_tokens, block_size)):
            return False
        request.num_computed_tokens = num_hit_tokens
        self._cache_full_blocks(request, num_hit_tokens + num_new_tokens)
        return True

    def _take_blocks(self, request: SimRequest, hit_ids: list[int], num_blocks: int) -> bool:
        """Give a request that holds nothing a table of `num_blocks` blocks starting with the cached `hit_ids`;
        False (nothing changed) if fewer blocks are free than the new ones plus the free hit blocks."""
        num_new_blocks = num_blocks - len(hit_ids)
        if num_new_blocks + self._pool.num_free_among(hit_ids) > self._pool.num_free_blocks:
            return False
        self._pool.touch(hit_ids)
        allocated = self._pool.allocate(num_new_blocks)
        assert allocated
        self._num_blocks_held[request.request_id] = num_blocks
        if hit_ids:
            self._block_ids[request.request_id] = hit_ids
        return True

    def _cache_full_blocks(self, request: SimRequest, num_tokens: int) -> None:
        """Name by their keys the blocks of a keyed request that `num_tokens` tokens fill (those it holds).

        Source: block_pool.py `BlockPool.cache_full_blocks`, called by `KVCacheManager.allocate_slots` for the
        tokens scheduled (``min(num_computed + num_new, num_tokens)``).
        """
        keys = request.block_keys
        assert keys is not None
        num_full = min(num_tokens // self.config.block_size, len(keys))
        block_ids = self._block_ids.get(request.request_id)
        if block_ids is None:
            if not num_full:
                return
            block_ids = self._block_ids[request.request_id] = []
        if num_full > len(block_ids):
            block_ids.extend(self._pool.cache_blocks(keys[len(block_ids):num_full]))

    def _record_prefix_cache_lookup(self, request: SimRequest, num_hit_tokens: int) -> None:
        """Count an admitted request's prefix-cache lookup (every request is looked up; one without keys misses)
        and set its cached-token count at its first admission.

        Source: kv_cache_manager.py `KVCacheManager.record_prefix_cache_stats` (called by the scheduler at
        admission: "unscheduled lookups are not counted"), vllm/v1/metrics/stats.py `PrefixCacheStats.record`
        (queries += num_tokens, hits += hit tokens; recomputations of preempted requests counted apart), exported
        as ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``; vllm/v1/core/sched/scheduler.py (``if
        request.num_cached_tokens < 0: request.num_cached_tokens = num_computed_tokens``).
        """
        if not self._prefix_caching:
            return
        if request.num_preemptions:
            self.prefix_cache_preempted_queries += request.num_tokens
            self.prefix_cache_preempted_hits += num_hit_tokens
        else:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_hit_tokens

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
            if request.block_keys and self._prefix_caching:
                self._cache_full_blocks(request, request.num_computed_tokens + num_new_tokens)
            return True
        if not self._pool.allocate(num_needed - num_held):
            return False
        self._num_blocks_held[request.request_id] = num_needed
        if request.block_keys and self._prefix_caching:
            self._cache_full_blocks(request, request.num_computed_tokens + num_new_tokens)
        return True

    def _free_blocks(self, request: SimRequest) -> None:
        """Free a request's blocks; its cached ones stay reusable, its tail is evicted first
        (`PrefixCachePool.release`)."""
        num_held = self._num_blocks_held.pop(request.request_id, 0)
        block_ids = self._block_ids.pop(request.request_id, None)
        if block_ids:
            self._pool.release(block_ids, num_held - len(block_ids))
        else:
            self._pool.free(num_held)

    def _preempt(self, request: SimRequest, batch: ScheduledBatch, to_front: bool = True) -> None:
        """Free all blocks of a (removed) running request and put it back in the waiting queue: at the front (vLLM
        V1's preemption) or, ``to_front=False``, at the end (SGLang's retraction)."""
        self._free_blocks(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        if self._by_priority:
            self._enqueue_by_priority(request)  # vLLM's PriorityRequestQueue.prepend_request = add_request
        elif to_front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)
        batch.preempted_request_ids.append(request.request_id)
        logger.debug("%s %s (%d times)", "preempted" if to_front else "retracted", request.request_id,
                     request.num_preemptions)

    @staticmethod
    def _remove_from_batch(batch: ScheduledBatch, request: SimRequest) -> int:
        """Undo `_add_to_batch` for a request scheduled earlier in this step (before its counters change); return
        the tokens it had."""
        num_new_tokens = batch.num_scheduled_tokens.pop(request.request_id)
        num_computed = request.num_computed_tokens
        if num_new_tokens == 1 and num_computed >= request.num_prompt_tokens:
            batch.num_decode_seqs -= 1
            batch.decode_context_tokens -= num_computed + 1
        else:
            batch.num_prefill_tokens -= num_new_tokens
            batch.prefill_attention_work -= num_new_tokens * (num_computed + num_new_tokens)
        return num_new_tokens

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
        assert self._pool.num_used_blocks == sum(self._num_blocks_held.values()) - self._pool.num_extra_refs
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
        if self._sglang:
            self._sglang_after_step(batch, output)
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
            if request.block_keys and self._prefix_caching:
                # Stepping caches at each schedule() up to computed + 1 tokens: after the run, up to its new context.
                self._cache_full_blocks(request, request.num_computed_tokens)
        if self._sglang:
            # Each of the num_steps - 1 skipped decode steps decays the ratio once, as stepping would (one by one:
            # the same float result as stepping).
            for _ in range(num_steps - 1):
                self._sglang_decay_ratio()

    # ---- SGLang rules --------------------------------------------------------------------------------------
    # Source of everything below: sgl-project/sglang python/sglang/srt/managers/ (see the module docstring).

    @staticmethod
    def _is_decoding(request: SimRequest) -> bool:
        """SGLang: in the decode batch (prefill done: KV covers all but the newest sampled token); otherwise the
        request is a partial prefill (SGLang's chunked request, or a recomputation after retraction)."""
        return request.num_generated_tokens >= 1 and request.num_computed_tokens == request.num_tokens - 1

    def _sglang_remaining_tokens(self, request: SimRequest) -> int:
        """Output tokens SGLang reserves for a running request before the ratio: its remaining cap, clipped.

        Source: schedule_policy.py `PrefillAdder._get_running_request_total_token_offset`
        (``min(max_new_tokens - len(output_ids), CLIP_MAX_NEW_TOKENS)``; here never below 0).
        """
        num_left = self.sglang_max_new_tokens(request) - request.num_generated_tokens
        return min(max(num_left, 0), SGLANG_CLIP_MAX_NEW_TOKENS)

    def _sglang_decay_ratio(self) -> None:
        """Source: `NewTokenRatioTracker.decay_step`, once per decode step without retraction."""
        self._new_token_ratio = max(self._new_token_ratio - SGLANG_NEW_TOKEN_RATIO_DECAY, SGLANG_MIN_NEW_TOKEN_RATIO)

    def _sglang_reset_if_idle(self) -> None:
        """Source: scheduler.py `Scheduler.on_idle` (`NewTokenRatioTracker.reset` once nothing waits or runs)."""
        if not self.waiting and not self.running:
            self._new_token_ratio = SGLANG_INIT_NEW_TOKEN_RATIO
            self._batch_is_full = False
            self._stale_reserved_tokens.clear()

    def _schedule_sglang(self) -> ScheduledBatch:
        """`schedule()` under the SGLang rules.

        Prefill first when a prefill batch can be formed, else decode; the decode path first filters out the
        requests that finished in the last decode step (a smaller batch clears batch_is_full). With nothing to
        decode, SGLang's event loop idles through the iteration and tries again at once in the state the filter
        left; so does this. States SGLang does not reach (partial prefills that hold the KV between them, a full
        mark on an empty batch; only from snapshots) would make no progress: the last partial prefill is then
        retracted, or the mark dropped (sim-only rules, so that every call with work makes progress).

        Source: scheduler.py `Scheduler.get_next_batch_to_run` ("Run prefill first if possible"),
        `update_running_batch` (`filter_batch`, then ``batch_is_full = False`` if the batch shrank).
        """
        self._last_batch_is_prefill = False
        retracted_ids: list[str] = []
        dropped_full_mark = False
        while True:
            batch = self._sglang_try_prefill()
            if batch.num_scheduled_tokens:
                break
            filtered = bool(self._stale_reserved_tokens)
            if filtered:
                self._stale_reserved_tokens.clear()
                self._batch_is_full = False
            decodes = [r for r in self.running if self._is_decoding(r)]
            if decodes:
                batch = self._sglang_decode(decodes)
                break
            if filtered:
                continue
            if self.running:
                victim = self.running.pop()  # all partial prefills here
                self._retract(victim, batch)
                retracted_ids.extend(batch.preempted_request_ids)
                continue
            if self.waiting and self._batch_is_full and not dropped_full_mark:
                self._batch_is_full = False
                dropped_full_mark = True
                continue
            break  # nothing waits or runs, or blocks held outside the requests keep the head out
        batch.preempted_request_ids[:0] = retracted_ids
        return batch

    def _sglang_try_prefill(self) -> ScheduledBatch:
        """A prefill batch: partial prefills continue first (schedule order), then waiting requests, FCFS.

        Returns:
            The batch; empty when no prefill is possible (nothing waits, or batch_is_full, and no partial prefill;
            or nothing fits).

        Source: scheduler.py `Scheduler._get_new_batch_prefill_raw` (no attempt while ``batch_is_full`` or the
        queue is empty, unless a chunked request is pending; `PrefillAdder` built with the running batch's
        reservations; `add_chunked_req` before the waiting loop).
        """
        batch = ScheduledBatch()
        decodes: list[SimRequest] = []
        partials: list[SimRequest] = []
        for request in self.running:
            (decodes if self._is_decoding(request) else partials).append(request)
        if not partials and (not self.waiting or self._batch_is_full):
            return batch
        cfg = self.config
        ratio = self._new_token_ratio
        reserved = 0.0
        for request in decodes:
            reserved += self._sglang_remaining_tokens(request) * ratio
        for num_tokens in self._stale_reserved_tokens:
            reserved += num_tokens * ratio
        budget = _PrefillBudget(
            avail_tokens=self._pool.num_free_blocks * cfg.block_size,
            total_offset=reserved,
            rem_chunk_tokens=cfg.max_num_batched_tokens if cfg.enable_chunked_prefill else None,
            rem_input_tokens=cfg.max_num_batched_tokens,
            page_size=cfg.block_size,
        )
        for request in partials:
            self._sglang_continue_prefill(batch, budget, request)
        instance_idle = not decodes and not partials and not self._stale_reserved_tokens
        self._sglang_admit_waiting(batch, budget, instance_idle)
        if batch.num_scheduled_tokens:
            self._last_batch_is_prefill = True
            # SGLang replaces an empty running batch by the prefill batch, dropping its full mark.
            self._prefill_keeps_full = bool(decodes) or bool(self._stale_reserved_tokens)
        return batch

    def _sglang_continue_prefill(self, batch: ScheduledBatch, budget: _PrefillBudget, request: SimRequest) -> None:
        """Next chunk of a partial prefill: the rest of it, capped by the chunk budget and the KV tokens left
        after reservations; none (the request waits, holding its KV) if nothing is left.

        Source: schedule_policy.py `PrefillAdder.add_chunked_req` (chunk = min(rest, rem_chunk_tokens,
        rem_total_tokens); the output cap is reserved only with the last chunk; `_update_prefill_budget`).
        """
        num_rest = request.num_tokens - request.num_computed_tokens
        num_cap = int(budget.rem_total_tokens)
        if budget.rem_chunk_tokens is not None:
            num_cap = min(num_cap, budget.rem_chunk_tokens)
        if num_cap <= 0:
            return
        num_new_tokens = min(num_rest, num_cap)
        reserved = self._reserve_blocks(request, num_new_tokens)
        assert reserved, "the rem_total_tokens cap keeps a chunk within the free KV"
        self._add_prefill_to_batch(batch, request, num_new_tokens)
        num_cap_tokens = 0 if num_new_tokens < num_rest else min(self.sglang_max_new_tokens(request),
                                                                  SGLANG_CLIP_MAX_NEW_TOKENS)
        budget.charge(num_new_tokens, num_cap_tokens)

    def _sglang_admit_waiting(self, batch: ScheduledBatch, budget: _PrefillBudget, instance_idle: bool) -> None:
        """Admit waiting requests in FCFS order while the request cap, the reservations and the chunk budget allow;
        a refusal for KV or the request cap sets batch_is_full.

        A request is admitted if prompt (+ generated, for a recomputation) + clipped remaining cap + one page <
        rem_total_tokens; a prompt longer than the chunk budget left is cut to a page-aligned first chunk (with no
        cap reserved). Sim-only: on an idle instance (nothing runs, nothing admitted yet) the head is admitted
        whatever its cap if its prefill fits the free KV (SGLang's request validation guarantees it would fit;
        inputs here need not).

        Source: scheduler.py `Scheduler._get_new_batch_prefill_raw` (the waiting loop: ``batch_is_full`` when
        ``len(can_run_list) >= get_num_allocatable_reqs(running_bs)`` or on NO_TOKEN); schedule_policy.py
        `PrefillAdder.add_one_req` / `_select_prefill_admission` (``total_tokens >= rem_total_tokens`` ->
        NO_TOKEN, then the chunk cut), `_update_prefill_budget`, `budget_state`.
        """
        cfg = self.config
        page = cfg.block_size
        while self.waiting:
            if len(self.running) + len(self._stale_reserved_tokens) >= cfg.max_num_seqs:
                self._batch_is_full = True
                break
            if self._batch_is_full:
                break
            request = self.waiting[0]
            num_extend_tokens = request.num_tokens - request.num_computed_tokens
            num_max_new_tokens = self.sglang_max_new_tokens(request)
            num_total_tokens = (num_extend_tokens + page
                                + min(max(num_max_new_tokens - request.num_generated_tokens, 0),
                                      SGLANG_CLIP_MAX_NEW_TOKENS))
            idle_head = (instance_idle and not batch.num_scheduled_tokens
                         and blocks_for_tokens(num_extend_tokens, page) <= self._pool.num_free_blocks)
            if num_total_tokens >= budget.rem_total_tokens and not idle_head:
                self._batch_is_full = True
                break
            num_paged_tokens = blocks_for_tokens(num_extend_tokens, page) * page
            num_cap_tokens = min(num_max_new_tokens, SGLANG_CLIP_MAX_NEW_TOKENS)
            num_new_tokens = num_extend_tokens
            if budget.rem_chunk_tokens is None:
                if batch.num_scheduled_tokens and num_paged_tokens >= budget.rem_input_tokens:
                    break  # max_prefill_tokens; the first request of a step is admitted whatever its length
            elif num_paged_tokens > budget.rem_chunk_tokens:
                num_new_tokens = budget.rem_chunk_tokens // page * page
                num_cap_tokens = 0
                if num_new_tokens <= 0:
                    break
            reserved = self._reserve_blocks(request, num_new_tokens)
            assert reserved, "an admitted prefill fits the free KV (total_tokens < rem_total_tokens)"
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_prefill_to_batch(batch, request, num_new_tokens)
            budget.charge(num_new_tokens, num_cap_tokens)
            if budget.rem_total_tokens <= 0 or budget.cur_rem_tokens <= 0:
                self._batch_is_full = True
                break
            if budget.rem_chunk_tokens is not None and budget.rem_chunk_tokens <= 0:
                break
            if budget.rem_chunk_tokens is None and budget.rem_input_tokens <= 0:
                break

    def _num_new_blocks(self, requests: list[SimRequest]) -> int:
        """Blocks the next decode step of `requests` needs beyond those they hold (one token each)."""
        block_size = self.config.block_size
        held = self._num_blocks_held
        total = 0
        for request in requests:
            extra = blocks_for_tokens(request.num_computed_tokens + 1, block_size) - held.get(request.request_id, 0)
            if extra > 0:
                total += extra
        return total

    def _sglang_decode(self, decodes: list[SimRequest]) -> ScheduledBatch:
        """A decode batch of `decodes` (running order), after retracting requests if their next tokens do not fit
        the free KV; otherwise the ratio decays by one step.

        Source: scheduler.py `Scheduler.update_running_batch` (`ScheduleBatch.check_decode_mem`: the new pages of
        the step must be free; else `retract_decode`; else `NewTokenRatioTracker.decay_step`).
        """
        batch = ScheduledBatch()
        if self._num_new_blocks(decodes) > self._pool.num_free_blocks:
            decodes = self._sglang_retract(decodes, batch)
        else:
            self._sglang_decay_ratio()
        for request in decodes:
            reserved = self._reserve_blocks(request, 1)
            assert reserved, "retraction leaves room for the decode step"
            self._add_decode_to_batch(batch, request)
        return batch

    def _sglang_retract(self, decodes: list[SimRequest], batch: ScheduledBatch) -> list[SimRequest]:
        """Retract decoding requests until the next decode step of the rest fits; return the rest, running order.

        Victims: at least one, the request with the fewest output tokens first (the longest prompt first among
        equals), never the last one; each goes to the END of the waiting queue and recomputes later. Then
        new_token_ratio = min(1, (sum generated + 20 * n) / (sum max_new_tokens + 1)) over the n survivors.
        Sim-only: if the last survivor still does not fit beside partial prefills (SGLang aborts it), partial
        prefills are retracted instead, last first.

        Source: schedule_batch.py `ScheduleBatch.retract_decode` (sort by (len(output_ids), -len(origin_input_ids)),
        reverse; pop from the end ``while first_iter or not check_decode_mem``; stop at one request),
        `NewTokenRatioTracker.estimate_new_token_ratio_after_retract`; scheduler.py
        `Scheduler._add_request_to_queue` (append).
        """
        order = sorted(decodes, key=lambda r: (r.num_generated_tokens, -r.num_prompt_tokens), reverse=True)
        first_iter = True
        while first_iter or self._num_new_blocks(order) > self._pool.num_free_blocks:
            if len(order) == 1:
                break
            first_iter = False
            victim = order.pop()
            self.running.remove(victim)
            self._retract(victim, batch)
        if self._num_new_blocks(order) > self._pool.num_free_blocks:
            for victim in [r for r in reversed(self.running) if not self._is_decoding(r)]:
                self.running.remove(victim)
                self._retract(victim, batch)
                if self._num_new_blocks(order) <= self._pool.num_free_blocks:
                    break
        survivors = {id(r) for r in order}
        kept = [r for r in decodes if id(r) in survivors]
        num_generated = sum(r.num_generated_tokens for r in kept)
        num_max_new = sum(self.sglang_max_new_tokens(r) for r in kept)
        self._new_token_ratio = min(1.0, (num_generated + SGLANG_RETRACT_DECODE_STEPS * len(kept)) / (num_max_new + 1))
        if len(kept) < len(decodes):
            self._batch_is_full = False
        return kept

    def _retract(self, request: SimRequest, batch: ScheduledBatch) -> None:
        """Free all blocks of a (removed) running request and append it to the END of the waiting queue."""
        self._preempt(request, batch, to_front=False)

    def _sglang_after_step(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """State changes of an applied step that SGLang makes when it merges or filters its batches.

        After a prefill step the full mark is dropped if the batch left a chunked request, had a request finish,
        or the running batch was empty (it is replaced); after a decode step the finished requests stay in the
        running batch (reserved, counted) until the next decode step filters them; idle resets the ratio.

        Source: scheduler.py `Scheduler.get_next_batch_to_run` (``last_batch.filter_batch(chunked_req_to_exclude)``,
        ``batch_is_full = False`` if it shrank, ``running_batch = last_batch`` if empty), `on_idle`.
        """
        if self._last_batch_is_prefill:
            left_chunk = False
            for request_id in batch.num_scheduled_tokens:
                request = self._requests.get(request_id)
                if request is not None and request.status == RequestStatus.RUNNING and not self._is_decoding(request):
                    left_chunk = True
                    break
            if not self._prefill_keeps_full or output.finished or left_chunk:
                self._batch_is_full = False
        else:
            for request in output.finished:
                self._stale_reserved_tokens.append(self._sglang_remaining_tokens(request))
        self._sglang_reset_if_idle()

    @staticmethod
    def _add_prefill_to_batch(batch: ScheduledBatch, request: SimRequest, num_new_tokens: int) -> None:
        batch.num_scheduled_tokens[request.request_id] = num_new_tokens
        batch.num_prefill_tokens += num_new_tokens
        batch.prefill_attention_work += num_new_tokens * (request.num_computed_tokens + num_new_tokens)

    @staticmethod
    def _add_decode_to_batch(batch: ScheduledBatch, request: SimRequest) -> None:
        batch.num_scheduled_tokens[request.request_id] = 1
        batch.num_decode_seqs += 1
        batch.decode_context_tokens += request.num_computed_tokens + 1

    def _check_invariants_sglang(self, batch: ScheduledBatch) -> None:
        cfg = self.config
        assert batch.total_num_scheduled_tokens == sum(batch.num_scheduled_tokens.values())
        if batch.num_decode_seqs:
            assert batch.num_prefill_tokens == 0 and batch.num_decode_seqs == batch.num_seqs <= cfg.max_num_seqs
        elif cfg.enable_chunked_prefill:
            assert batch.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(self.running) <= cfg.max_num_seqs
        assert self._pool.num_used_blocks == sum(self._num_blocks_held.values()) - self._pool.num_extra_refs
        assert self._pool.num_free_blocks + self._pool.num_used_blocks == cfg.num_gpu_blocks
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert 0.0 < self._new_token_ratio <= 1.0


@dataclass(slots=True)
class _PrefillBudget:
    """SGLang `PrefillAdder`'s budgets during one prefill attempt.

    Attributes:
        avail_tokens: Free KV tokens when the attempt started (SGLang allocates after the adder has decided).
        total_offset: Tokens reserved: running requests' ratio-scaled remaining caps, then per admitted chunk its
            page-rounded tokens, one page and (last chunk only) its clipped cap (`rem_total_token_offset`).
        rem_chunk_tokens: Chunk budget left (`chunked_prefill_size`), tokens; None with chunked prefill off.
        rem_input_tokens: Prefill budget left (`max_prefill_tokens`), tokens; binds only with chunked prefill off.
        page_size: Tokens per KV page.
        cur_offset: Tokens this batch allocates, page-rounded, plus one page per chunk (`cur_rem_token_offset`).

    Source: schedule_policy.py `PrefillAdder.__init__`, `rem_total_tokens`, `cur_rem_tokens`,
    `_update_prefill_budget` (newest: each charge also includes one page of alignment overhead).
    """

    avail_tokens: int
    total_offset: float
    rem_chunk_tokens: int | None
    rem_input_tokens: int
    page_size: int
    cur_offset: int = 0

    @property
    def rem_total_tokens(self) -> float:
        """KV tokens left for admission after every reservation (may be negative), tokens."""
        return self.avail_tokens - self.total_offset

    @property
    def cur_rem_tokens(self) -> int:
        """KV tokens left after this batch's allocations, tokens."""
        return self.avail_tokens - self.cur_offset

    def charge(self, num_new_tokens: int, num_cap_tokens: int) -> None:
        """Charge one admitted chunk of `num_new_tokens` tokens reserving `num_cap_tokens` output tokens."""
        page = self.page_size
        num_paged_tokens = blocks_for_tokens(num_new_tokens, page) * page
        self.total_offset += num_paged_tokens + num_cap_tokens + page
        self.cur_offset += num_paged_tokens + page
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= num_paged_tokens
        self.rem_input_tokens -= num_paged_tokens
