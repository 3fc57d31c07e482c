"""Protocol-free routing: ``RoutingRequest`` -> ``Decision``, using the pool and the configured policy.

Failure policy (the only place it is decided):
- the requested model is served by no configured endpoint -> MODEL_NOT_FOUND (404);
- endpoints serve it but none is healthy -> NO_HEALTHY_ENDPOINT (503).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from extproc.errors import ErrorCode, RoutingError
from extproc.metrics import ExtprocMetrics
from extproc.policies.base import EndpointView, Policy
from extproc.pool import EndpointPool
from extproc.request import RoutingRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes.

    Attributes:
        destination: ``ip:port`` written to the destination header and ``envoy.lb`` metadata.
        policy: name of the policy that chose it.
    """

    destination: str
    policy: str


class Router:
    """Chooses endpoints and counts each replica's in-flight requests.

    Args:
        pool: the endpoint pool (shared with the health checker and config reloads).
        policy: the dispatch policy.
        metrics: where routing time and outcomes are counted (a private registry if None).
    """

    def __init__(self, pool: EndpointPool, policy: Policy, metrics: ExtprocMetrics | None = None) -> None:
        self.pool = pool
        self.policy = policy
        self.metrics = metrics or ExtprocMetrics(pool)

    async def route(self, request: RoutingRequest) -> Decision:
        """Chooses the destination and counts the request in flight there until ``release``.

        Raises:
            RoutingError: MODEL_NOT_FOUND or NO_HEALTHY_ENDPOINT.
        """
        start_s = time.monotonic()
        serving = self.pool.serving(request.model)
        if not serving:
            raise RoutingError(ErrorCode.MODEL_NOT_FOUND,
                               f"The model `{request.model}` does not exist.", "model")
        views = [EndpointView(e.address, self.pool.in_flight(e.address))
                 for e in serving if self.pool.is_healthy(e.address)]
        if not views:
            raise RoutingError(ErrorCode.NO_HEALTHY_ENDPOINT,
                               f"no healthy endpoint serves model {request.model!r}" if request.model
                               else "no healthy endpoint")
        chosen = self.policy.choose(request, views)
        self.pool.acquire(chosen.address)
        self.metrics.routing_seconds.observe(time.monotonic() - start_s)
        self.metrics.requests.labels("routed").inc()
        logger.debug("request %s -> %s (%s)", request.request_id, chosen.address, self.policy.TYPE)
        return Decision(chosen.address, self.policy.TYPE)

    def release(self, decision: Decision) -> None:
        """The request routed by ``decision`` has ended (its ext_proc stream closed)."""
        self.pool.release(decision.destination)
