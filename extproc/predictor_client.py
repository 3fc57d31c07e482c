"""gRPC client of the predictor sidecars: Predict with a deadline, fire-and-forget Admit and Release (batched on
a notice stream per sidecar, ``extproc/notices.py``).

A sidecar that fails or times out never fails a request: ``predict`` returns None. What a failure does to the
next requests depends on what it says about the sidecar. Must not import a metrics library or the router: the
caller exports ``outcomes``.

NOTE: the rule, per sidecar.

- **ok** (an answer): resets everything below: the backoff, its escalation and the late streak.
  INVALID_ARGUMENT (this request cannot be served there, e.g. a prompt larger than its KV cache) and a state
  older than ``max_state_age_s`` (not reconciled with its backend lately: an idle-looking stale state would
  attract traffic to a backend that may be down) are answers too: None for this request, the sidecar works.
- **down** (UNAVAILABLE, i.e. connection refused or reset, or any other error but INVALID_ARGUMENT and
  DEADLINE_EXCEEDED): the sidecar is skipped (not even asked) for a backoff that doubles per failure in a row,
  from ``min_backoff_s`` to ``max_backoff_s``.
- **late** (no answer within ``predict_timeout_s``): the answer is dropped for this request only. A gRPC
  deadline cannot tell "answered 1 ms too late" from "never answers", so one late call is weak evidence;
  the sidecar backs off (same schedule) only when it is late persistently: ``late_backoff_after`` late calls
  in a row, the first started at least ``late_backoff_span_s`` before the last failed, with no answer in
  between (a frozen sidecar, not a sidecar slow during a burst: any answer in the streak resets it).
- **the router's own lag is not the sidecar's fault.** grpc.aio stamps the deadline when the call object is
  created but sends the call only when the event loop next runs the call's task; under a burst that wait can
  eat the whole 20 ms (it is the router's lag, not the sidecar's). So ``predict_timeout_s`` runs from when the call is actually *sent*, measured by a callback
  queued right behind gRPC's task (asyncio runs ready callbacks FIFO), and the gRPC deadline (also what the
  sidecar sees) is ``predict_timeout_s + max_loop_lag_s`` from creation, a backstop. A late call is held
  against the sidecar only if the loop noticed the expiry within ``max_loop_lag_s``; a call that hit the
  backstop (the loop could not send it or notice its answer in time) is late but excused (``num_late_excused``).
- **in a row, not at once.** Each sidecar has an epoch, bumped by every recorded failure and recovery. A
  failure counts (escalates a backoff, extends a late streak) only if the epoch has not moved since its call
  was started: four calls that fail together escalate once, and calls in flight when a backoff starts (or
  that were sent before another late call was counted) say nothing new.
- **probing a backing-off sidecar.** When the backoff runs out, exactly one call (the probe) goes through
  while the others are still skipped; its failure (it started after the backoff began) doubles the backoff,
  its answer ends it. For a down sidecar the channel's connectivity is checked too
  (``get_state(try_to_connect=True)``, a cheap local call on each skipped request): if the channel was seen
  disconnected during the backoff and is READY again, the probe goes at once, so a restarted sidecar is
  used again within gRPC's reconnect delay (configured to follow the backoff) instead of the whole backoff.
  Why both: READY only proves a TCP/HTTP2 connection, not a working Predict (a sidecar failing with INTERNAL
  stays READY), so the probe call stays the authority and connectivity only brings it forward, once per
  reconnection; a frozen sidecar also stays READY, so the timed probe is the only way back for a late one.

Tracing (a ``tracer`` given): each Predict and Admit is a CLIENT span ``astrolabe.predictor.v1.Predictor/<method>``
below the current span, its context sent in the call's metadata; a Predict span records the outcome and the
figures the router got (a late call's span ends when the call is given up). Release is not traced (it comes
after the request's span ended). The maintained aio client interceptor does not fit here: it never ends the span
of a call cancelled by the caller, and a late Predict is exactly such a call.

Counters: ``outcomes[address][o]`` for o in ``OUTCOMES`` (every call of ``predict``, exactly one each),
``num_calls`` (Predicts sent) and ``num_late_excused``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import time
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from astrolabe.tls import ClientTls, channel_credentials, channel_options
from astrolabe.tracing import (ADMIT_ID, PREDICTED_E2E_S, PREDICTED_QUEUE_S, PREDICTED_TTFT_S, SERVER_ADDRESS,
                               SERVER_PORT, STATE_AGE_S, grpc_metadata)
from extproc.notices import NoticeStream
from extproc.policies.base import Prediction
from extproc.spans import host_port
from predictor.api import pb, pb_grpc

logger = logging.getLogger(__name__)

_METRICS = {"e2e": pb.METRIC_E2E, "ttft": pb.METRIC_TTFT}
LATE_LOG_INTERVAL_S = 60.0
"""Least time between two log lines about late answers of one sidecar, seconds."""

MODES = ("watch", "predict")
"""``PredictorClientConfig.mode``: where predictions are made (the router, from streamed states; or the sidecars)."""
NOTICES = ("stream", "unary")
"""``PredictorClientConfig.notices``: how Admit and Release travel (``extproc/notices.py``)."""
OUTCOMES = ("ok", "late", "down", "invalid", "skipped_backoff", "stale_state")
_MAX_UINT32 = 2**32 - 1


def _uint32(value: int) -> int:
    """A count for a uint32 field: values beyond it are cut to it (a prompt or cap that large is unservable)."""
    return min(max(int(value), 0), _MAX_UINT32)


def _cap(max_tokens: int | None) -> int:
    """``max_tokens`` for the wire: 0 (no cap) when absent or beyond uint32 (a cap that large caps nothing)."""
    return max_tokens if max_tokens is not None and 0 < max_tokens <= _MAX_UINT32 else 0
"""Outcomes of ``predict``, one per call, counted in ``PredictorClient.outcomes``."""


MAX_SENT_ADMITS = 1024
"""Admits remembered per sidecar until a watched state includes them (``extproc/fleet_state.py``): far more than one
state interval's dispatches to one instance."""


