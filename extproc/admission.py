"""Latency objectives per request and admission on predicted latency: which requests to refuse (429) before
they are sent.

Objectives (`extproc.objectives.Objectives`): a TTFT and a TPOT objective, seconds, and a priority (the Gateway API
Inference Extension's convention: an ``InferenceObjective``'s ``spec.priority``, negative = sheddable, 0 the
default). They come from the request's headers (`HeaderObjectives`: ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` and llm-d's
``x-llm-d-slo-ttft-ms`` / ``x-llm-d-slo-tpot-ms``; the objective's name from ``x-gateway-inference-objective`` or
llm-d's ``x-llm-d-inference-objective``) resolved against the configuration (`ObjectiveConfig`: named objectives
with their priority and objectives, and defaults per model). A header value that is not a plain decimal number
(digits, an optional point and exponent: no ``_``, hex or words), not finite, or not above 0 is ignored, as is a
header repeated with different values; one below `MIN_OBJECTIVE_S` or above `MAX_OBJECTIVE_S` is clamped; all are
counted (``astrolabe_extproc_objective_headers_invalid_total``). A header value can only TIGHTEN the objective the
configuration gives the request (the smaller of the two is kept; a header sets one only where the configuration
has none), and never sets a priority: a looser header would let a sheddable client escape refusal. Priority comes
from the configured objective the request names (``x-gateway-inference-objective``: the Inference Extension's
design, where the gateway, not the client, is expected to set that header; strip it at the gateway if clients are
not trusted to pick among the configured objectives), else its model's default, else the default.

Admission (`shed_reason`), decided on the probed candidates' predictions after the second round of probes, for
sheddable requests only (priority < 0; a request with priority >= 0 is never refused here: it goes to the best
candidate). Rules (`ADMISSION_RULES`):

- ``none``: never refuse.
- ``slo``: llm-d's ``latency-slo-admitter`` rule applied to our predictions: refuse when no candidate is predicted
  to meet the request's own objectives (`meets`) and none is idle (llm-d-router
  ``pkg/epp/framework/plugins/requestcontrol/admitter/latencyslo``: it admits when at least one endpoint has a
  prediction meeting the SLOs, is idle, or is cold).
- ``headroom`` (the default): the ``slo`` rule, and also refuse when the best candidate's predicted TTFT is past
  ``protect_ttft_s``. Refusing only what would miss its own (loose) objective lets sheddable work fill every queue
  up to that objective, and then every critical request behind it misses its tighter one: past the knee the
  ``slo`` rule lets queues grow to the sheddable objective (5 s in the benchmark) before it refuses anything. The
  headroom bound keeps the queues that sheddable work may build below what the critical class can stand
  (`ObjectiveConfig.protect_ttft_s`: by default half the tightest TTFT objective of a priority >= 0 objective).
  That bound alone still admits a sheddable request wherever a probed instance can start it at once, and past
  about 1.5x capacity the slots it takes (for the seconds its reply lasts) are the ones the next critical requests
  needed. So the rule also watches the critical side (`CriticalPressure`): for ``pressure_window_s`` after a
  request of priority >= 0 was predicted to wait past the bound on every candidate it probed, every sheddable
  request is refused. Measured: ``astrolabe bench goodput`` (bench/README.md "Objectives, admission and goodput").

Trust guard: a candidate with no request on it (its sidecar counts none and this replica sent it none the answer
lacks) admits the request whatever it predicts, as llm-d's admitter does for an idle endpoint: an empty instance
is where a model that mispredicts (a cold or restarted sidecar, one still on its prior calibration) would refuse
work for nothing. A decision with no prediction at all (every sidecar failed) never refuses: the fallback routes
it.

The choice itself (``extproc/policies/power_of_k.py``) prefers the candidates predicted to meet the request's
objectives, and asks the second round of probes also when no first-round candidate meets them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from extproc.objectives import NO_OBJECTIVES, Objectives
from extproc.policies.base import EndpointView

TTFT_HEADERS = ("x-slo-ttft-ms", "x-llm-d-slo-ttft-ms")
"""Headers of the TTFT objective, milliseconds, first present wins (llm-d-router's latency predictor reads both)."""
TPOT_HEADERS = ("x-slo-tpot-ms", "x-llm-d-slo-tpot-ms")
"""Headers of the TPOT objective, milliseconds (mean time per output token after the first)."""
OBJECTIVE_HEADERS = ("x-gateway-inference-objective", "x-llm-d-inference-objective")
"""Headers naming the request's objective (an ``InferenceObjective``: Gateway API Inference Extension; llm-d's
alias), first present wins; the name is looked up in `ObjectiveConfig.objectives`."""
_OBJECTIVE_HEADER_NAMES = frozenset((*TTFT_HEADERS, *TPOT_HEADERS, *OBJECTIVE_HEADERS))
MAX_OBJECTIVE_S = 3600.0
"""Largest objective kept, seconds; a larger header value is clamped to it (an hour: far past any request's
timeout), so that no value overflows a deadline computed from it."""
MIN_OBJECTIVE_S = 1e-6
"""Smallest objective kept, seconds (a microsecond); a smaller positive header value is clamped up to it, so that
no objective rounds to 0 s."""
_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)
"""A plain decimal number (what `float` reads, less its ``_`` separators, ``inf`` / ``nan`` words and non-ASCII
digits)."""
ADMISSION_RULES = ("none", "slo", "headroom")
"""`AdmissionParams.rule` values (module docstring)."""
SHED_SLO_UNREACHABLE = "slo_unreachable"
"""Refused: no probed candidate is predicted to meet the request's own objectives."""
SHED_HEADROOM = "headroom"
"""Refused: the best probed candidate's predicted TTFT is past the headroom bound kept for priority >= 0 work."""
SHED_PRESSURE = "critical_pressure"
"""Refused: a request of priority >= 0 was predicted to wait past the headroom bound on every candidate it probed
within the last ``pressure_window_s`` (`CriticalPressure`)."""
SHED_REASONS = (SHED_SLO_UNREACHABLE, SHED_HEADROOM, SHED_PRESSURE)
"""Every `shed_reason` but None (a bounded set: fit for metric labels and the drop-reason header)."""
DROP_REASON_HEADER = "x-astrolabe-drop-reason"
"""Response header of a refused request: its `SHED_REASONS` entry."""
DEFAULT_RETRY_AFTER_S = 1
"""``retry-after`` of a refused request, whole seconds (RFC 9110 10.2.3)."""
DEFAULT_PRESSURE_WINDOW_S = 2.0
"""`AdmissionParams.pressure_window_s`: measured with ``astrolabe bench goodput`` (bench/README.md "Objectives,
admission and goodput")."""


