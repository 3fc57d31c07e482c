"""Extproc configuration: one YAML file plus environment overrides, validated by pydantic; unknown keys are errors.

Owns the config classes (frozen, slotted pydantic dataclasses, so ``dataclasses.replace`` and ``==`` work as on
plain ones), their JSON Schema, and the mapping of validation errors to dotted key paths. Must not import the
server, the router or the pool (they import this module).

Example (every key but ``endpoints`` is optional; defaults shown)::

    listen: 127.0.0.1:9002          # gRPC address of the ExternalProcessor service
    workers: 1                      # extproc processes serving on it (> 1: a supervisor and N workers sharing the
                                    # port with SO_REUSEPORT, extproc/workers.py); the --workers flag wins
    policy: astrolabe               # astrolabe | random | round-robin | least-requests | min-qpm | infaas |
                                    # llumnix | gie | gie-prefix | llm-d | llm-d-precise | sglang-cache-aware |
                                    # dynamo-kv | dynamo-kv-precise
    policy_params: {}               # typed per policy, e.g. {k: 2, metric: e2e} for astrolabe
    output_length:                  # predicted output tokens sent to predictors (extproc/lengths.py)
      source: tagger                # tagger | fixed | oracle
      fixed_tokens: 256             # the estimate for 'fixed' (the sidecars cap it by max_tokens)
      tagger_path: null             # a trained tagger directory for 'tagger' (null = the shipped light tagger)
    predictor_client:               # calls to predictor sidecars (extproc/predictor_client.py)
      mode: watch                   # watch: sidecars stream their state, predictions made here (extproc/
                                    # fleet_state.py) | predict: a Predict round trip per candidate
      watch_interval_s: 0.02        # watch: how often each sidecar sends its state
      watch_max_age_s: 0.25         # watch: an older state gives no prediction
      predict_timeout_s: 0.02       # time a sidecar gets to answer one Predict, from when the call is sent
      notices: stream               # Admit / Release: batched on one stream per sidecar (extproc/notices.py)
                                    # | unary: one call each
      notify_timeout_s: 0.5         # deadline of a unary Admit / Release (fire and forget)
      max_state_age_s: 2.0          # an answer whose state is older counts as no prediction
      min_backoff_s: 0.5            # a failing sidecar is skipped this long, doubling per failure in a row ...
      max_backoff_s: 10.0           # ... up to this
      max_loop_lag_s: 0.1           # extproc event-loop lag tolerated per Predict (gRPC deadline = timeout + this)
      late_backoff_after: 5         # a late sidecar backs off after this many late answers in a row ...
      late_backoff_span_s: 1.0      # ... spanning at least this long
      hold_s: 0.5                   # a Predict holds its request at the sidecar this long (0 = off): Admit confirms
                                    # it at the chosen one, Release drops it at the others (predictor/holds.py)
    seed: null                      # seeds the policy RNG; null = from os.urandom
    max_body_bytes: 8388608         # larger request bodies get 413
    fallback_endpoints: 0           # endpoints after the chosen one in the destination list (gateways that take a
                                    # list only, e.g. `astrolabe envoy --pool`; ORIGINAL_DST takes one)
    drain_delay_s: 2.0              # at shutdown, keep serving this long after readiness goes NOT_SERVING
    grace_period_s: 10.0            # then streams still being routed get at most this long
    metrics_listen: null            # host:port for Prometheus /metrics (null = off)
    tls: null                       # TLS of the gRPC server (astrolabe/tls.py); null = plaintext, else:
    #   cert_file: /etc/astrolabe/tls/tls.crt   # PEM chain, re-read when it changes
    #   key_file: /etc/astrolabe/tls/tls.key
    #   client_ca_file: null        # set = mutual TLS: Envoy must present a certificate this CA signed
    predictor_tls: null             # TLS of the calls to the sidecars; null = plaintext, else:
    #   ca_file: /etc/astrolabe/tls/ca.crt      # verifies the sidecars (null = system roots)
    #   cert_file: null             # client certificate (mutual TLS), with key_file
    #   key_file: null
    #   server_name: null           # name the sidecars' certificates carry, if not their IP
    backend_tls: null               # HTTPS for health checks and /metrics scrapes; null = HTTP, else:
    #   ca_file: /etc/astrolabe/tls/ca.crt      # verifies the backends
    #   server_name: null           # name their certificates must carry (null = the CA's signature alone)
    decision_log_path: null         # JSON lines, one record per routing decision (null = off)
    log_level: INFO                 # DEBUG | INFO | WARNING | ERROR | CRITICAL (the --log-level flag wins)
    log_format: text                # text | json: one JSON object per line (the --log-format flag wins)
    tokenizers: {}                  # served model -> tokenizer.json or model dir (prompt tokens as the engine
                                    # counts them; other models: the shipped WordPiece, extproc/prompt_tokens.py)
    prefix_cache:                   # the prompt's KV block keys, sent with predictions (extproc/prompt_tokens.py)
      enabled: true                 # tokenize every prompt in full and key its blocks (false: no keys, long
                                    # prompts' counts extrapolated)
      block_size: 16                # tokens per KV block: the instances' vLLM --block-size
      max_keyed_chars: 262144       # a longer prompt (characters) gets no keys
    objectives:                     # latency objectives and admission (extproc/admission.py); headers
                                    # x-slo-ttft-ms / x-slo-tpot-ms (and llm-d's x-llm-d-slo-*) set a request's own
      named: {}                     # objective name (x-gateway-inference-objective) -> {priority, ttft_ms, tpot_ms}
      models: {}                    # served model -> {priority, ttft_ms, tpot_ms} of requests naming none
      default: {}                   # every other request (priority 0, no objective)
      admission: headroom           # none | slo | headroom: when a sheddable (priority < 0) request gets 429
      protect_ttft_ms: null         # headroom bound (null = half the tightest TTFT objective of priority >= 0)
      retry_after_s: 1              # retry-after of a refused request
      pressure_window_s: 2.0        # headroom: refuse every sheddable request this long after a priority >= 0 one
                                    # was predicted to wait past the bound everywhere it probed (0 = never)
      engine_priority: false        # write each request's priority into its body for vLLM's --scheduling-policy
                                    # priority (negated: vLLM serves lower first); false for fcfs engines
    reload_interval_s: 1.0          # how often the file is checked for changes (endpoints reload live)
    metrics_interval_s: 0.05        # endpoint /metrics scrape interval (only for infaas | llumnix | gie)
    metrics_staleness_s: 2.0        # an older scrape counts as missing (GIE's default)
    metrics_format: auto            # auto | vllm | sglang: the endpoints' /metrics names (auto: read each scrape
                                    # by the gauges it carries)
    tracing:                        # OpenTelemetry traces (astrolabe/tracing.py); OTEL_* variables win per key
      endpoint: null                # OTLP receiver, host:port or http(s):// URL (null = off unless OTEL_* say)
      protocol: grpc                # grpc | http/protobuf
      sampler_ratio: null           # share of new traces sampled, [0, 1] (null = all); a sampled caller is
                                    # always followed
      service_name: null            # service.name (null = astrolabe-extproc)
    health_check:                   # active HTTP health checks of the endpoints
      enabled: true
      path: /health
      interval_s: 2.0
      timeout_s: 1.0
      unhealthy_threshold: 2        # consecutive failures before an endpoint leaves the pool
    discovery:                      # where the endpoints come from (extproc/discovery)
      source: static                # static: the endpoints key | kubernetes | dns
      namespace: null               # kubernetes: null = the kubeconfig context's, else the pod's own
      label_selector: null          # kubernetes: pods by label selector, e.g. app=vllm ...
      inference_pool: null          # ... or by an InferencePool's selector and targetPorts (exactly one)
      target_ports: [8000]          # model-server port(s) per pod (InferencePool: its targetPorts)
      predictor_port: 9100          # sidecar port (or a container port name); null = no sidecar
      models: []                    # served models of discovered endpoints; empty = any
      kubeconfig: null              # null = in-cluster service account, else $KUBECONFIG / ~/.kube/config
      resync_interval_s: 300.0      # kubernetes: full relist period
      dns_name: null                # dns: e.g. vllm.default.svc.cluster.local (a headless Service)
      dns_nameservers: []           # dns: empty = /etc/resolv.conf
      dns_interval_s: 5.0           # dns: time between lookups
      timeout_s: 5.0                # one API list or DNS lookup
    endpoints:                      # discovery.source static only (required there)
      - address: 10.0.0.5:8000      # ip:port of a vLLM (or compatible) OpenAI server
        models: [llama-2-7b]        # served model names; empty = serves any model
        predictor: 10.0.0.5:9100    # predictor sidecar beside it (optional)

Environment overrides (``load_config`` only; ``parse_config`` is pure): ``ASTROLABE_EXTPROC_<KEY>`` replaces a
root key and ``ASTROLABE_EXTPROC_<SECTION>__<KEY>`` one key of a section (``health_check``, ``output_length``,
``predictor_client``, ``policy_params``, ``tokenizers``, ``prefix_cache``, ``tracing``, ``discovery``, ``tls``,
``predictor_tls``, ``backend_tls``); the key is the name's lower-case tail, e.g.
``ASTROLABE_EXTPROC_PREDICTOR_CLIENT__PREDICT_TIMEOUT_S=0.05`` or ``ASTROLABE_EXTPROC_TLS__CERT_FILE=/tls/tls.crt``. A value is read as one YAML scalar (``0.05``,
``true``, ``null``; empty = null); text that YAML reads as a list or mapping, or cannot parse, stays a string
(so ``[::]:9002`` works). ``endpoints``, ``policy_params`` and whole sections take YAML or JSON text, e.g.
``ASTROLABE_EXTPROC_ENDPOINTS='[{address: 10.0.0.5:8000}]'``. Precedence, lowest first: defaults, the file, the
environment (a whole section before its ``__`` keys), then the CLI flags ``--listen``, ``--workers``, ``--policy``,
``--log-level`` and ``--log-format`` (applied by the caller, with ``replace_config``). An override naming an
unknown key is an error that names the variable, as is any error in a value it set. The standard ``OTEL_*`` variables are read later, by ``astrolabe.tracing``,
and win over the ``tracing`` section key by key (its module docstring).

All errors raise ``ConfigError`` whose message starts with the dotted path of the offending key (``<root>`` for
the top level) and, for a value from the environment, names the variable.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import random
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, GetPydanticSchema, TypeAdapter, \
    ValidationError, field_validator
from pydantic.dataclasses import dataclass
from pydantic_core import core_schema

from astrolabe.logs import DEFAULT_LOG_FORMAT, DEFAULT_LOG_LEVEL, LOG_FORMATS, LOG_LEVELS
from astrolabe.tracing import PROTOCOLS, TracingConfig, TracingConfigError, normalize_endpoint
from extproc.admission import ADMISSION_RULES, DEFAULT_PRESSURE_WINDOW_S, MAX_OBJECTIVE_S, AdmissionParams, ObjectiveConfig
from extproc.objectives import Objectives
from extproc.lengths import SOURCES, OutputLengthConfig
from extproc.policies.registry import POLICY_NAMES, build_policy
from predictor.backend_metrics import METRICS_FORMATS
from extproc.predictor_client import MODES, NOTICES, PredictorClientConfig

# NOTE: invariants.
# - Every class here is a frozen pydantic dataclass with extra="forbid"; numeric and boolean fields are strict
#   (a bool is not a number, "1" is not a number, an int is a float), so YAML typos fail instead of coercing.
# - ``output_length``, ``predictor_client`` and ``tracing`` are validated by the ``*Section`` mirrors below but
#   hold the plain dataclasses their modules take; tests check each mirror has its dataclass's fields and defaults.
# - ``*_s`` durations and ``*_tokens`` counts in sections must be > 0 (the policy is checked by ``parse_config``,
#   by building it once, not by the classes, so ``dataclasses.replace`` stays cheap).

ENV_PREFIX = "ASTROLABE_EXTPROC_"
"""Prefix of environment overrides: ``ASTROLABE_EXTPROC_POLICY`` sets ``policy`` (see the module docstring)."""

ENV_NESTED_DELIMITER = "__"
"""Separates section and key in an override: ``ASTROLABE_EXTPROC_PREDICTOR_CLIENT__PREDICT_TIMEOUT_S``."""

ROOT = "<root>"
"""How error messages name the top level of the file."""

MAX_WORKERS = 256
"""Most ``workers`` (processes of one extproc)."""

LIVE_KEYS = ("endpoints",)
"""Root keys a reload applies while the extproc runs; a change to any other key needs a restart."""


class ConfigError(ValueError):
    """Invalid configuration; the message names the key, e.g. ``endpoints[1].address: ...``."""


def _config(title: str) -> ConfigDict:
    return ConfigDict(extra="forbid", title=title, allow_inf_nan=False)


class _Located(ValueError):
    """A validator's error about a key below the field it checks (``sub_path`` appended to the field's path)."""

    def __init__(self, sub_path: tuple[int | str, ...], message: str) -> None:
        super().__init__(message)
        self.sub_path = sub_path


# ---------------------------------------------------------------------------------------------------------------
# Field types and checks


def _ip_port(value: object) -> str:
    """``ip:port`` normalised (IPv6 bracketed); raises ValueError with the message tail."""
    if not isinstance(value, str) or ":" not in value:
        raise ValueError(f"expected 'ip:port', got {value!r}")
    host, _, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{host!r} is not an IP address (Envoy's ORIGINAL_DST needs one)") from None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"port {port!r} is not in 1..65535")
    return f"[{ip}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"


def parse_ip_port(value: object, where: str) -> str:
    """Validates ``ip:port`` and returns it normalised (IPv6 bracketed).

    Args:
        value: the configured value.
        where: the dotted key path, the prefix of the error message.

    Raises:
        ConfigError: not a string of the form ``ip:port`` with a literal IP and a port in 1..65535.
    """
    try:
        return _ip_port(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _host_port(value: object) -> object:
    """Checks ``host:port`` (any host, a numeric port); the server binds it."""
    if not isinstance(value, str) or not value.rpartition(":")[2].isdigit():
        raise ValueError(f"expected 'host:port', got {value!r}")
    return value


def _optional_host_port(value: object) -> object:
    return None if value is None else _host_port(value)


def _predictor_address(value: object) -> object:
    if value is not None and (not isinstance(value, str) or ":" not in value):
        raise ValueError(f"expected 'host:port', got {value!r}")
    return value


def _url_path(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError("must start with '/'")
    return value


def _log_level(value: object) -> object:
    """A level name in any case, upper-cased; anything else unchanged (the Literal's error names it as given)."""
    return value.upper() if isinstance(value, str) and value.upper() in LOG_LEVELS else value


def _none_as(empty: Callable[[], object]) -> Callable[[object], object]:
    """A before-validator: YAML's ``key:`` with nothing after it (None) means ``empty()``."""
    return lambda value: empty() if value is None else value


_Bool = Annotated[bool, Field(strict=True)]
_Str = Annotated[str, Field(strict=True)]
_NonEmptyStr = Annotated[str, Field(strict=True, min_length=1)]
_PositiveInt = Annotated[int, Field(strict=True, ge=1)]
_PositiveSeconds = Annotated[float, Field(strict=True, gt=0)]
_NonNegativeSeconds = Annotated[float, Field(strict=True, ge=0)]
_PORT_PATTERN = {"pattern": ":[0-9]+$"}  # JSON Schema only; the validators check more
_HostPort = Annotated[str, BeforeValidator(_host_port, json_schema_input_type=str)]
_OptionalHostPort = Annotated[str | None, BeforeValidator(_optional_host_port, json_schema_input_type=str | None)]


def _section(mirror: type, target: type) -> Any:
    """The type of a section that ``mirror`` validates (its rules, descriptions, schema) and ``target`` holds.

    Accepts a mapping, None (all defaults) or a ``target`` instance (``dataclasses.replace`` passes those).
    """
    def to_input(value: object) -> object:
        if isinstance(value, target):
            return dataclasses.asdict(value)
        return {} if value is None else value

    def to_target(value: object) -> object:
        return target(**{f.name: getattr(value, f.name) for f in dataclasses.fields(value)})

    def schema(_source: Any, handler: Any) -> core_schema.CoreSchema:
        inner = handler.generate_schema(mirror)
        return core_schema.no_info_before_validator_function(
            to_input, core_schema.no_info_after_validator_function(to_target, inner),
            json_schema_input_schema=core_schema.nullable_schema(inner),
            serialization=core_schema.plain_serializer_function_ser_schema(dataclasses.asdict))

    return Annotated[target, GetPydanticSchema(schema)]


# ---------------------------------------------------------------------------------------------------------------
# Sections

_OUTPUT_LENGTH = OutputLengthConfig()
_PREDICTOR_CLIENT = PredictorClientConfig()
_TRACING = TracingConfig()


def _otlp_endpoint(value: object) -> object:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"expected 'host:port' or an http(s):// URL, got {value!r}")
    try:
        normalize_endpoint(value, "endpoint")
    except TracingConfigError as exc:
        raise ValueError(str(exc).removeprefix("endpoint: ")) from None
    return value