@dataclass(frozen=True, slots=True)
class SentAdmit:
    """An Admit this router sent: its number (``admit_seq``), prompt and predicted output tokens, cap (tokens, None
    = none), length source, when it was sent (the client's clock, seconds), its prompt's block keys (None: none
    sent) and its engine priority (vLLM's: lower = earlier)."""

    seq: int
    num_prompt_tokens: int
    num_output_tokens: int
    max_tokens: int | None
    length_source: int
    sent_s: float = 0.0
    block_keys: tuple[int, ...] | None = None
    priority: int = 0


@dataclass(frozen=True, slots=True)
class PredictorClientConfig:
    """Deadlines, seconds, and the backoff rule (see the module docstring).

    Attributes:
        predict_timeout_s: time a sidecar gets to answer one Predict, counted from when the call is sent.
        notify_timeout_s: deadline of Admit / Release.
        max_state_age_s: an answer whose state is older counts as no prediction.
        min_backoff_s: first backoff of a failing sidecar; doubles per failure in a row ...
        max_backoff_s: ... up to this cap (which wins if it is the smaller).
        max_loop_lag_s: the extproc's own event-loop lag tolerated per Predict: the gRPC deadline is
            ``predict_timeout_s + max_loop_lag_s`` from the call's creation, and a late call whose expiry the
            loop noticed later than this is not held against the sidecar.
        late_backoff_after: late calls in a row (count) before a sidecar backs off ...
        late_backoff_span_s: ... provided they span at least this long (first sent to last failed).
        hold_s: each Predict asks its sidecar to hold the request this long (``predictor/holds.py``, protocol
            v1.1): counted there from the answer, so that concurrent decisions see each other, until the router's
            Admit confirms it or its Release drops it; 0 = plain Predicts (v1.0: decisions made together are
            answered from the same state and herd).
        mode: ``watch`` (each sidecar streams its state and the router predicts locally, ``extproc/fleet_state.py``,
            protocol v1.2: no round trip on the request path; a sidecar without Watch is asked by Predict) or
            ``predict`` (a Predict round trip per candidate, v1.1).
        watch_interval_s: ``watch``: how often each sidecar sends its state, seconds.
        watch_max_age_s: ``watch``: a state received longer ago gives no prediction (a frozen or cut-off sidecar),
            seconds.
        notices: ``stream`` (Admits and Releases batched on one Notify stream per sidecar, protocol v1.3,
            ``extproc/notices.py``; unary calls to a sidecar without it) or ``unary`` (one call each).
    """

    predict_timeout_s: float = 0.02
    notify_timeout_s: float = 0.5
    max_state_age_s: float = 2.0
    min_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    max_loop_lag_s: float = 0.1
    late_backoff_after: int = 5
    late_backoff_span_s: float = 1.0
    hold_s: float = 0.5
    mode: str = "watch"
    watch_interval_s: float = 0.02
    watch_max_age_s: float = 0.25
    notices: str = "stream"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.notices not in NOTICES:
            raise ValueError(f"notices must be one of {', '.join(NOTICES)}, got {self.notices!r}")
        if self.late_backoff_after < 1:
            raise ValueError("late_backoff_after: must be >= 1")
        if self.late_backoff_span_s < 0 or self.max_loop_lag_s < 0 or not self.hold_s >= 0:
            raise ValueError("late_backoff_span_s, max_loop_lag_s, hold_s: must be >= 0")
        if not (self.watch_interval_s > 0 and self.watch_max_age_s > 0):
            raise ValueError("watch_interval_s, watch_max_age_s: must be > 0")


