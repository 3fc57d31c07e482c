"""The policy interface and what a policy may read about an endpoint.

NOTE: a policy is called on the event loop for every request; it must be O(number of endpoints) or better and
never block. Randomness comes only from the ``random.Random`` the registry injects (seeded from config).
"""

from __future__ import annotations

import abc
import dataclasses
import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from extproc.request import RoutingRequest


@dataclass(frozen=True, slots=True)
class Prediction:
    """A predictor sidecar's answer for one request at one endpoint.

    Attributes:
        ttft_s: predicted time to first token, seconds from now.
        e2e_s: predicted end-to-end latency, seconds from now.
        state_age_s: age of the sidecar's state (since its last reconciliation), seconds.
        queue_s: the part of ``ttft_s`` that the requests already on the instance cause (waiting for a slot, KV
            blocks or token budget), seconds; 0 = it would start at once.
        num_requests: requests on the instance in the sidecar's state (running + waiting, requests held by
            concurrent Predicts included; ``PredictResponse.num_running + num_waiting``).
        model_error: how far the sidecar's step-time model is off on its instance's measured steps, a fraction
            (``PredictResponse.calibration_residual``: mean absolute relative error; 0 = not known).
        ttft_s_per_request: how much ``ttft_s`` grows per request like this one dispatched there before it,
            seconds (``PredictResponse.ttft_s_per_request``; 0 = not known).
        e2e_s_per_request: the same for ``e2e_s``, seconds.
        num_admits_seen: up to which of this router's Admits (their sequence number) the answer includes
            (``PredictResponse.admits_seen``); -1 = the sidecar does not say (protocol v1.0).
        idle_e2e_s: the request's E2E on the instance idle by the sidecar's model, seconds
            (``PredictResponse.idle_e2e_s``; ``ttft_s - queue_s`` is the same for TTFT); 0 = not known.
    """

    ttft_s: float
    e2e_s: float
    state_age_s: float = 0.0
    queue_s: float = 0.0
    num_requests: int = 0
    model_error: float = 0.0
    ttft_s_per_request: float = 0.0
    e2e_s_per_request: float = 0.0
    num_admits_seen: int = -1
    idle_e2e_s: float = 0.0


@dataclass(frozen=True, slots=True)
class EndpointMetrics:
    """An endpoint's last scraped engine metrics (vLLM ``/metrics`` gauges), as load-based policies read them.

    Attributes:
        num_requests_running: ``vllm:num_requests_running``.
        num_requests_waiting: ``vllm:num_requests_waiting``.
        kv_cache_usage_frac: ``vllm:kv_cache_usage_perc``, a fraction in [0, 1].
        num_free_blocks: free KV blocks, (1 - kv_cache_usage_frac) * num_gpu_blocks, rounded down.
        num_gpu_blocks: KV blocks of the instance (``vllm:cache_config_info``); 0 when the backend does not say.
        num_waiting_prompt_blocks: KV blocks the waiting requests' prompts need; None when unknown (vLLM's
            /metrics does not export it; only an in-engine exporter or the cluster simulator knows it).
        age_s: seconds between the scrape and the moment the policy reads it.
    """

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_frac: float
    num_free_blocks: int
    num_gpu_blocks: int
    num_waiting_prompt_blocks: int | None = None
    age_s: float = 0.0


@dataclass(frozen=True, slots=True)
class EndpointView:
    """A routable endpoint as policies see it.

    Attributes:
        address: ``ip:port``; also the identity of the endpoint.
        num_in_flight: requests this extproc replica routed there whose ext_proc stream has not ended yet.
        predictor: ``host:port`` of its predictor sidecar, or None.
        prediction: the sidecar's prediction for the request being routed; None when not asked or failed.
        metrics: the endpoint's scraped metrics when the policy ``needs_metrics`` and a fresh scrape exists;
            None otherwise (not scraped, scrape failed, or older than the staleness limit).
        num_recent_requests: requests this replica dispatched there within the policy's ``recent_window_s``.
        mean_in_flight: the mean ``num_in_flight`` over the healthy endpoints that serve the request.
        num_unseen_dispatches: requests this replica dispatched there that its sidecar's answer for this request
            does not include (``extproc/router.py``); a policy prices them with ``Prediction.*_per_request``;
            0 when not asked.
        num_prefix_blocks_cached: leading blocks of ``RoutingRequest.block_keys`` that the endpoint's last
            published state holds or caches (the router's view of its prefix cache); None = unknown (no state, or
            the request has no block keys).
        num_prefix_blocks_in_use: of those, the leading blocks that the state's requests (running or waiting) hold
            in their prompts: a prefix other requests there use now; None = unknown (as above).
    """

    address: str
    num_in_flight: int = 0
    predictor: str | None = None
    prediction: Prediction | None = None
    metrics: EndpointMetrics | None = None
    num_recent_requests: int = 0
    mean_in_flight: float = 0.0
    num_unseen_dispatches: int = 0
    num_prefix_blocks_cached: int | None = None
    num_prefix_blocks_in_use: int | None = None


