"""One request as the simulated engine (vLLM V1 or SGLang rules) sees it.

Owns `SimRequest` (token counters and timestamps of one request) and its lifecycle enum
`RequestStatus`. Imports only the standard library; no I/O.

NOTE: status graph, enforced by `predictor.sim.scheduler.Scheduler`:
WAITING -> RUNNING -> (PREEMPTED -> RUNNING)* -> FINISHED, and any unfinished state -> ABORTED.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class RequestStatus(enum.IntEnum):
    """Lifecycle of a `SimRequest` (a subset of vLLM V1 `RequestStatus`)."""

    WAITING = 0
    """Never scheduled yet."""
    RUNNING = 1
    """In the running list; may hold KV blocks."""
    PREEMPTED = 2
    """Blocks freed, back at the FRONT of the waiting queue (as vLLM V1 does); will recompute."""
    FINISHED = 3
    """Generated all its output tokens."""
    ABORTED = 4
    """Removed by `Scheduler.abort_request`."""


@dataclass(slots=True)
class SimRequest:
    """Token counters and timestamps of one request.

    Attributes:
        request_id: Unique id among the scheduler's unfinished requests.
        num_prompt_tokens: Prompt length in tokens, >= 1.
        num_output_tokens: Tokens the request generates before it finishes, >= 1 (the true length in the
            emulator, a predicted one in the predictor).
        arrival_time_s: Arrival time in seconds on the driver's clock (virtual or `time.monotonic()`).
        num_computed_tokens: Tokens whose KV is in the cache (vLLM `num_computed_tokens`); reset to 0 on
            preemption.
        num_generated_tokens: Output tokens sampled so far.
        status: Lifecycle state.
        first_token_time_s: End time of the step that sampled the first output token, seconds; None before.
        finish_time_s: End time of the step that sampled the last output token, seconds; None before.
        num_preemptions: Times this request was preempted (vLLM) or retracted (SGLang).
        max_new_tokens: The request's output cap (OpenAI ``max_tokens``, SGLang ``sampling_params.max_new_tokens``),
            tokens, >= 1; None = not set by the client. Read only by the SGLang rules, which reserve KV for it
            (`predictor.sim.scheduler.Scheduler.sglang_max_new_tokens`); it does not stop the request (that is
            num_output_tokens), and the vLLM V1 rules ignore it.
        block_keys: Keys of the request's full KV blocks, first block first (`predictor.sim.block_hash.block_keys`
            over its token ids with the instance's block size): at least the prompt's full blocks, and may go on
            over output tokens the driver knows (so that a recomputation after preemption, or a later request
            that extends this one, can hit them); at most (prompt + output tokens) // block_size keys. None or ()
            = unknown tokens: the request never hits the prefix cache and leaves nothing in it (the behaviour
            without prefix caching). Read only by the vLLM V1 rules (`predictor.sim.scheduler`).
        num_cached_tokens: Prompt tokens found in the prefix cache at the request's first admission (vLLM
            `Request.num_cached_tokens`, reported as ``usage.prompt_tokens_details.cached_tokens``); None before
            its first admission.
        priority: Scheduling priority as vLLM reads it (`Request.priority`: LOWER is served earlier; default 0).
            Read only under ``EngineConfig.scheduling_policy == "priority"`` (vllm-v1 rules): the waiting queue
            is ordered by (priority, arrival_time_s) and a preemption takes the running request with the largest
            (priority, arrival_time_s). The Inference Extension's priority runs the other way (higher = more
            important, negative = sheddable): `vllm_priority` converts it.

    Raises:
        ValueError: On construction, if a token count is out of range.
    """

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_time_s: float
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    first_token_time_s: float | None = None
    finish_time_s: float | None = None
    num_preemptions: int = 0
    max_new_tokens: int | None = None
    block_keys: tuple[int, ...] | None = None
    num_cached_tokens: int | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(f"request {self.request_id}: num_prompt_tokens must be >= 1, got {self.num_prompt_tokens}")
        if self.num_output_tokens < 1:
            raise ValueError(f"request {self.request_id}: num_output_tokens must be >= 1, got {self.num_output_tokens}")
        if not 0 <= self.num_generated_tokens <= self.num_output_tokens:
            raise ValueError(
                f"request {self.request_id}: num_generated_tokens must be in [0, {self.num_output_tokens}], "
                f"got {self.num_generated_tokens}"
            )
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_new_tokens must be >= 1 or None, got {self.max_new_tokens}")
        if not 0 <= self.num_computed_tokens <= self.num_tokens:
            raise ValueError(
                f"request {self.request_id}: num_computed_tokens must be in [0, {self.num_tokens}], "
                f"got {self.num_computed_tokens}"
            )

    @property
    def num_tokens(self) -> int:
        """Prompt plus sampled output tokens (vLLM `Request.num_tokens`)."""
        return self.num_prompt_tokens + self.num_generated_tokens

    @property
    def is_finished(self) -> bool:
        """True once the request is FINISHED or ABORTED."""
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)


def vllm_priority(objective_priority: int) -> int:
    """The vLLM request priority (lower = earlier) for an Inference Extension objective priority (higher = more
    important; negative = sheddable): its negation, so priority 0 stays 0 and a sheddable -1 becomes 1.

    Source: vLLM's OpenAI server, ``priority`` request field ("lower values mean earlier handling", default 0,
    vllm/entrypoints/openai/protocol.py); the Gateway API Inference Extension's InferenceObjective ``priority``
    (api/v1alpha2 inferenceobjective_types.go: higher is more critical).
    """
    return -int(objective_priority)
