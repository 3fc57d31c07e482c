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
class EndpointView:
    """A routable endpoint as policies see it.

    Attributes:
        address: ``ip:port``; also the identity of the endpoint.
        num_in_flight: requests this extproc replica routed there whose ext_proc stream has not ended yet.
    """

    address: str
    num_in_flight: int = 0


class Policy(abc.ABC):
    """Chooses one endpoint for a request. Subclasses set ``TYPE`` (the registry name)."""

    TYPE: ClassVar[str]

    @abc.abstractmethod
    def choose(self, request: RoutingRequest, endpoints: Sequence[EndpointView]) -> EndpointView:
        """Picks the endpoint for ``request``.

        Args:
            request: the request being routed.
            endpoints: healthy endpoints that serve the request's model; never empty; stable order (by address).

        Returns:
            One element of ``endpoints``.
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
