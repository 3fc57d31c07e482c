"""The endpoint pool: configured endpoints, their health, and this replica's in-flight count per endpoint.

NOTE: everything here runs on the event loop thread; no locks. ``replace`` swaps the endpoint list atomically
(one attribute assignment) and keeps health and in-flight counts of addresses that stay, so a reload drops no
traffic: a request already routed keeps its destination, and its release still finds its counter.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Sequence

import aiohttp

from astrolabe.tls import BackendTls, backend_url, https_request_options
from extproc.config import EndpointConfig, HealthCheckConfig

logger = logging.getLogger(__name__)

SGLANG_HEALTH_PATHS = ("/health", "/health_generate")
SGLANG_HEALTH_S = 1.0
"""SGLang's ``/health`` (= ``/health_generate``) queues a one-token request and polls for its answer once a second
(python/sglang/srt/entrypoints/http_server.py ``health_generate``), so it answers after about 1 s: a check with a
timeout of 1 s or less fails against SGLang, and the first failure's warning says so."""


class EndpointPool:
    """Endpoints with health state and in-flight counters.

    Args:
        endpoints: the configured endpoints.
        new_endpoints_healthy: the health of an endpoint before its first check (at start and after a reload).
    """

    def __init__(self, endpoints: Sequence[EndpointConfig], new_endpoints_healthy: bool = True) -> None:
        self._new_endpoints_healthy = new_endpoints_healthy
        self._endpoints: tuple[EndpointConfig, ...] = ()
        self._addresses: dict[str, EndpointConfig] = {}
        self._healthy: dict[str, bool] = {}
        self._in_flight: dict[str, int] = {}
        # Dispatch times (router's monotonic clock, seconds) per address, oldest first, for min-qpm.
        self._dispatch_times_s: dict[str, collections.deque[float]] = {}
        self.replace(endpoints)

    @property
    def endpoints(self) -> tuple[EndpointConfig, ...]:
        """Configured endpoints, sorted by address."""
        return self._endpoints

    def replace(self, endpoints: Sequence[EndpointConfig]) -> None:
        """Installs a new endpoint list (a config reload)."""
        new = tuple(sorted(endpoints, key=lambda e: e.address))
        addresses = {e.address for e in new}
        self._healthy = {a: self._healthy.get(a, self._new_endpoints_healthy) for a in addresses}
        # Counters of removed endpoints stay until their requests end (release drops them at zero).
        self._in_flight = {a: n for a, n in self._in_flight.items() if a in addresses or n > 0}
        self._dispatch_times_s = {a: t for a, t in self._dispatch_times_s.items() if a in addresses}
        self._endpoints = new
        self._addresses = {e.address: e for e in new}

    def has(self, address: str) -> bool:
        """``address`` is one of the endpoints (O(1))."""
        return address in self._addresses

    def endpoint(self, address: str) -> EndpointConfig:
        """The endpoint at ``address``. Raises KeyError if there is none."""
        return self._addresses[address]

    def set_healthy(self, address: str, healthy: bool, reason: str = "") -> None:
        """Marks ``address`` healthy or not; a change is logged, with ``reason`` (why it failed) when given."""
        if address in self._healthy and self._healthy[address] != healthy:
            if healthy:
                logger.info("endpoint %s is now healthy", address)
            else:
                logger.warning("endpoint %s is now UNHEALTHY%s", address, f": {reason}" if reason else "")
            self._healthy[address] = healthy

    def is_healthy(self, address: str) -> bool:
        return self._healthy.get(address, False)

    def in_flight(self, address: str) -> int:
        """Engine requests routed to ``address`` by this replica that have not ended (a request with ``n`` choices,
        or several prompts, counts as that many: ``RoutingRequest.num_sequences``)."""
        return self._in_flight.get(address, 0)

    def acquire(self, address: str, count: int = 1) -> None:
        """``count`` more engine requests in flight on ``address``."""
        self._in_flight[address] = self._in_flight.get(address, 0) + count

    def release(self, address: str, count: int = 1) -> None:
        """``count`` engine requests on ``address`` ended (never below 0)."""
        remaining = self._in_flight.get(address, 0) - count
        if remaining > 0 or address in self._addresses:
            self._in_flight[address] = max(remaining, 0)
        else:
            self._in_flight.pop(address, None)

    def record_dispatch(self, address: str, now_s: float) -> None:
        """Notes that this replica dispatched a request to ``address`` at ``now_s`` (monotonic seconds)."""
        self._dispatch_times_s.setdefault(address, collections.deque()).append(now_s)

    def num_dispatched_since(self, address: str, since_s: float) -> int:
        """Dispatches to ``address`` at or after ``since_s``; older records are dropped (callers ask with a
        non-decreasing ``since_s`` per window, so nothing still needed is lost)."""
        times_s = self._dispatch_times_s.get(address)
        if not times_s:
            return 0
        while times_s and times_s[0] < since_s:
            times_s.popleft()
        return len(times_s)

    def serving(self, model: str | None) -> list[EndpointConfig]:
        """Endpoints (healthy or not) that serve ``model``; all of them when ``model`` is None."""
        if model is None:
            return list(self._endpoints)
        return [e for e in self._endpoints if not e.models or model in e.models]


