"""HTTP server of one emulated vLLM or SGLang instance (OpenAI-compatible API, ``/health``, ``/metrics``) and its CLI.

``--api sglang`` presents the instance as an SGLang server (``bench.emulator.sglang_api``): ``/metrics`` under
SGLang's names, its native ``/generate`` (one JSON answer, or SSE events each carrying the whole text so far),
``/get_server_info`` (the engine limits: ``max_running_requests``, ``chunked_prefill_size``, ``page_size``,
``max_total_num_tokens``), ``/get_model_info``, and ``/health`` = ``/health_generate`` that answer after
``sglang_api.HEALTH_POLL_S`` (1 s) as SGLang's do; the OpenAI routes stay. It schedules by SGLang's rules
(``--scheduling sglang``, the default with ``--api sglang``; ``predictor.sim.scheduler``).

Owns the aiohttp application, request admission (prompt counting, context-length check, output-length draw)
and the ``astrolabe emulator`` entry point :func:`main`. Scheduling and step timing live in
``predictor.sim`` and :mod:`bench.emulator.engine_loop`; wire formats in :mod:`bench.emulator.openai_api`.

Prompt and reply tokens (`bench.emulator.tokens`): a text prompt (chat: the messages joined by the emulator's
"role: content" template, the tiny vLLM model's) becomes token ids with the shipped tokenizer, as the tiny vLLM
model of ``make install-vllm`` tokenizes it; token-id prompts are taken as given. The reply is deterministic ids
(a function of the prompt's ids) whose text tokenizes back to the same ids, so a next chat turn that resends it
hits the reply's blocks too.

Prefix caching (vLLM V1's automatic prefix caching, on unless ``--no-enable-prefix-caching``; vllm-v1 scheduling
only): the request's prompt and reply ids become block keys (`predictor.sim.block_hash.block_keys`, the engine's
``--block-size``) in its ``SimRequest``, so the scheduler's prefix cache serves repeated prefixes (the longest run
of cached full blocks, at most prompt - 1 tokens) and shortens their prefill. ``/metrics`` exports
``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total`` (tokens), and with
``--enable-prompt-tokens-details`` the responses carry ``usage.prompt_tokens_details.cached_tokens`` (chat also
``created_cache_tokens``), as vLLM's do. ``tests/vllm/test_prefix_cache_fidelity.py`` holds the cached-token
counts equal to a real vLLM's over a sequence of shared-prefix requests.

Output length: ``max_tokens`` with ``ignore_eos``; otherwise ``min(max_tokens, round(X))`` with X log-normal of
the configured median and sigma (ShareGPT-like replies), drawn from the instance's seeded ``random.Random`` in
arrival order. Chat requests without a cap may run to ``max_model_len`` (vLLM's default).

Request ids are vLLM's: with an ``x-request-id`` header X, the engine knows a chat request as
``chatcmpl-X-<n>`` and a completion as ``cmpl-X-<n>`` (``n`` counts this instance's requests and keeps ids unique
when clients reuse theirs, as vLLM's random suffix does) and the response's ``id`` is ``chatcmpl-X`` / ``cmpl-X``;
without the header both are ``chatcmpl-<n>`` / ``cmpl-<n>``. The sidecar matches engine ids to its admissions
by X (``predictor.state_source.AdmitRecords``).
Source: vllm/entrypoints/openai/serving_engine.py ``OpenAIServing._base_request_id`` and
vllm/v1/engine/input_processor.py ``InputProcessor.assign_request_id`` (engine id = external id + ``-<8 hex>``).

Tracing, as vLLM's ``--otlp-traces-endpoint`` (or the ``OTEL_*`` variables, ``astrolabe.tracing``): each finished
request becomes one SERVER span ``llm_request``, a child of the request's ``traceparent`` header, from arrival to
the last token, with vLLM's attributes (``gen_ai.latency.time_in_queue``, ``gen_ai.latency.time_to_first_token``,
``gen_ai.latency.e2e``, ``gen_ai.usage.prompt_tokens``, ``gen_ai.usage.completion_tokens``, ...).
Source: vllm/v1/engine/output_processor.py ``OutputProcessor.do_tracing`` and vllm/tracing.py ``SpanAttributes``
(span created when the request finishes, start time = arrival); the emulator has no detokenizer or sampling
params to report, and an aborted request's span carries ``error.type`` = ``abort``.

Logs (``astrolabe.logs``, ``--log-level``, ``--log-format``): a line logged while a request is handled carries its
``x-request-id`` (else the engine's id) and, traced, the trace of its ``traceparent``.

Fault hook (tests): SIGUSR1 freezes ``/metrics`` (every later scrape gets the text rendered at that moment, as a
backend whose metrics exporter hung would serve), the next SIGUSR1 thaws it; serving goes on either way.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import math
import random
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import prometheus_client
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client import CONTENT_TYPE_LATEST

from astrolabe.cli import HelpFormatter
from astrolabe.logs import add_arguments as add_log_arguments
from astrolabe.logs import request_context, setup_logging, trace_id_hex
from astrolabe.tracing import (
    Tracing,
    TracingConfig,
    TracingConfigError,
    context_from,
    normalize_endpoint,
    setup_tracing,
)
from bench.emulator.engine_loop import EngineLoop, RequestHandle
from bench.emulator import sglang_api
from bench.emulator.metrics import APIS, EmulatorMetrics
from bench.emulator.openai_api import (
    REPLY_TEXT_FIELD,
    SSE_DONE,
    ApiError,
    ParsedRequest,
    ResponseShaper,
    context_length_error,
    parse_request,
    prompt_tokens_details,
    usage_json,
)
from predictor.engine_flags import add_engine_arguments, engine_from_args
from predictor.sim import EngineConfig, LinearBatchTimeModel, Scheduler
from predictor.vllm_plugin import DEFAULT_MIN_INTERVAL_S
from bench.emulator.tokens import RecordedReply, Reply, prompt_token_ids, request_block_keys
from tagger.tokenizer import TOKENIZER_NAME

logger = logging.getLogger(__name__)

INSTANCE_HEADER = "x-emulator-instance"
"""Response header naming the instance that served a request, ``host:port``."""
REQUEST_ID_HEADER = "x-request-id"
"""Request header whose value the request ids embed (vLLM reads ``X-Request-Id``; HTTP headers ignore case)."""


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """Settings of one emulated instance (CLI flags mirror vLLM's names).

    Attributes:
        engine: scheduler settings (``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``, ...).
        batch_time_model: shipped model name (``predictor.sim.known_models()``) or a JSON file path.
        served_model_name: the only model name accepted in requests.
        host, port: listen address; port 0 picks a free port.
        seed: seeds the output-length and step-noise generators.
        max_model_len: context limit in tokens (prompt + output).
        stream_interval: output tokens per SSE event after the first (vLLM/SGLang ``stream_interval``), >= 1.
        time_scale: wall-clock seconds per modelled H200 second, > 0.
        step_noise_frac: stddev of multiplicative step-time noise, fraction, >= 0.
        output_len_median_tokens: median of the log-normal output length, tokens, >= 1.
        output_len_sigma: sigma (of the underlying normal) of the output length, >= 0.
        state_path: file the engine's state is published to in the vLLM plugin's format (a sidecar reads it
            with ``--state-source vllm-plugin --vllm-state-path``); None = not published. Put it on /dev/shm.
        state_interval_s: least time between two publications while the engine stays busy, seconds, >= 0
            (the plugin's ``ASTROLABE_VLLM_STATE_MIN_INTERVAL_S`` and its default; 0 = after every step).
        otlp_traces_endpoint: OTLP receiver of the ``llm_request`` spans (vLLM's ``--otlp-traces-endpoint``;
            ``host:port`` or a URL); None = the ``OTEL_*`` variables decide (off when none is set).
        api: ``vllm`` or ``sglang``: which server the instance presents itself as (module docstring).
        enable_prefix_caching: vLLM's automatic prefix caching (on by default, as in vLLM V1): each request's
            prompt and reply token ids become block keys the scheduler looks up and caches (module docstring);
            off (``--no-enable-prefix-caching``): no request hits and the prefix-cache counters stay 0, as on
            vLLM. Only the vllm-v1 scheduling rules model it.
        enable_prompt_tokens_details: answer ``usage.prompt_tokens_details`` (cached prompt tokens), as vLLM
            does with ``--enable-prompt-tokens-details``; off by default, as on vLLM.
    """

    engine: EngineConfig = EngineConfig()
    batch_time_model: str = "llama-2-7b"
    served_model_name: str = "llama-2-7b"
    host: str = "127.0.0.1"
    port: int = 8000
    seed: int = 0
    max_model_len: int = 4096
    stream_interval: int = 1
    time_scale: float = 1.0
    step_noise_frac: float = 0.0
    output_len_median_tokens: float = 200.0
    output_len_sigma: float = 1.0
    state_path: str | None = None
    state_interval_s: float = DEFAULT_MIN_INTERVAL_S
    otlp_traces_endpoint: str | None = None
    api: str = "vllm"
    enable_prefix_caching: bool = True
    enable_prompt_tokens_details: bool = False

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        checks = {"max_model_len": self.max_model_len >= 2, "stream_interval": self.stream_interval >= 1,
                  "time_scale": self.time_scale > 0, "step_noise_frac": self.step_noise_frac >= 0,
                  "output_len_median_tokens": self.output_len_median_tokens >= 1,
                  "output_len_sigma": self.output_len_sigma >= 0, "port": 0 <= self.port <= 65535,
                  "state_interval_s": self.state_interval_s >= 0}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} is out of range: {getattr(self, name)!r}")
        if self.otlp_traces_endpoint is not None:  # TracingConfigError is a ValueError
            normalize_endpoint(self.otlp_traces_endpoint, "otlp_traces_endpoint")


def load_batch_time_model(name_or_path: str) -> LinearBatchTimeModel:
    """A shipped batch-time model by name, or one read from a JSON file written by ``to_json``.

    Raises:
        ValueError: unknown name, or a malformed file.
        OSError: the file cannot be read.
    """
    if name_or_path.endswith(".json") or Path(name_or_path).is_file():
        return LinearBatchTimeModel.from_json(name_or_path)
    return LinearBatchTimeModel.default(name_or_path)


class _Instance:
    """Per-app state: scheduler, engine loop, metrics, RNG, the admission rule and the tracer (None: off)."""

    def __init__(self, config: EmulatorConfig, tracer=None) -> None:
        self.config = config
        self.tracer = tracer
        self.scheduler = Scheduler(config.engine)
        # Block keys only where the scheduler reads them (the SGLang rules do not model a prefix cache).
        self.prefix_caching = config.enable_prefix_caching and config.engine.scheduling == "vllm-v1"
        cache_info = {"block_size": str(config.engine.block_size),
                      "num_gpu_blocks": str(config.engine.num_gpu_blocks), "cache_dtype": "auto",
                      "enable_prefix_caching": str(self.prefix_caching)}  # vllm:cache_config_info
        self.metrics = EmulatorMetrics(self.scheduler, config.served_model_name, cache_info, config.api,
                                       prefix_caching=self.prefix_caching)
        self.engine = EngineLoop(self.scheduler, load_batch_time_model(config.batch_time_model), self.metrics,
                                 time_scale=config.time_scale, step_noise_frac=config.step_noise_frac,
                                 rng=random.Random(config.seed + 1), state_path=config.state_path,
                                 state_interval_s=config.state_interval_s)
        self._output_rng = random.Random(config.seed)
        self._ids = itertools.count()
        self.instance_name = f"{config.host}:{config.port}"
        self.frozen_metrics: bytes | None = None  # what /metrics serves while frozen (`toggle_metrics_freeze`)

    def toggle_metrics_freeze(self) -> None:
        """Freezes ``/metrics`` at its current text, or thaws it if frozen (the SIGUSR1 fault hook)."""
        if self.frozen_metrics is None:
            self.frozen_metrics = self.metrics.render()
            logger.warning("/metrics frozen (SIGUSR1): scrapes get this moment's text until the next SIGUSR1")
        else:
            self.frozen_metrics = None
            logger.warning("/metrics live again (SIGUSR1)")

    def next_request_ids(self, is_chat: bool, x_request_id: str | None) -> tuple[str, str]:
        """(engine request id, response ``id``) of a new request (shapes in the module docstring)."""
        prefix = "chatcmpl" if is_chat else "cmpl"
        number = next(self._ids)
        if not x_request_id:
            return f"{prefix}-{number}", f"{prefix}-{number}"
        return f"{prefix}-{x_request_id}-{number}", f"{prefix}-{x_request_id}"

    def num_output_tokens(self, max_tokens: int, ignore_eos: bool,
                          num_reply_tokens: int | None = None) -> tuple[int, str]:
        """Output length (tokens) and its finish_reason, for a cap of ``max_tokens``.

        ``num_reply_tokens`` (the `OUTPUT_TOKENS_HEADER` test hook): the reply "ends" (EOS) after that many
        tokens, capped by ``max_tokens``; otherwise ``ignore_eos`` gives ``max_tokens`` and a log-normal draw the
        rest.
        """
        if ignore_eos:
            return max_tokens, "length"
        if num_reply_tokens is not None:
            return (max_tokens, "length") if num_reply_tokens >= max_tokens else (num_reply_tokens, "stop")
        cfg = self.config
        draw = self._output_rng.lognormvariate(math.log(cfg.output_len_median_tokens), cfg.output_len_sigma)
        num_tokens = max(1, round(draw))
        return (max_tokens, "length") if num_tokens >= max_tokens else (num_tokens, "stop")

    def usage(self, handle: RequestHandle, is_chat: bool, num_completion_tokens: int, stream: bool = False) -> dict:
        """The ``usage`` object of a request that has generated ``num_completion_tokens`` tokens, with
        ``prompt_tokens_details`` when enabled: the prompt tokens found cached at its first admission and (chat)
        those it cached itself, its full prompt blocks less the cached ones (vLLM's ``created_cache_tokens``:
        vllm/v1/metrics/stats.py ``PrefillStats.finalize``); both 0 with prefix caching off, as on vLLM."""
        sim = handle.sim
        details = None
        if self.config.enable_prompt_tokens_details:
            num_cached = sim.num_cached_tokens or 0
            block_size = self.config.engine.block_size
            num_created = (sim.num_prompt_tokens // block_size * block_size - num_cached) if self.prefix_caching else 0
            details = prompt_tokens_details(is_chat, num_cached, max(0, num_created), stream)
        return usage_json(sim.num_prompt_tokens, num_completion_tokens, details)

    def admit(self, parsed: ParsedRequest, request_id: str, num_reply_tokens: int | None = None) -> RequestHandle:
        """Validates a parsed request against this instance and queues it (``num_reply_tokens``: see
        `num_output_tokens`).

        Raises:
            ApiError: 404 for another model name; 400 when the context limit is exceeded or the KV cache can
                never hold the request.
        """
        cfg = self.config
        if parsed.model is not None and parsed.model != cfg.served_model_name:
            raise ApiError(404, f"The model `{parsed.model}` does not exist.", param="model")
        if parsed.prompt_token_ids is not None:
            prompt_ids = parsed.prompt_token_ids
        else:
            try:
                prompt_ids = prompt_token_ids(parsed.prompt_text or "")
            except ValueError:  # e.g. a lone surrogate, which JSON escapes can write
                raise ApiError(400, "the prompt is not valid Unicode", param="prompt") from None
        num_prompt_tokens = len(prompt_ids)
        max_tokens = parsed.max_tokens
        if max_tokens is None:
            if num_prompt_tokens >= cfg.max_model_len:
                raise context_length_error(cfg.max_model_len, num_prompt_tokens, None)
            max_tokens = cfg.max_model_len - num_prompt_tokens
        elif num_prompt_tokens + max_tokens > cfg.max_model_len:
            raise context_length_error(cfg.max_model_len, num_prompt_tokens, max_tokens)
        recorded = None
        if parsed.recorded_reply is not None:
            try:
                recorded = RecordedReply.of(parsed.recorded_reply)
            except ValueError:
                raise ApiError(400, "the recorded reply is not valid Unicode", param=REPLY_TEXT_FIELD) from None
            if num_reply_tokens is None:  # the recorded reply ends where its text does
                num_reply_tokens = max(1, len(recorded.token_ids))
        if parsed.priority and cfg.engine.scheduling_policy != "priority":
            # vllm/v1/engine/processor.py (and the V0 engines): the request is refused before it is queued
            raise ApiError(400, f"Got priority {parsed.priority} but Priority scheduling is not enabled.",
                           param="priority")
        num_output_tokens, finish_reason = self.num_output_tokens(max_tokens, parsed.ignore_eos, num_reply_tokens)
        reply = Reply(prompt_ids, num_output_tokens, recorded)
        keys = request_block_keys(prompt_ids, reply.token_ids, cfg.engine.block_size) if self.prefix_caching else None
        try:
            return self.engine.add_request(request_id, num_prompt_tokens, num_output_tokens, finish_reason,
                                           stream_interval=cfg.stream_interval if parsed.stream else 0,
                                           max_tokens=max_tokens, block_keys=keys, reply=reply,
                                           priority=parsed.priority)
        except ValueError as exc:
            raise ApiError(400, f"request cannot be served by this instance: {exc}") from None


_INSTANCE = web.AppKey("instance", _Instance)

OUTPUT_TOKENS_HEADER = "x-emulator-output-tokens"
"""Test hook: the emulated reply ends after this many tokens (as if the model sampled EOS there), capped by
``max_tokens``. Benchmarks replay a trace's true reply lengths with it while sending a realistic ``max_tokens``
cap; the router never reads it (a real client cannot know its reply's length in advance)."""


def _latin1_header(request: web.Request, name: str) -> str | None:
    """A header's raw bytes decoded as Latin-1, as vLLM's server (Starlette) and the extproc decode them (aiohttp
    decodes UTF-8), so that a non-ASCII x-request-id names the same request everywhere."""
    key = name.lower().encode("ascii")
    return next((v.decode("latin-1") for k, v in request.raw_headers if k.lower() == key), None)


def _reply_tokens_hint(value: str | None) -> int | None:
    """The `OUTPUT_TOKENS_HEADER` value as a positive count, or None when absent.

    Raises:
        ApiError: 400 for a value that is not a positive integer.
    """
    if value is None:
        return None
    if len(value) > 12 or not value.strip().isdigit() or int(value) < 1:
        raise ApiError(400, f"{OUTPUT_TOKENS_HEADER} must be a positive integer, got {value!r}")
    return int(value)


def _error_response(exc: ApiError) -> web.Response:
    return web.json_response(exc.to_json(), status=exc.status)


def _monotonic_to_unix_ns(time_s: float) -> int:
    """A ``time.monotonic()`` instant as wall-clock ns since the epoch (span timestamps are wall clock)."""
    return time.time_ns() - round((time.monotonic() - time_s) * 1e9)


def _record_span(instance: _Instance, request: web.Request, handle: RequestHandle, request_id: str) -> None:
    """The request's ``llm_request`` span, as vLLM writes it when a request finishes (module docstring)."""
    sim = handle.sim
    end_s = handle.last_token_time_s if handle.finish_reason != "abort" and handle.last_token_time_s else \
        time.monotonic()
    attributes = {"gen_ai.response.model": instance.config.served_model_name, "gen_ai.request.id": request_id,
                  "gen_ai.usage.prompt_tokens": sim.num_prompt_tokens,
                  "gen_ai.usage.completion_tokens": handle.num_generated_tokens,
                  "gen_ai.latency.e2e": end_s - sim.arrival_time_s,
                  "gen_ai.response.finish_reasons": [handle.finish_reason or "abort"]}
    if handle.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = handle.max_tokens
    if handle.first_scheduled_time_s is not None:
        attributes["gen_ai.latency.time_in_queue"] = handle.first_scheduled_time_s - sim.arrival_time_s
    if sim.first_token_time_s is not None:
        attributes["gen_ai.latency.time_to_first_token"] = sim.first_token_time_s - sim.arrival_time_s
    if handle.finish_reason in (None, "abort"):
        attributes["error.type"] = "abort"
    span = instance.tracer.start_span("llm_request", context=context_from(request.headers), kind=SpanKind.SERVER,
                                      attributes=attributes, start_time=_monotonic_to_unix_ns(sim.arrival_time_s))
    span.end(end_time=_monotonic_to_unix_ns(end_s))


async def _generate(request: web.Request, is_chat: bool, native: bool = False) -> web.StreamResponse:
    """Handles a completion, chat or (``native``) SGLang ``/generate`` request."""
    instance = request.app[_INSTANCE]
    x_request_id = _latin1_header(request, REQUEST_ID_HEADER)
    request_id, response_id = instance.next_request_ids(is_chat, x_request_id)
    # Log lines while it is handled name it (and, traced, the caller's trace, which its span joins).
    parent = context_from(request.headers) if instance.tracer is not None else None
    trace_id = trace_id_hex(trace.get_current_span(parent).get_span_context()) if parent is not None else None
    with request_context(x_request_id or request_id, trace_id):
        return await _generate_admitted(request, instance, request_id, response_id, is_chat, native)


async def _generate_admitted(request: web.Request, instance: _Instance, request_id: str, response_id: str,
                             is_chat: bool, native: bool = False) -> web.StreamResponse:
    try:
        if native:
            parsed, rid = sglang_api.parse_generate(await request.read())
            response_id = rid or request_id
            if parsed.max_tokens == 0:  # SGLang answers at once with no tokens (its engine never sees it)
                return web.json_response(sglang_api.generate_json(response_id, "", "length", 0, 0, 0.0))
        else:
            parsed = parse_request(await request.read(), is_chat)
        handle = instance.admit(parsed, request_id, _reply_tokens_hint(request.headers.get(OUTPUT_TOKENS_HEADER)))
    except ApiError as exc:
        return web.json_response(sglang_api.error_json(exc.message), status=exc.status) if native else \
            _error_response(exc)
    try:
        if native:
            return await _answer_native(request, instance, parsed, handle, request_id, response_id)
        return await _answer(request, instance, parsed, handle, request_id, response_id, is_chat)
    finally:
        if instance.tracer is not None:
            _record_span(instance, request, handle, request_id)


def _native_json(handle: RequestHandle, rid: str, num_tokens: int, finish_reason: str | None) -> dict:
    return sglang_api.generate_json(rid, handle.reply.text(0, num_tokens), finish_reason,
                                    handle.sim.num_prompt_tokens, num_tokens,
                                    time.monotonic() - handle.sim.arrival_time_s, handle.sim.num_cached_tokens or 0)


async def _answer_native(request: web.Request, instance: _Instance, parsed: ParsedRequest, handle: RequestHandle,
                         request_id: str, rid: str) -> web.StreamResponse:
    """The answer to an admitted ``/generate`` request; aborts it when the client goes away."""
    try:
        if not parsed.stream:
            while handle.finish_reason is None:
                await handle.wait_progress(0)
            if handle.finish_reason == "abort":
                return web.json_response(sglang_api.error_json("the server is shutting down"), status=503)
            return web.json_response(_native_json(handle, rid, handle.num_generated_tokens, handle.finish_reason))
        # SGLang streams the whole text so far in every event, the finish reason in the last.
        return await _stream_events(request, handle, lambda num_sent, num_generated, reason: sglang_api.sse(
            _native_json(handle, rid, num_generated, reason)))
    finally:
        if handle.finish_reason is None:
            instance.engine.abort(request_id)


async def _answer(request: web.Request, instance: _Instance, parsed: ParsedRequest, handle: RequestHandle,
                  request_id: str, response_id: str, is_chat: bool) -> web.StreamResponse:
    """The response to an admitted request (SSE or one JSON body); aborts it when the client goes away."""
    shaper = ResponseShaper(is_chat, response_id, instance.config.served_model_name, int(time.time()))
    try:
        if parsed.stream:
            return await _stream(request, instance, handle, shaper, parsed.include_usage)
        while handle.finish_reason is None:
            await handle.wait_progress(0)
        if handle.finish_reason == "abort":
            return _error_response(ApiError(503, "the server is shutting down"))
        num_out = handle.num_generated_tokens
        token_ids = None
        if parsed.return_token_ids and not is_chat:
            prompt_ids = parsed.prompt_token_ids or prompt_token_ids(parsed.prompt_text or "")
            token_ids = (list(prompt_ids), handle.reply.token_ids[:num_out])
        body = shaper.full_response(handle.reply.text(0, num_out), handle.finish_reason,
                                    instance.usage(handle, is_chat, num_out), token_ids)
        return web.json_response(body)
    finally:
        # Client gone (handler cancelled) or write failed: free the request's slot and KV blocks.
        if handle.finish_reason is None:
            instance.engine.abort(request_id)


async def _stream(request: web.Request, instance: _Instance, handle: RequestHandle, shaper: ResponseShaper,
                  include_usage: bool) -> web.StreamResponse:
    """SSE as vLLM sends it: first token at once, then one event per ``stream_interval`` tokens, the final event
    with ``finish_reason``, then (``include_usage``) a usage-only chunk, then ``[DONE]``."""

    def event(num_sent: int, num_generated: int, reason: str | None) -> bytes:
        chunk = shaper.sse_chunk(handle.reply.text(num_sent, num_generated), num_sent == 0, reason)
        if reason is not None and include_usage:
            chunk += shaper.sse_usage_chunk(instance.usage(handle, shaper.is_chat, num_generated, stream=True))
        return chunk

    return await _stream_events(request, handle, event)


async def _stream_events(request: web.Request, handle: RequestHandle,
                         event: Callable[[int, int, str | None], bytes]) -> web.StreamResponse:
    """An SSE response: after each progress wake-up, ``event(tokens sent, tokens generated, finish_reason or None)``
    is written (only when there is something new, or the request finished), then ``[DONE]`` after the last; an
    aborted request or a client gone ends it quietly."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    num_sent = 0
    try:
        while True:
            await handle.wait_progress(num_sent)
            reason = handle.finish_reason
            if reason == "abort":
                break
            num_generated = handle.num_generated_tokens
            if reason is not None:
                await response.write(event(num_sent, num_generated, reason) + SSE_DONE)
                break
            if num_generated > num_sent:
                await response.write(event(num_sent, num_generated, None))
                num_sent = num_generated
        await response.write_eof()
    except ConnectionError:
        logger.debug("client of %s went away", handle.sim.request_id)
    return response


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, is_chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, is_chat=True)


async def _native_generate(request: web.Request) -> web.StreamResponse:
    return await _generate(request, is_chat=False, native=True)


async def _server_info(request: web.Request) -> web.Response:
    cfg = request.app[_INSTANCE].config
    engine = cfg.engine
    return web.json_response(sglang_api.server_info(cfg.served_model_name, engine.max_num_seqs,
                                                    engine.max_num_batched_tokens, engine.block_size,
                                                    engine.num_gpu_blocks, cfg.max_model_len))


async def _model_info(request: web.Request) -> web.Response:
    return web.json_response(sglang_api.model_info(request.app[_INSTANCE].config.served_model_name))


async def _sglang_health(request: web.Request) -> web.Response:
    await asyncio.sleep(sglang_api.HEALTH_POLL_S)
    return web.Response(status=200)


async def _models(request: web.Request) -> web.Response:
    cfg = request.app[_INSTANCE].config
    card = {"id": cfg.served_model_name, "object": "model", "created": int(time.time()), "owned_by": cfg.api,
            "root": cfg.served_model_name, "parent": None, "max_model_len": cfg.max_model_len}
    return web.json_response({"object": "list", "data": [card]})


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _metrics(request: web.Request) -> web.Response:
    instance = request.app[_INSTANCE]
    body = instance.frozen_metrics if instance.frozen_metrics is not None else instance.metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _add_instance_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[INSTANCE_HEADER] = request.app[_INSTANCE].instance_name


def build_app(config: EmulatorConfig, tracing: Tracing | None = None) -> web.Application:
    """The aiohttp application of one instance; its engine loop starts and stops with the app.

    Args:
        config: the instance's settings.
        tracing: where each request's ``llm_request`` span goes (None = off); the caller shuts it down.

    Raises:
        ValueError: unknown batch-time model name or malformed model file.
        OSError: the batch-time model file cannot be read.
    """
    # vLLM and SGLang take bodies as large as the context allows; aiohttp's 1 MiB default would answer plain text.
    app = web.Application(client_max_size=64 * 1024 * 1024)
    instance = _Instance(config, tracing.tracer("astrolabe.emulator") if tracing and tracing.enabled else None)
    app[_INSTANCE] = instance
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    if config.api == "sglang":
        app.router.add_route("POST", "/generate", _native_generate)
        app.router.add_route("PUT", "/generate", _native_generate)
        app.router.add_get("/get_server_info", _server_info)
        app.router.add_get("/get_model_info", _model_info)
        app.router.add_get("/health", _sglang_health)
        app.router.add_get("/health_generate", _sglang_health)
    else:
        app.router.add_get("/health", _health)
    app.on_response_prepare.append(_add_instance_header)

    async def _start_engine(_: web.Application) -> None:
        instance.engine.start()

    async def _stop_engine(_: web.Application) -> None:
        await instance.engine.stop()

    app.on_startup.append(_start_engine)
    app.on_shutdown.append(_stop_engine)
    return app


@dataclass(slots=True)
class RunningEmulator:
    """A started instance: ``host``/``port`` it listens on; ``stop()`` aborts in-flight requests and closes."""

    host: str
    port: int
    runner: web.AppRunner

    def toggle_metrics_freeze(self) -> None:
        """Freezes or thaws ``/metrics`` (`_Instance.toggle_metrics_freeze`)."""
        self.runner.app[_INSTANCE].toggle_metrics_freeze()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_emulator(config: EmulatorConfig, tracing: Tracing | None = None) -> RunningEmulator:
    """Builds and starts one instance on the running event loop (port 0 = any free port; ``tracing``: as
    :func:`build_app`).

    Raises:
        OSError: the address cannot be bound.
        ValueError: see :func:`build_app`.
    """
    app = build_app(config, tracing)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    app[_INSTANCE].instance_name = f"{config.host}:{port}"
    return RunningEmulator(config.host, port, runner)


def _parse_args(argv: Sequence[str]) -> tuple[EmulatorConfig, argparse.Namespace]:
    d = EmulatorConfig()
    p = argparse.ArgumentParser(prog="astrolabe emulator", description="Run one emulated vLLM (or SGLang) server.",
                                formatter_class=HelpFormatter)
    p.add_argument("--api", choices=APIS, default=d.api,
                   help="the server it presents itself as: vllm (OpenAI routes, vllm: metrics) or sglang (also "
                        "/generate, /get_server_info, sglang: metrics, a 1 s /health)")
    p.add_argument("--host", default=d.host, help="listen address (vLLM's --host)")
    p.add_argument("--port", type=int, default=d.port, help="listen port; 0 picks a free port (logged at startup)")
    p.add_argument("--served-model-name", default=d.served_model_name,
                   help="the only model name requests may ask for (vLLM's --served-model-name)")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the output lengths and the step-time noise")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="vLLM --max-model-len: context limit, prompt + output tokens")
    add_engine_arguments(p, d.engine, kv_note="; /metrics reports it in vllm:cache_config_info",
                         scheduling_note="default: sglang with --api sglang, else vllm-v1; ")
    p.add_argument("--batch-time-model", default=d.batch_time_model,
                   help="step-time model: a shipped name (predictor/sim/*.json) or a JSON path")
    p.add_argument("--stream-interval", type=int, default=d.stream_interval,
                   help="output tokens per SSE event after the first (vLLM's --stream-interval), tokens")
    p.add_argument("--time-scale", type=float, default=d.time_scale,
                   help="wall seconds per modelled H200 second (>1 = slower), a factor")
    p.add_argument("--step-noise", type=float, default=d.step_noise_frac,
                   help="standard deviation of the multiplicative step-time noise, a fraction of the step time")
    p.add_argument("--output-len-median", type=float, default=d.output_len_median_tokens,
                   help="median output length of a request without ignore_eos (log-normal), tokens")
    p.add_argument("--output-len-sigma", type=float, default=d.output_len_sigma,
                   help="sigma of the log-normal output length (of the underlying normal, in log tokens)")
    p.add_argument("--state-path", default=d.state_path,
                   help="publish the engine's state to this file in the vLLM plugin's format, for a sidecar's "
                        "--state-source vllm-plugin --vllm-state-path (put it on /dev/shm); default: off")
    p.add_argument("--state-interval-s", type=float, default=d.state_interval_s,
                   help="least time between two state publications while busy (0 = every step), seconds")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="vLLM's automatic prefix caching (vllm-v1 scheduling only): prompts and replies become "
                        "block keys the scheduler looks up and caches; --no-enable-prefix-caching turns it off")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="answer usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix "
                        "cache), as vLLM's flag does")
    p.add_argument("--otlp-traces-endpoint", default=None,
                   help="OTLP receiver of one span per request (vLLM's flag; host:port or URL); default: the "
                        "OTEL_* variables decide, off when none is set")
    add_log_arguments(p)
    a = p.parse_args(list(argv))
    if a.scheduling is None:
        a.scheduling = "sglang" if a.api == "sglang" else "vllm-v1"
    if a.state_path is not None and (not Path(a.state_path).parent.is_dir() or Path(a.state_path).is_dir()):
        # Else the publisher fails in its thread and the emulator serves on with no state for its sidecar to read.
        p.error(f"--state-path {a.state_path}: must name a file in an existing folder")
    try:
        config = EmulatorConfig(
            engine=engine_from_args(a),
            batch_time_model=a.batch_time_model, served_model_name=a.served_model_name,
            host=a.host, port=a.port, seed=a.seed, max_model_len=a.max_model_len, stream_interval=a.stream_interval,
            time_scale=a.time_scale, step_noise_frac=a.step_noise, output_len_median_tokens=a.output_len_median,
            output_len_sigma=a.output_len_sigma, state_path=a.state_path, state_interval_s=a.state_interval_s,
            otlp_traces_endpoint=a.otlp_traces_endpoint, api=a.api, enable_prefix_caching=a.enable_prefix_caching,
            enable_prompt_tokens_details=a.enable_prompt_tokens_details)
    except ValueError as exc:
        p.error(str(exc))
    return config, a


async def _serve(config: EmulatorConfig, tracing: Tracing) -> None:
    server = await start_emulator(config, tracing)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, server.toggle_metrics_freeze)
    logger.info("emulated %s %r listening on %s (time scale %.3g: each step takes %.3g x the modelled H200 time; "
                "all reported times are emulator wall-clock seconds; tokenizer: %s)",
                "SGLang" if config.api == "sglang" else "vLLM", config.served_model_name,
                server.base_url, config.time_scale, config.time_scale, TOKENIZER_NAME)
    try:
        await stop.wait()
    finally:
        logger.info("shutting down %s", server.base_url)
        await server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """``astrolabe emulator``: runs one instance until SIGTERM/SIGINT, then aborts in-flight requests.

    Returns:
        0 after a clean shutdown (argparse exits with 2 on bad flags).
    """
    config, args = _parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging(args.log_level, args.log_format)
    try:
        load_batch_time_model(config.batch_time_model)
    except (ValueError, OSError) as exc:
        logger.error("cannot load batch-time model: %s", exc)
        return 2
    try:
        tracing = setup_tracing("astrolabe-emulator", TracingConfig(endpoint=config.otlp_traces_endpoint))
    except TracingConfigError as exc:
        logger.error("invalid tracing configuration: %s", exc)
        return 2
    # Fewer series per scrape; process-wide, so only the CLI does it (tests may share a process).
    prometheus_client.disable_created_metrics()
    try:
        asyncio.run(_serve(config, tracing))
    finally:
        tracing.shutdown()
    return 0
