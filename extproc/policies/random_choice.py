"""``random``: uniform random choice among healthy endpoints.

Reads nothing about the endpoints; cannot herd, ignores load. Ties: not applicable.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from extproc.policies.base import EndpointView, Policy, reject_params

TYPE = "random"


class RandomPolicy(Policy):
    TYPE = TYPE
    needs_block_keys = False  # load only: no prompt keys

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, request, endpoints: Sequence[EndpointView]) -> EndpointView:
        return self._rng.choice(endpoints)


def build(params: Mapping[str, Any], rng: random.Random) -> RandomPolicy:
    reject_params(TYPE, params)
    return RandomPolicy(rng)
