"""The decision log: one JSON line per routing decision, so that any decision can be explained after the fact.

Record (keys always present; times in seconds)::

    {"time_unix_s": 1764581400.123,      # wall clock when the decision was made (to join with other logs)
     "pid": 4321,                        # the process that decided (with ``workers`` > 1: which worker)
     "request_id": "abc",                # the client's x-request-id (or the generated one)
     "trace_id": "0af7651916cd43dd8448eb211c80319c",  # the request's trace (null: tracing off)
     "span_id": "b7ad6b7169203331",      # its astrolabe.route span (null: tracing off)
     "model": "llama-2-7b", "max_tokens": 256,  # from the body (null when absent; the model cut to 256 chars)
     "admit_id": "abc/9f3c2a1b7e4d",     # the id the chosen sidecar knows it by ("" when not predicted)
     "policy": "astrolabe",              # the policy that decided ("least-requests" on a fallback)
     "basis": "prediction",              # prediction | partial | fallback | policy | shed (extproc.router)
     "fallback_reason": "",              # why least-requests decided (extproc.router.FALLBACK_REASONS), else ""
     "destination": "10.0.0.5:8000",     # "" when refused (basis shed)
     "routing_s": 0.0021,                # from the request's headers to the decision
     "stage_s": {"tokens": 0.0002, "length": 0.0003, "predict": 0.0012},  # predicted decisions only
     "num_prompt_tokens": 291, "num_predicted_output_tokens": 180, "length_source": 1,  # before the max_tokens cap
     "priority": 0, "ttft_objective_s": 1.0,  # the request's objectives (extproc.admission; null: none)
     "shed_reason": "",                  # why it was refused with 429 (extproc.admission.SHED_REASONS), else ""
     "num_prompt_blocks": 18,            # full KV blocks with keys (prefix_cache); null: no keys
     "candidates": [{"endpoint": "10.0.0.5:8000", "ttft_s": 0.031, "e2e_s": 2.9, "state_age_s": 0.004,
                     "queue_s": 0.0, "prefix_blocks_cached": 16},  # leading blocks its state holds or caches
                    {"endpoint": "10.0.0.6:8000", "ttft_s": null, "e2e_s": null, "state_age_s": null,
                     "queue_s": null, "prefix_blocks_cached": null}]}

Candidates are in probe order (a second round's after the first's). A candidate with nulls did not answer (no
sidecar, failed, late, backing off or stale). A record holds the decision attributes of the request's span
(``extproc.spans``), so either explains a decision; its trace and span ids are those of the span current when the
router writes it (the stream routes with the request span current), else the trace bound to the request's log
lines (``astrolabe.logs``). Lines are buffered and flushed when a record finds the last flush older than
``flush_interval_s`` or the buffer holding `MAX_BUFFER_BYTES`, by the server's ``flush`` timer (every second, so
records reach the file when traffic stops) and on ``close``; a write error is logged once and the log turns itself
off (routing never fails because of it). Records are written on the event loop: ~10 us each.

Several processes may append to one file (``workers`` > 1: every worker logs to ``decision_log_path``): the file
is opened with ``O_APPEND`` and a flush writes whole lines in one ``write`` call, which Linux appends at the end
of the file as one piece on a local file system (the inode's lock is held for the whole write), so records of
different workers never interleave within a line. A short write (a full disk) is completed by a second call,
which another worker's write may precede; on a network file system (NFS) ``O_APPEND`` is not atomic at all:
give each worker a local file there.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

from astrolabe.logs import current_trace
from extproc.spans import clip_text

if TYPE_CHECKING:
    from extproc.decision import Decision
    from extproc.request import RoutingRequest

logger = logging.getLogger(__name__)

MAX_BUFFER_BYTES = 1 << 16
"""Buffered records are written once they hold this many bytes (or at the flush interval)."""


class DecisionLog:
    """Appends decision records to ``path`` (created with its folder if needed).

    Args:
        path: the JSON-lines file.
        flush_interval_s: most time a record stays in the buffer, seconds.
        clock: monotonic clock, seconds (for flushing).

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | Path, flush_interval_s: float = 1.0, clock=time.monotonic) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Unbuffered and O_APPEND: one write() per flush, of whole lines (module docstring).
        self._file: IO[bytes] | None = self.path.open("ab", buffering=0)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._pid = os.getpid()
        self._flush_interval_s = flush_interval_s
        self._clock = clock
        self._last_flush_s = clock()
        self.num_records = 0

    def write(self, request: RoutingRequest, decision: Decision) -> None:
        """Appends one record (format in the module docstring); never raises."""
        if self._file is None:
            return
        admit_id = decision.request_id if decision.request_id != request.request_id else ""
        trace_id, span_id = current_trace()
        record = {
            "time_unix_s": round(time.time(), 6), "pid": self._pid, "request_id": request.request_id,
            "trace_id": trace_id, "span_id": span_id, "model": None if request.model is None else clip_text(request.model),
            "max_tokens": request.max_tokens, "admit_id": admit_id,
            "policy": decision.policy, "basis": decision.basis, "fallback_reason": decision.fallback_reason,
            "destination": decision.destination,
            "routing_s": round(decision.routing_s, 6),
            "stage_s": {name: round(value, 6) for name, value in decision.stage_s},
            "num_prompt_tokens": decision.num_prompt_tokens,
            "num_predicted_output_tokens": decision.num_predicted_output_tokens,
            "length_source": decision.length_source,
            "priority": request.objectives.priority, "ttft_objective_s": request.objectives.ttft_s,
            "shed_reason": decision.shed_reason,
            "num_prompt_blocks": decision.num_prompt_blocks,
            "candidates": [{"endpoint": address,
                            "ttft_s": None if p is None else round(p.ttft_s, 6),
                            "e2e_s": None if p is None else round(p.e2e_s, 6),
                            "state_age_s": None if p is None else round(p.state_age_s, 6),
                            "queue_s": None if p is None else round(p.queue_s, 6),
                            "prefix_blocks_cached": cached}
                           for (address, p), cached in zip(decision.candidates, decision.prefix_blocks_cached
                                                           or (None,) * len(decision.candidates))],
        }
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        self._pending.append(line)
        self._pending_bytes += len(line)
        self.num_records += 1
        if self._pending_bytes >= MAX_BUFFER_BYTES or self._clock() - self._last_flush_s >= self._flush_interval_s:
            self.flush()

    def flush(self) -> None:
        """Writes buffered records to the file now, whole lines in one ``write`` call (the server calls it every
        ``flush_interval_s``, so records reach the file while traffic is quiet too); never raises."""
        self._last_flush_s = self._clock()
        if self._file is None or not self._pending:
            return
        data = memoryview(b"".join(self._pending))
        self._pending.clear()
        self._pending_bytes = 0
        try:
            while data:
                data = data[self._file.write(data):]
        except (OSError, ValueError) as exc:
            logger.error("decision log %s failed (%s); no more decisions are logged", self.path, exc)
            self._close_quietly()

    def close(self) -> None:
        """Flushes and closes the file (idempotent)."""
        self._close_quietly()

    def _close_quietly(self) -> None:
        if self._pending:
            self.flush()  # on a write error it comes back here with nothing pending
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                logger.error("decision log %s: %s", self.path, exc)
            self._file = None