@dataclass(frozen=True, slots=True, config=_config("OutputLengthSection"))
class OutputLengthSection:
    """Predicted output tokens sent to predictor sidecars (``extproc/lengths.py``)."""

    source: Literal[SOURCES] = Field(  # type: ignore[valid-type]
        _OUTPUT_LENGTH.source,
        description="tagger: the length tagger's estimate; fixed: fixed_tokens; oracle: the request's max_tokens "
                    "(exact only with ignore_eos). The sidecars get the estimate and the request's max_tokens, and "
                    "price E[min(reply length, max_tokens)] (extproc/lengths.py).")
    fixed_tokens: Annotated[int, Field(strict=True, gt=0)] = Field(
        _OUTPUT_LENGTH.fixed_tokens, description="The estimate for source 'fixed', tokens (> 0).")
    tagger_path: _Str | None = Field(
        _OUTPUT_LENGTH.tagger_path,
        description="A trained tagger directory for source 'tagger'; null = the shipped light tagger.")


@dataclass(frozen=True, slots=True, config=_config("PredictorClientSection"))
class PredictorClientSection:
    """Calls to the predictor sidecars (``extproc/predictor_client.py``); every duration in seconds, > 0."""

    predict_timeout_s: _PositiveSeconds = Field(
        _PREDICTOR_CLIENT.predict_timeout_s,
        description="Time a sidecar gets to answer one Predict, counted from when the call is sent, seconds; a "
                    "late or failed sidecar is dropped for that request.")
    notify_timeout_s: _PositiveSeconds = Field(
        _PREDICTOR_CLIENT.notify_timeout_s,
        description="Deadline of a unary Admit / Release (fire and forget), seconds.")
    max_state_age_s: _PositiveSeconds = Field(
        _PREDICTOR_CLIENT.max_state_age_s,
        description="An answer whose sidecar state is older than this (backend unreachable) counts as no "
                    "prediction, seconds.")
    min_backoff_s: _PositiveSeconds = Field(
        _PREDICTOR_CLIENT.min_backoff_s,
        description="First backoff of a failing sidecar (skipped, not asked), seconds; doubles per failure in a "
                    "row.")
    max_backoff_s: _PositiveSeconds = Field(
        _PREDICTOR_CLIENT.max_backoff_s, description="Cap of the doubling backoff, seconds (>= min_backoff_s).")
    max_loop_lag_s: _PositiveSeconds = Field(
        _PREDICTOR_CLIENT.max_loop_lag_s,
        description="The extproc's own event-loop lag tolerated per Predict, seconds: the gRPC deadline is "
                    "predict_timeout_s + this; a late answer the loop's lag caused is not held against the "
                    "sidecar.")
    late_backoff_after: _PositiveInt = Field(
        _PREDICTOR_CLIENT.late_backoff_after,
        description="Late answers in a row (a count, >= 1) before a late sidecar backs off ...")
    late_backoff_span_s: _PositiveSeconds = Field(
        _PREDICTOR_CLIENT.late_backoff_span_s,
        description="... provided they span at least this long (first sent to last failed), seconds.")
    hold_s: _NonNegativeSeconds = Field(
        _PREDICTOR_CLIENT.hold_s,
        description="Each Predict asks its sidecar to count the request from its answer for up to this long "
                    "(protocol v1.1, predictor/holds.py), so that concurrent decisions see each other; the chosen "
                    "sidecar's hold is confirmed by Admit, the others' dropped by Release, seconds; 0 = plain "
                    "Predicts (decisions made together then herd).")
    mode: Literal[MODES] = Field(  # type: ignore[valid-type]
        _PREDICTOR_CLIENT.mode,
        description="Where predictions are made: 'watch' (each sidecar streams its instance's state and the extproc "
                    "predicts locally, extproc/fleet_state.py: no round trip on the request path; a sidecar that "
                    "does not stream is asked by Predict) or 'predict' (a Predict round trip to each candidate's "
                    "sidecar).")
    watch_interval_s: _PositiveSeconds = Field(
        _PREDICTOR_CLIENT.watch_interval_s,
        description="'watch': how often each sidecar sends its state, seconds (the sidecar cuts it to [0.005, 1]).")
    watch_max_age_s: _PositiveSeconds = Field(
        _PREDICTOR_CLIENT.watch_max_age_s,
        description="'watch': a state received longer ago than this gives no prediction (a frozen or cut-off "
                    "sidecar), seconds.")
    notices: Literal[NOTICES] = Field(  # type: ignore[valid-type]
        _PREDICTOR_CLIENT.notices,
        description="How Admit and Release travel: 'stream' (the notices of one event-loop turn batched on one "
                    "long-lived Notify stream per sidecar, protocol v1.3, extproc/notices.py; unary calls to a "
                    "sidecar without it, and for a sampled request's Admit, which is traced) or 'unary' (one call "
                    "each).")

    def __post_init__(self) -> None:
        if self.max_backoff_s < self.min_backoff_s:
            raise _Located(("max_backoff_s",), f"must be at least min_backoff_s ({self.min_backoff_s:g} s), got "
                                               f"{self.max_backoff_s:g} s: the backoff doubles from the one to the "
                                               "other")


