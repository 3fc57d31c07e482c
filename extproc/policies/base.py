"""The policy interface and what a policy may read about an endpoint.

NOTE: a policy is called on the event loop for every request; it must be O(number of endpoints) or better and
never block. Randomness comes only from the ``random.Random`` the registry injects (seeded from config).
"""

from __future__ import annotations

import abc
import random
from collections.abc import Callable, Mapping, Sequence
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
    """

    ttft_s: float
    e2e_s: float
    state_age_s: float = 0.0


@dataclass(frozen=True, slots=True)
class EndpointView:
    """A routable endpoint as policies see it.

    Attributes:
        address: ``ip:port``; also the identity of the endpoint.
        num_in_flight: requests this extproc replica routed there whose ext_proc stream has not ended yet.
        predictor: ``host:port`` of its predictor sidecar, or None.
        prediction: the sidecar's prediction for the request being routed; None when not asked or failed.
    """

    address: str
    num_in_flight: int = 0
    predictor: str | None = None
    prediction: Prediction | None = None


class Policy(abc.ABC):
    """Chooses one endpoint for a request. Subclasses set ``TYPE`` (the registry name).

    A policy that sets ``needs_predictions`` works in two steps around the router's I/O: ``candidates`` picks
    the endpoints whose sidecars are asked, the router fills ``EndpointView.prediction`` for them, and
    ``choose`` gets those candidates back.
    """

    TYPE: ClassVar[str]
    needs_predictions: ClassVar[bool] = False

    def candidates(self, request: RoutingRequest, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        """The endpoints ``choose`` will consider (default: all of them). Same contract for ``endpoints``."""
        return endpoints

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
