"""The only place where policy names map to factories."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

from extproc.policies import (
    dynamo_kv,
    gie,
    gie_prefix,
    infaas,
    least_requests,
    llmd_baseline,
    llumnix,
    min_qpm,
    power_of_k,
    random_choice,
    round_robin,
    sglang_cache_aware,
)
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
    gie_prefix.TYPE: gie_prefix.build,
    llmd_baseline.TYPE: llmd_baseline.build,
    llmd_baseline.PRECISE_TYPE: llmd_baseline.build_precise,
    sglang_cache_aware.TYPE: sglang_cache_aware.build,
    dynamo_kv.TYPE: dynamo_kv.build,
    dynamo_kv.PRECISE_TYPE: dynamo_kv.build_precise,
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
