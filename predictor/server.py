"""``astrolabe predictor serve``: the sidecar beside one backend (gRPC Predictor API + health).

It keeps a ``Ledger`` of the requests the extproc admitted here, answers Predict by simulating the instance
forward from the ledger's state with the new request added (``predictor.sim.predict``), and every
``reconcile_interval_s`` scrapes the backend's /metrics to correct the ledger. A Predict that asks for a hold
(``hold_s``, protocol v1.1) counts its request here from its answer until the router's Admit confirms it or its
Release drops it (``predictor.holds``): concurrent decisions then see each other. ``state_age_s`` in every answer is
the time since the last successful reconciliation (a dead or slow backend makes it grow).
At start (and, while the backend does not answer yet, at every reconciliation until it does: a sidecar may start
before its server) it reads the KV cache (``block_size``, ``num_gpu_blocks``) from the backend's /metrics
(``vllm:cache_config_info``; SGLang: ``sglang:cache_config_info`` pages, ``predictor.backend_metrics``), and, beside
an SGLang server, its engine limits from ``GET /get_server_info`` (``max_running_requests`` -> max_num_seqs,
``chunked_prefill_size`` -> max_num_batched_tokens, ``page_size`` and ``max_total_num_tokens`` -> the KV cache;
python/sglang/srt/entrypoints/http_server.py ``get_server_info``). ``--backend-engine`` says which server it is
(``auto``: read from the metric names of each scrape).

With the plugin's (or the emulator's) state file it also refits its step-time model from the engine's measured
steps (``predictor.calibration``, ``--calibration online``, the default) and observes each request's first token;
every request admitted with a prediction is checked against what happened at Release
(``predictor.outcomes``). Both are reported in every Predict answer (calibration), in ``State`` and, with
``--metrics-port``, as Prometheus metrics (`SidecarCollector`).

Tracing (the ``OTEL_*`` variables, ``astrolabe.tracing``; off when none is set): Predict and Admit continue the
caller's trace from the call's gRPC metadata in a SERVER span (``opentelemetry-instrumentation-grpc``), and each
Predict's simulation is a child span ``astrolabe.simulate`` (state source, requests running and waiting, free KV
blocks, simulated steps, state age, the predicted TTFT and E2E).

Logs (``astrolabe.logs``, ``--log-level``, ``--log-format``): at start one line says what was discovered from the
backend (KV cache, engine limits, state source, step-time model); a line logged while a Predict, Admit or Release
is handled carries the request's id (the extproc's admit id, ``<x-request-id>/<suffix>``) and, traced, its trace.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass
import json
import logging
import math
import re
import time

import aiohttp
import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Histogram

from astrolabe.lifecycle import settle_heap, wait_for_termination
from astrolabe.logs import add_arguments as add_log_arguments, request_context, setup_logging
from astrolabe.tls import BackendTls, ServerTls, TlsError, add_port, backend_url, https_context, \
    https_request_options, server_credentials
from astrolabe.tracing import (ADMIT_ID, NUM_PREDICTED_OUTPUT_TOKENS, NUM_PROMPT_TOKENS, PREDICTED_E2E_S,
                               PREDICTED_TTFT_S, STATE_AGE_S, Tracing, TracingConfigError, setup_tracing)
from predictor.api import NOTIFY_READY_KEY, pb, pb_grpc
from predictor.backend_metrics import METRICS_FORMATS, SGLANG, check_metrics_format, parse_backend_metrics
from predictor.calibration import CalibrationStatus, StepTimeCalibrator
from predictor.engine_flags import add_engine_arguments, engine_from_args
from predictor.early_releases import EarlyReleases
from predictor.holds import MAX_HOLD_S, Holds
from predictor.instance_state import Corrections, encode
from predictor.ledger import BackendObservation, Ledger
from predictor.outcomes import OutcomeTracker
from predictor.residual_rules import LENGTH_DISTRIBUTIONS, ResidualRules
from predictor.sim import EngineConfig, LinearBatchTimeModel
from predictor.sim.scheduler import check_request_fits
from predictor.sim.predict import marginal_cost_s, predict, predict_idle
from predictor.sim.residual import RESIDUAL_RULES
from predictor.sim.snapshot import InstanceSnapshot, RequestState
from predictor.ingress import IngressDelayEstimator
from predictor.kv_events import KvEventIndex, KvEventSubscriber
from predictor.state_source import (STATE_SOURCE_LEDGER, STATE_SOURCE_PLUGIN, STATE_SOURCES, PluginStateSource,
                                    pending_id, x_request_id_of)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class SidecarConfig:
    """Sidecar settings (CLI flags of the same names).

    Attributes:
        backend: ``host:port`` of the vLLM server whose /metrics is scraped.
        listen: ``host:port`` of the gRPC server.
        engine: the instance's engine limits (vLLM names); KV fields may be replaced from the backend.
        batch_time_model: shipped model name or JSON path (``predictor.sim.LinearBatchTimeModel``); None = the
            shipped shape nearest ``model_config`` (``predictor.model_shape``), else ``llama-2-7b``.
        model_config: the served model's ``config.json`` (or its directory), for the cold start; None = none.
        time_scale: multiplies modelled step times (1.0 for a real GPU; the emulator's time scale otherwise).
        reconcile_interval_s: how often /metrics is scraped, seconds.
        visibility_grace_s: an admitted request is not reconciled away for this long, seconds.
        state_source: ``auto`` | ``ledger`` | ``vllm-plugin`` (`predictor.state_source`).
        vllm_state_path: the vLLM plugin's state file (None = no plugin).
        kv_events_endpoint: the engine's KV cache events (ZMQ, ``tcp://host:port``; vLLM's ``--kv-events-config``
            with ``"endpoint": "tcp://*:port"``), read into the exact index of its cached blocks
            (`predictor.kv_events`) that plugin snapshots carry; None = none (no cached free blocks there).
        kv_events_topic: the publisher's topic (vLLM's ``kv_events_config.topic``, default "").
        plugin_max_age_s: a plugin state this old with requests in flight is ignored, seconds.
        plugin_reconcile_interval_s: the /metrics scrape interval while the plugin's state is in use, seconds
            (the ledger is then only a fallback: a slower scrape saves the sidecar's and the backend's CPU).
        residual_lengths: the residual-length rule of requests whose length source is unspecified
            (``predictor.sim.residual.RESIDUAL_RULES``); tagger/fixed/exact requests get theirs
            (``predictor.residual_rules``).
        length_errors: the tagger directory (or its errors.npz) whose measured errors condition residual
            lengths; None = the shipped light tagger's.
        length_distribution: how a tagger's live requests are priced (``predictor.residual_rules
            .LENGTH_DISTRIBUTIONS``): ``quantiles``, each one's own distribution from the tagger directory's
            ``quantiles.npz``, or ``binned``, its held-out errors in the bin of the estimate.
        calibration: ``online`` (refit the step-time model from the engine's measured steps, when the state file
            carries them) or ``off`` (the shipped model as given).
        calibration_min_samples: measured steps before the first refit.
        bias_correction: correct the recent measured bias (``predictor.outcomes``): E2E by a factor, TTFT by an
            offset.
        metrics_listen: ``host:port`` of a Prometheus /metrics endpoint; None = none.
        ingress_delay: ``online`` (add the measured delay from Admit to the engine's scheduler,
            ``predictor.ingress``, to TTFT and E2E predictions; needs the plugin's ``arrivals``) or ``off`` (the
            default: the delay is measured and reported only).
        tls: TLS (mutual when it names a client CA) of the gRPC server (``astrolabe.tls``); None = plaintext.
        backend_tls: HTTPS to the backend's /metrics (``astrolabe.tls.BackendTls``); None = plain HTTP.
        backend_engine: ``auto`` | ``vllm`` | ``sglang``: whose /metrics names (and, SGLang, ``/get_server_info``)
            the backend serves; ``auto`` reads each scrape by the gauges it carries.
        discover_engine_limits: beside SGLang, take max_num_seqs, max_num_batched_tokens and the KV cache from
            ``/get_server_info`` at start (vLLM publishes no such endpoint: its limits come from the flags or the
            plugin's state file).
        follow_backend_scheduling: model the backend's scheduler rules: ``sglang`` (``predictor.sim.scheduler``)
            once the backend shows itself as SGLang, else ``engine.scheduling``; False = ``engine.scheduling``
            always (the CLI: an explicit ``--scheduling``).
        watch_interval_s: how often a watching router (protocol v1.2) gets the instance's state when it does not
            ask for another interval, seconds.
    """

    backend: str
    listen: str = "127.0.0.1:9100"
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    batch_time_model: str | None = "llama-2-7b"
    time_scale: float = 1.0
    reconcile_interval_s: float = 0.1
    visibility_grace_s: float = 2.0
    discover_kv_cache: bool = True
    state_source: str = "auto"
    vllm_state_path: str | None = None
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    plugin_max_age_s: float = 2.0
    residual_lengths: str = "empirical"
    length_errors: str | None = None
    length_distribution: str = "quantiles"
    plugin_reconcile_interval_s: float = 1.0
    calibration: str = "online"
    calibration_min_samples: int = 64
    bias_correction: bool = False
    metrics_listen: str | None = None
    model_config: str | None = None
    ingress_delay: str = "off"
    tls: ServerTls | None = None
    backend_tls: BackendTls | None = None
    backend_engine: str = "auto"
    discover_engine_limits: bool = True
    follow_backend_scheduling: bool = True
    watch_interval_s: float = 0.02


def resolve_batch_time_model(batch_time_model: str | None, model_config: str | None) -> str:
    """The batch-time model to start from: ``batch_time_model`` when given, else the shipped shape nearest the
    served model's config (logged), else ``llama-2-7b``.

    Raises:
        OSError, ValueError: ``model_config`` cannot be read or is not a transformer config.
    """
    if batch_time_model:
        return batch_time_model
    if not model_config:
        return "llama-2-7b"
    from predictor.model_shape import nearest_shipped_model, read_model_shape  # noqa: PLC0415

    name, distance = nearest_shipped_model(read_model_shape(model_config))
    logger.info("cold start: shipped step-time model %s is the nearest shape to %s (log distance %.2f); "
                "calibration refits it from the engine's steps", name, model_config, distance)
    return name


def load_batch_time(name_or_path: str, time_scale: float = 1.0) -> LinearBatchTimeModel:
    """A shipped model (by name) or a JSON file, with every coefficient multiplied by ``time_scale``.

    Raises:
        ValueError: unknown name, bad JSON, or ``time_scale <= 0``.
        OSError: unreadable file.
    """
    if not 0 < time_scale < math.inf:
        raise ValueError(f"time_scale must be a finite number > 0, got {time_scale}")
    model = (LinearBatchTimeModel.from_json(name_or_path) if name_or_path.endswith(".json")
             else LinearBatchTimeModel.default(name_or_path))
    return model.scaled(time_scale)


CALIBRATION_MODES = ("online", "off")
INGRESS_DELAY_MODES = ("online", "off")


REDISCOVER_INTERVAL_S = 5.0
"""While the backend's KV cache or limits could not be read, discovery is retried this often, seconds."""


def _describe(exc: BaseException) -> str:
    """An exception as a log reads it: its message, else its type (a timeout has no message)."""
    return str(exc) or type(exc).__name__


FROM_SERVER_INFO = "the backend's /get_server_info"
"""Where the limits came from when SGLang's ``/get_server_info`` changed them."""
NOT_READABLE_YET = "the flags (the backend not readable yet)"
"""Where the KV cache or the limits came from while the backend has not answered: discovery is retried at every
reconciliation until it does (a sidecar starts before its server: a native sidecar in Kubernetes), and the start
line is logged again then."""


MAX_STATED_LIMIT = 10**9
"""Largest limit (requests, tokens) taken from ``/get_server_info``; a larger one is ignored as absurd."""


def _positive(info: dict, key: str) -> int | None:
    value = info.get(key)
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_STATED_LIMIT
    return value if ok else None


def sglang_engine_limits(info: dict, engine: EngineConfig) -> EngineConfig:
    """``engine`` with the limits an SGLang server's ``/get_server_info`` object states (missing ones kept).

    Mapping (python/sglang/srt/server_args.py names): ``max_running_requests`` (null unless set: then
    ``internal_states[0].effective_max_running_requests_per_dp``, what the scheduler chose; SGLang 0.5.23) ->
    max_num_seqs;
    ``chunked_prefill_size`` -> max_num_batched_tokens (-1 or null: chunked prefill off, the budget then
    ``max_prefill_tokens``); ``page_size`` -> block_size; ``max_total_num_tokens`` (the KV pool, tokens; top level
    or in ``internal_states[0]``) // page_size -> num_gpu_blocks.

    Raises:
        ValueError: ``info`` is not an object, or the limits it states make an invalid ``EngineConfig``.
    """
    if not isinstance(info, dict):
        raise ValueError(f"/get_server_info answered {type(info).__name__}, not an object")
    states = info.get("internal_states")
    state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    changes: dict = {}
    max_running = _positive(info, "max_running_requests") or _positive(state, "effective_max_running_requests_per_dp")
    if max_running is not None:
        changes["max_num_seqs"] = max_running
    chunk = info.get("chunked_prefill_size")
    if (size := _positive(info, "chunked_prefill_size")) is not None:
        changes["max_num_batched_tokens"] = size
    elif chunk is None or chunk == -1:
        if (prefill := _positive(info, "max_prefill_tokens")) is not None:
            changes.update(enable_chunked_prefill=False, max_num_batched_tokens=prefill)
    page_size = _positive(info, "page_size") or 1
    total = _positive(info, "max_total_num_tokens") or _positive(state, "max_total_num_tokens")
    if total is not None and total >= page_size:
        changes.update(block_size=page_size, num_gpu_blocks=total // page_size)
    return dataclasses.replace(engine, **changes)


def _check_host_port(value: str, flag: str) -> None:
    """Raises ValueError unless ``value`` is ``host:port`` with a port in [0, 65535]."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{flag} must be host:port with a port in [0, 65535], got {value!r}")


def _json_safe(value):
    """``value`` with every non-finite float replaced by None (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


SERVICE_NAME = "astrolabe-predictor"
"""The sidecar's default ``service.name`` (``OTEL_SERVICE_NAME`` replaces it)."""
TRACED_METHODS = ("/astrolabe.predictor.v1.Predictor/Predict", "/astrolabe.predictor.v1.Predictor/Admit")
"""Calls whose caller's trace the sidecar continues (a SERVER span each); Release, State and health are not traced,
nor are Watch and Notify (streams for the router's whole life: one span would last for hours). A router sends the
Admit of a sampled request as a unary call, so that it is traced (``extproc/notices.py``)."""
SIMULATION_SPAN = "astrolabe.simulate"
PROTOCOL_REVISION = 6
"""``PredictResponse.protocol_revision``: the revision of ``predictor.proto`` v1 this sidecar speaks (6 = v1.6:
holding Predicts since v1.1, Watch since v1.2, Notify streams since v1.3, prompt block keys since v1.4, engine
priorities since v1.5, a tagger's later turns since v1.6)."""
NOTICES_PER_TURN = 256
"""Notices a Notify stream handles before it lets the event loop run others (``PredictorServicer.Notify``)."""
MIN_WATCH_INTERVAL_S = 0.005
MAX_WATCH_INTERVAL_S = 1.0
"""Bounds of a Watch stream's interval, seconds: a router cannot make a sidecar send more than 200 states a second,
nor leave its state older than a second."""
SHARED_STATE_MAX_AGE_S = 0.02
"""A watched state built for one router is sent to another as it is for this long, seconds (one default interval),
if nothing it depends on changed (`Sidecar.state_version`): the streams of several extproc replicas then cost one
snapshot (they wake together, on one poll of the state: `Sidecar._watch_loop`)."""
WATCH_HEARTBEAT_S = 0.1
"""Longest a Watch stream stays silent while nothing changes, seconds: also how fresh the decode progress of an
unchanged queue is at the router (a heartbeat carries the state of its moment), which meanwhile shifts each
prediction by the state's age (``extproc/fleet_state.py``)."""
ABSORB_INTERVAL_S = 0.1
"""How often the plugin's newest state is absorbed (measured steps into calibration, first tokens and arrivals into
the outcome and ingress checks), seconds: off the path of Predict and Watch, which only read queues. The plugin
keeps its last 32 steps and 64 first tokens in every file (``predictor.vllm_plugin.publisher``): at this interval
a reader misses no step of 3 ms or longer."""
MAX_ROUTERS = 1024
"""Routers whose Admit numbers a sidecar remembers (``Sidecar.saw_admit``): far more extproc workers than a pool
has, few enough that a flood of router ids costs nothing."""


def _simulation_attributes(response: pb.PredictResponse) -> dict:
    """What the simulation span records: the state it started from and what it found."""
    return {"astrolabe.state_source": response.state_source, "astrolabe.num_running": response.num_running,
            "astrolabe.num_waiting": response.num_waiting, "astrolabe.num_free_blocks": response.num_free_blocks,
            "astrolabe.num_gpu_blocks": response.num_gpu_blocks,
            "astrolabe.num_steps_simulated": response.num_steps_simulated, STATE_AGE_S: response.state_age_s,
            PREDICTED_TTFT_S: response.ttft_s, PREDICTED_E2E_S: response.e2e_s,
            "astrolabe.calibration_source": response.calibration_source}


class PredictorServicer(pb_grpc.PredictorServicer):
    """Translates gRPC messages to ledger calls; no logic of its own.

    Args:
        sidecar: the sidecar the calls go to.
        tracer: starts the simulation span of each Predict, below the call's SERVER span (None: tracing off).
    """

    def __init__(self, sidecar: Sidecar, tracer=None) -> None:
        self._sidecar = sidecar
        self._tracer = tracer

    def _predict(self, request: pb.PredictRequest) -> pb.PredictResponse:
        """``Sidecar.predict`` of ``request``, in the simulation span when tracing.

        Raises:
            ValueError: as ``Sidecar.predict``.
        """
        sidecar = self._sidecar
        args = (request.num_prompt_tokens, request.num_predicted_output_tokens, request.max_tokens or None,
                request.length_source, sidecar.holds.held_by(request.router_id),
                sidecar.usable_block_keys(request.block_keys, request.block_keys_block_size, request.num_prompt_tokens),
                request.priority)
        if self._tracer is None:
            return sidecar.predict(*args)
        with self._tracer.start_as_current_span(SIMULATION_SPAN, attributes={
                ADMIT_ID: request.request_id, NUM_PROMPT_TOKENS: request.num_prompt_tokens,
                NUM_PREDICTED_OUTPUT_TOKENS: request.num_predicted_output_tokens}) as span:
            response = sidecar.predict(*args)
            if span.is_recording():
                span.set_attributes(_simulation_attributes(response))
        return response

    async def Predict(self, request, context):  # noqa: N802
        with request_context(request.request_id):  # log lines name the request (and its trace: astrolabe.logs)
            if request.num_prompt_tokens < 1 or request.num_predicted_output_tokens < 1:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "num_prompt_tokens and num_predicted_output_tokens must be >= 1")
            sidecar = self._sidecar
            sidecar.end_expired_holds(time.monotonic())
            try:
                response = self._predict(request)
            except ValueError as exc:  # e.g. a prompt larger than the instance's whole KV cache
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot be served by this instance: {exc}")
            response.protocol_revision = PROTOCOL_REVISION
            response.num_held = sidecar.holds.num_held_for_others(request.router_id)
            response.admits_seen = sidecar.admits_seen(request.router_id)
            if request.hold_s > 0 and request.request_id:  # v1.1: count it here from now on (NaN is not > 0)
                sidecar.hold(request.request_id, request.num_prompt_tokens, request.num_predicted_output_tokens,
                             request.hold_s, max_tokens=request.max_tokens or None,
                             length_source=request.length_source, router_id=request.router_id,
                             priority=request.priority)
            return response

    async def Admit(self, request, context):  # noqa: N802
        with request_context(request.request_id):
            return await self._admit(request, context)

    async def _admit(self, request, context):
        try:
            return self._apply_admit(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def _apply_admit(self, request: pb.AdmitRequest) -> pb.AdmitResponse:
        """Counts an admitted request (an Admit call, or one of a Notify stream's).

        Raises:
            ValueError: no ``request_id``, or counts the ledger refuses.
        """
        if not request.request_id:
            raise ValueError("request_id is required")
        sidecar = self._sidecar
        now_s = time.monotonic()
        sidecar.end_expired_holds(now_s)
        sidecar.saw_admit(request.router_id, request.admit_seq)
        if sidecar.early_releases.admit_came_late(request.request_id, now_s):
            logger.debug("Admit of %r after its Release: not counted", request.request_id)
            return pb.AdmitResponse(duplicate=True)
        hold = sidecar.holds.confirm(request.request_id)
        if hold is not None:  # its Predict held it: counted since then, its prediction made then
            sidecar.outcomes.admit(request.request_id, hold.held_s, request.predicted_ttft_s, request.predicted_e2e_s)
            keys = sidecar.usable_block_keys(request.block_keys, request.block_keys_block_size,
                                             request.num_prompt_tokens)
            if keys and not sidecar.plugin.in_use:  # held without them (`Sidecar.hold`)
                sidecar.ledger.add_block_keys(request.request_id, keys, now_s)
            if keys:
                sidecar.plugin.admits.add_block_keys(request.request_id, keys)
            return pb.AdmitResponse(duplicate=False)
        added = sidecar.admit(request.request_id, request.num_prompt_tokens, request.num_predicted_output_tokens,
                              now_s, max_tokens=request.max_tokens or None, length_source=request.length_source,
                              block_keys=sidecar.usable_block_keys(request.block_keys, request.block_keys_block_size,
                                                                   request.num_prompt_tokens),
                              priority=request.priority)
        if added:
            sidecar.outcomes.admit(request.request_id, now_s, request.predicted_ttft_s, request.predicted_e2e_s)
            sidecar.check_engine_had_it(request.request_id)
        return pb.AdmitResponse(duplicate=not added)

    async def Release(self, request, context):  # noqa: N802
        with request_context(request.request_id):
            return self._release(request)

    def _release(self, request) -> pb.ReleaseResponse:
        sidecar = self._sidecar
        now_s = time.monotonic()
        if sidecar.outcomes.awaits_first_token(request.request_id) and sidecar.plugin.reader is not None:
            sidecar.absorb(sidecar.plugin.reader.read(now_s), now_s)  # its first token may be in the newest file
        # held and routed elsewhere (or, rarely, ended before its Admit arrived): it did not run here
        held = sidecar.holds.drop(request.request_id)
        sidecar.num_changes += 1
        sidecar.outcomes.release(request.request_id, now_s, scored=not request.failed)
        admitted = sidecar.plugin.admits.release(request.request_id)
        known = sidecar.ledger.release(request.request_id, now_s, ran=not held)
        if not (held or known or admitted):  # no Admit of it handled yet: a late one must not count it
            sidecar.early_releases.release(request.request_id, now_s)
        return pb.ReleaseResponse(known=known)

    async def Notify(self, request_iterator, context):  # noqa: N802
        """Protocol v1.3: a router's Admits and Releases, batched (``NoticeBatch``), handled as the unary calls are,
        in order, until the router ends the stream. An invalid Admit is logged and skipped (the stream goes on: a
        notice has no caller waiting for its answer). Every `NOTICES_PER_TURN` notices the event loop gets a turn, so
        that a huge message does not hold up the Predicts and Watch streams meanwhile."""
        await context.send_initial_metadata(((NOTIFY_READY_KEY, str(PROTOCOL_REVISION)),))
        num_admits = num_releases = 0
        async for batch in request_iterator:
            for admit in batch.admits:
                num_admits += 1
                if num_admits % NOTICES_PER_TURN == 0:
                    await asyncio.sleep(0)
                with request_context(admit.request_id):
                    try:
                        self._apply_admit(admit)
                    except ValueError as exc:
                        logger.warning("Admit of %r skipped: %s", admit.request_id, exc)
            for release in batch.releases:
                num_releases += 1
                if num_releases % NOTICES_PER_TURN == 0:
                    await asyncio.sleep(0)
                with request_context(release.request_id):
                    self._release(release)
        return pb.NotifyResponse(num_admits=num_admits, num_releases=num_releases)

    async def State(self, request, context):  # noqa: N802
        return pb.StateResponse(state_json=json.dumps(self._sidecar.state()))

    async def Watch(self, request, context):  # noqa: N802
        """Protocol v1.2: the instance's state (``Sidecar.watched_state``) when it changed (`Sidecar.state_version`:
        queues, admissions and releases, refits; polled every ``interval_s``, 0: the sidecar's
        ``watch_interval_s``, cut to [`MIN_WATCH_INTERVAL_S`, `MAX_WATCH_INTERVAL_S`]), at most once per interval,
        and at least every `WATCH_HEARTBEAT_S` (the router drops states older than its ``watch_max_age_s``,
        0.25 s), until the router cancels. The stream sleeps between changes: one task polls the state for every
        stream (`Sidecar._watch_loop`) and wakes them together, so that they share one build."""
        sidecar = self._sidecar
        interval_s = request.interval_s if request.interval_s > 0 else sidecar.config.watch_interval_s
        interval_s = min(max(interval_s, MIN_WATCH_INTERVAL_S), MAX_WATCH_INTERVAL_S)  # NaN: the minimum
        sidecar.add_watcher(interval_s)
        try:
            seq, sent_version, sent_s = 0, None, -math.inf
            while True:
                now_s = time.monotonic()
                state_version = sidecar.watch_version
                version = (state_version, sidecar.admits_seen(request.router_id))
                if version != sent_version or now_s - sent_s >= WATCH_HEARTBEAT_S:
                    seq += 1
                    try:
                        yield sidecar.watched_state(request.router_id, seq, state_version)
                        sent_version, sent_s = version, now_s
                    except ValueError:  # a state the encoder refuses: skipped, said once
                        if not sidecar.watch_failed:
                            logger.exception("a state could not be sent to a watching router (logged once)")
                        sidecar.watch_failed = True
                    if interval_s > sidecar.watch_poll_s:  # a slower stream than the poll: its own pace
                        await asyncio.sleep(interval_s - sidecar.watch_poll_s)
                # the poller moves the version at least every heartbeat; this timeout only covers a stalled poller
                await sidecar.watch_changed(max(sent_s + WATCH_HEARTBEAT_S + interval_s - time.monotonic(), 0.0))
        finally:
            sidecar.remove_watcher(interval_s)


@dataclass(frozen=True, slots=True)
class _View:
    """The state a prediction simulates from (``Sidecar._view``): the snapshot (expected lengths applied), how far
    its clock stands ahead of now (s), its age (s), free KV blocks, and its source."""

    snapshot: InstanceSnapshot
    lag_s: float
    state_age_s: float
    num_free_blocks: int
    source: str


class Sidecar:
    """The running sidecar: ledger, reconciliation loop, gRPC server.

    Args:
        config: its settings.
        tracing: its tracer (None = off).
        residual: its residual-length rules, built from ``config`` when None (`run` builds them once, to check the
            configuration, and hands them over); rules passed in must be built from this ``config``'s
            ``residual_lengths``, ``length_errors`` and ``length_distribution`` (not checked).

    Raises:
        ValueError: a bad setting (and what `ResidualRules` raises when it builds them).
    """

    def __init__(self, config: SidecarConfig, tracing: Tracing | None = None,
                 residual: ResidualRules | None = None) -> None:
        self.config = config
        self.tracing = tracing or Tracing.off()
        if config.calibration not in CALIBRATION_MODES:
            raise ValueError(f"calibration must be one of {', '.join(CALIBRATION_MODES)}, got {config.calibration!r}")
        check_metrics_format(config.backend_engine, "backend_engine")
        if config.ingress_delay not in INGRESS_DELAY_MODES:
            raise ValueError(f"ingress_delay must be one of {', '.join(INGRESS_DELAY_MODES)}, "
                             f"got {config.ingress_delay!r}")
        self.prior_batch_time = load_batch_time(resolve_batch_time_model(config.batch_time_model,
                                                                         config.model_config), config.time_scale)
        self.calibrator = (StepTimeCalibrator(self.prior_batch_time, min_samples=config.calibration_min_samples)
                           if config.calibration == "online" else None)
        self.calibration_status: CalibrationStatus | None = self.calibrator.status() if self.calibrator else None
        self.outcomes = OutcomeTracker(bias_correction=config.bias_correction)
        self.ingress = IngressDelayEstimator()
        # Not registered anywhere: the /metrics collector (predictor.sidecar_metrics) yields it at scrape time.
        self.simulation_seconds = Histogram(
            "astrolabe_predictor_simulation_seconds", "Work of one Predict (state read, simulation), seconds",
            buckets=(0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1), registry=None)
        self._absorbed: tuple[int, int] = (0, -1)  # (pid, seq) of the last plugin state absorbed
        if residual is None:
            residual = ResidualRules(config.residual_lengths, config.length_errors, config.length_distribution)
        self.residual = residual
        # Named SGLang: its rules before it answers.
        self.ledger = self._new_ledger(self._with_backend_rules(config.engine, config.backend_engine))
        self.kv_index = (KvEventIndex(self.ledger.scheduler.config.block_size,
                                      max_blocks=max(4 * self.ledger.scheduler.config.num_gpu_blocks, 1 << 16))
                         if config.kv_events_endpoint else None)
        self._kv_events_task: asyncio.Task | None = None
        self.plugin = PluginStateSource(config.state_source, config.vllm_state_path, config.plugin_max_age_s,
                                        pending_grace_s=config.visibility_grace_s, residual=self.residual,
                                        kv_index=self.kv_index, default_policy=config.engine.scheduling_policy)
        self.holds = Holds()
        self.early_releases = EarlyReleases()
        self.num_states_sent = 0  # InstanceState messages sent to watching routers (v1.2)
        self.num_watchers = 0
        self.watch_failed = False
        self.num_changes = 0  # admissions and releases so far (a watched state is sent again when it moves)
        self._watch_cache: tuple[tuple, float, pb.InstanceState] | None = None  # (version, built at, message)
        self.watch_version: tuple | None = None  # (`state_version`, heartbeats) at the last poll of `_watch_loop`
        self._watch_intervals: list[float] = []  # the intervals of the open Watch streams, seconds
        self._watch_event = asyncio.Event()  # set (and replaced) when `watch_version` moves
        self._watch_task: asyncio.Task | None = None
        self._admits_seen: dict[int, int] = {}  # router id -> highest admit_seq handled, least recent first
        self.last_reconciled_s: float | None = None
        self.last_observed: BackendObservation | None = None  # the backend's last /metrics scrape read
        self.num_backend_restarts = 0  # engine restarts seen in its counters (`backend_restarted`)
        self._discovery_failed = False  # warned once that the backend is not readable yet
        self.health = health.aio.HealthServicer()
        self._backend_request_options = https_request_options(config.backend_tls)
        # With tracing on, Predict and Admit continue the extproc's trace from the call's metadata.
        # No SO_REUSEPORT (gRPC's default): a second sidecar on a port in use must fail, not share its Predicts.
        self._server = grpc.aio.server(interceptors=self.tracing.server_interceptors(TRACED_METHODS),
                                       options=[("grpc.so_reuseport", 0)])
        tracer = self.tracing.tracer("astrolabe.predictor") if self.tracing.enabled else None
        pb_grpc.add_PredictorServicer_to_server(PredictorServicer(self, tracer), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self._task: asyncio.Task | None = None
        self.port = 0

    @property
    def batch_time(self) -> LinearBatchTimeModel:
        """The step-time model predictions use now: the calibrated one, else the shipped prior."""
        return self.calibrator.model if self.calibrator is not None else self.prior_batch_time

    def absorb(self, state, now_s: float) -> None:
        """Take what a new plugin state adds beyond queues: measured steps (refit when due) and first tokens of
        admitted requests. Cheap for a state already absorbed (one comparison). Never raises: calibration and
        outcome checks must not cost a prediction or a Release (a failure is logged once)."""
        if state is None or (state.pid, state.seq) == self._absorbed:
            return
        self._absorbed = (state.pid, state.seq)
        try:
            self._absorb(state, now_s)
        except Exception:  # noqa: BLE001
            if not self._absorb_failed:
                logger.exception("absorbing the plugin state's steps and first tokens failed (logged once)")
            self._absorb_failed = True

    _absorb_failed = False

    def _calibrate(self, now_s: float) -> None:
        """Refit when due (the ledger's engine then steps with the new model) and refresh the cached status that
        Predict answers carry (at most every 0.5 s)."""
        calibrator = self.calibrator
        if calibrator.maybe_refit(now_s):
            self.ledger.engine.batch_time = calibrator.model
            if calibrator.num_refits == 1:
                logger.info("step-time model calibrated from %d measured steps", calibrator.status().num_samples)
        if now_s - self._status_s >= 0.5:
            self.calibration_status, self._status_s = calibrator.status(), now_s

    def _absorb(self, state, now_s: float) -> None:
        if self.calibrator is not None:
            self.calibrator.observe(self.plugin.new_steps(state))
            self._calibrate(now_s)
        admits = self.plugin.admits
        for engine_request_id, at_s in self.plugin.new_first_tokens(state):
            admit_id = admits.admit_id_of(engine_request_id)
            if admit_id is not None:
                self.outcomes.first_token(admit_id, at_s)
        for engine_request_id, at_s in self.plugin.new_arrivals(state):
            admit_id = admits.admit_id_of(engine_request_id)
            if admit_id is not None:
                self.outcomes.engine_arrival(admit_id, at_s)
            admitted_s = admits.admitted_at_s(admit_id) if admit_id is not None else None
            if admitted_s is not None:
                self.ingress.observe(at_s - admitted_s, now_s)

    _status_s = float("-inf")

    def _calibration_fields(self) -> dict:
        status = self.calibration_status
        if status is None:
            return {"calibration_source": "off"}
        return {"calibration_source": status.source, "calibration_num_samples": status.num_samples,
                "calibration_residual": status.residual}

    def _new_ledger(self, engine: EngineConfig) -> Ledger:
        return Ledger(engine, self.batch_time, time.monotonic(), visibility_grace_s=self.config.visibility_grace_s,
                      residual=self.residual.for_source)

    def usable_block_keys(self, block_keys, block_size: int, num_prompt_tokens: int) -> tuple[int, ...] | None:
        """A Predict's or Admit's block keys (protocol v1.4) as this sidecar can use them: None when there are none,
        when they were computed at another block size than this instance's engine uses (they name other blocks:
        ignored, logged once), or when there are more than the prompt's full blocks (a broken router: ignored)."""
        if not block_keys:
            return None
        engine_block_size = self.ledger.scheduler.config.block_size
        if block_size != engine_block_size or len(block_keys) > max(num_prompt_tokens, 1) // engine_block_size:
            if not self._warned_block_keys:
                logger.warning("a router sent %d block keys at block size %d for a %d-token prompt; this engine's "
                               "block size is %d: keys ignored (set the extproc's prefix_cache.block_size to the "
                               "engine's --block-size); logged once", len(block_keys), block_size,
                               num_prompt_tokens, engine_block_size)
                self._warned_block_keys = True
            return None
        return tuple(block_keys)

    _warned_block_keys = False

    def check_engine_had_it(self, request_id: str) -> None:
        """For an Admit just counted: the events of the plugin's last state read (its ``arrivals`` and
        ``first_tokens``) that belong to ``request_id`` reached the outcome check before the Admit could claim them,
        and are never handed out again (`_absorb` takes each once), so they are given to it here: a request the
        engine received or answered before this admission is not TTFT-checked (``predictor.outcomes``). The state
        holds the last 64 arrivals; only engine ids that contain the request's ``x-request-id`` are matched."""
        state = self.plugin.last_state
        if state is None:
            return
        x_request_id = x_request_id_of(request_id)
        admits = self.plugin.admits
        for engine_request_id, at_s in (*state.arrivals, *state.first_tokens):
            if x_request_id in engine_request_id and admits.admit_id_of(engine_request_id) == request_id:
                self.outcomes.engine_arrival(request_id, at_s)

    def admit(self, request_id: str, num_prompt_tokens: int, num_output_tokens: int, now_s: float, *,
              max_tokens: int | None = None, length_source: int = 0,
              block_keys: tuple[int, ...] | None = None, priority: int = 0) -> bool:
        """Counts a request dispatched here from ``now_s`` (seconds, monotonic): in the ledger (unless the plugin's
        state is in use, which shows the engine's own queues), with its prompt's ``block_keys`` (its model of the
        prefix cache, ``predictor.ledger``) and its engine ``priority`` (vLLM's: lower = earlier), and in the
        admission records. Returns False if it was already counted.

        Raises:
            ValueError: the request can never fit this instance (its prompt exceeds the KV cache).
        """
        if self.plugin.in_use:  # the ledger is not simulated: check here what it would have checked
            config = self.plugin.last_state.engine if self.plugin.last_state else self.ledger.scheduler.config
            # the prompt must fit; the predicted output is a guess (snapshots cut it to the KV cache)
            check_request_fits(config, request_id, max(num_prompt_tokens, 1), 1)
            added = not self.plugin.admits.is_admitted(request_id)
        else:
            added = self.ledger.admit(request_id, num_prompt_tokens, num_output_tokens, now_s,
                                      max_tokens=max_tokens, length_source=length_source, block_keys=block_keys,
                                      priority=priority)
        if added:
            self.plugin.admits.admit(request_id, num_output_tokens, num_prompt_tokens, now_s, max_tokens=max_tokens,
                                     length_source=length_source, block_keys=block_keys, priority=priority)
            self.num_changes += 1
        return added

    def hold(self, request_id: str, num_prompt_tokens: int, num_output_tokens: int, hold_s: float, *,
             max_tokens: int | None = None, length_source: int = 0, router_id: int = 0, priority: int = 0) -> bool:
        """A Predict asked to hold its request (``predictor.holds``): it counts here from now, as `admit` counts
        it, until an Admit confirms it or a Release or the end of ``hold_s`` (seconds, cut to
        ``predictor.holds.MAX_HOLD_S``) drops it; ``router_id``'s own Predicts do not count it. Returns whether it
        is held now; a request already counted here (admitted, or held by an earlier Predict) or one that can never
        fit is not held. It is held without its prompt's block keys: a hold dropped unconfirmed must leave nothing
        in the ledger's prefix cache (the request never ran here); the confirming Admit adds them
        (``Ledger.add_block_keys``). Never raises."""
        now_s = time.monotonic()
        self.end_expired_holds(now_s)
        if request_id in self.holds:
            return False
        try:
            if not self.admit(request_id, num_prompt_tokens, num_output_tokens, now_s, max_tokens=max_tokens,
                              length_source=length_source, priority=priority):
                return False
        except ValueError:
            return False
        for pushed in self.holds.hold(request_id, now_s, min(hold_s, MAX_HOLD_S), router_id):
            self._uncount(pushed, now_s)
        return True

    def saw_admit(self, router_id: int, admit_seq: int) -> None:
        """Notes that ``router_id``'s Admit number ``admit_seq`` was handled (0s: a v1.0 router, nothing noted).
        At most `MAX_ROUTERS` routers are remembered (the longest silent is forgotten first)."""
        if not router_id or not admit_seq:
            return
        seen = self._admits_seen.pop(router_id, 0)
        self._admits_seen[router_id] = max(seen, admit_seq)  # re-inserted: the dict's order is recency
        if len(self._admits_seen) > MAX_ROUTERS:
            del self._admits_seen[next(iter(self._admits_seen))]

    def admits_seen(self, router_id: int) -> int:
        """The highest Admit number of ``router_id`` handled here (0: none, or a v1.0 router)."""
        return self._admits_seen.get(router_id, 0) if router_id else 0

    def end_expired_holds(self, now_s: float) -> None:
        """Stops counting the holds that ended unconfirmed by ``now_s`` (their router never said where the request
        went: a lost notice, or a router that died)."""
        for request_id in self.holds.expired(now_s):
            self._uncount(request_id, now_s)

    def _uncount(self, request_id: str, now_s: float) -> None:
        """Stops counting a hold that ended unconfirmed (it never ran here)."""
        self.plugin.admits.release(request_id)
        self.ledger.release(request_id, now_s, ran=False)
        self.num_changes += 1

    def state_age_s(self, now_s: float) -> float:
        return float("inf") if self.last_reconciled_s is None else now_s - self.last_reconciled_s

    def predict(self, num_prompt_tokens: int, num_output_tokens: int, max_tokens: int | None = None,
                length_source: int = 0, exclude: frozenset[str] | set[str] = frozenset(),
                block_keys: tuple[int, ...] | None = None, priority: int = 0) -> pb.PredictResponse:
        """`_predict`, timed into ``simulation_seconds`` (the metric ``astrolabe_predictor_simulation_seconds``)."""
        start_s = time.perf_counter()
        try:
            return self._predict(num_prompt_tokens, num_output_tokens, max_tokens, length_source, exclude,
                                 block_keys, priority)
        finally:
            self.simulation_seconds.observe(time.perf_counter() - start_s)

    def _predict(self, num_prompt_tokens: int, num_output_tokens: int, max_tokens: int | None = None,
                 length_source: int = 0, exclude: frozenset[str] | set[str] = frozenset(),
                 block_keys: tuple[int, ...] | None = None, priority: int = 0) -> pb.PredictResponse:
        """Predicted TTFT and E2E, in seconds from now, of a new request on this instance, and what one more like
        it arriving first would add (``ttft_s_per_request``, ``e2e_s_per_request``: ``marginal_cost_s``).

        Args:
            num_prompt_tokens: prompt tokens (>= 1).
            num_output_tokens: PREDICTED output tokens (>= 1); the simulated request gets the expected length
                of the residual rule of ``length_source`` (for a tagger, its calibrated mean for that guess).
            max_tokens: the request's cap, tokens, or None.
            length_source: ``predictor.residual_rules.LENGTH_SOURCE_*``.
            exclude: ids of held requests left out (the asking router's own holds, ``predictor.holds``).
            block_keys: the prompt's block keys (`usable_block_keys`; None: none): the simulation starts it past
                the prefix the state holds or caches (a shorter prefill, fewer blocks).
            priority: its priority at the engine (vLLM's: lower = earlier; the request queues by it where the
                engine runs the "priority" scheduling policy, ``predictor.sim.scheduler``).

        Raises:
            ValueError: the request can never fit this instance (e.g. a prompt larger than its KV cache).
        """
        now_s = time.monotonic()
        expected_tokens = self.residual.for_source(length_source).expected_output_tokens(
            num_output_tokens, 0, max_tokens)
        view = self._view(now_s, exclude)
        snapshot = view.snapshot.fit_to_kv_cache()
        new = snapshot.fit_request(RequestState("new", num_prompt_tokens, expected_tokens,
                                                max_new_tokens=max_tokens or None, block_keys=block_keys,
                                                priority=priority))
        result = predict(snapshot, new, self.batch_time)
        idle = predict_idle(snapshot, new, self.batch_time)
        ttft_per_request_s, e2e_per_request_s = marginal_cost_s(snapshot, new, self.batch_time, result)
        corrections = self.corrections()
        ttft_s, e2e_s = corrections.apply(result.ttft_s + view.lag_s, result.e2e_s + view.lag_s)
        return pb.PredictResponse(
            ttft_s=ttft_s, e2e_s=e2e_s, state_age_s=view.state_age_s,
            # relative to an idle engine: the ingress delay and the TTFT offset are in both, not in the queue
            queue_s=max(result.ttft_s + view.lag_s - idle.ttft_s, 0.0),
            idle_e2e_s=corrections.apply(idle.ttft_s, idle.e2e_s)[1],
            num_running=len(view.snapshot.running), num_waiting=len(view.snapshot.waiting),
            num_free_blocks=view.num_free_blocks, num_gpu_blocks=snapshot.config.num_gpu_blocks,
            state_source=view.source, num_steps_simulated=result.num_steps_simulated,
            ttft_s_per_request=ttft_per_request_s, e2e_s_per_request=e2e_per_request_s * corrections.e2e_factor,
            **self._calibration_fields())

    def _view(self, now_s: float, exclude: frozenset[str] | set[str] = frozenset()) -> _View:
        """What a prediction at ``now_s`` simulates from: the plugin's state when it is in use, else the ledger
        advanced to ``now_s``; less the held requests ``exclude``."""
        plugin_snapshot = self.plugin.snapshot(now_s)
        if plugin_snapshot is not None:  # its steps and first tokens are absorbed apart (`_absorb_loop`)
            state = self.plugin.last_state
            return _View(plugin_snapshot.without({pending_id(rid) for rid in exclude}), 0.0, state.age_s(now_s),
                         state.num_free_blocks, STATE_SOURCE_PLUGIN)
        self.ledger.advance(now_s)
        # The ledger's clock may stand at the end of the step in progress, a little ahead of now.
        return _View(self.ledger.snapshot().without(exclude), self.ledger.engine.now_s - now_s,
                     self.state_age_s(now_s), self.ledger.scheduler.num_free_blocks, STATE_SOURCE_LEDGER)

    def corrections(self) -> Corrections:
        """What every prediction gets added now: the measured ingress delay (``predictor.ingress``; 0 while off or
        young) and the outcome tracker's bias correction (none while it is off or young)."""
        ingress_s = self.ingress.delay_at(time.monotonic()) if self.config.ingress_delay == "online" else 0.0
        return Corrections(ingress_s, self.outcomes.ttft_offset_s(), self.outcomes.correction("e2e"))

    def state_version(self, now_s: float) -> tuple:
        """What a watched state depends on, beyond the simulated clock and the watching router's own fields: equal
        tuples, the same queues (for the plugin's state: the engine process and the ids of its running and waiting
        requests, in order; reconciliations, admissions and releases, holds, refits). A publication that only
        moves the requests' progress (tokens computed and generated) keeps the version: the router shifts its
        predictions by the state's age meanwhile, and the heartbeat (`WATCH_HEARTBEAT_S`) carries the progress.
        Cheap: the plugin's file is re-read only when it changed."""
        plugin = self.plugin.reader.read(now_s) if self.plugin.reader is not None else None
        queues = None if plugin is None else (plugin.pid, *(row[0] for row in plugin.running), None,
                                             *(row[0] for row in plugin.waiting))
        return (queues, self.ledger.stats.num_reconciliations, self.num_changes,
                self.calibrator.num_refits if self.calibrator is not None else 0)

    @property
    def watch_poll_s(self) -> float:
        """How often `_watch_loop` polls the state: the shortest interval an open Watch stream asked for, seconds."""
        return min(self._watch_intervals, default=self.config.watch_interval_s)

    def add_watcher(self, interval_s: float) -> None:
        """Counts a Watch stream of ``interval_s`` seconds; starts `_watch_loop` with the first."""
        self.num_watchers += 1
        self._watch_intervals.append(interval_s)
        if self._watch_task is None or self._watch_task.done():
            self.watch_version = (self.state_version(time.monotonic()), 0)
            self._watch_task = asyncio.create_task(self._watch_loop(), name="watch")

    def remove_watcher(self, interval_s: float) -> None:
        """Uncounts a Watch stream; `_watch_loop` ends after the last."""
        self.num_watchers -= 1
        self._watch_intervals.remove(interval_s)

    async def watch_changed(self, timeout_s: float) -> None:
        """Returns when `watch_version` moves, or after ``timeout_s`` seconds."""
        event = self._watch_event
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)

    async def _watch_loop(self) -> None:
        """While a router watches: polls `state_version` every `watch_poll_s` and moves `watch_version` (waking the
        waiting streams, which then share one build) when it changed or `WATCH_HEARTBEAT_S` after the last move:
        one stat of the plugin's file per poll, one parse per publication seen, no stream woken while the queues
        stand still between heartbeats."""
        moved_s = time.monotonic()
        while self.num_watchers > 0:
            await asyncio.sleep(self.watch_poll_s)
            now_s = time.monotonic()
            try:
                version = self.state_version(now_s)
            except Exception:  # noqa: BLE001 (never raises in practice; the streams must not lose their poller)
                logger.exception("polling the state for watching routers failed")
                continue
            last, beats = self.watch_version
            if version != last or now_s - moved_s >= WATCH_HEARTBEAT_S - self.watch_poll_s / 2:
                self.watch_version, moved_s = (version, beats + 1), now_s
                self._watch_event.set()
                self._watch_event = asyncio.Event()

    def watched_state(self, router_id: int, seq: int, version: tuple | None = None) -> pb.InstanceState:
        """The state a watching router predicts from (protocol v1.2, ``predictor.instance_state``): what Predict
        would simulate from for that router now (its own holds left out), with the step-time model and the
        corrections. Cost: one snapshot and its encoding, O(requests), shared by the watchers that ask within
        `SHARED_STATE_MAX_AGE_S` of each other while nothing changed (``version``: `state_version` of now, if the
        caller has it)."""
        now_s = time.monotonic()
        self.end_expired_holds(now_s)
        self.num_states_sent += 1
        exclude = self.holds.held_by(router_id)
        version = self.state_version(now_s) if version is None else version
        cached = self._watch_cache
        if not exclude and cached is not None and cached[0] == version and now_s - cached[1] < SHARED_STATE_MAX_AGE_S:
            message = pb.InstanceState()  # another watcher's state of a moment ago: only the per-router fields differ
            message.CopyFrom(cached[2])
            message.seq, message.admits_seen = seq, self.admits_seen(router_id)
            return message
        view = self._view(now_s, exclude)
        status = self.calibration_status
        model_error = status.residual if status is not None and math.isfinite(status.residual) else 0.0
        message = encode(view.snapshot.fit_to_kv_cache(), self.batch_time, self.corrections(), seq=seq,
                         lag_s=max(view.lag_s, 0.0), state_age_s=view.state_age_s,
                         admits_seen=self.admits_seen(router_id), model_error=model_error, state_source=view.source,
                         length_distribution=self.residual.length_distribution)
        if not exclude:
            self._watch_cache = (version, now_s, message)
        return message

    def quality(self) -> dict:
        """Calibration (status, current and prior coefficients) and prediction-vs-outcome statistics, JSON-ready
        (NaN as null)."""
        calibration = {"mode": self.config.calibration,
                       "model": dataclasses.asdict(self.batch_time), "prior": dataclasses.asdict(self.prior_batch_time)}
        if self.calibrator is not None:
            calibration.update(self.calibrator.status().as_dict())
        ingress = {"mode": self.config.ingress_delay, **self.ingress.as_dict(time.monotonic())}
        return _json_safe({"calibration": calibration, "outcomes": self.outcomes.as_dict(), "ingress": ingress})

    def state(self) -> dict:
        """The sidecar's view (queues, blocks, reconciliation or plugin figures) plus `quality`, strict JSON-ready
        (non-finite figures, e.g. the state age before the first reconciliation, as null)."""
        return _json_safe({**self._state(), **self.quality(), "holds": self.holds.as_dict(),
                           "watch": {"watchers": self.num_watchers, "states_sent": self.num_states_sent}})

    def _state(self) -> dict:
        now_s = time.monotonic()
        self.ledger.advance(now_s)
        scheduler = self.ledger.scheduler

        def req(r):
            return {"id": r.request_id, "prompt": r.num_prompt_tokens, "output": r.num_output_tokens,
                    "computed": r.num_computed_tokens, "generated": r.num_generated_tokens}

        snapshot = self.plugin.snapshot(now_s)
        if snapshot is not None:
            state = self.plugin.last_state
            return {"state_source": STATE_SOURCE_PLUGIN, "state_age_s": state.age_s(now_s),
                    "engine": dataclasses.asdict(snapshot.config), "num_free_blocks": state.num_free_blocks,
                    "num_preemptions_total": state.num_preemptions_total, "seq": state.seq,
                    "running": [dataclasses.asdict(r) for r in snapshot.running],
                    "waiting": [dataclasses.asdict(r) for r in snapshot.waiting]}
        return {"state_source": STATE_SOURCE_LEDGER, "state_age_s": self.state_age_s(now_s),
                "engine": dataclasses.asdict(scheduler.config),
                "running": [req(r) for r in scheduler.running], "waiting": [req(r) for r in scheduler.waiting],
                "num_free_blocks": scheduler.num_free_blocks, "reconcile": dataclasses.asdict(self.ledger.stats)}

    async def _scrape(self, session: aiohttp.ClientSession):
        async with session.get(backend_url(self.config.backend, "/metrics", self.config.backend_tls),
                               **self._backend_request_options) as response:
            response.raise_for_status()
            return parse_backend_metrics(await response.text(), self.config.backend_engine)

    async def _discover_kv_cache(self, session: aiohttp.ClientSession) -> tuple[str, str]:
        """Takes the backend's KV cache (its /metrics) and, SGLang, its engine limits (``/get_server_info``) into the
        ledger; returns where the KV figures and the limits in use came from, for `_log_discovered`."""
        limits_source = "the flags"
        if not (self.config.discover_kv_cache or self.config.discover_engine_limits):
            return "the flags (--no-discover-kv-cache)", limits_source
        try:
            observed = await self._scrape(session)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # MetricsFormatError is one
            if not self._discovery_failed:
                logger.warning("cannot read the backend's KV cache config yet (%s); using the flags until it answers",
                               _describe(exc))
            self._discovery_failed = True
            return NOT_READABLE_YET, limits_source
        info_name = "SGLang KV pool gauges" if observed.engine == SGLANG else "vllm:cache_config_info"
        engine = self._with_backend_rules(self.config.engine, observed.engine)
        if observed.engine == SGLANG and self.config.discover_engine_limits:
            discovered, limits_source = await self._discover_sglang_limits(session, engine)
            engine = dataclasses.replace(discovered, block_size=engine.block_size,
                                         num_gpu_blocks=engine.num_gpu_blocks) if not self.config.discover_kv_cache \
                else discovered
        if not self.config.discover_kv_cache:
            kv_source = "the flags (--no-discover-kv-cache)"
        elif not (observed.num_gpu_blocks and observed.block_size):
            kv_source = f"the flags (the backend's /metrics has no {info_name})"
            if limits_source == FROM_SERVER_INFO and engine.num_gpu_blocks != self.config.engine.num_gpu_blocks:
                kv_source = "the backend's /get_server_info (max_total_num_tokens, page_size)"
        else:
            engine = dataclasses.replace(engine, num_gpu_blocks=observed.num_gpu_blocks,
                                         block_size=observed.block_size)
            kv_source = f"the backend's {info_name}"
        if engine != self.ledger.scheduler.config:
            self.ledger = self._new_ledger(engine)
        return kv_source, limits_source

    def _with_backend_rules(self, engine: EngineConfig, backend_engine: str) -> EngineConfig:
        """``engine`` with SGLang's scheduler rules when the backend is SGLang and ``follow_backend_scheduling``:
        they predict its TTFT far better than V1's (bench/README.md, "SGLang backends")."""
        if backend_engine == SGLANG and self.config.follow_backend_scheduling:
            if engine.scheduling_policy != "fcfs":
                logger.warning("--scheduling-policy %s is vLLM's: an SGLang backend is modelled first come, first "
                               "served", engine.scheduling_policy)
            return dataclasses.replace(engine, scheduling="sglang", scheduling_policy="fcfs")
        return engine

    async def _discover_sglang_limits(self, session: aiohttp.ClientSession,
                                      engine: EngineConfig) -> tuple[EngineConfig, str]:
        """``engine`` with SGLang's limits from ``/get_server_info`` and where they came from; the flags' on a
        failure (logged)."""
        url = backend_url(self.config.backend, "/get_server_info", self.config.backend_tls)
        try:
            async with session.get(url, **self._backend_request_options) as response:
                response.raise_for_status()
                info = await response.json(content_type=None)
            limited = sglang_engine_limits(info, engine)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, RecursionError) as exc:
            if not self._discovery_failed:
                logger.warning("cannot read the SGLang backend's limits from /get_server_info (%s); using the flags "
                               "until it does", _describe(exc))
            self._discovery_failed = True
            return engine, NOT_READABLE_YET
        if limited == engine:
            return engine, "the flags (/get_server_info changed none)"
        return limited, FROM_SERVER_INFO

    def _log_discovered(self, kv_source: str, limits_source: str = "the flags") -> None:
        """One INFO line at start: the engine limits and KV cache in use and where each came from, the state
        source and the step-time model."""
        state = self.plugin.reader.read(time.monotonic()) if self.plugin.reader is not None else None
        engine = state.engine if state is not None else self.ledger.scheduler.config
        if state is not None:
            kv_source = limits_source = f"the plugin's state file {self.plugin.reader.path}"
            source = f"vllm-plugin (--state-source {self.config.state_source})"
        else:
            source = "ledger" if self.plugin.reader is None else \
                f"ledger until the plugin's state file is readable ({self.plugin.reader.last_error}; " \
                f"--state-source {self.config.state_source})"
        logger.info("backend %s: KV cache %d blocks x %d tokens (from %s); engine limits max_num_seqs %d, "
                    "max_num_batched_tokens %d, chunked prefill %s (from %s); scheduler rules %s; state source %s; "
                    "step-time model %s (calibration %s)", self.config.backend, engine.num_gpu_blocks,
                    engine.block_size, kv_source, engine.max_num_seqs, engine.max_num_batched_tokens,
                    "on" if engine.enable_chunked_prefill else "off", limits_source, engine.scheduling, source,
                    self.prior_batch_time.model,
                    self.config.calibration if self.calibrator is None or self.plugin.reader is not None
                    else "online, idle without the plugin's state file")

    async def _reconcile_loop(self) -> None:
        timeout = aiohttp.ClientTimeout(total=max(self.config.reconcile_interval_s * 5, 1.0))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            sources = await self._discover_kv_cache(session)
            self._log_discovered(*sources)
            last_discovery_s, failing = time.monotonic(), False
            while True:
                try:
                    if NOT_READABLE_YET in sources and time.monotonic() - last_discovery_s >= REDISCOVER_INTERVAL_S:
                        # A backend that was not up yet: discover once it answers (not at every scrape).
                        last_discovery_s = time.monotonic()
                        sources = await self._discover_kv_cache(session)
                        if NOT_READABLE_YET not in sources:
                            self._log_discovered(*sources)
                    observed = await self._scrape(session)
                    if backend_restarted(self.last_observed, observed):
                        # A new engine process at the same address: nothing of the old one's queues or prefix
                        # cache is there (a router must not keep crediting its cached prefixes).
                        logger.warning("the backend's counters went back (%s): the engine restarted; its ledger and "
                                       "prefix cache model start empty", self.config.backend)
                        self.ledger = self._new_ledger(self.ledger.scheduler.config)
                        self.num_backend_restarts += 1
                        self.num_changes += 1
                    self.last_observed = observed
                    self.end_expired_holds(time.monotonic())
                    self.ledger.reconcile(observed, time.monotonic())
                    self.last_reconciled_s = time.monotonic()
                    if failing:
                        logger.info("reconciliation with the backend's /metrics works again")
                    failing = False
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # MetricsFormatError is one
                    if not failing:  # said once per outage: the state ages meanwhile (state_age_s in every answer)
                        logger.warning("reconciliation with the backend's /metrics fails (%s); the ledger goes on "
                                       "unreconciled until it works", _describe(exc))
                    failing = True
                await asyncio.sleep(self.config.plugin_reconcile_interval_s if self.plugin.in_use
                                    else self.config.reconcile_interval_s)

    async def _absorb_loop(self, interval_s: float = ABSORB_INTERVAL_S) -> None:
        """Absorbs the plugin's newest state every ``interval_s`` seconds (`absorb`): calibration, first tokens and
        arrivals, off the path of Predict and Watch."""
        while True:
            await asyncio.sleep(interval_s)
            if self.plugin.reader is not None:
                now_s = time.monotonic()
                # also decides whether the plugin's state is in use while nothing asks (the scrape's interval)
                self.absorb(self.plugin.read(now_s), now_s)
                if self.calibrator is not None:  # a refit that came due after the last step (engine now idle)
                    try:
                        self._calibrate(now_s)
                    except Exception:  # noqa: BLE001 (refit never raises; status must not end the loop either)
                        logger.exception("calibration status failed")

    async def start(self) -> int:
        if self.config.metrics_listen:
            from predictor.sidecar_metrics import start_metrics_server  # noqa: PLC0415

            self._metrics_server, self.metrics_port = start_metrics_server(self, self.config.metrics_listen)
            logger.info("metrics on http://%s/metrics (port %d)", self.config.metrics_listen, self.metrics_port)
        self.port = add_port(self._server, self.config.listen, self.config.tls)
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {self.config.listen}")
        await self._server.start()
        self._task = asyncio.create_task(self._reconcile_loop(), name="reconcile")
        self._absorb_task = asyncio.create_task(self._absorb_loop(), name="absorb")
        if self.kv_index is not None:
            subscriber = KvEventSubscriber(self.config.kv_events_endpoint, self.kv_index, self.config.kv_events_topic)
            self._kv_events_task = asyncio.create_task(subscriber.run(), name="kv-events")
        settle_heap()
        for name in ("", "liveness", "readiness", "astrolabe.predictor.v1.Predictor"):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        tls = "plaintext" if self.config.tls is None else "mutual TLS" if self.config.tls.client_ca_file else "TLS"
        logger.info("predictor for %s listening on %s (port %d, %s; state source %s, scheduling policy %s%s; "
                    "a tagger's requests priced by %s)",
                    self.config.backend, self.config.listen, self.port, tls, self.config.state_source,
                    self.config.engine.scheduling_policy,
                    " unless the engine's state file names one" if self.plugin.reader is not None else "",
                    "their own quantiles" if self.residual.length_distribution == "quantiles"
                    else "binned held-out errors")
        return self.port

    async def stop(self, grace_s: float = 2.0) -> None:
        await self._server.stop(grace_s)
        for task in (self._task, getattr(self, "_absorb_task", None), self._watch_task, self._kv_events_task):
            if task:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if getattr(self, "_metrics_server", None) is not None:
            self._metrics_server.shutdown()


def _check_kv_events_endpoint(endpoint: str) -> None:
    """``--kv-events-endpoint``: ``tcp://HOST:PORT`` (a host to connect to, not vLLM's wildcard ``*``; a port in
    1..65535) or ``ipc://PATH``.

    Raises:
        ValueError: anything else (with what to give instead).
    """
    match = re.fullmatch(r"tcp://([^\s:/*]+):(\d{1,5})|ipc://\S+", endpoint)
    if match is None or (match.group(2) is not None and not 1 <= int(match.group(2)) <= 65535):
        raise ValueError(f"--kv-events-endpoint must be tcp://HOST:PORT (the engine's address and the port of its "
                         f"--kv-events-config endpoint, e.g. tcp://127.0.0.1:5557 for vLLM's tcp://*:5557) or "
                         f"ipc://PATH, got {endpoint!r}")


def backend_restarted(before: BackendObservation | None, after: BackendObservation) -> bool:
    """Whether the backend's engine restarted between two /metrics scrapes: a counter that only grows in one
    process (``vllm:num_preemptions_total``, ``vllm:prefix_cache_queries_total``, ``..._hits_total``) went back.
    A restart whose counters are back above their old values by the next scrape is not seen (the KV event
    stream's sequence, `predictor.kv_events`, sees every restart)."""
    if before is None:
        return False
    pairs = [(before.num_preemptions_total, after.num_preemptions_total),
             (before.prefix_cache_queries_total, after.prefix_cache_queries_total),
             (before.prefix_cache_hits_total, after.prefix_cache_hits_total)]
    return any(old is not None and new is not None and new < old for old, new in pairs)


async def serve(config: SidecarConfig, tracing: Tracing | None = None, residual: ResidualRules | None = None) -> None:
    """Runs the sidecar until SIGTERM or SIGINT (``tracing``, ``residual``: as `Sidecar`; the caller shuts the
    tracer down)."""
    sidecar = Sidecar(config, tracing, residual)
    await sidecar.start()
    await wait_for_termination()
    await sidecar.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sidecar's flags (``astrolabe predictor serve``): one per `SidecarConfig` field, with its default and unit."""
    defaults = SidecarConfig(backend="")
    parser.add_argument("--backend", required=True,
                        help="host:port of the vLLM or SGLang server (its /metrics is scraped)")
    parser.add_argument("--backend-engine", choices=METRICS_FORMATS, default=defaults.backend_engine,
                        help="which server --backend is: vllm or sglang (its /metrics names; SGLang's limits from "
                             "/get_server_info), or auto (read from the metric names)")
    parser.add_argument("--discover-engine-limits", action=argparse.BooleanOptionalAction,
                        default=defaults.discover_engine_limits,
                        help="beside SGLang, take max_num_seqs, max_num_batched_tokens and the KV cache from its "
                             "/get_server_info at start; --no-discover-engine-limits keeps the flags")
    parser.add_argument("--listen", default=defaults.listen, help="host:port of the gRPC server (port 0: any free)")
    parser.add_argument("--batch-time-model", default=None,
                        help="shipped step-time model name (predictor/sim/*.json) or a JSON path; default: the "
                             "shipped shape nearest --model-config, else llama-2-7b")
    parser.add_argument("--model-config", default=None,
                        help="the served model's config.json or directory: the cold start picks the shipped "
                             "step-time model of the nearest architecture; default: none")
    parser.add_argument("--time-scale", type=float, default=defaults.time_scale,
                        help="factor on every modelled step time: 1.0 for a real GPU, an emulator's --time-scale "
                             "for an emulated backend")
    add_engine_arguments(parser, defaults.engine,
                         kv_note="; the backend's vllm:cache_config_info replaces it at start (--discover-kv-cache)",
                         scheduling_note="default: the backend's (sglang beside an SGLang server, else vllm-v1); ")
    parser.add_argument("--discover-kv-cache", action=argparse.BooleanOptionalAction,
                        default=defaults.discover_kv_cache,
                        help="at start, take block_size and num_gpu_blocks from the backend's "
                             "vllm:cache_config_info; --no-discover-kv-cache keeps --block-size / --num-gpu-blocks")
    parser.add_argument("--reconcile-interval-s", type=float, default=defaults.reconcile_interval_s,
                        help="how often the backend's /metrics is scraped to correct the ledger, seconds")
    parser.add_argument("--visibility-grace-s", type=float, default=defaults.visibility_grace_s,
                        help="an admitted request the backend does not show yet is not reconciled away for this "
                             "long, seconds")
    parser.add_argument("--watch-interval-s", type=float, default=defaults.watch_interval_s,
                        help="how often a router that watches this sidecar (prediction in the router, protocol v1.2) "
                             "gets the instance's state, seconds, unless it asks for another interval "
                             f"(cut to [{MIN_WATCH_INTERVAL_S:g}, {MAX_WATCH_INTERVAL_S:g}])")
    parser.add_argument("--plugin-reconcile-interval-s", type=float, default=defaults.plugin_reconcile_interval_s,
                        help="the /metrics scrape interval while the plugin's state is in use (the ledger is then a "
                             "fallback), seconds")
    parser.add_argument("--state-source", choices=STATE_SOURCES, default=defaults.state_source,
                        help="instance state: the vLLM plugin's, the ledger's, or the plugin's when present (auto)")
    parser.add_argument("--vllm-state-path", default=None,
                        help="state file written by the vLLM plugin (the server's ASTROLABE_VLLM_STATE_PATH) or an "
                             "emulator's --state-path; default: none (the ledger)")
    parser.add_argument("--kv-events-endpoint", default=None,
                        help="the engine's KV cache events over ZMQ, tcp://HOST:PORT (vLLM --kv-events-config with "
                             "\"endpoint\": \"tcp://*:PORT\"): plugin snapshots then carry its cached blocks; "
                             "default: none")
    parser.add_argument("--kv-events-topic", default=defaults.kv_events_topic,
                        help="the KV event publisher's topic (vLLM kv_events_config.topic); default: \"\"")
    parser.add_argument("--plugin-max-age-s", type=float, default=defaults.plugin_max_age_s,
                        help="a plugin state this old while requests are in flight is not used (the ledger "
                             "answers), seconds")
    parser.add_argument("--residual-lengths", choices=RESIDUAL_RULES, default=defaults.residual_lengths,
                        help="residual-length rule for requests of unspecified length source: empirical "
                             "(conditioned on the tagger's measured errors), paper (10 more tokens past the "
                             "prediction) or exact")
    parser.add_argument("--length-errors", default=None,
                        help="tagger directory (or its errors.npz) whose measured errors and quantiles (quantiles.npz "
                             "beside errors.npz) condition residual lengths (default: the shipped light tagger's)")
    parser.add_argument("--length-distribution", choices=LENGTH_DISTRIBUTIONS,
                        default=defaults.length_distribution,
                        help="how a tagger's live requests are priced: quantiles (each one's own distribution, "
                             "the tagger's quantiles.npz around its estimate for a first or later turn) or binned "
                             "(its held-out errors in the bin of the estimate); default: quantiles")
    parser.add_argument("--calibration", choices=CALIBRATION_MODES, default=defaults.calibration,
                        help="refit the step-time model from the engine's measured steps (online; needs the "
                             "plugin's state file) or keep the shipped one (off)")
    parser.add_argument("--calibration-min-samples", type=int, default=defaults.calibration_min_samples,
                        help="measured engine steps before the first refit, steps (1..512)")
    parser.add_argument("--bias-correction", action="store_true",
                        help="correct the measured recent bias (prediction vs outcome): E2E by a factor, TTFT by an "
                             "offset; without it, the bias is only measured and reported")
    parser.add_argument("--ingress-delay", choices=INGRESS_DELAY_MODES, default=defaults.ingress_delay,
                        help="add the measured delay from Admit to the engine's scheduler (the plugin's arrivals) "
                             "to TTFT and E2E predictions (online) or only measure and report it (off; see "
                             "predictor/ingress.py for what it did on real vLLM)")
    parser.add_argument("--metrics-listen", default=None,
                        help="host:port of a Prometheus /metrics endpoint (calibration, prediction error); "
                             "default: off")
    parser.add_argument("--backend-tls-ca-file", default=None,
                        help="PEM CA bundle that verifies the backend's certificate: its /metrics over HTTPS (a vLLM "
                             "started with --ssl-certfile); default: plain HTTP")
    parser.add_argument("--backend-tls-server-name", default=None,
                        help="with --backend-tls-ca-file: the DNS name the backend's certificate must carry; "
                             "default: the CA's signature alone is checked")
    parser.add_argument("--tls-cert-file", default=None,
                        help="PEM certificate chain of the gRPC server (TLS; with --tls-key-file), re-read when it "
                             "changes; default: plaintext")
    parser.add_argument("--tls-key-file", default=None,
                        help="PEM private key of --tls-cert-file; default: none (plaintext)")
    parser.add_argument("--tls-client-ca-file", default=None,
                        help="PEM CA bundle that verifies client certificates: mutual TLS, the extproc must present a "
                             "certificate it signed (needs --tls-cert-file); default: server-only TLS")
    add_log_arguments(parser)


def tls_from_args(args: argparse.Namespace) -> ServerTls | None:
    """The server TLS that the ``--tls-*`` flags ask for, its files checked; None when none is given.

    Raises:
        TlsError: a certificate without its key (or the reverse), a client CA without a certificate, or a file
            that cannot be used.
    """
    cert, key, client_ca = args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file
    if cert is None and key is None and client_ca is None:
        return None
    if cert is None or key is None:
        raise TlsError("--tls-cert-file and --tls-key-file must be given together"
                       + (" (--tls-client-ca-file needs them)" if client_ca else ""))
    tls = ServerTls(cert_file=cert, key_file=key, client_ca_file=client_ca)
    server_credentials(tls)  # reads every file once, so that a bad one is an error at start
    return tls


def backend_tls_from_args(args: argparse.Namespace) -> BackendTls | None:
    """The HTTPS to the backend that ``--backend-tls-*`` ask for, its CA checked; None when not asked.

    Raises:
        TlsError: a server name without the CA, or a CA file that cannot be used.
    """
    if args.backend_tls_ca_file is None:
        if args.backend_tls_server_name is not None:
            raise TlsError("--backend-tls-server-name needs --backend-tls-ca-file")
        return None
    tls = BackendTls(args.backend_tls_ca_file, args.backend_tls_server_name)
    https_context(tls)
    return tls


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    try:
        engine = engine_from_args(args)
        config = SidecarConfig(backend=args.backend, listen=args.listen, engine=engine,
                               batch_time_model=args.batch_time_model, time_scale=args.time_scale,
                               reconcile_interval_s=args.reconcile_interval_s,
                               visibility_grace_s=args.visibility_grace_s, discover_kv_cache=args.discover_kv_cache,
                               state_source=args.state_source, vllm_state_path=args.vllm_state_path,
                               plugin_max_age_s=args.plugin_max_age_s, residual_lengths=args.residual_lengths,
                               kv_events_endpoint=args.kv_events_endpoint, kv_events_topic=args.kv_events_topic,
                               plugin_reconcile_interval_s=args.plugin_reconcile_interval_s,
                               length_errors=args.length_errors, length_distribution=args.length_distribution,
                               calibration=args.calibration,
                               calibration_min_samples=args.calibration_min_samples,
                               bias_correction=args.bias_correction, metrics_listen=args.metrics_listen,
                               model_config=args.model_config, ingress_delay=args.ingress_delay,
                               tls=tls_from_args(args), backend_tls=backend_tls_from_args(args),
                               backend_engine=args.backend_engine,
                               discover_engine_limits=args.discover_engine_limits,
                               follow_backend_scheduling=args.scheduling is None,
                               watch_interval_s=args.watch_interval_s)
        # Resolved once here (the cold start reads the model config and logs its choice once).
        config = dataclasses.replace(config, batch_time_model=resolve_batch_time_model(config.batch_time_model,
                                                                                       config.model_config))
        load_batch_time(config.batch_time_model, config.time_scale)
        # built once, here: a tagger directory without quantiles.npz falls back to binned, with its one warning
        residual = ResidualRules(config.residual_lengths, config.length_errors, config.length_distribution)
        config = dataclasses.replace(config, length_distribution=residual.length_distribution)
        PluginStateSource(config.state_source, config.vllm_state_path)
        if config.metrics_listen:
            _check_host_port(config.metrics_listen, "--metrics-listen")
        _check_host_port(config.listen, "--listen")
        if config.kv_events_endpoint is not None:
            _check_kv_events_endpoint(config.kv_events_endpoint)
        if not 1 <= config.calibration_min_samples <= 512:
            raise ValueError(f"--calibration-min-samples must be in [1, 512], got {config.calibration_min_samples}")
    except (ValueError, OSError) as exc:
        logger.error("invalid sidecar configuration: %s", exc)
        return 2
    try:
        tracing = setup_tracing(SERVICE_NAME)  # the OTEL_* variables alone (astrolabe.tracing)
    except TracingConfigError as exc:
        logger.error("invalid tracing configuration: %s", exc)
        return 2
    try:
        uvloop.run(serve(config, tracing, residual))
    except (OSError, RuntimeError) as exc:  # an address that cannot be bound (gRPC or metrics)
        logger.error("sidecar cannot start: %s", exc)
        return 2
    finally:
        tracing.shutdown()
    return 0