@dataclass(frozen=True, slots=True)
class HeaderObjectives:
    """What a request's headers say about its objectives (before the config resolves them).

    Attributes:
        ttft_s: the TTFT header's value, seconds (clamped), or None (absent or invalid).
        tpot_s: the TPOT header's value, seconds (clamped), or None.
        objective: the objective's name, or None.
        invalid: names of the headers whose value was ignored (not a number, not finite, <= 0, repeated with
            different values) or clamped.
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    objective: str | None = None
    invalid: tuple[str, ...] = ()


NO_HEADER_OBJECTIVES = HeaderObjectives()


def _header_ms(headers: Mapping[str, str], names: Sequence[str], invalid: list[str]) -> float | None:
    for name in names:
        text = headers.get(name)
        if text is None:
            continue
        text = text.strip()
        if not _DECIMAL.fullmatch(text):
            invalid.append(name)
            return None
        value_ms = float(text)
        if not math.isfinite(value_ms) or value_ms <= 0:
            invalid.append(name)
            return None
        value_s = value_ms / 1000.0
        if not MIN_OBJECTIVE_S <= value_s <= MAX_OBJECTIVE_S:
            invalid.append(name)
            return min(max(value_s, MIN_OBJECTIVE_S), MAX_OBJECTIVE_S)
        return value_s
    return None


def objective_header_values(pairs: Iterable[tuple[str, str]]) -> dict[str, str | None]:
    """The objective headers among a request's (lower-case name, value) pairs, in the form `header_objectives`
    takes: a header sent more than once with different values maps to None (RFC 9110 5.3 allows repeating only
    list-valued fields; these are single numbers or names, so which line to believe is unknowable)."""
    values: dict[str, str | None] = {}
    for name, value in pairs:
        if name in _OBJECTIVE_HEADER_NAMES:
            values[name] = value if values.setdefault(name, value) == value else None
    return values


def header_objectives(headers: Mapping[str, str | None]) -> HeaderObjectives:
    """The objectives a request's headers carry (module docstring). Never raises.

    Args:
        headers: lower-case header names -> values; a header sent more than once is the value ``None`` if its
            values differ (ignored and counted here), else its one value.
    """
    invalid: list[str] = [name for name in (*TTFT_HEADERS, *TPOT_HEADERS, *OBJECTIVE_HEADERS)
                          if name in headers and headers[name] is None]
    known: dict[str, str] = {name: value for name, value in headers.items() if value is not None}
    ttft_s = _header_ms(known, TTFT_HEADERS, invalid)
    tpot_s = _header_ms(known, TPOT_HEADERS, invalid)
    objective = next((known[name].strip() for name in OBJECTIVE_HEADERS if known.get(name, "").strip()), None)
    if ttft_s is None and tpot_s is None and objective is None and not invalid:
        return NO_HEADER_OBJECTIVES
    return HeaderObjectives(ttft_s, tpot_s, objective, tuple(invalid))


@dataclass(frozen=True, slots=True)
class ObjectiveConfig:
    """The config's objectives (``objectives`` section of the extproc config).

    Attributes:
        objectives: objective name -> its `Objectives` (the ``InferenceObjective`` names clients send).
        model_defaults: served model name -> the objectives of a request for it that names no known objective.
        default: the objectives of any other request (default: none, priority 0).
        protect_ttft_s: the ``headroom`` rule's bound, seconds; None = half the tightest TTFT objective of a
            priority >= 0 objective or model default (`protect_ttft_bound_s`), no bound when there is none.
    """

    objectives: Mapping[str, Objectives] = field(default_factory=dict)
    model_defaults: Mapping[str, Objectives] = field(default_factory=dict)
    default: Objectives = NO_OBJECTIVES
    protect_ttft_s: float | None = None

    def resolve(self, headers: HeaderObjectives, model: str | None) -> Objectives:
        """The request's objectives: the named objective (if configured), else its model's default, else the
        default; a header's TTFT / TPOT value only tightens that objective's (the smaller is kept; it sets one only
        where that objective has none), and priority never comes from a header."""
        base = self.objectives.get(headers.objective) if headers.objective is not None else None
        if base is None:
            base = self.model_defaults.get(model, self.default) if model is not None else self.default
        if headers.ttft_s is None and headers.tpot_s is None:
            return base
        return Objectives(_tighter(headers.ttft_s, base.ttft_s), _tighter(headers.tpot_s, base.tpot_s),
                          base.priority)

    def configured(self) -> tuple[Objectives, ...]:
        """Every configured `Objectives`: the named ones, the per-model defaults, the default."""
        return (*self.objectives.values(), *self.model_defaults.values(), self.default)

    def protect_ttft_bound_s(self) -> float | None:
        """The ``headroom`` rule's bound, seconds (``protect_ttft_s``, or its default), None = none."""
        if self.protect_ttft_s is not None:
            return self.protect_ttft_s
        tightest = [o.ttft_s for o in self.configured() if o.priority >= 0 and o.ttft_s is not None]
        return min(tightest) / 2 if tightest else None