@dataclass(frozen=True, slots=True, config=_config("TracingSection"))
class TracingSection:
    """OpenTelemetry traces (``astrolabe/tracing.py``); each standard ``OTEL_*`` variable wins over its key here."""

    endpoint: Annotated[str | None, BeforeValidator(_otlp_endpoint, json_schema_input_type=str | None)] = Field(
        _TRACING.endpoint,
        description="OTLP receiver: host:port (plain text) or an http(s):// URL, as OTEL_EXPORTER_OTLP_ENDPOINT (for "
                    "http/protobuf /v1/traces is appended); null = off unless OTEL_* variables configure an "
                    "exporter.")
    protocol: Literal[PROTOCOLS] = Field(  # type: ignore[valid-type]
        _TRACING.protocol, description="OTLP transport: grpc or http/protobuf.")
    sampler_ratio: Annotated[float, Field(strict=True, ge=0, le=1)] | None = Field(
        _TRACING.sampler_ratio,
        description="Share of new traces sampled, in [0, 1] (parentbased_traceidratio: a request whose caller sent "
                    "a sampled context is always traced); null = every trace.")
    service_name: _NonEmptyStr | None = Field(
        _TRACING.service_name, description="service.name of the extproc's spans; null = astrolabe-extproc.")


_OutputLength = _section(OutputLengthSection, OutputLengthConfig)
_Tracing = _section(TracingSection, TracingConfig)
_PredictorClient = _section(PredictorClientSection, PredictorClientConfig)


