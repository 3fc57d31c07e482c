"""``least-requests``: the endpoint with the fewest requests in flight from this extproc replica.

Input: ``EndpointView.num_in_flight``, counted by the router from dispatch until the request's ext_proc stream
ends (Envoy closes that stream when the HTTP request ends, including after a streamed response or a client
disconnect). It does not see traffic from other replicas or other routers. Ties: uniformly at random.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from extproc.policies.base import EndpointView, Policy, min_random_tie, reject_params

TYPE = "least-requests"


class LeastRequestsPolicy(Policy):
    TYPE = TYPE
    needs_block_keys = False  # load only: no prompt keys

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, request, endpoints: Sequence[EndpointView]) -> EndpointView:
        return min_random_tie(endpoints, lambda e: e.num_in_flight, self._rng)


def build(params: Mapping[str, Any], rng: random.Random) -> LeastRequestsPolicy:
    reject_params(TYPE, params)
    return LeastRequestsPolicy(rng)
