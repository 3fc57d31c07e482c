"""``min-qpm``: the endpoint that this router sent the fewest requests within the last ``window_s`` seconds.

Rule: minimise ``EndpointView.num_recent_requests`` (dispatches by this extproc replica to the endpoint within
``window_s``, counted by the router from its own dispatch times). Ties: uniformly at random. Reads no backend
metrics and no predictions, so it never lacks an input; it balances request counts, not work (a long request
counts as much as a short one), and it ignores requests that already finished only after the window passes.
Source: the Min-QPM baseline of the Astrolabe artifact ("fewest requests in the last 60 s";
/work/shared/FACTS.md, "Baseline loads in that artifact").
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from extproc.policies.base import EndpointView, Policy, min_random_tie

TYPE = "min-qpm"


@dataclass(frozen=True, slots=True)
class Params:
    """``window_s``: length of the counting window, seconds (> 0; the reference uses 60)."""

    window_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.window_s, bool) or not isinstance(self.window_s, int | float) or not self.window_s > 0:
            raise ValueError(f"policy {TYPE!r}: window_s must be a number > 0, got {self.window_s!r}")


class MinQpmPolicy(Policy):
    TYPE = TYPE
    needs_block_keys = False  # load only: no prompt keys

    def __init__(self, params: Params, rng: random.Random) -> None:
        self.params = params
        self.recent_window_s = float(params.window_s)
        self._rng = rng

    def choose(self, request, endpoints: Sequence[EndpointView]) -> EndpointView:
        return min_random_tie(endpoints, lambda e: e.num_recent_requests, self._rng)


def build(params: Mapping[str, Any], rng: random.Random) -> MinQpmPolicy:
    unknown = set(params) - {"window_s"}
    if unknown:
        raise ValueError(f"policy {TYPE!r}: unknown parameter(s) {sorted(unknown)}; known: ['window_s']")
    return MinQpmPolicy(Params(**params), rng)