@dataclass(frozen=True, slots=True, config=_config("HealthCheckConfig"))
class HealthCheckConfig:
    """Active health checks of endpoints (HTTP GET ``path``; 200 = healthy)."""

    enabled: _Bool = Field(True, description="Check endpoints; false = every endpoint counts as healthy.")
    path: Annotated[_Str, AfterValidator(_url_path)] = Field(
        "/health", description="HTTP path of the check; starts with '/'.", json_schema_extra={"pattern": "^/"})
    interval_s: _PositiveSeconds = Field(2.0, description="Time between two checks of one endpoint, seconds.")
    timeout_s: _PositiveSeconds = Field(1.0, description="Deadline of one check, seconds.")
    unhealthy_threshold: _PositiveInt = Field(
        2, description="Consecutive failed checks (a count, >= 1) before an endpoint leaves the pool.")


@dataclass(frozen=True, slots=True, config=_config("PrefixCacheConfig"))
class PrefixCacheConfig:
    """The prompt's KV block keys (``extproc.prompt_tokens``): what prefix-cache-aware predictions and policies read."""

    enabled: _Bool = Field(
        True, description="Tokenize every prompt in full (no extrapolation past 8,192 characters) and send the keys "
                          "of its full KV blocks with predictions; false = no keys (no prefix-cache hit is "
                          "predicted).")
    block_size: _PositiveInt = Field(
        16, le=4096, description="Tokens per KV block the keys are computed at: the instances' vLLM --block-size "
                                 "(16 by default; at most 4,096). A sidecar whose engine uses another block size "
                                 "ignores the keys, and the extproc warns once.")
    max_keyed_chars: _PositiveInt = Field(
        262_144, description="Longest prompt tokenized in full for its keys, characters (text and chat roles); a "
                             "longer prompt gets no keys and an extrapolated token count. It also bounds a token-id "
                             "prompt, in ids.")
    max_keyed_messages: _PositiveInt = Field(
        1024, description="Most chat messages whose template is rendered in full for the keys; a longer chat gets "
                          "no keys (rendering costs ~0.09 ms a message).")


def _yaml_exponent_as_float(value: object) -> object:
    """PyYAML (YAML 1.1) reads ``1e3`` (an exponent without a point or sign) as a string: take it as the number."""
    if isinstance(value, str) and _YAML_EXPONENT.fullmatch(value.strip()):
        return float(value)
    return value


_YAML_EXPONENT = re.compile(r"[+-]?\d+(?:\.\d*)?[eE][+-]?\d+", re.ASCII)
_ObjectiveMs = Annotated[float, Field(strict=True, gt=0, le=MAX_OBJECTIVE_S * 1000),
                         BeforeValidator(_yaml_exponent_as_float, json_schema_input_type=float)]
_INT32_MAX = 2 ** 31 - 1
"""Bounds of a configured priority: a 32-bit integer whose negation is one too (it becomes a metric label and, negated,
vLLM's request priority: ``predictor.sim.request.vllm_priority``)."""


@dataclass(frozen=True, slots=True, config=_config("ObjectiveEntry"))
class ObjectiveEntry:
    """One objective: a priority and latency objectives (``extproc.admission.Objectives``)."""

    priority: Annotated[int, Field(strict=True, ge=-_INT32_MAX, le=_INT32_MAX)] = Field(
        0, description="The Inference Extension's priority: negative = sheddable (may be refused with 429), 0 = the "
                       "default; higher is served sooner only where the engines schedule by priority "
                       "(engine_priority).")
    ttft_ms: _ObjectiveMs | None = Field(None, description="TTFT objective, milliseconds; null = none.")
    tpot_ms: _ObjectiveMs | None = Field(
        None, description="TPOT objective (mean time per output token after the first), milliseconds; null = none.")

    def objectives(self) -> Objectives:
        return Objectives(None if self.ttft_ms is None else self.ttft_ms / 1000,
                          None if self.tpot_ms is None else self.tpot_ms / 1000, self.priority)


_ObjectiveMap = Annotated[dict[_NonEmptyStr, ObjectiveEntry],
                          BeforeValidator(_none_as(dict), json_schema_input_type=dict[str, ObjectiveEntry] | None)]


@dataclass(frozen=True, slots=True, config=_config("ObjectivesConfig"))
class ObjectivesConfig:
    """Latency objectives per request and admission on predicted latency (``extproc/admission.py``)."""

    named: _ObjectiveMap = Field(
        default_factory=dict, description="Objective name (the InferenceObjective a request names in "
                                          "x-gateway-inference-objective) -> its priority and objectives.")
    models: _ObjectiveMap = Field(
        default_factory=dict, description="Served model -> the objectives of its requests that name no configured "
                                          "objective.")
    default: Annotated[ObjectiveEntry, BeforeValidator(_none_as(dict),
                                                        json_schema_input_type=ObjectiveEntry | None)] = Field(
        default_factory=ObjectiveEntry, description="The objectives of every other request (default: none, "
                                                    "priority 0: never refused).")
    admission: Literal[ADMISSION_RULES] = Field(  # type: ignore[valid-type]
        "headroom", description="When a sheddable request (priority < 0) is refused with 429: none (never), slo "
                                "(no probed endpoint is predicted to meet its objectives: llm-d's rule), headroom "
                                "(that, or the best probed endpoint's predicted TTFT is past protect_ttft_ms).")
    protect_ttft_ms: _ObjectiveMs | None = Field(
        None, description="The headroom rule's bound, milliseconds; null = half the tightest TTFT objective of "
                          "priority >= 0 (no bound when none has one).")
    retry_after_s: Annotated[int, Field(strict=True, ge=0, le=int(MAX_OBJECTIVE_S))] = Field(
        1, description="retry-after of a refused request, whole seconds (at most 3600).")
    pressure_window_s: _NonNegativeSeconds = Field(
        DEFAULT_PRESSURE_WINDOW_S, description="headroom rule: for this long after a request of priority >= 0 was "
                                               "predicted to wait past protect_ttft_ms on every endpoint it probed, "
                                               "every sheddable request is refused, seconds (0 = never).")

    engine_priority: Annotated[bool, Field(strict=True)] = Field(
        False, description="The endpoints run vLLM's --scheduling-policy priority: every routed request but SGLang's "
                           "/generate gets its objective's priority written into its JSON "
                           "body as vLLM's 'priority' field, negated (vLLM serves lower first: priority 0 stays 0, "
                           "a sheddable -1 becomes 1), replacing any the client sent, and the sidecars predict "
                           "with it. Leave false for engines that run fcfs: vLLM answers 400 to a nonzero "
                           "priority there.")

    def objective_config(self) -> ObjectiveConfig:
        """The router's view (``extproc.admission.ObjectiveConfig``)."""
        return ObjectiveConfig({name: e.objectives() for name, e in self.named.items()},
                               {name: e.objectives() for name, e in self.models.items()}, self.default.objectives(),
                               None if self.protect_ttft_ms is None else self.protect_ttft_ms / 1000)

    def admission_params(self) -> AdmissionParams:
        return AdmissionParams(self.admission, self.retry_after_s, self.pressure_window_s)


