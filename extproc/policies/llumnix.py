"""``llumnix``: Llumnix-, the endpoint with the most free KV blocks per running request after its queue.

Rule: score = -(num_free_blocks - num_waiting_prompt_blocks) / max(num_requests_running, 1) from the endpoint's
last scraped metrics; choose the smallest score. Ties: uniformly at random.
Inputs: ``EndpointView.metrics``. ``num_waiting_prompt_blocks`` is not exported by vLLM's /metrics: when it is
None it counts as 0 and the rule equals ``infaas`` (the cluster benchmark fills it from the simulated engine's
waiting queue, as Llumnix's in-engine llumlet would).
Missing metrics: as ``infaas``: endpoints with None are never chosen while another has metrics; when none has,
returns None and the router falls back to ``least-requests``.
Source: the Llumnix- baseline of the Astrolabe artifact (/work/shared/FACTS.md, "Baseline loads in that
artifact"): Llumnix's dispatch load (Sun et al., OSDI 2024) without its live migration.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from extproc.policies.base import EndpointView, LowestScorePolicy, reject_params

TYPE = "llumnix"


def score(endpoint: EndpointView) -> float:
    """-(free - waiting prompt blocks) / max(running, 1); lower is better. Raises AttributeError on None metrics."""
    m = endpoint.metrics
    num_waiting_blocks = m.num_waiting_prompt_blocks or 0
    return -(m.num_free_blocks - num_waiting_blocks) / max(m.num_requests_running, 1)


class LlumnixPolicy(LowestScorePolicy):
    TYPE = TYPE
    needs_block_keys = False  # load only: no prompt keys
    score = staticmethod(score)


def build(params: Mapping[str, Any], rng: random.Random) -> LlumnixPolicy:
    reject_params(TYPE, params)
    return LlumnixPolicy(rng)
