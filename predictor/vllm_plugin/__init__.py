"""vLLM general plugin: publishes the engine scheduler's real state to the Astrolabe sidecar beside it.

Registered under the ``vllm.general_plugins`` entry point (``pyproject.toml``), so vLLM calls `register` in each of
its processes (API server and engine core). When the environment variable `ENV_STATE_PATH` names a file,
`register` wraps four methods of vLLM V1's ``Scheduler`` (``__init__``; ``schedule``, the start of every engine
step, whose batch shape and start time are kept; ``update_from_output``, the end of every engine step, which
records the step's measured duration (from the previous step's end while the engine had requests left, else
from ``schedule``'s start, to the update's end: the engine core's work between steps, scheduling, the forward
pass, sampling and the update; with async scheduling the overlap with the next step's scheduling is included);
``add_request``) so that, in the engine core process, the scheduler's state is written to that file
as one JSON object (`predictor.vllm_plugin.publisher`; format documented there), atomically (write + rename), at
most every `ENV_MIN_INTERVAL_S` seconds, and whenever the engine turns idle or busy. The sidecar reads it
(`predictor.state_source.PluginStateReader`).

If the variable is unset the plugin does nothing; if this vLLM's scheduler lacks what the plugin reads, it logs
why (WARNING) and does nothing, and the sidecar keeps using its ledger. Imports only the standard library at
module level; vLLM is imported inside `register`.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time

# Under vLLM's "vllm" logger so that vLLM's own logging setup shows these lines in the server log.
logger = logging.getLogger(f"vllm.astrolabe.{__name__}")

ENV_STATE_PATH = "ASTROLABE_VLLM_STATE_PATH"
"""File the engine's state is written to; unset or empty = plugin disabled."""
ENV_MIN_INTERVAL_S = "ASTROLABE_VLLM_STATE_MIN_INTERVAL_S"
"""Least time between two writes while the engine stays busy, seconds (default `DEFAULT_MIN_INTERVAL_S`)."""
DEFAULT_MIN_INTERVAL_S = 0.01

_SCHEDULER_METHODS = ("update_from_output", "add_request", "schedule", "has_unfinished_requests")
_PATCHED_FLAG = "_astrolabe_state_patched"


def register() -> None:
    """vLLM plugin entry point: attach the state publisher to vLLM's V1 scheduler if enabled and compatible.

    Never raises: a failure to attach is logged and leaves vLLM untouched.
    """
    path = os.environ.get(ENV_STATE_PATH, "")
    if not path:
        logger.debug("astrolabe state plugin disabled (%s unset)", ENV_STATE_PATH)
        return
    try:
        min_interval_s = float(os.environ.get(ENV_MIN_INTERVAL_S, DEFAULT_MIN_INTERVAL_S))
        from vllm.v1.core.sched.scheduler import Scheduler  # noqa: PLC0415 (only inside vLLM)
    except (ImportError, ValueError) as exc:
        logger.warning("astrolabe state plugin cannot attach: %s", exc)
        return
    missing = [name for name in _SCHEDULER_METHODS if not callable(getattr(Scheduler, name, None))]
    if missing:
        logger.warning("astrolabe state plugin cannot attach: vLLM's Scheduler lacks %s", ", ".join(missing))
        return
    if getattr(Scheduler, _PATCHED_FLAG, False):
        return
    from predictor.vllm_plugin.publisher import StatePublisher  # noqa: PLC0415

    publisher = StatePublisher(path, min_interval_s)
    _wrap(Scheduler, "__init__", publisher)  # the first state (empty queues, engine settings) at start
    _wrap_step(Scheduler, publisher)
    _wrap(Scheduler, "update_from_output", publisher)
    _wrap_add_request(Scheduler, publisher)
    setattr(Scheduler, _PATCHED_FLAG, True)
    logger.info("astrolabe state plugin attached (pid %d): state file %s, min interval %.3f s",
                os.getpid(), path, min_interval_s)


def _wrap(cls: type, name: str, publisher) -> None:
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        publisher.maybe_publish(self)
        return result

    setattr(cls, name, wrapper)


def _wrap_add_request(cls: type, publisher) -> None:
    """``add_request``: record the request's arrival at the scheduler (its id, now), then publish if due."""
    original = cls.add_request
    failed: list[bool] = []

    @functools.wraps(original)
    def add_request(self, request, *args, **kwargs):
        result = original(self, request, *args, **kwargs)
        if not failed:
            try:
                publisher.record_arrival(str(request.request_id))
            except Exception:  # noqa: BLE001 (the engine must keep serving whatever happens here)
                logger.exception("astrolabe state plugin: recording an arrival failed; no arrival times")
                failed.append(True)
        publisher.maybe_publish(self)
        return result

    cls.add_request = add_request


def _wrap_step(cls: type, publisher) -> None:
    """Time each step: ``schedule`` keeps (its output, start time, shape); ``update_from_output`` records the step
    whose output it received. Wrapped before ``update_from_output``'s publishing wrapper, so the step is in the
    file that wrapper writes."""
    from predictor.vllm_plugin.publisher import vllm_step_shape  # noqa: PLC0415

    original_schedule, original_update = cls.schedule, cls.update_from_output
    in_flight: collections.deque = collections.deque(maxlen=8)  # steps scheduled, not updated yet
    failed: list[bool] = []
    busy_since: list[float] = []  # end of the previous step, while the engine had requests left after it

    @functools.wraps(original_schedule)
    def schedule(self, *args, **kwargs):
        start_s = time.monotonic()
        if busy_since and busy_since[0] <= start_s:
            start_s = busy_since[0]  # a busy engine's iteration includes its work between two steps
        output = original_schedule(self, *args, **kwargs)
        if not failed:
            try:
                shape, first = vllm_step_shape(self, output)
                if shape[0] > 0:
                    in_flight.append((output, start_s, shape, first))
            except Exception:  # noqa: BLE001 (the engine must keep serving whatever happens here)
                logger.exception("astrolabe state plugin: reading the step's shape failed; no step times")
                failed.append(True)
        return output

    @functools.wraps(original_update)
    def update_from_output(self, scheduler_output, *args, **kwargs):
        result = original_update(self, scheduler_output, *args, **kwargs)
        if failed:
            return result
        end_s = time.monotonic()
        try:
            busy_since.clear()
            if self.has_unfinished_requests():
                busy_since.append(end_s)
            for index, (output, start_s, shape, first) in enumerate(in_flight):
                if output is scheduler_output:
                    del in_flight[index]
                    publisher.record_step(*shape, end_s - start_s, first, end_s)
                    break
        except Exception:  # noqa: BLE001 (the engine must keep serving whatever happens here)
            logger.exception("astrolabe state plugin: recording the step failed; no step times")
            failed.append(True)
        return result

    cls.schedule, cls.update_from_output = schedule, update_from_output
