"""Extproc configuration: one YAML file, loaded into frozen dataclasses; unknown keys are errors.

Example (every key but ``endpoints`` is optional; defaults shown)::

    listen: 127.0.0.1:9002          # gRPC address of the ExternalProcessor service
    policy: astrolabe               # astrolabe | random | round-robin | least-requests | min-qpm | infaas |
                                    # llumnix | gie
    policy_params: {}               # typed per policy, e.g. {k: 2, metric: e2e} for astrolabe
    output_length:                  # predicted output tokens sent to predictors (extproc/lengths.py)
      source: tagger                # tagger | fixed | oracle
      fixed_tokens: 256             # the estimate for 'fixed' (capped by the request's max_tokens)
      tagger_path: null             # a trained tagger directory for 'tagger' (null = the shipped light tagger)
    predictor_client:               # calls to predictor sidecars (extproc/predictor_client.py)
      predict_timeout_s: 0.02       # deadline of one Predict; a late sidecar is dropped for this request
      notify_timeout_s: 0.5         # deadline of Admit / Release (fire and forget)
      min_backoff_s: 0.5            # a failing sidecar is skipped this long, doubling per failure
      max_backoff_s: 10.0
    seed: null                      # seeds the policy RNG; null = from os.urandom
    max_body_bytes: 8388608         # larger request bodies get 413
    drain_delay_s: 2.0              # at shutdown, keep serving this long after readiness goes NOT_SERVING
    grace_period_s: 10.0            # then streams still being routed get at most this long
    metrics_listen: null            # host:port for Prometheus /metrics (null = off)
    reload_interval_s: 1.0          # how often the file is checked for changes (endpoints reload live)
    metrics_interval_s: 0.05        # endpoint /metrics scrape interval (only for infaas | llumnix | gie)
    metrics_staleness_s: 2.0        # an older scrape counts as missing (GIE's default)
    health_check:                   # active HTTP health checks of the endpoints
      enabled: true
      path: /health
      interval_s: 2.0
      timeout_s: 1.0
      unhealthy_threshold: 2        # consecutive failures before an endpoint leaves the pool
    endpoints:
      - address: 10.0.0.5:8000      # ip:port of a vLLM (or compatible) OpenAI server
        models: [llama-2-7b]        # served model names; empty = serves any model
        predictor: 10.0.0.5:9100    # predictor sidecar beside it (optional)

All errors raise ``ConfigError`` whose message starts with the dotted path of the offending key.
"""

from __future__ import annotations

import ipaddress
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from extproc.lengths import OutputLengthConfig
from extproc.policies.registry import build_policy
from extproc.predictor_client import PredictorClientConfig


class ConfigError(ValueError):
    """Invalid configuration; the message names the key, e.g. ``endpoints[1].address: ...``."""


@dataclass(frozen=True, slots=True)
class HealthCheckConfig:
    """Active health checks of endpoints (HTTP GET ``path``; 200 = healthy)."""

    enabled: bool = True
    path: str = "/health"
    interval_s: float = 2.0
    timeout_s: float = 1.0
    unhealthy_threshold: int = 2

    def __post_init__(self) -> None:
        if not self.path.startswith("/"):
            raise ValueError("path: must start with '/'")
        if self.unhealthy_threshold < 1:
            raise ValueError("unhealthy_threshold: must be >= 1")


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    """One backend instance.

    Attributes:
        address: ``ip:port`` (IPv6 as ``[::1]:8000``), as Envoy's ORIGINAL_DST cluster needs an IP.
        models: served model names; empty means the endpoint accepts any model.
        predictor: ``host:port`` of its predictor sidecar, or None.
    """

    address: str
    models: tuple[str, ...] = ()
    predictor: str | None = None


@dataclass(frozen=True, slots=True)
class ExtprocConfig:
    """The whole extproc configuration (see the module docstring for the YAML form)."""

    endpoints: tuple[EndpointConfig, ...]
    listen: str = "127.0.0.1:9002"
    policy: str = "astrolabe"
    policy_params: Mapping[str, Any] = field(default_factory=dict)
    seed: int | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    drain_delay_s: float = 2.0
    grace_period_s: float = 10.0
    metrics_listen: str | None = None
    reload_interval_s: float = 1.0
    metrics_interval_s: float = 0.05
    metrics_staleness_s: float = 2.0
    health_check: HealthCheckConfig = field(default_factory=HealthCheckConfig)
    output_length: OutputLengthConfig = field(default_factory=OutputLengthConfig)
    predictor_client: PredictorClientConfig = field(default_factory=PredictorClientConfig)


def parse_ip_port(value: object, where: str) -> str:
    """Validates ``ip:port`` and returns it normalised (IPv6 bracketed).

    Raises:
        ConfigError: not a string of the form ``ip:port`` with a literal IP and a port in 1..65535.
    """
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(f"{where}: expected 'ip:port', got {value!r}")
    host, _, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"{where}: {host!r} is not an IP address (Envoy's ORIGINAL_DST needs one)") from None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{where}: port {port!r} is not in 1..65535")
    return f"[{ip}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"


def _check_keys(raw: Mapping, cls: type, where: str) -> None:
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def _typed(raw: Mapping, key: str, types: type | tuple[type, ...], where: str, default: Any) -> Any:
    value = raw.get(key, default)
    if value is default:
        return value
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ConfigError(f"{where}.{key}: expected {types}, got a boolean")
    if not isinstance(value, types):
        raise ConfigError(f"{where}.{key}: expected {getattr(types, '__name__', types)}, got {value!r}")
    return value