@dataclass(slots=True)
class _Health:
    """One sidecar's failure state. Times on the client's clock, seconds."""

    epoch: int = 0                      # bumped by every recorded failure and recovery
    num_backoffs: int = 0               # backoffs in a row: the next lasts min_backoff_s * 2**num_backoffs
    backoff_until_s: float | None = None  # None: not backing off; past: the next call is the probe
    backoff_cause: str = ""             # "down" or "late"
    saw_disconnected: bool = False      # the channel was seen not READY during this (down) backoff
    probe_in_flight: bool = False
    num_late: int = 0                   # late calls in a row (counted ones)
    late_since_s: float = 0.0           # when the first of them was sent


class _Late(Exception):
    def __init__(self, excused: bool) -> None:
        super().__init__("late")
        self.excused = excused


class _SendDeadline:
    """``predict_timeout_s`` from when the call is sent; times on the event loop's clock, seconds."""

    __slots__ = ("_loop", "_call", "_timeout_s", "_handle", "expired", "due_s", "fired_s")

    def __init__(self, loop: asyncio.AbstractEventLoop, call, timeout_s: float) -> None:
        self._loop, self._call, self._timeout_s = loop, call, timeout_s
        self.expired = False
        self.due_s = self.fired_s = None
        # FIFO: this runs right after the call's invocation task took its first step, i.e. sent the call
        self._handle = loop.call_soon(self._sent)

    def _sent(self) -> None:
        self.due_s = self._loop.time() + self._timeout_s
        self._handle = self._loop.call_later(self._timeout_s, self._fire)

    def _fire(self) -> None:
        self.fired_s = self._loop.time()
        # one more pass first: an answer that arrived while the loop was busy resumes before this check
        self._handle = self._loop.call_soon(self._expire)

    def _expire(self) -> None:
        if not self._call.done():
            self.expired = True
            self._call.cancel()

    def lag_s(self) -> float:
        """How late the loop noticed the expiry, seconds."""
        return self.fired_s - self.due_s

    def cancel(self) -> None:
        self._handle.cancel()