def _tighter(header_s: float | None, configured_s: float | None) -> float | None:
    if header_s is None or configured_s is None:
        return configured_s if header_s is None else header_s
    return min(header_s, configured_s)


def predicted_ttft_s(endpoint: EndpointView) -> float:
    """The request's predicted TTFT on ``endpoint``, seconds, with this replica's dispatches there that the
    prediction lacks priced at ``Prediction.ttft_s_per_request``; ``endpoint.prediction`` must be set."""
    return endpoint.prediction.ttft_s + endpoint.num_unseen_dispatches * endpoint.prediction.ttft_s_per_request


def predicted_tpot_s(endpoint: EndpointView, num_output_tokens: int) -> float:
    """The request's predicted mean TPOT on ``endpoint``, seconds per token after the first:
    (E2E - TTFT) / (output tokens - 1), 0 for a one-token reply; ``endpoint.prediction`` must be set."""
    prediction = endpoint.prediction
    if num_output_tokens <= 1:
        return 0.0
    return max(prediction.e2e_s - prediction.ttft_s, 0.0) / (num_output_tokens - 1)


def meets(objectives: Objectives, endpoint: EndpointView, num_output_tokens: int) -> bool:
    """Whether ``endpoint``'s prediction meets ``objectives`` (every objective set; True when none is);
    ``endpoint.prediction`` must be set.

    Args:
        num_output_tokens: the request's predicted output tokens (for the TPOT).
    """
    if objectives.ttft_s is not None and predicted_ttft_s(endpoint) > objectives.ttft_s:
        return False
    return objectives.tpot_s is None or predicted_tpot_s(endpoint, num_output_tokens) <= objectives.tpot_s


