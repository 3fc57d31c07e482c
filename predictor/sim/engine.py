"""Virtual-time driver of one simulated vLLM V1 instance.

Owns `Engine` (a `Scheduler` plus a virtual clock advanced by a `BatchTimeModel`) and
`measure_capacity_qps`. Used by the cluster benchmark, the predictor and the demo's capacity estimate; the
wall-clock emulator drives `Scheduler` directly instead. Pure and synchronous: imports only the standard
library and `predictor.sim`; no I/O, no asyncio, no grpc, no real clock.

NOTE: steps are atomic: a step that starts at t ends at t + step_time_s(batch) and its tokens appear at its
end. Requests whose arrival_time_s lies ahead of the clock are held back until the clock reaches them.
The virtual clock never decreases.
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
    """

    def __init__(self, config: EngineConfig, batch_time: BatchTimeModel, now_s: float = 0.0) -> None:
        self.scheduler = Scheduler(config)
        self.batch_time = batch_time
        self.now_s = float(now_s)
        # Future arrivals: (arrival_time_s, insertion seq, request); seq keeps equal times in FCFS order.
        self._pending: list[tuple[float, int, SimRequest]] = []
        self._pending_ids: set[str] = set()
        self._seq = itertools.count()

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

    def next_step_start_s(self) -> float | None:
        """When the next step would start (now, or the next arrival if idle); None if there is no work."""
        if self.scheduler.has_unfinished_requests():
            return self.now_s
        if self._pending:
            return max(self.now_s, self._pending[0][0])
        return None

    def _admit_arrivals(self) -> None:
        while self._pending and self._pending[0][0] <= self.now_s:
            _, _, request = heapq.heappop(self._pending)
            self._pending_ids.discard(request.request_id)
            self.scheduler.add_request(request)

    def step(self) -> StepResult | None:
        """Run one step, first jumping the clock to the next arrival if nothing is queued.

        Returns:
            The step, or None when there is nothing to run (clock unchanged).

        Raises:
            ValueError: If the batch-time model returns a non-positive or non-finite time for a batch.
        """
        start_s = self.next_step_start_s()
        if start_s is None:
            return None
        self.now_s = start_s
        self._admit_arrivals()
        batch = self.scheduler.schedule()
        # Admission is guaranteed when work is queued (add_request rejects requests that can never fit).
        assert batch.num_scheduled_tokens, "scheduler made no progress with unfinished requests"
        duration_s = self.batch_time.step_time_s(batch)
        if not (duration_s > 0 and math.isfinite(duration_s)):
            raise ValueError(f"batch-time model returned {duration_s!r} s for a batch of {batch.num_seqs} seqs")
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
            assert result is not None
            results.append(result)
        self.now_s = max(self.now_s, time_s)
        return results

    def run_until_idle(self) -> list[StepResult]:
        """Run steps until every submitted request has finished (or was aborted).

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