@dataclass(frozen=True, slots=True, config=_config("EndpointConfig"))
class EndpointConfig:
    """One backend instance.

    Attributes:
        address: ``ip:port`` (IPv6 as ``[::1]:8000``), as Envoy's ORIGINAL_DST cluster needs an IP; normalised.
        models: served model names; empty means the endpoint accepts any model.
        predictor: ``host:port`` of its predictor sidecar, or None.
    """

    address: Annotated[str, BeforeValidator(_ip_port, json_schema_input_type=str)] = Field(
        description="ip:port of a vLLM (or compatible) OpenAI server (IPv6 as [::1]:8000); Envoy's ORIGINAL_DST "
                    "cluster needs a literal IP.", examples=["10.0.0.5:8000", "[fd00::5]:8000"],
        json_schema_extra=_PORT_PATTERN)
    models: Annotated[tuple[_NonEmptyStr, ...],
                      BeforeValidator(_none_as(tuple), json_schema_input_type=list[_NonEmptyStr] | None)] = Field(
        (), description="Served model names; empty = the endpoint serves any model.")
    predictor: Annotated[_Str | None, BeforeValidator(_predictor_address, json_schema_input_type=str | None)] = \
        Field(None, description="host:port of the predictor sidecar beside it; null = none (astrolabe falls back "
                                "to least-requests for it).")



DISCOVERY_SOURCES = ("static", "kubernetes", "dns")
"""Where the endpoint list comes from (``discovery.source``)."""


def _port_or_name(value: object) -> object:
    """A port number (1..65535) or an IANA-style container port name (lower-case, <= 15 characters)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        if not 1 <= value <= 65535:
            raise ValueError(f"port {value} is not in 1..65535")
        return value
    if isinstance(value, str) and 1 <= len(value) <= 15 and value.replace("-", "").isalnum() \
            and value == value.lower() and not value.isdigit():
        return value
    raise ValueError(f"expected a port number or a container port name, got {value!r}")


_Port = Annotated[int, Field(strict=True, ge=1, le=65535)]

DNS_PORT = 53
"""Port of a nameserver given without one."""


def parse_nameserver(text: str) -> tuple[str, int]:
    """``'ip'``, ``'ip:port'``, ``'::1'`` or ``'[::1]:port'`` -> (normalised ip, port; `DNS_PORT` when absent).

    Raises:
        ValueError: not an IP literal (the message tail names the text), or a port outside 1..65535.
    """
    host, port = text, str(DNS_PORT)
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else port if not rest else ""
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"expected 'ip' or 'ip:port', got {text!r}") from None
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"port {port!r} is not in 1..65535")
    return str(ip), int(port)


@dataclass(frozen=True, slots=True, config=_config("DiscoveryConfig"))
class DiscoveryConfig:
    """Where the endpoints come from: the static ``endpoints`` list, the Kubernetes API, or DNS.

    ``kubernetes``: the Ready pods (phase Running, condition Ready True, not being deleted, with a pod IP) matched
    by ``label_selector``, or by the selector of the InferencePool ``inference_pool``
    (``inference.networking.k8s.io/v1``), in ``namespace``; each pod gives one endpoint per target port
    (``podIP:port``). Listed, then watched (resourceVersion, bookmarks; a 410 Gone relists) and relisted every
    ``resync_interval_s`` (``extproc/discovery/kubernetes.py``).
    ``dns``: the A/AAAA records of ``dns_name`` (a headless Service lists its Ready pods), re-resolved every
    ``dns_interval_s``, each ``ip:target_ports[0]`` (``extproc/discovery/dns.py``).
    The sidecar of each endpoint is ``podIP:predictor_port``. A failed list or lookup keeps the last endpoints.
    """

    source: Literal[DISCOVERY_SOURCES] = Field(  # type: ignore[valid-type]
        "static", description="static: the endpoints key; kubernetes: pods from the Kubernetes API; dns: the "
                              "records of a headless Service.")
    namespace: _NonEmptyStr | None = Field(
        None, description="kubernetes: namespace of the pods and the InferencePool; null = the kubeconfig's current "
                          "context's (as kubectl), else the extproc pod's own (its service account's namespace "
                          "file), else 'default'.")
    label_selector: _NonEmptyStr | None = Field(
        None, description="kubernetes: a label selector of the model-server pods, e.g. 'app=vllm' (exactly one of "
                          "label_selector and inference_pool).")
    inference_pool: _NonEmptyStr | None = Field(
        None, description="kubernetes: name of an InferencePool (inference.networking.k8s.io/v1) whose "
                          "spec.selector and spec.targetPorts define the endpoints; watched too.")
    target_ports: Annotated[tuple[_Port, ...], Field(min_length=1, max_length=8)] = Field(
        (8000,), description="Model-server port(s) of each pod (1-8, as InferencePool targetPorts); "
                             "inference_pool: ignored (the pool's targetPorts win); dns: the first.")
    predictor_port: Annotated[int | str | None, BeforeValidator(_port_or_name, json_schema_input_type=int | str | None)] = Field(
        9100, description="Port of the predictor sidecar in each pod: a number, or (kubernetes) the name of a "
                          "container port; null = no sidecar. With several target ports, the i-th port's sidecar "
                          "is predictor_port + i (a name: its number + i).")
    models: Annotated[tuple[_NonEmptyStr, ...],
                      BeforeValidator(_none_as(tuple), json_schema_input_type=list[_NonEmptyStr] | None)] = Field(
        (), description="Served model names of every discovered endpoint; empty = any model.")
    kubeconfig: _NonEmptyStr | None = Field(
        None, description="kubernetes: a kubeconfig file; null = in-cluster (service account) when "
                          "KUBERNETES_SERVICE_HOST is set, else $KUBECONFIG or ~/.kube/config.")
    resync_interval_s: _PositiveSeconds = Field(
        300.0, description="kubernetes: full relist period, seconds (each watch also ends after this long).")
    dns_name: _NonEmptyStr | None = Field(
        None, description="dns: the name to resolve, e.g. vllm.default.svc.cluster.local (a headless Service).")
    dns_nameservers: Annotated[tuple[_NonEmptyStr, ...],
                               BeforeValidator(_none_as(tuple), json_schema_input_type=list[str] | None)] = Field(
        (), description="dns: resolvers as 'ip' or 'ip:port'; empty = those of /etc/resolv.conf (with its search "
                        "domains).")
    dns_interval_s: _PositiveSeconds = Field(5.0, description="dns: time between two lookups, seconds.")
    timeout_s: _PositiveSeconds = Field(
        5.0, description="Deadline of one API list or DNS lookup, seconds; a failure retries with backoff "
                         "(0.5 s doubling to 30 s) and keeps the last endpoints.")

    def __post_init__(self) -> None:
        if self.source == "kubernetes" and (self.label_selector is None) == (self.inference_pool is None):
            raise _Located(("source",), "kubernetes needs exactly one of label_selector and inference_pool")
        if self.source == "dns" and (self.label_selector or self.inference_pool):
            raise _Located(("source",), "dns discovery takes no label_selector or inference_pool (kubernetes keys)")
        if self.source == "kubernetes" and self.dns_name:
            raise _Located(("source",), "kubernetes discovery takes no dns_name (a dns key)")
        if self.source == "dns" and self.dns_name is None:
            raise _Located(("dns_name",), "required when discovery.source is dns")
        if self.source == "dns" and isinstance(self.predictor_port, str):
            raise _Located(("predictor_port",), "dns discovery cannot read a named container port; give a number")
        for i, server in enumerate(self.dns_nameservers):
            try:
                parse_nameserver(server)
            except ValueError as exc:
                raise _Located(("dns_nameservers", i), str(exc)) from None


@dataclass(frozen=True, slots=True, config=_config("ServerTlsConfig"))
class ServerTlsConfig:
    """TLS of the extproc's gRPC server (``astrolabe.tls.ServerTls``): PEM files, as a ``kubernetes.io/tls``
    Secret mounts them; re-read when they change (new connections get the new certificate)."""

    cert_file: _NonEmptyStr = Field(description="PEM certificate chain the server presents (leaf first), e.g. "
                                                "/etc/astrolabe/tls/tls.crt.")
    key_file: _NonEmptyStr = Field(description="PEM private key of the certificate, e.g. /etc/astrolabe/tls/tls.key.")
    client_ca_file: _NonEmptyStr | None = Field(
        None, description="PEM CA bundle that verifies client certificates; set = mutual TLS (Envoy must present a "
                          "certificate this CA signed); null = server-only TLS.")


@dataclass(frozen=True, slots=True, config=_config("ClientTlsConfig"))
class ClientTlsConfig:
    """TLS of the extproc's calls to the predictor sidecars (``astrolabe.tls.ClientTls``)."""

    ca_file: _NonEmptyStr | None = Field(
        None, description="PEM CA bundle that verifies the sidecars' certificates; null = the system's roots.")
    cert_file: _NonEmptyStr | None = Field(
        None, description="PEM certificate chain presented to the sidecars (mutual TLS); null = none. Set with "
                          "key_file.")
    key_file: _NonEmptyStr | None = Field(None, description="PEM private key of cert_file.")
    server_name: _NonEmptyStr | None = Field(
        None, description="Name checked against each sidecar's certificate instead of its address's host (sidecars "
                          "are dialled by pod IP; a certificate usually names a Service); null = the host.")

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            missing = "key_file" if self.key_file is None else "cert_file"
            raise _Located((missing,), "cert_file and key_file must be set together (a client certificate and its key)")