class Policy(abc.ABC):
    """Chooses one endpoint for a request. Subclasses set ``TYPE`` (the registry name).

    A policy that sets ``needs_metrics`` gets ``EndpointView.metrics`` filled (None for an endpoint without a
    fresh scrape; such a policy must never fail on None). A policy that sets ``needs_predictions`` works in two steps around the router's I/O: ``candidates`` picks
    the endpoints whose sidecars are asked, the router fills ``EndpointView.prediction`` for them, and
    ``choose`` gets those candidates back.
    """

    TYPE: ClassVar[str]
    needs_predictions: ClassVar[bool] = False
    needs_metrics: ClassVar[bool] = False
    """True when ``choose`` reads ``EndpointView.metrics`` (the extproc then starts its metrics scraper)."""
    needs_block_keys: ClassVar[bool] = True
    """False when the policy reads neither ``RoutingRequest.block_keys`` nor ``EndpointView.num_prefix_blocks_cached``
    and predicts nothing: the router then does not tokenize its requests' prompts in full (``prefix_cache`` in the
    config; a load-only policy would pay for keys it never reads)."""
    recent_window_s: float = 60.0
    """Window of ``EndpointView.num_recent_requests``, seconds (only ``min-qpm`` reads it)."""

    def candidates(self, request: RoutingRequest, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        """The endpoints ``choose`` will consider (default: all of them). Same contract for ``endpoints``."""
        return endpoints

    def more_candidates(self, request: RoutingRequest, scored: Sequence[EndpointView],
                        endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        """A second round of probes, decided from the first round's predictions (default: none).

        Args:
            request: the request being routed.
            scored: the output of ``candidates`` with their predictions filled in.
            endpoints: every endpoint ``candidates`` chose from.

        Returns:
            Further endpoints (not in ``scored``) whose sidecars are asked before ``choose``, which then gets
            ``scored`` followed by them; empty for no second round.
        """
        return ()

    def on_finished(self, request: RoutingRequest, address: str) -> None:
        """``request``, routed to ``address`` by this policy object, has ended (its ext_proc stream closed, or in
        the cluster simulation its last token was produced). Default: nothing. Policies with their own
        bookkeeping of in-flight work (a cache-aware router's active blocks or tokens) release it here."""

    @abc.abstractmethod
    def choose(self, request: RoutingRequest, endpoints: Sequence[EndpointView]) -> EndpointView | None:
        """Picks the endpoint for ``request``.

        Args:
            request: the request being routed.
            endpoints: the output of ``candidates`` (healthy endpoints serving the request's model, never empty,
                in address order), with predictions filled in when ``needs_predictions``.

        Returns:
            One element of ``endpoints``, or None when the policy cannot decide (e.g. every prediction failed);
            the router then falls back to ``least-requests`` over all healthy endpoints.
        """


class LowestScorePolicy(Policy):
    """Picks the lowest ``score`` among endpoints with fresh metrics; ties at random; None (the router falls back
    to least-requests) when no endpoint has metrics. Subclasses define ``score``."""

    needs_metrics: ClassVar[bool] = True

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    @staticmethod
    @abc.abstractmethod
    def score(endpoint: EndpointView) -> float:
        """Lower is better; called only for endpoints whose ``metrics`` is not None."""

    def choose(self, request: RoutingRequest, endpoints: Sequence[EndpointView]) -> EndpointView | None:
        known = [e for e in endpoints if e.metrics is not None]
        return min_random_tie(known, self.score, self._rng) if known else None


T = TypeVar("T")


def min_random_tie(items: Sequence[T], key: Callable[[T], float], rng: random.Random) -> T:
    """The item with the smallest ``key``; ties broken uniformly at random with ``rng``.

    Raises:
        ValueError: ``items`` is empty.
    """
    if not items:
        raise ValueError("min_random_tie of an empty sequence")
    best = min(key(item) for item in items)
    return rng.choice([item for item in items if key(item) == best])


def reject_params(policy_type: str, params: Mapping[str, Any]) -> None:
    """For policies without parameters: any key is an error.

    Raises:
        ValueError: ``params`` is not empty.
    """
    if params:
        raise ValueError(f"policy {policy_type!r} takes no parameters, got {sorted(params)}")


P = TypeVar("P")


def reject_unknown_params(policy_type: str, params: Mapping[str, Any], known: Iterable[str]) -> None:
    """For policies with parameters: a key outside ``known`` is an error.

    Raises:
        ValueError: ``params`` has a key not in ``known``.
    """
    known = sorted(known)
    unknown = set(params) - set(known)
    if unknown:
        raise ValueError(f"policy {policy_type!r}: unknown parameter(s) {sorted(unknown)}; known: {known}")


def build_params(policy_type: str, params_type: Callable[..., P], params: Mapping[str, Any]) -> P:
    """``params_type(**params)`` for a dataclass of parameters that validates itself.

    Raises:
        ValueError: a key that is not a field of ``params_type``, or what ``params_type`` raises.
    """
    reject_unknown_params(policy_type, params, (f.name for f in dataclasses.fields(params_type)))
    return params_type(**params)


def check_number(policy_type: str, name: str, value: Any, low: float, high: float = math.inf, *,
                 integer: bool = False, low_open: bool = False) -> None:
    """A parameter must be a finite number (an integer when ``integer``) in [low, high] ((low, high] when
    ``low_open``).

    Raises:
        ValueError: it is not, with the parameter's name and value.
    """
    kinds = int if integer else int | float
    if (isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value)
            or value < low or value > high or (low_open and value == low)):
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"policy {policy_type!r}: {name} must be {'an integer' if integer else 'a number'} in "
                         f"{bounds}, got {value!r}")
