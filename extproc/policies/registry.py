"""The only place where policy names map to factories."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

from extproc.policies import gie, infaas, least_requests, llumnix, min_qpm, power_of_k, random_choice, round_robin
from extproc.policies.base import Policy

_FACTORIES: dict[str, Callable[[Mapping[str, Any], random.Random], Policy]] = {
    power_of_k.TYPE: power_of_k.build,
    random_choice.TYPE: random_choice.build,
    round_robin.TYPE: round_robin.build,
    least_requests.TYPE: least_requests.build,
    min_qpm.TYPE: min_qpm.build,
    infaas.TYPE: infaas.build,
    llumnix.TYPE: llumnix.build,
    gie.TYPE: gie.build,
}

POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)
"""Registered policy names, in registration order."""


def build_policy(name: str, params: Mapping[str, Any], rng: random.Random) -> Policy:
    """Builds the policy registered as ``name``.

    Raises:
        ValueError: unknown name, or parameters the policy rejects.
    """
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    return factory(params, rng)
