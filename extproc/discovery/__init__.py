"""Endpoint discovery: keeps the endpoint pool's list current from the Kubernetes API or DNS.

A source runs as one task of the extproc (``run``) and hands every new endpoint list, whole, to ``publish``; the
server installs it in the pool (``EndpointPool.replace``: requests in flight keep their destination and their
in-flight counter). The first ``publish`` marks the first sync: the extproc reports ready only after it. A source
never raises out of ``run`` for an API or DNS failure: it logs it, keeps the last list and retries with
`Backoff`. ``discovery.source: static`` has no source: the ``endpoints`` key (reloaded live) is the list.

Modules: ``extproc.discovery.kubernetes`` (pods by label selector or InferencePool, watched),
``extproc.discovery.dns`` (a headless Service's A/AAAA records, re-resolved).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Protocol

from extproc.config import DiscoveryConfig, EndpointConfig

Publish = Callable[[tuple[EndpointConfig, ...]], None]
"""Receives the whole discovered endpoint list (sorted by address) each time it changes."""

MIN_RETRY_S = 0.5
"""First wait after a failed list, watch or lookup, seconds (+-`JITTER`); doubles per failure in a row ..."""
MAX_RETRY_S = 30.0
"""... up to this, seconds."""


class EndpointSource(Protocol):
    """A discovery source (``extproc.discovery.kubernetes.KubernetesSource``, ``extproc.discovery.dns.DnsSource``)."""

    async def run(self, publish: Publish) -> None:
        """Discovers until cancelled, calling ``publish`` with the full list at the first sync and on each change."""


JITTER = 0.2
"""Each delay is drawn uniformly within +-20% of its nominal value, so that picker replicas that failed together
do not retry in lockstep."""


class Backoff:
    """Retry delays: `MIN_RETRY_S` doubling per failure in a row up to `MAX_RETRY_S` (each +-`JITTER`); ``reset``
    after a success."""

    def __init__(self, min_s: float = MIN_RETRY_S, max_s: float = MAX_RETRY_S) -> None:
        self._min_s = min_s
        self._max_s = max_s
        self._next_s = min_s

    def next_s(self) -> float:
        """The delay before the next attempt, seconds (and doubles the one after)."""
        delay_s = self._next_s * random.uniform(1 - JITTER, 1 + JITTER)
        self._next_s = min(self._next_s * 2, self._max_s)
        return delay_s

    def reset(self) -> None:
        self._next_s = self._min_s


def endpoint_address(ip: str, port: int) -> str:
    """``ip:port`` as the pool and Envoy's ORIGINAL_DST want it (IPv6 bracketed)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def build_source(config: DiscoveryConfig) -> EndpointSource | None:
    """The source ``config.source`` names; None for ``static``.

    Raises:
        ConfigError: the source cannot be set up (e.g. no kubeconfig and not in a cluster).
    """
    if config.source == "kubernetes":
        from extproc.discovery.kubernetes import KubernetesSource

        return KubernetesSource(config)
    if config.source == "dns":
        from extproc.discovery.dns import DnsSource

        return DnsSource(config)
    return None
