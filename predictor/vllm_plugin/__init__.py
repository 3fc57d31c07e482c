"""vLLM general plugin: publishes the engine scheduler's real state to the Astrolabe sidecar beside it.

Registered under the ``vllm.general_plugins`` entry point (``pyproject.toml``), so vLLM calls `register` in each of
its processes (API server and engine core). When the environment variable `ENV_STATE_PATH` names a file,
`register` wraps three methods of vLLM V1's ``Scheduler`` (``__init__``; ``update_from_output``, the end of every
engine step; ``add_request``) so that, in the engine core process, the scheduler's state is written to that file
as one JSON object (`predictor.vllm_plugin.publisher`; format documented there), atomically (write + rename), at
most every `ENV_MIN_INTERVAL_S` seconds, and whenever the engine turns idle or busy. The sidecar reads it
(`predictor.state_source.PluginStateReader`).

If the variable is unset the plugin does nothing; if this vLLM's scheduler lacks what the plugin reads, it logs
why (WARNING) and does nothing, and the sidecar keeps using its ledger. Imports only the standard library at
module level; vLLM is imported inside `register`.
"""

from __future__ import annotations

import functools
import logging
import os

# Under vLLM's "vllm" logger so that vLLM's own logging setup shows these lines in the server log.
logger = logging.getLogger(f"vllm.astrolabe.{__name__}")

ENV_STATE_PATH = "ASTROLABE_VLLM_STATE_PATH"
"""File the engine's state is written to; unset or empty = plugin disabled."""
ENV_MIN_INTERVAL_S = "ASTROLABE_VLLM_STATE_MIN_INTERVAL_S"
"""Least time between two writes while the engine stays busy, seconds (default `DEFAULT_MIN_INTERVAL_S`)."""
DEFAULT_MIN_INTERVAL_S = 0.01

_SCHEDULER_METHODS = ("update_from_output", "add_request", "schedule")
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
    _wrap(Scheduler, "update_from_output", publisher)
    _wrap(Scheduler, "add_request", publisher)
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
