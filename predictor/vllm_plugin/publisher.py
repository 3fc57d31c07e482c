"""Writes an engine scheduler's state to a file for the sidecar: vLLM's (inside its engine core), or the emulator's.

File format (one JSON object, replaced atomically by write + ``os.replace``; `STATE_FORMAT_VERSION`)::

    {"version": 1, "pid": 1234, "seq": 17, "published_monotonic_s": 5123.4,
     "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "block_size": 16, "num_gpu_blocks": 64,
                "enable_chunked_prefill": true},
     "num_free_blocks": 40, "num_preemptions_total": 3,
     "running": [[request_id, num_prompt_tokens, num_computed_tokens, num_output_tokens, max_tokens,
                  num_blocks_held, num_preemptions], ...],   # schedule order
     "waiting": [[...same fields...], ...],                    # queue order, front first
     "priorities": [[priority, arrival_age_s], ...],           # only under --scheduling-policy priority
     "num_steps_total": 5210,                                  # steps recorded since start (optional)
     "steps": [[step_index, num_tokens, prefill_attention_work, decode_context_tokens, num_seqs, duration_s],
               ...],                                           # the last STEP_HISTORY steps, oldest first
     "first_tokens": [[request_id, monotonic_s], ...],        # when the last requests got their first token
     "arrivals": [[request_id, monotonic_s], ...]}            # when the last requests reached the scheduler

``published_monotonic_s`` is on ``time.monotonic()``, which every process of one Linux host shares, so the
sidecar beside the engine can compute the state's age. ``num_gpu_blocks`` excludes vLLM's reserved null block;
``num_blocks_held`` is null when the writer does not read it (vLLM: see `collect_vllm`). ``num_output_tokens``
is the number of tokens generated so far; ``max_tokens`` the request's limit (null if unknown).
``steps`` are the engine's last steps as it ran them (batch shape in the terms of
``predictor.sim.scheduler.ScheduledBatch`` and measured duration, seconds): what the sidecar's online calibration
refits the step-time model from (`predictor.calibration`); ``step_index`` numbers them from 1 so that a reader
takes each step once. ``first_tokens`` are the last `FIRST_TOKEN_HISTORY` first-token events (request id, end of
the step that produced it on ``time.monotonic()``): the sidecar's observed TTFT (`predictor.outcomes`).
``arrivals`` are the last `FIRST_TOKEN_HISTORY` requests the scheduler received (request id, when
``add_request`` ran, ``time.monotonic()``): with the sidecar's Admit time, the delay before the engine sees a
request (Envoy, the API server's HTTP handling and tokenizer; `predictor.calibration.IngressDelayEstimator`). A
file without ``steps``, ``first_tokens`` or ``arrivals`` (an older plugin) is valid. Under vLLM's
``--scheduling-policy priority`` the engine object also says ``"scheduling_policy": "priority"`` and
``priorities`` holds one ``[priority, arrival_age_s]`` per request row, running rows first, then waiting: the
request's priority (vLLM's: lower = earlier) and how long before the collection it arrived, seconds (the order of
arrivals is what the scheduler reads: ties of priority go to the earlier). A file without them (FCFS, or an older
plugin) has every request at priority 0; a reader older than them ignores both keys.

`StatePublisher` owns everything but reading the scheduler: when to publish (rate limit, idle/busy edges), the
envelope (version, pid, seq, time, preemption total), the writer thread and the atomic write. What is read from
a scheduler comes from a collector, a function ``scheduler -> SchedulerState``: `collect_vllm` for vLLM V1's
scheduler (the default), ``bench.emulator.state_publisher.collect_sim`` for ``predictor.sim.Scheduler``.

NOTE: `StatePublisher.maybe_publish` is called on the engine's thread: in vLLM after ``update_from_output`` (end
of a step: computed and generated counts consistent, finished requests gone) and after ``add_request``. It must
be cheap (it runs on the engine's critical path) and must never raise into the engine: any error is logged once
and publishing stops. So the engine thread only copies the counters (~10 us for 16 requests, measured by
``astrolabe bench plugin-overhead``); a daemon thread encodes and writes the newest copy (a write on tmpfs takes
~40 us, on this machine's ext4 ~4 ms: put the file on /dev/shm). Imports only the standard library (it is loaded
inside vLLM's processes).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Under vLLM's "vllm" logger so that vLLM's own logging setup shows these lines in the server log.
logger = logging.getLogger(f"vllm.astrolabe.{__name__}")

STATE_FORMAT_VERSION = 1
"""Version of the state file format above; the reader rejects others."""

_PREEMPTIONS_COLUMN = 6
"""Index of ``num_preemptions`` in a request row."""

FIRST_TOKEN_HISTORY = 64
"""First-token events kept for the file (the newest)."""
STEP_HISTORY = 32
"""Steps kept for the file (the newest): at a 10 ms publish interval and 3-20 ms steps, every step reaches at
least one file; a reader that misses some only samples fewer. Small, because the sidecar parses the whole file
each time it changes (the figures: bench/README-vllm.md)."""


@dataclass(frozen=True, slots=True)
class SchedulerState:
    """What a collector reads from a scheduler: the parts of the file that depend on the engine.

    Attributes:
        engine: ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``, ``num_gpu_blocks`` (blocks the
            engine can hand out), ``enable_chunked_prefill``, in this order (vLLM names).
        num_free_blocks: KV blocks free now.
        running: request rows (format in the module docstring), schedule order.
        waiting: request rows, queue order, front first.
        priorities: under the priority policy, ``[priority, arrival_age_s]`` per row (running, then waiting);
            None otherwise.
    """

    engine: dict[str, Any]
    num_free_blocks: int
    running: list[list]
    waiting: list[list]
    priorities: list[list] | None = None


def _vllm_request_row(request) -> list:
    sampling = getattr(request, "sampling_params", None)
    return [
        request.request_id,
        request.num_prompt_tokens,
        request.num_computed_tokens,
        request.num_output_tokens,
        getattr(sampling, "max_tokens", None) if sampling is not None else getattr(request, "max_tokens", None),
        None,
        getattr(request, "num_preemptions", 0),
    ]


def collect_vllm(scheduler) -> SchedulerState:
    """The state of vLLM V1's ``Scheduler``.

    Source: vllm/v1/core/sched/scheduler.py Scheduler, vllm/v1/request.py Request (vLLM 0.32).
    """
    block_pool = scheduler.kv_cache_manager.block_pool
    config = scheduler.scheduler_config
    policy = str(getattr(getattr(config, "policy", None), "value", getattr(config, "policy", "fcfs")) or "fcfs")
    running, waiting = list(scheduler.running), list(scheduler.waiting)
    priorities = None
    if policy == "priority":  # vllm/v1/request.py Request.priority and .arrival_time (time.time() seconds)
        now_s = time.time()
        priorities = [[int(getattr(r, "priority", 0)), max(now_s - float(getattr(r, "arrival_time", now_s)), 0.0)]
                      for r in (*running, *waiting)]
    # Per-request block lists are not read: building them costs O(blocks) per request on the engine's thread,
    # and after a step a running request holds the blocks of its computed tokens, which the simulator derives
    # itself (num_blocks_held = null).
    return SchedulerState(
        engine={
            "max_num_seqs": scheduler.max_num_running_reqs,
            "max_num_batched_tokens": scheduler.max_num_scheduled_tokens,
            "block_size": scheduler.cache_config.block_size,
            # Block 0 is vLLM's null block, never handed out.
            "num_gpu_blocks": block_pool.num_gpu_blocks - 1,
            "enable_chunked_prefill": bool(getattr(config, "enable_chunked_prefill",
                                                   getattr(config, "chunked_prefill_enabled", True))),
            **({"scheduling_policy": policy} if priorities is not None else {}),
        },
        num_free_blocks=block_pool.get_num_free_blocks(),
        running=[_vllm_request_row(r) for r in running],
        waiting=[_vllm_request_row(r) for r in waiting], priorities=priorities)


def vllm_step_shape(scheduler, scheduler_output) -> tuple[tuple[int, int, int, int], list[str]]:
    """((num_tokens, prefill_attention_work, decode_context_tokens, num_seqs), first-token request ids) of the
    step vLLM V1 just scheduled; the ids are the requests whose prompt this step completes before they have any
    output (their first token comes out of this step).

    Called right after ``Scheduler.schedule`` returned ``scheduler_output``: vLLM has then already advanced each
    scheduled request's ``num_computed_tokens`` by its scheduled tokens (``Scheduler._update_after_schedule``), so
    the context before the step is ``num_computed_tokens - n``. A request computing one token at the end of all
    its tokens is a decode; anything else is a prefill chunk (a resumed preempted request's recomputation too).
    Speculative tokens are counted as scheduled tokens, not modelled apart.

    Source: vllm/v1/core/sched/scheduler.py ``Scheduler.schedule``, ``_update_after_schedule``;
    vllm/v1/core/sched/output.py ``SchedulerOutput.num_scheduled_tokens`` (vLLM 0.32).
    """
    requests = scheduler.requests
    num_tokens = attention = context = 0
    first: list[str] = []
    for request_id, n in scheduler_output.num_scheduled_tokens.items():
        request = requests.get(request_id)
        if request is None or n <= 0:
            continue
        num_tokens += n
        before = max(request.num_computed_tokens - n, 0)
        if n == 1 and before + 1 >= request.num_tokens:
            context += before + 1
        else:
            attention += n * (before + n)
        if request.num_output_tokens == 0 and request.num_computed_tokens >= request.num_prompt_tokens:
            first.append(request_id)
    return (num_tokens, attention, context, len(scheduler_output.num_scheduled_tokens)), first


class StatePublisher:
    """Writes a scheduler's state to ``path`` at most every ``min_interval_s`` seconds, and whenever the engine
    turns idle or busy.

    Args:
        path: state file; its folder must exist; a temporary ``path + ".tmp.<pid>"`` is written beside it.
        min_interval_s: least time between writes while the queue lengths stay the same, seconds (>= 0).
        synchronous: write on the caller's thread (tests, the cost benchmark) instead of the writer thread.
        collector: reads a scheduler (anything with ``running`` and ``waiting`` sequences); `collect_vllm` by
            default. Called on the caller's thread; it may raise (publishing then stops).
    """

    def __init__(self, path: str, min_interval_s: float, *, synchronous: bool = False,
                 collector: Callable[[Any], SchedulerState] = collect_vllm) -> None:
        self.path = path
        self.min_interval_s = max(min_interval_s, 0.0)
        self.num_published = 0
        self.synchronous = synchronous
        self._collector = collector
        self._tmp_path = f"{path}.tmp.{os.getpid()}"
        self._last_publish_s = float("-inf")
        self._last_counts: tuple[int, int] = (-1, -1)
        self._failed = False
        self._closing = False
        self._preemptions_seen: dict[str, int] = {}
        self._num_preemptions_total = 0
        # Only the newest state matters: appending replaces an older one not yet written. append and pop are
        # atomic under the GIL, so a state handed over while the writer takes the previous one is never lost
        # (a lost last state before idling would stay on file: an idle engine publishes nothing more).
        self._pending: collections.deque[dict] = collections.deque(maxlen=1)
        self._wake = threading.Event()
        self._writer: threading.Thread | None = None
        self._steps: collections.deque[tuple] = collections.deque(maxlen=STEP_HISTORY)
        self._first_tokens: collections.deque[tuple] = collections.deque(maxlen=FIRST_TOKEN_HISTORY)
        self._arrivals: collections.deque[tuple] = collections.deque(maxlen=FIRST_TOKEN_HISTORY)
        self.num_steps_total = 0

    def record_arrival(self, request_id: str, at_s: float | None = None) -> None:
        """Record that the scheduler received ``request_id`` at ``at_s`` (``time.monotonic()`` seconds; None =
        now); it goes into the next files' ``arrivals``. Called on the engine's thread; one append."""
        self._arrivals.append((request_id, time.monotonic() if at_s is None else at_s))

    def record_step(self, num_tokens: int, prefill_attention_work: int, decode_context_tokens: int, num_seqs: int,
                    duration_s: float, first_token_ids=(), end_s: float | None = None) -> None:
        """Record one step the engine ran (shape as ``ScheduledBatch``'s totals, measured duration in seconds)
        and the requests that got their first token from it (at ``end_s``, ``time.monotonic()``); they go into
        the next files' ``steps`` and ``first_tokens``. Called on the engine's thread; a few tuple appends."""
        self.num_steps_total += 1
        self._steps.append((self.num_steps_total, num_tokens, prefill_attention_work, decode_context_tokens,
                            num_seqs, duration_s))
        if first_token_ids:
            at_s = time.monotonic() if end_s is None else end_s
            self._first_tokens.extend((request_id, at_s) for request_id in first_token_ids)

    def maybe_publish(self, scheduler) -> None:
        """Publish if due; never raises (a failure is logged once and disables publishing)."""
        if self._failed or self._closing:
            return
        now_s = time.monotonic()
        counts = (len(scheduler.running), len(scheduler.waiting))
        # Publish when due, and at once when the engine turns idle or busy: an idle engine calls nothing, so the
        # last state before idling must show empty queues, and the first request after it must show up.
        edge = (counts == (0, 0)) != (self._last_counts == (0, 0))
        if not edge and now_s - self._last_publish_s < self.min_interval_s:
            return
        try:
            state = self.collect(scheduler, now_s)
            if self.synchronous:
                self._write(state)
            else:
                self._hand_over(state)
        except Exception:  # noqa: BLE001 (the engine must keep serving whatever happens here)
            logger.exception("astrolabe state plugin: publishing failed; stopping (the sidecar falls back)")
            self._failed = True
            return
        self._last_publish_s = now_s
        self._last_counts = counts

    def collect(self, scheduler, now_s: float) -> dict:
        """The state as a JSON-ready dict (format in the module docstring); counts it as published."""
        part = self._collector(scheduler)
        self._count_preemptions(part.running, part.waiting)
        self.num_published += 1
        return {
            "version": STATE_FORMAT_VERSION,
            "pid": os.getpid(),
            "seq": self.num_published,
            "published_monotonic_s": now_s,
            "engine": part.engine,
            "num_free_blocks": part.num_free_blocks,
            "num_preemptions_total": self._num_preemptions_total,
            "running": part.running,
            "waiting": part.waiting,
            "num_steps_total": self.num_steps_total,
            "steps": [list(step) for step in self._steps],
            "first_tokens": [list(event) for event in self._first_tokens],
            "arrivals": [list(event) for event in self._arrivals],
            **({"priorities": part.priorities} if part.priorities is not None else {}),
        }

    def close(self, timeout_s: float = 2.0, *, remove: bool = False) -> None:
        """Write the state handed over last, if any (none with ``remove``), end the writer thread and publish no
        more.

        Blocks up to ``timeout_s`` seconds for the writer thread. The vLLM plugin never calls it (its writer dies
        with the engine process); the emulator does when it stops, with ``remove``.

        Args:
            timeout_s: longest wait for the writer thread, seconds.
            remove: then delete the state file (and a temporary one left beside it), so that a stopped engine
                leaves nothing in /dev/shm; a reader then finds no file, as before the engine started, and falls
                back as it does for a dead writer's file. Kept when the writer thread is still running after
                ``timeout_s`` (its next replace would bring the file back).
        """
        self._closing = True
        if remove:
            self._pending.clear()
        writer = self._writer
        if writer is not None:
            self._wake.set()
            writer.join(timeout_s)
        if not remove:
            return
        if writer is not None and writer.is_alive():
            logger.warning("astrolabe state plugin: the writer of %s did not end within %.1f s; file kept",
                           self.path, timeout_s)
            return
        for path in (self.path, self._tmp_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _hand_over(self, state: dict) -> None:
        self._pending.append(state)
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="astrolabe-state-writer", daemon=True)
            self._writer.start()
        self._wake.set()

    def _write_loop(self) -> None:
        while not self._failed:
            self._wake.wait()
            self._wake.clear()
            if self._pending:
                try:
                    self._write(self._pending.pop())
                except Exception:  # noqa: BLE001
                    logger.exception("astrolabe state plugin: writing %s failed; stopping", self.path)
                    self._failed = True
            if self._closing and not self._pending:
                return

    def _count_preemptions(self, running: list, waiting: list) -> None:
        # vLLM keeps a per-request count only; the total is the sum of increases seen (a request preempted and
        # finished between two publishes is missed, so this is a lower bound).
        seen: dict[str, int] = {}
        for row in (*running, *waiting):
            request_id, count = row[0], row[_PREEMPTIONS_COLUMN] or 0
            self._num_preemptions_total += max(count - self._preemptions_seen.get(request_id, 0), 0)
            seen[request_id] = count
        self._preemptions_seen = seen

    def _write(self, state: dict) -> None:
        with open(self._tmp_path, "w", encoding="utf-8") as f:
            f.write(json.dumps(state, separators=(",", ":")))
        os.replace(self._tmp_path, self.path)
