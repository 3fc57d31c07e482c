"""Virtual-time driver of one simulated vLLM V1 instance.

Owns `Engine` (a `Scheduler` plus a virtual clock advanced by a `BatchTimeModel`) and
`measure_capacity_qps`. Used by the cluster benchmark, the predictor and the demo's capacity estimate; the
wall-clock emulator drives `Scheduler` directly instead. Pure and synchronous: imports only the standard
library and `predictor.sim`; no I/O, no asyncio, no grpc, no real clock.

NOTE: steps are atomic: a step that starts at t ends at t + step_time_s(batch) and its tokens appear at its
end. Requests whose arrival_time_s lies ahead of the clock are held back until the clock reaches them.
The virtual clock never decreases.

NOTE: three hooks let a driver model work that shares the GPU with the engine (the cluster benchmark's live
KV-cache migration, ``bench.migration``); with none used the engine behaves exactly as without them:
- `stall_until(t)`: no step starts before virtual time t (a copy that blocks the engine);
- `step_time_factor`: every step's time is multiplied by it while it differs from 1.0 (a copy running
  concurrently on another CUDA stream that slows the steps);
- `reserve_blocks` / `release_reserved_blocks`: KV blocks taken from the instance's pool and held by no request
  (a migration's destination pre-allocation, or a migrating request's source copy while it is stalled). The
  scheduler sees them as used: `num_free_blocks` and `kv_cache_usage_frac` count them, and its invariant
  "used == sum of blocks held" still holds (`Scheduler.hold_blocks`). Snapshots (`InstanceSnapshot.from_scheduler`) copy
  requests only, so predictions do not see reservations.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from predictor.sim.batch_time import BatchTimeModel
from predictor.sim.request import SimRequest
from predictor.sim.scheduler import EngineConfig, ScheduledBatch, Scheduler, StepOutput

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class StepResult:
    """One executed step.

    Attributes:
        start_s: Virtual time the step started, seconds.
        duration_s: Its execution time from the batch-time model, seconds.
        batch: What it computed.
        output: What it produced (applied at start_s + duration_s).
    """

    start_s: float
    duration_s: float
    batch: ScheduledBatch
    output: StepOutput


class Engine:
    """One simulated instance in virtual time.

    Args:
        config: Engine settings.
        batch_time: Step execution-time model.
        now_s: Initial virtual time, seconds.

    Attributes:
        step_time_factor: Factor on every step's time from the batch-time model (> 0; 1.0 = as modelled). A
            driver raises it while other work slows the GPU's steps; a step takes the factor in force when it
            starts.
        stalled_until_s: No step starts before this virtual time, seconds (-inf = never stalled); see
            `stall_until`.
        extra_step_time_s: Seconds of step time added by `step_time_factor` > 1 so far (virtual time).
        stalled_s: Seconds of stall imposed while the engine had requests to run, so far (virtual time).
    """

    def __init__(self, config: EngineConfig, batch_time: BatchTimeModel, now_s: float = 0.0) -> None:
        self.scheduler = Scheduler(config)
        self.batch_time = batch_time
        self.now_s = float(now_s)
        self.step_time_factor = 1.0
        self.stalled_until_s = -math.inf
        self.extra_step_time_s = 0.0
        self.stalled_s = 0.0
        # Future arrivals: (arrival_time_s, insertion seq, request); seq keeps equal times in FCFS order.
        self._pending: list[tuple[float, int, SimRequest]] = []
        self._pending_ids: set[str] = set()
        self._seq = itertools.count()
        # Set when reservations left the scheduler nothing it could run: the queue state it failed on.
        self._starved_on: tuple[int, int, str | None] | None = None

    def add_request(self, request: SimRequest) -> None:
        """Submit a request; it joins the waiting queue once the clock reaches its arrival_time_s.

        Args:
            request: As for `Scheduler.add_request`.

        Raises:
            ValueError: As `Scheduler.add_request` (checked now, even for a future arrival).
        """
        if request.request_id in self._pending_ids or self.scheduler.get_request(request.request_id) is not None:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        if request.arrival_time_s <= self.now_s:
            self.scheduler.add_request(request)
            return
        # Validate now so the caller sees the error at submission, not at a later step.
        self.scheduler.validate_request(request)
        heapq.heappush(self._pending, (request.arrival_time_s, next(self._seq), request))
        self._pending_ids.add(request.request_id)

    @property
    def num_pending_arrivals(self) -> int:
        """Submitted requests whose arrival time is still ahead of the clock."""
        return len(self._pending)

    def has_work(self) -> bool:
        """True while any request waits, runs or has yet to arrive."""
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    def _queue_state(self) -> tuple[int, int, str | None]:
        scheduler = self.scheduler
        return (scheduler.num_free_blocks, len(scheduler.running),
                scheduler.waiting[0].request_id if scheduler.waiting else None)

    def _ready_s(self) -> float | None:
        """When the next step could start without a stall (now, or the next arrival if idle); None if no work,
        or if reservations starve the queue and nothing changed since (more free blocks, another head)."""
        if self.scheduler.has_unfinished_requests():
            if self._starved_on is not None and self._starved_on == self._queue_state():
                return None
            self._starved_on = None
            return self.now_s
        if self._pending:
            return max(self.now_s, self._pending[0][0])
        return None

    def next_step_start_s(self) -> float | None:
        """When the next step would start (now, or the next arrival if idle, or the end of a stall, whichever
        is latest); None if there is no work."""
        ready_s = self._ready_s()
        return None if ready_s is None else max(ready_s, self.stalled_until_s)

    # ---- hooks for work sharing the GPU (module NOTE) ----------------------------------------------------
    def stall_until(self, time_s: float) -> None:
        """Let no step start before `time_s` (virtual seconds); a step in progress is not interrupted (steps are
        atomic). Stalls do not shorten: the later of the current and the new end holds. `stalled_s` grows by the
        stall's new part beyond the clock when requests are waiting or running at the call."""
        if self.scheduler.has_unfinished_requests():
            self.stalled_s += max(0.0, time_s - max(self.now_s, self.stalled_until_s))
        self.stalled_until_s = max(self.stalled_until_s, float(time_s))

    @property
    def num_reserved_blocks(self) -> int:
        """KV blocks held by reservations (no request), summed over reservation ids."""
        return self.scheduler.num_held_blocks

    def reserve_blocks(self, reservation_id: str, num_blocks: int) -> bool:
        """Take `num_blocks` free KV blocks and add them to reservation `reservation_id` (all or nothing).

        Args:
            reservation_id: Names the reservation; repeated calls add to it (Llumnix's per-request
                ``pre_alloc_cache_dict``).
            num_blocks: Blocks to take, >= 0.

        Returns:
            True if taken; False (nothing changed) if fewer are free.

        Raises:
            ValueError: If num_blocks < 0.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        return self.scheduler.hold_blocks(reservation_id, num_blocks)

    def release_reserved_blocks(self, reservation_id: str) -> int:
        """Return every block of reservation `reservation_id` to the pool.

        Returns:
            The blocks released (0 for an unknown reservation).
        """
        num_blocks = self.scheduler.blocks_held_by(reservation_id)
        if num_blocks:
            self.scheduler.hold_blocks(reservation_id, -num_blocks)
        return num_blocks

    def _admit_arrivals(self) -> None:
        while self._pending and self._pending[0][0] <= self.now_s:
            _, _, request = heapq.heappop(self._pending)
            self._pending_ids.discard(request.request_id)
            self.scheduler.add_request(request)

    def step(self) -> StepResult | None:
        """Run one step, first jumping the clock to the next arrival if nothing is queued.

        Returns:
            The step, or None when there is nothing to run (clock unchanged) or when reservations hold the blocks
            the queue needs (the clock then stands at the step's would-be start).

        Raises:
            ValueError: If the batch-time model returns a non-positive or non-finite time for a batch.
        """
        ready_s = self._ready_s()
        if ready_s is None:
            return None
        start_s = max(ready_s, self.stalled_until_s)
        self.now_s = start_s
        self._admit_arrivals()
        batch = self.scheduler.schedule()
        # Admission is guaranteed when work is queued (add_request rejects requests that can never fit), unless
        # reservations hold the blocks the queue's head needs: then nothing runs until the driver releases them.
        assert batch.num_scheduled_tokens or self.scheduler.num_held_blocks, "scheduler made no progress"
        if not batch.num_scheduled_tokens:
            self._starved_on = self._queue_state()
            return None
        duration_s = self.batch_time.step_time_s(batch)
        if not (duration_s > 0 and math.isfinite(duration_s)):
            raise ValueError(f"batch-time model returned {duration_s!r} s for a batch of {batch.num_seqs} seqs")
        if self.step_time_factor != 1.0:
            slowed_s = duration_s * self.step_time_factor
            self.extra_step_time_s += slowed_s - duration_s
            duration_s = slowed_s
        self.now_s = start_s + duration_s
        output = self.scheduler.update_after_step(batch, self.now_s)
        return StepResult(start_s=start_s, duration_s=duration_s, batch=batch, output=output)

    def advance_to(self, time_s: float) -> list[StepResult]:
        """Run every step that starts before `time_s`; if then idle, jump the clock to `time_s`.

        A step in progress at `time_s` is completed (steps are atomic), so afterwards now_s >= time_s may
        exceed it. The clock never moves back: a `time_s` in the past runs nothing.

        Args:
            time_s: Virtual time, seconds.

        Returns:
            The steps run, in order.
        """
        results: list[StepResult] = []
        while True:
            start_s = self.next_step_start_s()
            if start_s is None or start_s >= time_s:
                break
            result = self.step()
            if result is None:
                break  # starved by reservations (module NOTE)
            results.append(result)
        self.now_s = max(self.now_s, time_s)
        return results

    def run_until_idle(self) -> list[StepResult]:
        """Run steps until every submitted request has finished (or was aborted), or reservations starve the
        queue (module NOTE).

        Returns:
            The steps run, in order.
        """
        results: list[StepResult] = []
        while (result := self.step()) is not None:
            results.append(result)
        return results


def measure_capacity_qps(
    config: EngineConfig,
    batch_time: BatchTimeModel,
    requests: Sequence[tuple[int, int]],
    num_requests: int = 1000,
) -> float:
    """Saturation throughput of ONE instance, in requests per virtual second.

    Submits `num_requests` requests at t=0, taking (prompt_tokens, output_tokens) pairs from `requests` in
    order and cycling, runs until idle and returns completed / elapsed. The drain at the end (fewer than
    max_num_seqs requests left) makes this a slight underestimate; more requests shrink that effect.

    Args:
        config: Engine settings.
        batch_time: Step execution-time model.
        requests: (num_prompt_tokens, num_output_tokens) pairs, each >= 1; at least one.
        num_requests: Requests to submit, >= 1.

    Returns:
        Completed requests / virtual seconds until the last one finished.

    Raises:
        ValueError: If requests is empty, num_requests < 1, or a pair is invalid for `config`.
    """
    if not requests:
        raise ValueError("requests is empty")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    engine = Engine(config, batch_time)
    for i in range(num_requests):
        num_prompt_tokens, num_output_tokens = requests[i % len(requests)]
        engine.add_request(SimRequest(f"cap-{i}", num_prompt_tokens, num_output_tokens, arrival_time_s=0.0))
    results = engine.run_until_idle()
    num_completed = sum(len(r.output.finished) for r in results)
    assert num_completed == num_requests
    return num_completed / engine.now_s