def load(endpoint: EndpointView) -> int:
    """Requests on ``endpoint`` as a decision can know them: its sidecar's count (other routers' held requests
    included) and this replica's dispatches there that the count does not include, and never fewer than this
    replica's own requests in flight there (``num_in_flight``): a sidecar counting less under-reports (a bug, a
    restarted engine), and its count alone would let it escape the load bound (extproc/policies/power_of_k.py, "A
    bound on what one sidecar can pull"). ``endpoint.prediction`` must be set."""
    return max(endpoint.prediction.num_requests + endpoint.num_unseen_dispatches, endpoint.num_in_flight)


def is_idle(endpoint: EndpointView) -> bool:
    """No request on the candidate as this decision knows it (`load` 0); ``endpoint.prediction`` must be set."""
    return load(endpoint) == 0


@dataclass(frozen=True, slots=True)
class AdmissionParams:
    """How requests are refused (``admission`` section of the extproc config).

    Attributes:
        rule: one of `ADMISSION_RULES`.
        retry_after_s: ``retry-after`` of a refused request, whole seconds (>= 0).
        pressure_window_s: the ``headroom`` rule refuses every sheddable request for this long after a request of
            priority >= 0 was predicted to wait past the bound on every candidate it probed (`CriticalPressure`),
            seconds (>= 0; 0 = never).

    Raises:
        ValueError: an unknown rule or a bad ``retry_after_s`` or ``pressure_window_s``.
    """

    rule: str = "headroom"
    retry_after_s: int = DEFAULT_RETRY_AFTER_S
    pressure_window_s: float = DEFAULT_PRESSURE_WINDOW_S

    def __post_init__(self) -> None:
        if self.rule not in ADMISSION_RULES:
            raise ValueError(f"admission.rule must be one of {ADMISSION_RULES}, got {self.rule!r}")
        if isinstance(self.retry_after_s, bool) or not isinstance(self.retry_after_s, int) or self.retry_after_s < 0:
            raise ValueError(f"admission.retry_after_s must be an integer >= 0, got {self.retry_after_s!r}")
        if isinstance(self.pressure_window_s, bool) or not isinstance(self.pressure_window_s, int | float) \
                or not math.isfinite(self.pressure_window_s) or self.pressure_window_s < 0:
            raise ValueError(f"admission.pressure_window_s must be a finite number >= 0, got "
                             f"{self.pressure_window_s!r}")


class CriticalPressure:
    """When this router replica last saw a request of priority >= 0 predicted to wait past the headroom bound on
    every candidate it probed: while that is recent, sheddable requests are refused (`shed_reason`).

    Args:
        window_s: how long one such sighting keeps refusing sheddable requests, seconds (0 = never).
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._last_s = -math.inf

    def observe(self, objectives: Objectives, candidates: Sequence[EndpointView], now_s: float,
                protect_ttft_s: float | None) -> None:
        """Records the decision of a request at ``now_s`` (seconds, the router's clock) over ``candidates``."""
        if objectives.sheddable or protect_ttft_s is None or not self.window_s:
            return
        answered = [c for c in candidates if c.prediction is not None]
        if answered and min(predicted_ttft_s(c) for c in answered) > protect_ttft_s:
            self._last_s = now_s

    def active(self, now_s: float) -> bool:
        return now_s - self._last_s <= self.window_s


def shed_reason(objectives: Objectives, candidates: Sequence[EndpointView], num_output_tokens: int,
                rule: str, protect_ttft_s: float | None, under_pressure: bool = False) -> str | None:
    """Why the request should be refused (one of `SHED_REASONS`), or None to route it (module docstring).

    Args:
        objectives: the request's objectives; only a sheddable request (priority < 0) is ever refused.
        candidates: the probed candidates, both rounds; those without a prediction are left out.
        num_output_tokens: the request's predicted output tokens.
        rule: one of `ADMISSION_RULES`.
        protect_ttft_s: the ``headroom`` bound, seconds; None = the ``slo`` rule only.
        under_pressure: `CriticalPressure.active` (``headroom`` rule only).
    """
    if rule == "none" or not objectives.sheddable:
        return None
    answered = [c for c in candidates if c.prediction is not None]
    if not answered or any(is_idle(c) for c in answered):
        return None
    has_objective = objectives.ttft_s is not None or objectives.tpot_s is not None
    if has_objective and not any(meets(objectives, c, num_output_tokens) for c in answered):
        return SHED_SLO_UNREACHABLE
    if rule == "headroom" and protect_ttft_s is not None \
            and min(predicted_ttft_s(c) for c in answered) > protect_ttft_s:
        return SHED_HEADROOM
    if rule == "headroom" and under_pressure:
        return SHED_PRESSURE
    return None