def _positive(value: float, where: str) -> float:
    if value <= 0:
        raise ConfigError(f"{where}: must be > 0, got {value}")
    return value


def _flat_section(raw: object, cls: type, where: str) -> Any:
    """Builds a dataclass of scalar fields, each typed like its default (None default = optional string).

    Rules shared by every section: ``*_s`` durations and ``*_tokens`` counts must be > 0.
    """
    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    _check_keys(raw, cls, where)
    defaults = cls()
    values = {}
    for f in fields(cls):
        default = getattr(defaults, f.name)
        types = (str,) if default is None else (int, float) if isinstance(default, float) else (type(default),)
        value = _typed(raw, f.name, types, where, default)
        if isinstance(default, float):
            value = float(value)
        if value is not None and (f.name.endswith("_s") or f.name.endswith("_tokens")):
            _positive(value, f"{where}.{f.name}")
        values[f.name] = value
    try:
        return cls(**values)
    except ValueError as exc:
        raise ConfigError(f"{where}.{exc}") from None


def _endpoint(raw: object, where: str) -> EndpointConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping with 'address'")
    _check_keys(raw, EndpointConfig, where)
    if "address" not in raw:
        raise ConfigError(f"{where}.address: required")
    models = raw.get("models") or []
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise ConfigError(f"{where}.models: expected a list of non-empty strings")
    predictor = raw.get("predictor")
    if predictor is not None and (not isinstance(predictor, str) or ":" not in predictor):
        raise ConfigError(f"{where}.predictor: expected 'host:port', got {predictor!r}")
    return EndpointConfig(parse_ip_port(raw["address"], f"{where}.address"), tuple(models), predictor)


def parse_config(raw: object) -> ExtprocConfig:
    """Builds an ``ExtprocConfig`` from parsed YAML/JSON.

    Raises:
        ConfigError: unknown key, wrong type, bad value, duplicate endpoint, no endpoints.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError("<root>: expected a mapping")
    _check_keys(raw, ExtprocConfig, "<root>")
    endpoints_raw = raw.get("endpoints")
    if not isinstance(endpoints_raw, list):
        raise ConfigError("endpoints: required, a list of {address, models, predictor}")
    endpoints = tuple(_endpoint(e, f"endpoints[{i}]") for i, e in enumerate(endpoints_raw))
    seen: set[str] = set()
    for i, e in enumerate(endpoints):
        if e.address in seen:
            raise ConfigError(f"endpoints[{i}].address: duplicate {e.address}")
        seen.add(e.address)
    d = ExtprocConfig(endpoints=())
    listen = _typed(raw, "listen", str, "<root>", d.listen)
    if listen.rpartition(":")[2].isdigit() is False:
        raise ConfigError(f"listen: expected 'host:port', got {listen!r}")
    metrics_listen = _typed(raw, "metrics_listen", str, "<root>", d.metrics_listen)
    if metrics_listen is not None and not metrics_listen.rpartition(":")[2].isdigit():
        raise ConfigError(f"metrics_listen: expected 'host:port', got {metrics_listen!r}")
    params = raw.get("policy_params") or {}
    if not isinstance(params, Mapping):
        raise ConfigError("policy_params: expected a mapping")
    max_body = _typed(raw, "max_body_bytes", int, "<root>", d.max_body_bytes)
    if max_body < 1:
        raise ConfigError("max_body_bytes: must be >= 1")
    config = ExtprocConfig(
        endpoints=endpoints,
        listen=listen,
        policy=_typed(raw, "policy", str, "<root>", d.policy),
        policy_params=dict(params),
        seed=_typed(raw, "seed", int, "<root>", d.seed),
        max_body_bytes=max_body,
        metrics_listen=metrics_listen,
        drain_delay_s=float(_typed(raw, "drain_delay_s", (int, float), "<root>", d.drain_delay_s)),
        grace_period_s=float(_typed(raw, "grace_period_s", (int, float), "<root>", d.grace_period_s)),
        reload_interval_s=_positive(float(_typed(raw, "reload_interval_s", (int, float), "<root>",
                                                 d.reload_interval_s)), "reload_interval_s"),
        metrics_interval_s=_positive(float(_typed(raw, "metrics_interval_s", (int, float), "<root>",
                                                  d.metrics_interval_s)), "metrics_interval_s"),
        metrics_staleness_s=_positive(float(_typed(raw, "metrics_staleness_s", (int, float), "<root>",
                                                   d.metrics_staleness_s)), "metrics_staleness_s"),
        health_check=_flat_section(raw.get("health_check"), HealthCheckConfig, "health_check"),
        output_length=_flat_section(raw.get("output_length"), OutputLengthConfig, "output_length"),
        predictor_client=_flat_section(raw.get("predictor_client"), PredictorClientConfig, "predictor_client"),
    )
    try:  # policy name and params are checked by building the policy once
        build_policy(config.policy, config.policy_params, random.Random(0))
    except ValueError as exc:
        raise ConfigError(f"policy: {exc}") from None
    return config


def load_config(path: str | Path) -> ExtprocConfig:
    """Reads and validates the YAML file at ``path``.

    Raises:
        ConfigError: unreadable file, invalid YAML, or any error of ``parse_config``.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    return parse_config(raw)
