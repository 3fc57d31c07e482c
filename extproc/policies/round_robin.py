"""``round-robin``: endpoints in turn, in address order.

The cursor is a counter modulo the current number of endpoints, so a pool reload shifts the rotation but
never skips the pool. Each extproc replica rotates on its own (no shared state).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from extproc.policies.base import EndpointView, Policy, reject_params

TYPE = "round-robin"


class RoundRobinPolicy(Policy):
    TYPE = TYPE
    needs_block_keys = False  # load only: no prompt keys

    def __init__(self, rng: random.Random) -> None:
        # Random start so that several replicas do not send their first requests to the same endpoint.
        self._next = rng.randrange(1 << 16)

    def choose(self, request, endpoints: Sequence[EndpointView]) -> EndpointView:
        endpoint = endpoints[self._next % len(endpoints)]
        self._next += 1
        return endpoint


def build(params: Mapping[str, Any], rng: random.Random) -> RoundRobinPolicy:
    reject_params(TYPE, params)
    return RoundRobinPolicy(rng)