@dataclass(frozen=True, slots=True, config=_config("BackendTlsConfig"))
class BackendTlsConfig:
    """HTTPS to the backends for the extproc's own requests to them (health checks, /metrics scrapes); Envoy's
    side is ``astrolabe envoy --backend-tls-ca`` (``astrolabe.tls.BackendTls``)."""

    ca_file: _NonEmptyStr = Field(description="PEM CA bundle that verifies the backends' certificates.")
    server_name: _NonEmptyStr | None = Field(
        None, description="DNS name the backends' certificates must carry (sent as SNI); null = the CA's signature "
                          "alone is checked (backends are dialled by IP), as Envoy without --backend-tls-server-name.")


# ---------------------------------------------------------------------------------------------------------------
# The root


@dataclass(frozen=True, slots=True, config=_config("ExtprocConfig"))
class ExtprocConfig:
    """The whole extproc configuration (see the module docstring for the YAML form)."""

    endpoints: tuple[EndpointConfig, ...] = Field(
        (), description="The backends (required with discovery.source static, where it is reloaded live when the "
                        "file changes; must be empty otherwise); addresses must be distinct.")
    listen: _HostPort = Field("127.0.0.1:9002", description="host:port of the gRPC ExternalProcessor service.",
                              json_schema_extra=_PORT_PATTERN)
    workers: Annotated[int, Field(strict=True, ge=1, le=MAX_WORKERS)] = Field(
        1, description=f"Extproc processes serving on `listen`, 1-{MAX_WORKERS}: above 1, a supervisor reserves the "
                       "port and runs this many workers on it with SO_REUSEPORT, each a whole extproc sharing "
                       "nothing (extproc/workers.py); about one core each. The --workers flag wins.")
    policy: _Str = Field(
        "astrolabe", description="Routing policy name.", json_schema_extra={"enum": list(POLICY_NAMES)})
    policy_params: Annotated[dict[str, Any],
                             BeforeValidator(_none_as(dict), json_schema_input_type=dict[str, Any] | None)] = \
        Field(default_factory=dict,
              description="The policy's parameters, typed per policy (e.g. {k: 2, metric: e2e} for astrolabe).")
    seed: Annotated[int, Field(strict=True)] | None = Field(
        None, description="Seeds the policy RNG; null = from os.urandom.")
    max_body_bytes: _PositiveInt = Field(
        8 * 1024 * 1024, description="Largest request body routed, bytes (>= 1); larger bodies get 413.")
    fallback_endpoints: Annotated[int, Field(strict=True, ge=0, le=7)] = Field(
        0, description="Endpoints listed after the chosen one in the destination (an ordered fallback list, "
                       "Endpoint Picker protocol v0.4: the other probed candidates best first, then the least "
                       "loaded), 0-7. Only for gateways that take a list (Envoy's override_host policy: "
                       "`astrolabe envoy --pool`; Envoy Gateway, GKE); an ORIGINAL_DST cluster takes one ip:port, "
                       "so keep 0 there.")
    drain_delay_s: _NonNegativeSeconds = Field(
        2.0, description="At shutdown, keep serving this long after readiness goes NOT_SERVING, seconds.")
    grace_period_s: _NonNegativeSeconds = Field(
        10.0, description="Then streams still being routed get at most this long, seconds.")
    metrics_listen: _OptionalHostPort = Field(
        None, description="host:port of the Prometheus /metrics endpoint; null = off.",
        json_schema_extra=_PORT_PATTERN)
    reload_interval_s: _PositiveSeconds = Field(
        1.0, description="How often the config file is checked for changes, seconds.")
    metrics_interval_s: _PositiveSeconds = Field(
        0.05, description="Interval between scrapes of each endpoint's /metrics, seconds (infaas, llumnix, gie).")
    metrics_staleness_s: _PositiveSeconds = Field(
        2.0, description="A scrape older than this counts as missing, seconds (GIE's default).")
    metrics_format: Literal[METRICS_FORMATS] = Field(  # type: ignore[valid-type]
        "auto", description="Which server's /metrics names the endpoints export: vllm, sglang, or auto (read each "
                            "scrape by the gauges it carries: a mixed pool works).")
    health_check: Annotated[HealthCheckConfig, BeforeValidator(_none_as(dict),
                                                               json_schema_input_type=HealthCheckConfig | None)] = \
        Field(default_factory=HealthCheckConfig, description="Active HTTP health checks of the endpoints.")
    discovery: Annotated[DiscoveryConfig, BeforeValidator(_none_as(dict),
                                                          json_schema_input_type=DiscoveryConfig | None)] = \
        Field(default_factory=DiscoveryConfig,
              description="Where the endpoints come from: the endpoints key, the Kubernetes API or DNS.")
    output_length: _OutputLength = Field(
        default_factory=OutputLengthConfig, description="Predicted output tokens sent to predictor sidecars.")
    predictor_client: _PredictorClient = Field(
        default_factory=PredictorClientConfig, description="Calls to the predictor sidecars.")
    tracing: _Tracing = Field(
        default_factory=TracingConfig,
        description="OpenTelemetry traces; off unless an endpoint is set here or by OTEL_* variables.")
    tls: ServerTlsConfig | None = Field(
        None, description="TLS (mutual with client_ca_file) of the ExternalProcessor gRPC server; null = plaintext.")
    predictor_tls: ClientTlsConfig | None = Field(
        None, description="TLS of the calls to the predictor sidecars (their `astrolabe predictor serve --tls-*` "
                          "flags); null = plaintext.")
    backend_tls: BackendTlsConfig | None = Field(
        None, description="HTTPS to the backends for health checks and /metrics scrapes (the backends serve TLS); "
                          "null = plain HTTP.")
    decision_log_path: _NonEmptyStr | None = Field(
        None, description="File that receives JSON lines, one record per routing decision; null = off.")
    log_level: Annotated[Literal[LOG_LEVELS], BeforeValidator(_log_level)] = Field(  # type: ignore[valid-type]
        DEFAULT_LOG_LEVEL, description="Least severe level logged (any case); the --log-level flag wins.")
    log_format: Literal[LOG_FORMATS] = Field(  # type: ignore[valid-type]
        DEFAULT_LOG_FORMAT,
        description="text, or json: one JSON object per line (time, level, logger, message, request_id and "
                    "trace_id while handling a request); the --log-format flag wins.")
    tokenizers: Annotated[dict[_NonEmptyStr, _NonEmptyStr],
                          BeforeValidator(_none_as(dict), json_schema_input_type=dict[str, str] | None)] = \
        Field(default_factory=dict,
              description="Served model name -> its tokenizer.json or model directory: prompt tokens are counted "
                          "as that model's engine counts them (chat: with its chat template); other models with "
                          "the shipped WordPiece.")
    prefix_cache: Annotated[PrefixCacheConfig, BeforeValidator(_none_as(dict),
                                                                json_schema_input_type=PrefixCacheConfig | None)] = \
        Field(default_factory=PrefixCacheConfig,
              description="The prompt's KV block keys, computed from its token ids and sent with predictions.")
    objectives: Annotated[ObjectivesConfig, BeforeValidator(_none_as(dict),
                                                            json_schema_input_type=ObjectivesConfig | None)] = \
        Field(default_factory=ObjectivesConfig,
              description="Latency objectives per request (headers, named objectives, defaults per model) and the "
                          "admission rule that refuses sheddable requests predicted to miss.")

    @field_validator("endpoints")
    @classmethod
    def _distinct_addresses(cls, endpoints: tuple[EndpointConfig, ...]) -> tuple[EndpointConfig, ...]:
        seen: set[str] = set()
        for i, endpoint in enumerate(endpoints):
            if endpoint.address in seen:
                raise _Located((i, "address"), f"duplicate {endpoint.address}")
            seen.add(endpoint.address)
        return endpoints

    def __post_init__(self) -> None:
        if self.discovery.source != "static" and self.endpoints:
            raise _Located(("endpoints",), f"must be empty when discovery.source is {self.discovery.source} (the "
                                           "endpoints are discovered)")


