"""Real-time driver of one emulated vLLM engine: ``predictor.sim.Scheduler`` stepped on the wall clock.

Owns the asyncio task that repeats schedule -> sleep for the modelled step time -> update, and the hand-off of
progress to the HTTP handlers (one :class:`RequestHandle` each). It contains no scheduling logic of its own:
every decision comes from ``predictor.sim``. It must not import aiohttp.

NOTE: timing. A step's planned end is a running deadline on ``time.monotonic()`` (previous deadline + modelled
step time x ``time_scale`` x noise), so event-loop overheads do not accumulate as drift. If the loop falls more
than ``_MAX_LAG_S`` behind (a stalled process), the deadline is reset to now rather than replaying steps
back-to-back. Timestamps given to the scheduler are the actual ``time.monotonic()`` after the sleep, so every
figure the emulator reports is in its own wall-clock seconds. An idle engine waits on an ``asyncio.Event``
(no polling), and a handle's event is set only when its consumer has something to do (every
``stream_interval`` tokens while streaming, otherwise only at the end), which keeps per-token work small.

With a state file configured, the loop publishes the scheduler's state in the vLLM plugin's format
(:mod:`bench.emulator.state_publisher`) where vLLM's plugin does: at start, after each step's update, after
``add_request``, and after an abort. The loop's thread only copies the counters; a writer thread writes the file.
`EngineLoop.stop` deletes the file (the emulator's clean exit, SIGTERM and SIGINT included).
Each step also goes into the file's ``steps`` with its measured wall time (from the previous step's end while the
engine stays busy, else from just before ``schedule``, to just after the update), which is what a sidecar calibrates from: on a loaded CPU a step runs late and the next ones
catch up to the deadline, so single steps scatter around the modelled time while their mean stays on it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

from predictor.sim import Scheduler, SimRequest

from bench.emulator.metrics import EmulatorMetrics
from bench.emulator.state_publisher import sim_state_publisher

logger = logging.getLogger(__name__)

_MAX_LAG_S = 0.5
"""How far (seconds) the loop may run behind its deadline before the deadline is reset to now."""

_NEVER = 1 << 62
"""``next_notify_tokens`` of a handle that wants to hear only about the end of its request."""


@dataclass(slots=True, eq=False)
class RequestHandle:
    """Progress of one request, shared by the engine loop (writer) and its HTTP handler (reader).

    Attributes:
        sim: the scheduler's request; ``sim.num_generated_tokens`` is the number of output tokens so far.
        planned_finish_reason: "length" if the request stops at its ``max_tokens`` cap, else "stop".
        stream_interval: tokens per progress notification while streaming; 0 = notify only at the end.
        next_notify_tokens: the event is set once ``sim.num_generated_tokens`` reaches this.
        max_tokens: the client's output cap in tokens (published in the state file), or None if unknown.
        finish_reason: None while unfinished, then "stop", "length" or "abort".
        first_scheduled_time_s: ``time.monotonic()`` start of the first step that scheduled it; None before.
        last_token_time_s: ``time.monotonic()`` of its latest output token; None before the first.
        reply: its output tokens and their text (`bench.emulator.tokens.Reply`: what its handler answers; the
            loop does not read it), or None.
    """

    sim: SimRequest
    planned_finish_reason: str
    stream_interval: int
    next_notify_tokens: int
    max_tokens: int | None = None
    finish_reason: str | None = None
    first_scheduled_time_s: float | None = None
    last_token_time_s: float | None = None
    reply: Any = None
    event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def num_generated_tokens(self) -> int:
        """Output tokens produced so far."""
        return self.sim.num_generated_tokens

    async def wait_progress(self, num_consumed_tokens: int) -> None:
        """Waits until there is news past ``num_consumed_tokens`` output tokens, or the request ended.

        While streaming, the next wake-up is after ``stream_interval`` more tokens; the first token (when
        ``num_consumed_tokens == 0``) wakes it at once so that time to first token stays observable.
        """
        if self.stream_interval and self.finish_reason is None:
            self.next_notify_tokens = num_consumed_tokens + (1 if num_consumed_tokens == 0 else self.stream_interval)
            if self.num_generated_tokens >= self.next_notify_tokens:
                return
        if self.finish_reason is not None:
            return
        self.event.clear()
        await self.event.wait()


class EngineLoop:
    """Drives a ``predictor.sim.Scheduler`` in real time.

    Args:
        scheduler: the instance's scheduler (owned by this loop from now on).
        batch_time_model: object with ``step_time_s(batch) -> float`` (seconds on an H200).
        metrics: where steps and request lifecycles are recorded.
        time_scale: wall-clock seconds per modelled second (> 0; > 1 is slower than a real H200).
        step_noise_frac: standard deviation of a multiplicative Gaussian noise on each step time, as a fraction
            (0 = deterministic); the factor is clipped at 0.
        rng: seeded source of the step noise.
        state_path: file the scheduler's state is published to (vLLM plugin format); None = not published.
        state_interval_s: least time between two publications while the engine stays busy, seconds (>= 0).
    """

    def __init__(self, scheduler: Scheduler, batch_time_model: Any, metrics: EmulatorMetrics, *,
                 time_scale: float, step_noise_frac: float, rng: random.Random, state_path: str | None = None,
                 state_interval_s: float = 0.0) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        if step_noise_frac < 0:
            raise ValueError(f"step_noise_frac must be >= 0, got {step_noise_frac}")
        if state_interval_s < 0:
            raise ValueError(f"state_interval_s must be >= 0, got {state_interval_s}")
        self.scheduler = scheduler
        self._batch_time_model = batch_time_model
        self._metrics = metrics
        self._time_scale = time_scale
        self._step_noise_frac = step_noise_frac
        self._rng = rng
        self._handles: dict[str, RequestHandle] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._state_publisher = (None if state_path is None
                                 else sim_state_publisher(state_path, state_interval_s, self._max_tokens_of))

    @property
    def num_unfinished_requests(self) -> int:
        """Requests added and not yet finished or aborted."""
        return len(self._handles)

    def start(self) -> None:
        """Starts the loop task on the running event loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="emulator-engine-loop")
            self._publish_state()  # the first state: engine settings and empty queues, as vLLM's plugin

    async def stop(self) -> None:
        """Aborts every unfinished request (handlers see finish_reason "abort") and ends the loop task."""
        for request_id in list(self._handles):
            self.abort(request_id)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._state_publisher is not None:
            # Ends the writer thread and deletes the state file (nothing left in /dev/shm), off the event loop.
            await asyncio.to_thread(self._state_publisher.close, remove=True)

    def add_request(self, request_id: str, num_prompt_tokens: int, num_output_tokens: int,
                    planned_finish_reason: str, stream_interval: int, max_tokens: int | None = None,
                    block_keys: tuple[int, ...] | None = None, reply: Any = None,
                    priority: int = 0) -> RequestHandle:
        """Queues a request in the scheduler and returns its handle.

        Args:
            request_id: unique among unfinished requests.
            num_prompt_tokens: prompt length in tokens (>= 1).
            num_output_tokens: tokens it will generate (>= 1).
            planned_finish_reason: finish_reason reported when it completes ("length" or "stop").
            stream_interval: tokens per progress wake-up while streaming; 0 for a non-streaming request.
            max_tokens: the client's output cap in tokens (>= num_output_tokens), or None if unknown.
            block_keys: keys of the full blocks of its prompt and output tokens (`SimRequest.block_keys`), or
                None: it neither hits the prefix cache nor leaves anything in it.
            reply: its output tokens and their text (kept on the handle for its handler).
            priority: vLLM's request priority (lower = earlier), read under the "priority" scheduling policy.

        Raises:
            ValueError: the scheduler refuses it (duplicate id, or it could never fit in the KV cache).
        """
        sim = SimRequest(request_id=request_id, num_prompt_tokens=num_prompt_tokens,
                         num_output_tokens=num_output_tokens, arrival_time_s=time.monotonic(),
                         max_new_tokens=max_tokens, block_keys=block_keys, priority=priority)
        self.scheduler.add_request(sim)
        handle = RequestHandle(sim=sim, planned_finish_reason=planned_finish_reason, stream_interval=stream_interval,
                               next_notify_tokens=1 if stream_interval else _NEVER, max_tokens=max_tokens,
                               reply=reply)
        self._handles[request_id] = handle
        self._wakeup.set()
        if self._state_publisher is not None:
            self._state_publisher.record_arrival(request_id, sim.arrival_time_s)
        self._publish_state()
        return handle

    def abort(self, request_id: str) -> None:
        """Removes an unfinished request (client gone, or shutdown); no-op if it already ended."""
        handle = self._handles.pop(request_id, None)
        if handle is None:
            return
        self.scheduler.abort_request(request_id)
        self._publish_state()
        handle.finish_reason = "abort"
        handle.event.set()
        self._metrics.observe_finished("abort", time.monotonic() - handle.sim.arrival_time_s, None, None, None)
        logger.debug("aborted %s after %d tokens", request_id, handle.num_generated_tokens)

    def _max_tokens_of(self, request_id: str) -> int | None:
        handle = self._handles.get(request_id)
        return None if handle is None else handle.max_tokens

    def _publish_state(self) -> None:
        if self._state_publisher is not None:
            self._state_publisher.maybe_publish(self.scheduler)

    def _step_duration_s(self, batch: Any) -> float:
        step_s = self._batch_time_model.step_time_s(batch) * self._time_scale
        if self._step_noise_frac > 0:
            step_s *= max(0.0, 1.0 + self._rng.gauss(0.0, self._step_noise_frac))
        return step_s

    async def _run(self) -> None:
        try:
            await self._step_forever()
        except Exception:
            # A broken invariant in the sim must not leave clients hanging: end every request.
            logger.exception("engine loop failed; aborting %d requests", len(self._handles))
            for request_id in list(self._handles):
                self.abort(request_id)
            raise

    async def _step_forever(self) -> None:
        deadline_s: float | None = None
        busy_since_s: float | None = None  # end of the previous step while the engine stays busy
        while True:
            if not self.scheduler.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
                deadline_s = busy_since_s = None
                continue
            now_s = time.monotonic()
            if deadline_s is None or now_s - deadline_s > _MAX_LAG_S:
                deadline_s = now_s
            step_start_s = deadline_s
            # A busy engine's iteration runs from the previous step's end (its delivery and publishing included).
            wall_start_s = now_s if busy_since_s is None else busy_since_s
            batch = self.scheduler.schedule()
            if batch.total_num_scheduled_tokens == 0:
                # Should not happen (every admitted request fits); wait for news instead of spinning.
                logger.warning("empty batch with %d unfinished requests", len(self._handles))
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            deadline_s += self._step_duration_s(batch)
            delay_s = deadline_s - time.monotonic()
            # sleep(0) still yields, so handlers run even when the loop is behind.
            await asyncio.sleep(max(0.0, delay_s))
            end_s = time.monotonic()
            output = self.scheduler.update_after_step(batch, end_s)
            self._deliver(batch, output, step_start_s, end_s)
            if self._state_publisher is not None:  # the step as it ran (wall time), for online calibration
                self._state_publisher.record_step(batch.total_num_scheduled_tokens, batch.prefill_attention_work,
                                                  batch.decode_context_tokens, batch.num_seqs, end_s - wall_start_s,
                                                  output.first_token_request_ids, end_s)
            self._publish_state()
            busy_since_s = end_s

    def _deliver(self, batch: Any, output: Any, step_start_s: float, end_s: float) -> None:
        """Records the step and wakes the handlers that have something to do."""
        handles = self._handles
        metrics = self._metrics
        metrics.observe_step(batch.total_num_scheduled_tokens, len(output.new_token_request_ids))
        for request_id in batch.num_scheduled_tokens:
            handle = handles.get(request_id)
            if handle is not None and handle.first_scheduled_time_s is None:
                handle.first_scheduled_time_s = max(step_start_s, handle.sim.arrival_time_s)
        for request_id in output.first_token_request_ids:
            sim = handles[request_id].sim
            metrics.observe_first_token(sim.num_prompt_tokens, end_s - sim.arrival_time_s)
        for request_id in output.new_token_request_ids:
            handle = handles[request_id]
            if handle.last_token_time_s is not None:
                metrics.observe_inter_token(end_s - handle.last_token_time_s)
            handle.last_token_time_s = end_s
            if handle.sim.num_generated_tokens >= handle.next_notify_tokens:
                handle.event.set()
        for sim in output.finished:
            handle = handles.pop(sim.request_id)
            handle.finish_reason = handle.planned_finish_reason
            handle.event.set()
            first_s = sim.first_token_time_s if sim.first_token_time_s is not None else end_s
            scheduled_s = handle.first_scheduled_time_s
            metrics.observe_finished(
                handle.finish_reason, end_s - sim.arrival_time_s,
                queue_s=None if scheduled_s is None else scheduled_s - sim.arrival_time_s,
                prefill_s=None if scheduled_s is None else first_s - scheduled_s,
                decode_s=end_s - first_s)