class PredictorClient:
    """Talks to many sidecars, one cached channel each; all methods run on the event loop.

    Args:
        config: deadlines and backoff.
        clock: monotonic clock, seconds, for backoffs and late streaks (injectable for tests). Deadlines and
            loop lag run on the event loop's clock, since asyncio timers do.
        tracer: starts a CLIENT span per Predict and Admit (a child of the current span) whose context travels
            as gRPC metadata, so the sidecar continues the trace; None = no spans, no metadata (tracing off).
        tls: TLS (mutual when it has a certificate) of every sidecar channel; None = plaintext.

    Raises:
        astrolabe.tls.TlsError: a file of ``tls`` cannot be used.

    Attributes:
        outcomes: sidecar address -> outcome (``OUTCOMES``) -> number of ``predict`` calls.
        num_calls: Predicts sent (skipped ones not counted).
        num_late_excused: late Predicts blamed on the extproc's event-loop lag rather than on the sidecar.
    """

    def __init__(self, config: PredictorClientConfig, clock=time.monotonic,
                 tracer: trace.Tracer | None = None, tls: ClientTls | None = None) -> None:
        self.config = config
        # Read once (a TlsError here is a configuration error); every sidecar channel shares them.
        self._credentials = channel_credentials(tls) if tls is not None else None
        self._channel_options = channel_options(tls)
        self._clock = clock
        self._tracer = tracer
        self._stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.PredictorStub]] = {}
        self._health: dict[str, _Health] = {}
        self._tasks: set[asyncio.Task] = set()
        self.outcomes: dict[str, dict[str, int]] = {}
        self.num_calls = 0
        self.num_late_excused = 0
        self._late_said_s: dict[str, float] = {}  # when a late answer of each sidecar was last logged
        # Protocol v1.1: this process's id, and per sidecar the Admits sent (their sequence) and not yet answered.
        self.router_id = int.from_bytes(os.urandom(8), "big") >> 1 or 1
        self._num_admitted: dict[str, int] = {}
        self._num_admits_pending: dict[str, int] = {}
        self._sent_admits: dict[str, collections.deque[SentAdmit]] = {}  # per sidecar, oldest first (v1.2)
        self.notice_streams: dict[str, NoticeStream] = {}  # per sidecar (v1.3)

    def _stub(self, address: str) -> pb_grpc.PredictorStub:
        entry = self._stubs.get(address)
        if entry is None:
            # gRPC reconnects a failed channel on its own schedule; keep it no slower than our backoff,
            # or a probe would find the channel still waiting to reconnect to a sidecar that is back
            options = [("grpc.initial_reconnect_backoff_ms", max(int(self.config.min_backoff_s * 1000), 1)),
                       ("grpc.max_reconnect_backoff_ms", max(int(self.config.max_backoff_s * 1000), 1))]
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(address, options=options)
            else:
                channel = grpc.aio.secure_channel(address, self._credentials, options=options + self._channel_options)
            entry = self._stubs[address] = (channel, pb_grpc.PredictorStub(channel))
        return entry[1]

    def _sidecar(self, address: str) -> _Health:
        health = self._health.get(address)
        if health is None:
            health = self._health[address] = _Health()
            self.outcomes[address] = dict.fromkeys(OUTCOMES, 0)
        return health

    def is_backing_off(self, address: str) -> bool:
        """True while ``predict`` skips this sidecar (a backoff in force, or its probe in flight)."""
        health = self._health.get(address)
        return health is not None and self._skips(address, health)

    def _skips(self, address: str, health: _Health) -> bool:
        if health.backoff_until_s is None:
            return False
        if health.probe_in_flight:
            return True
        if self._clock() >= health.backoff_until_s:
            return False
        entry = self._stubs.get(address)
        if health.backoff_cause == "down" and entry is not None:
            if entry[0].get_state(try_to_connect=True) != grpc.ChannelConnectivity.READY:
                health.saw_disconnected = True
            elif health.saw_disconnected:
                return False  # reconnected since the failure: probe now
        return True

    async def predict(self, address: str, request_id: str, num_prompt_tokens: int,
                      num_output_tokens: int, metric: str = "e2e", *, max_tokens: int | None = None,
                      length_source: int = 0, block_keys: tuple[int, ...] | None = None,
                      block_size: int = 0, priority: int = 0) -> Prediction | None:
        """Asks one sidecar (in a CLIENT span, its context sent as gRPC metadata, when tracing).

        Args:
            address: the sidecar's ``host:port``.
            request_id: the request's admit id.
            num_prompt_tokens: prompt tokens.
            num_output_tokens: predicted output tokens, before the ``max_tokens`` cap (the sidecar applies it).
            metric: the figure the policy compares (``e2e``, ``ttft`` or ``blend``; informational).
            max_tokens: the request's output cap, tokens (None: not given).
            length_source: where ``num_output_tokens`` came from (``predictor.residual_rules.LENGTH_SOURCE_*``).
            block_keys: the prompt's KV block keys (``RoutingRequest.block_keys``; None: none sent).
            block_size: tokens per block of ``block_keys``.
            priority: the priority the request carries to the engine (vLLM's: lower = earlier; 0 = none written).

        Returns:
            The prediction, or None if the sidecar is backing off, fails, misses the deadline, cannot serve
            the request, or answers from a stale state (the outcome is counted in ``outcomes``). With
            ``config.hold_s`` the sidecar holds the request (unless it failed or was skipped): the caller then
            sends it ``admit`` (chosen) or ``release`` (not chosen).
        """
        message = pb.PredictRequest(request_id=request_id, num_prompt_tokens=_uint32(num_prompt_tokens),
                                    num_predicted_output_tokens=_uint32(num_output_tokens),
                                    metric=_METRICS.get(metric, pb.METRIC_TTFT), max_tokens=_cap(max_tokens),
                                    length_source=length_source, hold_s=self.config.hold_s,
                                    router_id=self.router_id, block_keys=block_keys or (),
                                    block_keys_block_size=block_size if block_keys else 0, priority=priority)
        if self._tracer is None:
            return (await self._predict(address, message, None))[0]
        span = _call_span(self._tracer, "Predict", address, request_id)
        try:
            prediction, outcome = await self._predict(address, message, span)
        except BaseException:  # the caller's own cancellation: the span still ends
            span.end()
            raise
        if span.is_recording():
            span.set_attribute(PREDICTOR_OUTCOME, outcome)
            if outcome in ("down", "late"):
                span.set_status(Status(StatusCode.ERROR, outcome))
            if prediction is not None:
                span.set_attributes({PREDICTED_TTFT_S: prediction.ttft_s, PREDICTED_E2E_S: prediction.e2e_s,
                                     PREDICTED_QUEUE_S: prediction.queue_s, STATE_AGE_S: prediction.state_age_s})
        span.end()
        return prediction

    async def _predict(self, address: str, message: pb.PredictRequest,
                       span: trace.Span | None) -> tuple[Prediction | None, str]:
        """``predict`` without the span: the prediction (None on any failure) and its outcome (``OUTCOMES``)."""
        health = self._sidecar(address)
        counts = self.outcomes[address]
        if self._skips(address, health):
            counts["skipped_backoff"] += 1
            return None, "skipped_backoff"
        is_probe = health.backoff_until_s is not None
        health.probe_in_flight |= is_probe
        epoch, sent_s = health.epoch, self._clock()
        self.num_calls += 1
        try:
            reply = await self._send_predict(self._stub(address), message,
                                             None if span is None else grpc_metadata(span))
        except _Late as late:
            counts["late"] += 1
            if late.excused:
                self.num_late_excused += 1
            else:
                self._late(address, health, epoch, sent_s)
                self._say_late(address)
            return None, "late"
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                counts["invalid"] += 1
                logger.debug("predictor %s cannot serve request %s: %s", address, message.request_id,
                             _describe(exc))
                self._answered(address, health)
                return None, "invalid"
            counts["down"] += 1
            self._down(address, health, epoch, exc)
            return None, "down"
        finally:
            if is_probe:
                health.probe_in_flight = False
        self._answered(address, health)
        if not reply.state_age_s <= self.config.max_state_age_s:  # also catches inf (never reconciled)
            counts["stale_state"] += 1
            return None, "stale_state"
        figures = (reply.ttft_s, reply.e2e_s, reply.queue_s)
        if not all(math.isfinite(f) and f >= 0 for f in figures) or reply.e2e_s < reply.ttft_s:
            counts["invalid"] += 1  # a broken sidecar's answer must not reach a comparison (NaN loses every min)
            logger.debug("predictor %s answered nonsense for %s: %s", address, message.request_id, figures)
            return None, "invalid"
        counts["ok"] += 1
        residual = reply.calibration_residual
        per_request = (reply.ttft_s_per_request, reply.e2e_s_per_request)
        if not all(math.isfinite(f) and f >= 0 for f in per_request):
            per_request = (0.0, 0.0)
        return Prediction(reply.ttft_s, reply.e2e_s, reply.state_age_s, reply.queue_s,
                          num_requests=reply.num_running + reply.num_waiting,
                          model_error=residual if math.isfinite(residual) and residual > 0 else 0.0,
                          ttft_s_per_request=per_request[0], e2e_s_per_request=per_request[1],
                          idle_e2e_s=reply.idle_e2e_s if math.isfinite(reply.idle_e2e_s) and reply.idle_e2e_s > 0
                          else 0.0,
                          num_admits_seen=reply.admits_seen if reply.protocol_revision >= 1 else -1), "ok"

    async def _send_predict(self, stub: pb_grpc.PredictorStub, message: pb.PredictRequest,
                            metadata) -> pb.PredictResponse:
        """One Predict under the send-time deadline (``metadata``: the trace context, or None).

        Raises:
            _Late: no answer in time; ``excused`` when the event loop's lag, not the sidecar, made it late.
            grpc.RpcError: any other failure.
        """
        loop = asyncio.get_running_loop()
        call = stub.Predict(message, timeout=self.config.predict_timeout_s + self.config.max_loop_lag_s,
                            metadata=metadata)
        deadline = _SendDeadline(loop, call, self.config.predict_timeout_s)
        try:
            return await call
        except asyncio.CancelledError:
            if deadline.expired and not asyncio.current_task().cancelling():
                raise _Late(excused=deadline.lag_s() > self.config.max_loop_lag_s) from None
            raise
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # the backstop: only a lagging loop gets here
                raise _Late(excused=True) from None
            raise
        finally:
            deadline.cancel()

    def _down(self, address: str, health: _Health, epoch: int, error: BaseException) -> None:
        if epoch != health.epoch:  # sent before the failure or backoff now in force: nothing new
            return
        self._back_off(address, health, "down", _describe(error))
        entry = self._stubs.get(address)
        health.saw_disconnected = (entry is not None
                                   and entry[0].get_state() != grpc.ChannelConnectivity.READY)

    def _say_late(self, address: str) -> None:
        """A late answer is logged at most once a minute per sidecar (they are counted in
        ``astrolabe_extproc_predictor_calls_total{outcome="late"}``): under a burst the decisions then fall back
        to least requests without the predictions, and the log should say what to change."""
        now_s = self._clock()
        if now_s - self._late_said_s.get(address, -math.inf) < LATE_LOG_INTERVAL_S:
            return
        self._late_said_s[address] = now_s
        logger.warning("predictor %s answered later than predict_timeout_s (%g s): its prediction was not used "
                       "(count: astrolabe_extproc_predictor_calls_total{outcome=\"late\"}); if this persists under "
                       "load, raise predictor_client.predict_timeout_s", address, self.config.predict_timeout_s)

    def _late(self, address: str, health: _Health, epoch: int, sent_s: float) -> None:
        if epoch != health.epoch:  # sent before the last counted failure: the same stall, counted once
            return
        health.epoch += 1
        if health.num_late == 0:
            health.late_since_s = sent_s
        health.num_late += 1
        span_s = self._clock() - health.late_since_s
        if health.num_late >= self.config.late_backoff_after and span_s >= self.config.late_backoff_span_s:
            self._back_off(address, health, "late", f"{health.num_late} late answers in {span_s:.2f} s")

    def _back_off(self, address: str, health: _Health, cause: str, why: str) -> None:
        health.epoch += 1
        health.num_backoffs += 1
        backoff_s = min(self.config.min_backoff_s * 2 ** (health.num_backoffs - 1), self.config.max_backoff_s)
        health.backoff_until_s = self._clock() + backoff_s
        health.backoff_cause = cause
        health.saw_disconnected = False
        logger.warning("predictor %s %s (%s); skipped for %.1f s", address, cause, why, backoff_s)

    def _answered(self, address: str, health: _Health) -> None:
        if health.backoff_until_s is None and health.num_late == 0:
            return
        if health.backoff_until_s is not None:
            logger.info("predictor %s answers again", address)
        health.epoch += 1  # calls in flight since before the recovery cannot start a new backoff
        health.num_backoffs = health.num_late = 0
        health.backoff_until_s = None
        health.saw_disconnected = False

    async def wait_ready(self, address: str, timeout_s: float) -> bool:
        """Waits until the channel to ``address`` is connected; True if it was within ``timeout_s`` seconds."""
        self._stub(address)
        try:
            await asyncio.wait_for(self._stubs[address][0].channel_ready(), timeout=timeout_s)
        except (asyncio.TimeoutError, grpc.RpcError, grpc.aio.UsageError, KeyError):
            return False  # not ready in time, or forgotten (its channel closed) meanwhile
        return True

    def connect(self, addresses) -> None:
        """Opens channels to ``addresses`` in the background, so that first predictions do not pay the connect."""
        for address in addresses:
            self._spawn(self.wait_ready(address, timeout_s=5.0))  # a failure shows in the first Predict
            stream = self._notice_stream(address)
            if stream is not None:
                stream.start()

    def admit(self, address: str, request_id: str, num_prompt_tokens: int, num_output_tokens: int, *,
              max_tokens: int | None = None, length_source: int = 0, predicted_ttft_s: float = 0.0,
              predicted_e2e_s: float = 0.0, block_keys: tuple[int, ...] | None = None, block_size: int = 0,
              priority: int = 0) -> None:
        """Tells the chosen sidecar about the request, without waiting for the answer (arguments as ``predict``;
        ``predicted_*_s``: what that sidecar predicted for it, seconds, 0 = none, which it checks against the
        outcome; ``block_keys``: its ledger keeps them, its model of the instance's prefix cache)."""
        seq = self._num_admitted[address] = self._num_admitted.get(address, 0) + 1
        message = pb.AdmitRequest(request_id=request_id, num_prompt_tokens=_uint32(num_prompt_tokens),
                                  num_predicted_output_tokens=_uint32(num_output_tokens), max_tokens=_cap(max_tokens),
                                  length_source=length_source, predicted_ttft_s=predicted_ttft_s,
                                  predicted_e2e_s=predicted_e2e_s, router_id=self.router_id, admit_seq=seq,
                                  block_keys=block_keys or (), block_keys_block_size=block_size if block_keys else 0,
                                  priority=priority)
        span = None if self._tracer is None else _call_span(self._tracer, "Admit", address, request_id)
        if span is not None and not span.is_recording():
            span = None  # not sampled: nothing to end, nothing to continue
        self._num_admits_pending[address] = self._num_admits_pending.get(address, 0) + 1
        stream = self._notice_stream(address)
        # A sampled request's Admit is a unary call: the sidecar continues its trace from the call's metadata.
        if span is not None or stream is None or not stream.offer(admit=message):
            call = self._stub(address).Admit(message, timeout=self.config.notify_timeout_s,
                                             metadata=None if span is None else grpc_metadata(span))
            self._notify(address, call, span, admit=True)
        sent = self._sent_admits.get(address)
        if sent is None:
            sent = self._sent_admits[address] = collections.deque(maxlen=MAX_SENT_ADMITS)
        sent.append(SentAdmit(seq, num_prompt_tokens, num_output_tokens, max_tokens or None, length_source,
                              self._clock(), block_keys or None, priority))

    def admits_after(self, address: str, seq: int) -> list[SentAdmit]:
        """The Admits sent to ``address`` with a number above ``seq`` (at most `MAX_SENT_ADMITS` of the latest),
        oldest first: what a state that includes up to ``seq`` does not include yet."""
        sent = self._sent_admits.get(address)
        if not sent or sent[-1].seq <= seq:
            return []
        return [a for a in sent if a.seq > seq]

    def forget_admits_through(self, address: str, seq: int) -> None:
        """Drops the record of the Admits to ``address`` numbered ``seq`` or below (a state includes them)."""
        sent = self._sent_admits.get(address)
        while sent and sent[0].seq <= seq:
            sent.popleft()

    def stub(self, address: str) -> pb_grpc.PredictorStub:
        """The stub of ``address``'s channel (opened on first use; shared with every call to it)."""
        return self._stub(address)

    def num_admitted(self, address: str) -> int:
        """Admits sent to the sidecar at ``address`` so far (the last one's ``admit_seq``)."""
        return self._num_admitted.get(address, 0)

    def num_admits_pending(self, address: str) -> int:
        """Admits sent to the sidecar at ``address`` whose call has not ended yet (answered, failed or timed
        out); on a notice stream, until gRPC took the batch that carries it (its handling is not confirmed) or it
        was lost."""
        return self._num_admits_pending.get(address, 0)

    def release(self, address: str, request_id: str, failed: bool = False) -> None:
        """Tells the sidecar the request ended (``failed``: the backend answered it with an error), without waiting
        for the answer."""
        message = pb.ReleaseRequest(request_id=request_id, failed=failed)
        stream = self._notice_stream(address)
        if stream is None or not stream.offer(release=message):
            self._notify(address, self._stub(address).Release(message, timeout=self.config.notify_timeout_s))

    def _notice_stream(self, address: str) -> NoticeStream | None:
        """The notice stream of ``address`` (created, not opened, on first use); None: notices are unary calls."""
        if self.config.notices != "stream":
            return None
        stream = self.notice_streams.get(address)
        if stream is None:
            def gone(num_admits: int) -> None:
                if address in self._num_admits_pending:
                    self._num_admits_pending[address] -= num_admits

            stream = self.notice_streams[address] = NoticeStream(
                address, lambda batches: self._stub(address).Notify(batches), self.config.min_backoff_s,
                self.config.max_backoff_s, on_gone=gone)
        return stream

    def _notify(self, address: str, call, span: trace.Span | None = None, admit: bool = False) -> None:
        async def run() -> None:
            try:
                await call
            except grpc.RpcError as exc:  # the sidecar reconciles with /metrics; a lost notice heals there
                logger.debug("notice to predictor %s lost: %s", address, _describe(exc))
                if span is not None:
                    span.set_status(Status(StatusCode.ERROR, _describe(exc)))
            finally:
                if span is not None:
                    span.end()
                if admit and address in self._num_admits_pending:
                    self._num_admits_pending[address] -= 1

        self._spawn(run())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def forget(self, address: str) -> None:
        """Drops a sidecar that left the pool (its endpoint is gone): its channel is closed in the background, its
        health and outcome counts are deleted. A later call to it starts afresh."""
        entry = self._stubs.pop(address, None)
        self._health.pop(address, None)
        self.outcomes.pop(address, None)
        self._num_admitted.pop(address, None)
        self._num_admits_pending.pop(address, None)
        self._sent_admits.pop(address, None)
        stream = self.notice_streams.pop(address, None)
        if stream is not None:
            self._spawn(stream.close())
        if entry is not None:
            self._spawn(entry[0].close(grace=self.config.notify_timeout_s))

    async def close(self) -> None:
        for stream in self.notice_streams.values():
            await stream.close()
        self.notice_streams.clear()
        for task in list(self._tasks):
            task.cancel()
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()


PREDICTOR_SERVICE = "astrolabe.predictor.v1.Predictor"
PREDICTOR_OUTCOME = "astrolabe.predictor.outcome"  # one of OUTCOMES


def _call_span(tracer: trace.Tracer, method: str, address: str, request_id: str) -> trace.Span:
    """A CLIENT span for one call to a sidecar, named and attributed as the RPC semantic conventions say."""
    host, port = host_port(address)
    attributes = {"rpc.system": "grpc", "rpc.service": PREDICTOR_SERVICE, "rpc.method": method,
                  SERVER_ADDRESS: host, ADMIT_ID: request_id}
    if port is not None:
        attributes[SERVER_PORT] = port
    return tracer.start_span(f"{PREDICTOR_SERVICE}/{method}", kind=SpanKind.CLIENT, attributes=attributes)


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    return type(error).__name__