_ADAPTER = TypeAdapter(ExtprocConfig)

# Keys allowed at each path (list indices dropped), for unknown-key messages.
_CLASS_AT: dict[tuple[str, ...], type] = {
    (): ExtprocConfig, ("endpoints",): EndpointConfig, ("health_check",): HealthCheckConfig,
    ("output_length",): OutputLengthSection, ("predictor_client",): PredictorClientSection,
    ("tracing",): TracingSection, ("discovery",): DiscoveryConfig, ("tls",): ServerTlsConfig,
    ("predictor_tls",): ClientTlsConfig, ("backend_tls",): BackendTlsConfig, ("prefix_cache",): PrefixCacheConfig,
    ("objectives",): ObjectivesConfig, ("objectives", "named"): ObjectiveEntry,
    ("objectives", "models"): ObjectiveEntry, ("objectives", "default"): ObjectiveEntry,
}
_MAPPING_KEYS = ("health_check", "output_length", "predictor_client", "policy_params", "tokenizers", "tracing",
                 "discovery", "tls", "predictor_tls", "backend_tls", "prefix_cache", "objectives")
"""Root keys whose own keys an ``<SECTION>__<KEY>`` override may set."""


def config_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the YAML file, with a description (and unit) for every key.

    For Helm / ConfigMap validation. It cannot express the rules ``parse_config`` also checks: distinct
    endpoint addresses, parameters the chosen policy accepts, and the keys each discovery source needs.
    """
    discovered = {"required": ["discovery"], "properties": {"discovery": {
        "required": ["source"], "properties": {"source": {"enum": [s for s in DISCOVERY_SOURCES if s != "static"]}}}}}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **_ADAPTER.json_schema(),
            # endpoints: required with static discovery (the default), empty with the others.
            "if": {"not": discovered}, "then": {"required": ["endpoints"]},
            "else": {"properties": {"endpoints": {"maxItems": 0}}}}


# ---------------------------------------------------------------------------------------------------------------
# Errors


_TYPE_MESSAGES = {
    "float_type": "expected a number", "int_type": "expected an integer", "int_from_float": "expected an integer",
    "bool_type": "expected a boolean", "string_type": "expected a string", "tuple_type": "expected a list",
    "list_type": "expected a list", "dict_type": "expected a mapping", "dataclass_type": "expected a mapping",
    "dataclass_args_type": "expected a mapping", "model_type": "expected a mapping",
}
_UNKNOWN_KEY_TYPES = ("unexpected_keyword_argument", "extra_forbidden")


def _dotted(loc: tuple[int | str, ...]) -> str:
    """``('endpoints', 1, 'address')`` -> ``endpoints[1].address``; ``()`` -> ``<root>``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or ROOT


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _message(error: Mapping[str, Any]) -> tuple[tuple[int | str, ...], str]:
    """One pydantic error as (location, message tail)."""
    loc, kind, ctx = tuple(error["loc"]), error["type"], error.get("ctx") or {}
    if kind == "value_error":
        cause = ctx.get("error")
        if isinstance(cause, _Located):
            return loc + cause.sub_path, str(cause)
        return loc, str(cause) if cause is not None else error["msg"]
    if kind == "missing":
        return loc, "required"
    got = f", got {_short_repr(error['input'])}"
    if kind in _TYPE_MESSAGES:
        return loc, _TYPE_MESSAGES[kind] + got
    if kind == "greater_than":
        return loc, f"must be > {ctx['gt']:g}{got}"
    if kind == "greater_than_equal":
        return loc, f"must be >= {ctx['ge']:g}{got}"
    if kind == "less_than_equal":
        return loc, f"must be <= {ctx['le']:g}{got}"
    if kind == "string_too_short":
        return loc, "must not be empty"
    if kind == "literal_error":
        return loc, f"must be one of {ctx['expected']}{got}"
    return loc, error["msg"] + got


def _set_by(sources: Mapping[tuple[str, ...], str], *locs: tuple[int | str, ...]) -> str:
    """`` (set by VAR, ...)`` naming the environment variables that set one of ``locs`` or a key above it."""
    names = sorted({name for path, name in sources.items() for loc in locs
                    if loc[:len(path)] == path or path[:len(loc)] == loc})
    return f" (set by {', '.join(names)})" if names else ""


def _config_error(exc: ValidationError, sources: Mapping[tuple[str, ...], str]) -> ConfigError:
    """All of ``exc``'s errors, each ``dotted.path: message``, in order; unknown keys grouped per mapping."""
    entries: list[tuple[tuple[int | str, ...], str | None]] = []  # (location, message); None = unknown keys
    unknown: dict[tuple[int | str, ...], list[str]] = {}
    for error in exc.errors():
        if error["type"] in _UNKNOWN_KEY_TYPES:
            parent = tuple(error["loc"][:-1])
            if parent not in unknown:
                unknown[parent] = []
                entries.append((parent, None))
            unknown[parent].append(str(error["loc"][-1]))
        else:
            entries.append(_message(error))
    lines = []
    for loc, message in entries:
        if message is None:
            keys = sorted(unknown[loc])
            cls = _CLASS_AT.get(tuple(p for p in loc if isinstance(p, str)))
            allowed = f"; allowed: {sorted(f.name for f in dataclasses.fields(cls))}" if cls else ""
            set_by = _set_by(sources, *(loc + (key,) for key in keys))
            lines.append(f"{_dotted(loc)}: unknown key(s) {keys}{set_by}{allowed}")
        else:
            lines.append(f"{_dotted(loc)}: {message}{_set_by(sources, loc)}")
    return ConfigError("; ".join(lines))


