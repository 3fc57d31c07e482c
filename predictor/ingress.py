"""The delay before the engine sees a request: from the extproc's Admit to the scheduler's ``add_request``.

Between the routing decision and the engine's queue a request crosses Envoy and the backend's API server (HTTP
parsing, the tokenizer, chat template, the hand-over to the engine core process). On an idle server this takes a
few milliseconds; on a server whose API process competes for CPU it grows to hundreds of milliseconds
(`bench/README-vllm.md`: mean 0.22-0.46 s, median 0.07-0.15 s on two vLLM servers sharing 2 cores at 8 req/s), and
nothing in the engine's state shows it. The vLLM plugin's state file lists when the scheduler received each of
its last requests (``arrivals``, ``time.monotonic()``); the sidecar knows when it admitted each one (the same
host-wide clock), so each admitted request yields one measured delay. `IngressDelayEstimator` keeps the last
``window`` of them and predicts the next request's delay as their median (a robust centre: the delays are
heavy-tailed, and the median is what a mean-absolute-error-minded predictor of a skewed delay should use). Only
delays measured in the last ``max_age_s`` count: an instance the router avoids admits nothing new, and a stale
high estimate would keep it avoided for good.

With ``--ingress-delay online`` the estimate is added to TTFT and E2E predictions (the new request reaches the
engine that much later; the queue delay used by the extproc's second round, ``queue_s``, stays the engine's own).
The default is ``off``: measured and reported (``State``, metrics), not added. Measured on real vLLM
(`bench/README-vllm.md`, "Where the error comes from"): on one server it cut the sidecar's TTFT error from 72% to
27% and E2E MAPE from 16.3% to 13.9%; on two servers sharing 2 cores it was mixed, and in the test tier (a burst
through Envoy, then 48 requests at 16 req/s) the estimate one burst left on one server sent all 48 to the other.
Imports only the standard library.
"""

from __future__ import annotations

import collections
import math
import statistics

MAX_INGRESS_S = 60.0
"""A measured delay above this (seconds) is a matching error or a stalled client, not an ingress delay: dropped."""


class IngressDelayEstimator:
    """Median of the last ``window`` measured Admit -> engine delays of the last ``max_age_s`` seconds.

    Args:
        window: delays kept (>= 1).
        min_samples: fresh delays needed before the estimate is used (until then, and after ``max_age_s``
            without new ones, `delay_at` is 0: an idle server's delay is a few ms, under the predictor's
            resolution).
        max_age_s: a delay measured longer ago than this stops counting, seconds (> 0).

    Raises:
        ValueError: ``window < 1``, ``min_samples`` not in [1, window], or ``max_age_s <= 0``.
    """

    def __init__(self, window: int = 64, min_samples: int = 8, max_age_s: float = 10.0) -> None:
        if window < 1 or not 1 <= min_samples <= window or not max_age_s > 0:
            raise ValueError(f"need window >= 1, 1 <= min_samples <= window and max_age_s > 0, got {window}, "
                             f"{min_samples}, {max_age_s}")
        self.min_samples = min_samples
        self.max_age_s = max_age_s
        self._delays: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)  # (when, delay)
        self.num_observed = 0
        self.num_rejected = 0

    def observe(self, delay_s: float, now_s: float) -> None:
        """Take one delay (seconds) measured at ``now_s`` (``time.monotonic()`` seconds). A non-finite, negative
        (beyond 10 ms of clock granularity) or over-`MAX_INGRESS_S` value is counted as rejected and otherwise
        ignored; never raises."""
        if not isinstance(delay_s, int | float) or not math.isfinite(delay_s) or not -0.01 <= delay_s <= MAX_INGRESS_S:
            self.num_rejected += 1
            return
        self._delays.append((now_s, max(float(delay_s), 0.0)))
        self.num_observed += 1

    def _fresh(self, now_s: float) -> tuple[int, float]:
        """(fresh samples, their median or 0.0 when fewer than ``min_samples``) at ``now_s``."""
        fresh = [delay for at_s, delay in self._delays if now_s - at_s <= self.max_age_s]
        return len(fresh), statistics.median(fresh) if len(fresh) >= self.min_samples else 0.0

    def delay_at(self, now_s: float) -> float:
        """The predicted delay of a request admitted at ``now_s``, seconds (0 with fewer than ``min_samples``
        delays measured in the last ``max_age_s``)."""
        return self._fresh(now_s)[1]

    def as_dict(self, now_s: float) -> dict:
        """JSON-ready status at ``now_s``: estimate, fresh and kept samples, observed and rejected totals, mean and
        max of the kept ones (seconds)."""
        delays = [delay for _, delay in self._delays]
        num_fresh, estimate_s = self._fresh(now_s)
        return {"delay_s": estimate_s, "num_fresh": num_fresh, "num_samples": len(delays),
                "num_observed": self.num_observed, "num_rejected": self.num_rejected,
                "mean_s": statistics.fmean(delays) if delays else None, "max_s": max(delays) if delays else None,
                "in_use": num_fresh >= self.min_samples}