MAX_CONCURRENT_CHECKS = 64
"""Health checks in flight at once; each one's ``timeout_s`` starts when it gets its slot (thousands of endpoints
checked in one burst would otherwise time out waiting for connections and the event loop, not for the endpoint)."""


class HealthChecker:
    """Polls ``GET http(s)://<address><path>`` on every endpoint; ``unhealthy_threshold`` consecutive failures
    (non-200 or timeout) mark it unhealthy, one success marks it healthy again.

    Args:
        pool: the pool whose health it maintains.
        config: path, interval, timeout and threshold.
        backend_tls: HTTPS to the endpoints (``astrolabe.tls.BackendTls``); None = plain HTTP.

    Raises:
        astrolabe.tls.TlsError: the CA file of ``backend_tls`` cannot be used.
    """

    def __init__(self, pool: EndpointPool, config: HealthCheckConfig, backend_tls: BackendTls | None = None) -> None:
        self._pool = pool
        self._config = config
        self._tls = backend_tls
        self._request_options = https_request_options(backend_tls)
        self._failures: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_CHECKS)
        self._checked: set[str] = set()
        self.first_round_done = asyncio.Event()

    def wake(self) -> None:
        """Starts the next round now (new endpoints were discovered: they serve after their first check)."""
        self._wake.set()

    async def _check(self, session: aiohttp.ClientSession, address: str) -> None:
        async with self._slots:  # the deadline counts from here: time spent queued is not the endpoint's fault
            problem = ""
            try:
                async with asyncio.timeout(self._config.timeout_s):
                    async with session.get(backend_url(address, self._config.path, self._tls),
                                           **self._request_options) as response:
                        ok = response.status == 200
                        problem = "" if ok else f"HTTP {response.status}"
            except TimeoutError:
                ok, problem = False, f"no answer within {self._config.timeout_s:g} s"
                if self._config.path in SGLANG_HEALTH_PATHS and self._config.timeout_s <= SGLANG_HEALTH_S:
                    problem += (f" (an SGLang server's {self._config.path} answers after about {SGLANG_HEALTH_S:g} s: "
                                "give health_check.timeout_s 3)")
            except (aiohttp.ClientError, OSError) as exc:
                ok, problem = False, f"{type(exc).__name__}: {exc}"
        if not ok and address not in self._checked and not self._pool.is_healthy(address):
            # Its first check failed: it has not served yet and would never say why (only changes are logged).
            logger.warning("endpoint %s fails its health check (GET %s): %s; it serves after its first passing "
                           "check", address, backend_url(address, self._config.path, self._tls), problem)
        elif not ok:
            logger.debug("endpoint %s: health check failed: %s", address, problem)
        self._checked.add(address)
        failures = 0 if ok else self._failures.get(address, 0) + 1
        self._failures[address] = failures
        if ok:
            self._pool.set_healthy(address, True)
        elif failures >= self._config.unhealthy_threshold:
            self._pool.set_healthy(address, False, f"{failures} failed health check(s) (GET {self._config.path}), "
                                                   f"the last: {problem}")

    async def run_once(self, session: aiohttp.ClientSession, only_new: bool = False) -> None:
        """Checks every endpoint once (``only_new``: those never checked yet), at most `MAX_CONCURRENT_CHECKS` at a
        time."""
        addresses = [e.address for e in self._pool.endpoints]
        current = set(addresses)
        self._checked &= current  # an endpoint that left and comes back is new again
        self._failures = {a: n for a, n in self._failures.items() if a in current}
        if only_new:
            addresses = [a for a in addresses if a not in self._checked]
        await asyncio.gather(*(self._check(session, a) for a in addresses))

    async def run(self) -> None:
        """Runs until cancelled: a round every ``interval_s``; after `wake`, the endpoints not checked yet at once."""
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=2)
        async with aiohttp.ClientSession(connector=connector) as session:
            loop = asyncio.get_running_loop()
            next_round_s = loop.time()
            while True:
                self._wake.clear()
                full = loop.time() >= next_round_s
                if full:
                    next_round_s = loop.time() + self._config.interval_s
                await self.run_once(session, only_new=not full)
                self.first_round_done.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(next_round_s - loop.time(), 0))