# ---------------------------------------------------------------------------------------------------------------
# Loading


def _parse(raw: object, sources: Mapping[tuple[str, ...], str]) -> ExtprocConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{ROOT}: expected a mapping")
    discovery = raw.get("discovery")
    if "endpoints" not in raw and (not isinstance(discovery, Mapping) or discovery.get("source", "static") == "static"):
        raise ConfigError(f"endpoints: required (or set discovery.source to kubernetes or dns){_set_by(sources, ('endpoints',))}")
    try:
        config = _ADAPTER.validate_python(dict(raw))
    except ValidationError as exc:
        raise _config_error(exc, sources) from None
    try:  # policy name and params are checked by building the policy once
        build_policy(config.policy, config.policy_params, random.Random(0))
    except ValueError as exc:
        key = _policy_error_key(exc)
        raise ConfigError(f"{key}: {exc}{_set_by(sources, (key,))}") from None
    return config


def _policy_error_key(exc: ValueError) -> str:
    """The key a ``build_policy`` error is about: ``policy`` for an unknown name, else ``policy_params``."""
    return "policy" if str(exc).startswith("unknown policy") else "policy_params"


def parse_config(raw: object) -> ExtprocConfig:
    """Builds an ``ExtprocConfig`` from parsed YAML/JSON (no environment overrides).

    Raises:
        ConfigError: unknown key, wrong type, bad value, duplicate endpoint, no endpoints, a policy name or
            parameters the policy rejects.
    """
    return _parse(raw, {})


def replace_config(config: ExtprocConfig, **changes: Any) -> ExtprocConfig:
    """``config`` with ``changes`` (e.g. CLI flags, which win over file and environment), validated as a file is.

    ``dataclasses.replace`` validates too, but raises pydantic's ``ValidationError``; this raises ``ConfigError``.

    Raises:
        ConfigError: a changed value is invalid (message ``key: ...``), or the policy rejects its parameters.
    """
    try:
        new = dataclasses.replace(config, **changes)
    except ValidationError as exc:
        raise _config_error(exc, {}) from None
    except TypeError as exc:  # a name that is no field
        raise ConfigError(f"{ROOT}: {exc}") from None
    if new.policy != config.policy or new.policy_params != config.policy_params:
        try:
            build_policy(new.policy, new.policy_params, random.Random(0))
        except ValueError as exc:
            raise ConfigError(f"{_policy_error_key(exc)}: {exc}") from None
    return new


def changed_keys(old: ExtprocConfig, new: ExtprocConfig) -> list[str]:
    """The keys whose values differ, dotted, in field order: one per changed key of a section or a mapping
    (``predictor_client.predict_timeout_s``, ``policy_params.k``), ``endpoints`` and other keys whole."""
    keys = []
    for field in dataclasses.fields(ExtprocConfig):
        before, after = getattr(old, field.name), getattr(new, field.name)
        if before == after:
            continue
        if dataclasses.is_dataclass(before) and type(before) is type(after):
            keys += [f"{field.name}.{f.name}" for f in dataclasses.fields(before)
                     if getattr(before, f.name) != getattr(after, f.name)]
        elif isinstance(before, Mapping) and isinstance(after, Mapping):
            keys += [f"{field.name}.{key}" for key in sorted({*before, *after}, key=str)
                     if before.get(key) != after.get(key)]
        else:
            keys.append(field.name)
    return keys


_TOO_DEEP = object()
"""What `_safe_load` returns for YAML nested past Python's recursion limit."""


def _safe_load(text: str) -> object:
    """``yaml.safe_load(text)``, or `_TOO_DEEP` when it nests past the recursion limit. Returned, not raised: a
    ConfigError chained to the RecursionError would keep its ~1,000-frame traceback (and the half-built nesting)
    alive as long as a log record holds the error.

    Raises:
        yaml.YAMLError: the text is not YAML.
    """
    try:
        return yaml.safe_load(text)
    except RecursionError:
        return _TOO_DEEP


def _env_value(name: str, path: tuple[str, ...], text: str, structured: bool) -> object:
    """An override's value: YAML for ``structured`` keys, else one YAML scalar or the text itself."""
    try:
        value = _safe_load(text)
    except yaml.YAMLError as exc:
        if structured:
            raise ConfigError(f"{_dotted(path)}: invalid YAML (set by {name}): {' '.join(str(exc).split())}") \
                from None
        return text
    if value is _TOO_DEEP:
        raise ConfigError(f"{_dotted(path)}: invalid YAML (set by {name}): nested too deeply")
    if not structured and isinstance(value, (list, dict)):
        return text
    return value


def _with_env_overrides(raw: Mapping[str, Any], environ: Mapping[str, str]
                        ) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """``raw`` with the ``ASTROLABE_EXTPROC_*`` overrides applied, and the variable that set each key path.

    Raises:
        ConfigError: a variable name that is not ``<KEY>`` or ``<SECTION>__<KEY>``, a ``__`` key under a key
            that is not a section, or invalid YAML where a list or mapping is expected.
    """
    merged = dict(raw)
    sources: dict[tuple[str, ...], str] = {}
    names = sorted((n for n in environ if n.startswith(ENV_PREFIX)), key=lambda n: (ENV_NESTED_DELIMITER in n, n))
    for name in names:
        parts = tuple(name[len(ENV_PREFIX):].lower().split(ENV_NESTED_DELIMITER))
        if len(parts) > 2 or not all(parts):
            raise ConfigError(f"{name}: expected {ENV_PREFIX}<KEY> or {ENV_PREFIX}<SECTION>{ENV_NESTED_DELIMITER}"
                              "<KEY>")
        if len(parts) == 1:
            merged[parts[0]] = _env_value(name, parts, environ[name], parts[0] in _MAPPING_KEYS + ("endpoints",))
        else:
            section, key = parts
            if section not in _MAPPING_KEYS:
                raise ConfigError(f"{_dotted((section,))}: not a section, cannot set {key!r} (set by {name}); "
                                  f"sections: {sorted(_MAPPING_KEYS)}")
            current = merged.get(section)
            if current is None:
                current = {}
            if not isinstance(current, Mapping):
                raise ConfigError(f"{section}: expected a mapping, cannot set {key!r} (set by {name})")
            merged[section] = {**current, key: _env_value(name, parts, environ[name], False)}
        sources[parts] = name
    return merged, sources


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> ExtprocConfig:
    """Reads the YAML file at ``path``, applies the environment overrides, and validates the result.

    Args:
        path: the YAML file.
        environ: the environment whose ``ASTROLABE_EXTPROC_*`` variables override the file; None = os.environ.

    Raises:
        ConfigError: unreadable file, invalid YAML, a malformed override, or any error of ``parse_config``.
    """
    environ = os.environ if environ is None else environ
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc}") from None
    try:
        raw = _safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if raw is _TOO_DEEP:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply")
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{ROOT}: expected a mapping")
    try:
        merged, sources = _with_env_overrides(raw, environ)
        return _parse(merged, sources)
    except RecursionError:  # a value nested thousands deep (from the file or an override)
        pass
    raise ConfigError(f"{ROOT}: a value is nested too deeply")
