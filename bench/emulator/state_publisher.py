"""The emulator's engine-state file: the vLLM plugin's format (`predictor.vllm_plugin.publisher`), read from the
emulator's ``predictor.sim.Scheduler``, so a sidecar beside an emulator can run with ``--state-source vllm-plugin``.

Owns `collect_sim` (the collector for a sim scheduler) and `sim_state_publisher`; when and how the file is
written (rate limit, idle/busy edges, writer thread, atomic replace) is the shared `StatePublisher`'s. Imports
``predictor.sim`` and ``predictor.vllm_plugin.publisher`` (stdlib only); nothing here imports aiohttp.

Why here: ``predictor.sim`` must know no file format or service, and production code must not carry what only
the emulator uses. And the collector needs something only the emulator knows: each request's ``max_tokens``
cap. A ``SimRequest`` carries the *true* output length, which the file must not reveal (vLLM does not know it
either, and the sidecar would predict from the answer); the emulator passes the client's cap instead.

Differences from vLLM's file (Source: `predictor.vllm_plugin.publisher.collect_vllm`, vLLM 0.32):
``num_gpu_blocks`` is the sim's as is (the sim has no null block); ``num_blocks_held`` is the real count (a dict
lookup here; 0 for waiting requests), where vLLM writes null. Published during a step (after an ``add_request``
or an abort), the counters are those before the step: the sim counts a step's tokens at its end, vLLM when it
schedules them; the step's blocks are already reserved in both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from predictor.sim import Scheduler, SimRequest
from predictor.vllm_plugin.publisher import SchedulerState, StatePublisher

logger = logging.getLogger(__name__)


def collect_sim(scheduler: Scheduler, max_tokens_of: Callable[[str], int | None]) -> SchedulerState:
    """The state of a ``predictor.sim.Scheduler`` in the plugin's format.

    Args:
        scheduler: the emulator's scheduler (only read).
        max_tokens_of: request id -> its ``max_tokens`` cap in tokens, or None if unknown.
    """
    def row(request: SimRequest, num_blocks_held: int) -> list:
        return [request.request_id, request.num_prompt_tokens, request.num_computed_tokens,
                request.num_generated_tokens, max_tokens_of(request.request_id), num_blocks_held,
                request.num_preemptions]

    config = scheduler.config
    priorities = None
    engine = {"max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
              "block_size": config.block_size, "num_gpu_blocks": config.num_gpu_blocks,
              "enable_chunked_prefill": config.enable_chunked_prefill}
    if config.scheduling_policy == "priority":  # ages on the scheduler's clock: only their order is read
        engine["scheduling_policy"] = config.scheduling_policy
        latest_s = max((r.arrival_time_s for r in (*scheduler.running, *scheduler.waiting)), default=0.0)
        priorities = [[r.priority, latest_s - r.arrival_time_s] for r in (*scheduler.running, *scheduler.waiting)]
    return SchedulerState(
        engine=engine, num_free_blocks=scheduler.num_free_blocks,
        running=[row(r, scheduler.num_blocks_held(r.request_id)) for r in scheduler.running],
        waiting=[row(r, 0) for r in scheduler.waiting], priorities=priorities)


def sim_state_publisher(path: str, min_interval_s: float, max_tokens_of: Callable[[str], int | None], *,
                        synchronous: bool = False) -> StatePublisher:
    """A `StatePublisher` for a sim scheduler: call its ``maybe_publish(scheduler)`` where vLLM's plugin does.

    Args:
        path: state file (its folder must exist); put it on /dev/shm.
        min_interval_s: least time between two writes while the engine stays busy, seconds (0 = every call).
        max_tokens_of: see `collect_sim`.
        synchronous: write on the caller's thread (tests) instead of the writer thread.
    """
    return StatePublisher(path, min_interval_s, synchronous=synchronous,
                          collector=lambda scheduler: collect_sim(scheduler, max_tokens_of))
