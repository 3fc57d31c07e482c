"""``infaas``: INFaaS++, the endpoint with the most free KV blocks per running request.

Rule: score = -num_free_blocks / max(num_requests_running, 1) from the endpoint's last scraped metrics; choose
the smallest score. Ties: uniformly at random.
Inputs: ``EndpointView.metrics`` (scraped every ``metrics_interval_s``, so up to one interval stale; many
requests routed within one interval all see the same numbers and go to the same endpoint).
Missing metrics: an endpoint whose metrics are None (never scraped, failed, stale) is treated as unknown and
never chosen while another endpoint has metrics; when none has, returns None and the router falls back to
``least-requests``.
Source: the INFaaS++ baseline of the Astrolabe artifact (/work/shared/FACTS.md, "Baseline loads in that
artifact"), after INFaaS (Romero et al., USENIX ATC 2021).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from extproc.policies.base import EndpointView, LowestScorePolicy, reject_params

TYPE = "infaas"


def score(endpoint: EndpointView) -> float:
    """-free blocks / max(running, 1); lower is better. Raises AttributeError if metrics is None."""
    m = endpoint.metrics
    return -m.num_free_blocks / max(m.num_requests_running, 1)


class InfaasPolicy(LowestScorePolicy):
    TYPE = TYPE
    needs_block_keys = False  # load only: no prompt keys
    score = staticmethod(score)


def build(params: Mapping[str, Any], rng: random.Random) -> InfaasPolicy:
    reject_params(TYPE, params)
    return InfaasPolicy(rng)
