"""Scrapes every endpoint's ``/metrics`` (vLLM or SGLang) at an interval, for the policies that read engine load.

Owns ``MetricsScraper``: one background task that GETs ``http://<address>/metrics`` of every configured endpoint
every ``interval_s`` (GIE's default refresh is 50 ms), parses it with ``predictor.backend_metrics`` (the
project's only backend /metrics reader: vLLM's names, SGLang's, or either by what the text carries,
``metrics_format``) and keeps the last good scrape per endpoint with its ``time.monotonic()`` time.
``get(address)`` returns it as an ``EndpointMetrics`` only while it is younger than ``staleness_s`` (GIE: 2 s);
otherwise None, and the policies treat that endpoint as unknown.
Started by ``extproc.server`` only when the configured policy sets ``needs_metrics``.

NOTE: derived fields. ``num_free_blocks = floor((1 - kv_cache_usage_frac) * num_gpu_blocks)`` with
``num_gpu_blocks`` from ``vllm:cache_config_info`` (SGLang: its KV pages, from ``sglang:cache_config_info`` or, as
SGLang 0.5.23 exports them, the ``sglang:num_pages`` gauge; 0 when the backend exports neither, so free blocks read
0). ``num_waiting_prompt_blocks`` is always None: neither vLLM nor SGLang exports per-request queue detail, and the
router's own dispatch records cannot tell which of its requests are still waiting; ``llumnix`` then counts it as 0.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import aiohttp

from astrolabe.tls import BackendTls, backend_url, https_request_options
from extproc.policies.base import EndpointMetrics
from extproc.pool import EndpointPool
from predictor.backend_metrics import AUTO, MetricsFormatError, check_metrics_format, parse_backend_metrics
from predictor.ledger import BackendObservation

logger = logging.getLogger(__name__)


def to_endpoint_metrics(observation: BackendObservation, age_s: float) -> EndpointMetrics:
    """Converts a parsed scrape into what policies read (see the module NOTE for derived fields)."""
    num_gpu_blocks = observation.num_gpu_blocks or 0
    usage_frac = min(max(observation.kv_cache_usage_frac, 0.0), 1.0)
    return EndpointMetrics(
        num_requests_running=observation.num_running,
        num_requests_waiting=observation.num_waiting,
        kv_cache_usage_frac=usage_frac,
        num_free_blocks=math.floor((1.0 - usage_frac) * num_gpu_blocks + 1e-9),
        num_gpu_blocks=num_gpu_blocks,
        num_waiting_prompt_blocks=None,
        age_s=age_s,
    )


class MetricsScraper:
    """Polls ``/metrics`` of every endpoint in ``pool``.

    Args:
        pool: whose endpoints are scraped (re-read every round, so config reloads apply).
        interval_s: seconds between the starts of two rounds (> 0).
        staleness_s: a scrape older than this many seconds reads as None (> 0).
        timeout_s: deadline of one scrape, seconds; default: ``staleness_s``.
        clock: monotonic clock in seconds (injected for tests).
        backend_tls: HTTPS to the endpoints (``astrolabe.tls.BackendTls``); None = plain HTTP.
        metrics_format: ``auto`` | ``vllm`` | ``sglang`` (``predictor.backend_metrics.parse_backend_metrics``).

    Raises:
        ValueError: a non-positive interval, staleness or timeout; an unknown ``metrics_format``.
        astrolabe.tls.TlsError: the CA file of ``backend_tls`` cannot be used (a ValueError too).
    """

    def __init__(self, pool: EndpointPool, interval_s: float = 0.05, staleness_s: float = 2.0,
                 timeout_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 backend_tls: BackendTls | None = None, metrics_format: str = AUTO) -> None:
        timeout_s = staleness_s if timeout_s is None else timeout_s
        if not (interval_s > 0 and staleness_s > 0 and timeout_s > 0):
            raise ValueError("interval_s, staleness_s and timeout_s must be > 0")
        check_metrics_format(metrics_format)
        self.metrics_format = metrics_format
        self._unreadable: set[str] = set()  # endpoints whose last scrape was not readable (warned once)
        self._pool = pool
        self.interval_s = interval_s
        self.staleness_s = staleness_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._last: dict[str, tuple[float, BackendObservation]] = {}
        self.num_failures = 0
        self._tls = backend_tls
        self._request_options = https_request_options(backend_tls)

    def get(self, address: str) -> EndpointMetrics | None:
        """The last good scrape of ``address`` if younger than ``staleness_s``, else None."""
        entry = self._last.get(address)
        if entry is None:
            return None
        age_s = self._clock() - entry[0]
        if age_s > self.staleness_s:
            return None
        return to_endpoint_metrics(entry[1], age_s)

    async def _scrape(self, session: aiohttp.ClientSession, address: str) -> None:
        try:
            async with session.get(backend_url(address, "/metrics", self._tls), **self._request_options) as response:
                if response.status != 200:
                    raise MetricsFormatError(f"HTTP {response.status}")
                text = await response.text()
            self._last[address] = (self._clock(), parse_backend_metrics(text, self.metrics_format))
            self._unreadable.discard(address)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:  # MetricsFormatError too
            # The previous scrape stays until it goes stale; failures are counted, not raised.
            self.num_failures += 1
            if isinstance(exc, ValueError) and address not in self._unreadable:
                # Said once per endpoint (until it reads again): a wrong metrics_format, or not an engine's /metrics.
                self._unreadable.add(address)
                logger.warning("the /metrics of %s cannot be read as %s metrics (%s): its load is unknown to the "
                               "policy until it can (metrics_format: auto reads vLLM's and SGLang's)", address,
                               "vLLM or SGLang" if self.metrics_format == AUTO else self.metrics_format, exc)
            else:
                logger.debug("metrics scrape of %s failed: %s", address, exc)

    async def run_once(self, session: aiohttp.ClientSession) -> None:
        """Scrapes every endpoint once, concurrently; forgets endpoints no longer configured."""
        addresses = [e.address for e in self._pool.endpoints]
        for gone in set(self._last) - set(addresses):
            del self._last[gone]
        await asyncio.gather(*(self._scrape(session, a) for a in addresses))

    async def run(self) -> None:
        """Runs until cancelled."""
        timeout = aiohttp.ClientTimeout(total=self._timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                start_s = self._clock()
                await self.run_once(session)
                await asyncio.sleep(max(0.0, self.interval_s - (self._clock() - start_s)))
