"""Every prediction checked against what happened: the sidecar's record of predicted vs observed TTFT and E2E.

At Admit the extproc sends what this sidecar predicted for the request (``AdmitRequest.predicted_ttft_s`` /
``predicted_e2e_s``); `OutcomeTracker` keeps it with the admission time. When the request ends (Release: its
ext_proc stream closed, i.e. the last byte of the response went through Envoy) the observed E2E is the time from
Admit to Release; the observed TTFT is the time from Admit to the engine's first token where the state source
shows it (the vLLM plugin's and the emulator's state files carry first-token times; the ledger does not, so in
ledger mode only E2E is checked). Both clocks are this host's ``time.monotonic()``. The router sends Admit without
waiting for it, so an Admit can be handled after its request reached the engine, or even after its first token
(a slow unary call, a Notify stream being opened): measured from that late admission the TTFT would be a few
milliseconds or nothing (clamped to 1 µs, one such request took a 1,000-request run's TTFT MAPE from ~45% to
1,687%), so such a request's TTFT is not checked (`engine_arrival`, `first_token`; counted in
``ttft_unobservable``); its E2E still is (seconds long, it loses those few milliseconds).

Per metric it keeps running statistics over every completed request (`ErrorStats`: count, MAPE, the mean and
the recent mean of log(predicted / observed), i.e. the bias) and the last `RECENT_RECORDS` records for reports
(`bench accuracy`, the demo). With ``bias_correction`` on, once ``min_samples`` requests were checked,
`correction` returns the factor the sidecar multiplies its E2E predictions by to cancel a persistent bias
(exp(−recent mean log ratio), bounded to [1/`MAX_CORRECTION`, `MAX_CORRECTION`]) and `ttft_offset_s` the seconds
it adds to TTFT predictions (the median shortfall of the last `_SHORTFALL_WINDOW`, bounded to
[0, `MAX_TTFT_OFFSET_S`]: a median, since a few queued requests' long TTFTs must not shift every short one). Imports only the standard library.

Why admission and not the Predict call as the origin: Admit follows the Predict the router acted on by one
round trip (~1–2 ms, measured in the demo), so the error this adds is far below the figures it checks.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import statistics
from dataclasses import dataclass

RECENT_RECORDS = 256
"""Completed requests kept for reports (the newest)."""
MAX_CORRECTION = 4.0
"""Bias correction never scales an E2E prediction by more than this factor either way."""
MAX_TTFT_OFFSET_S = 1.0
"""Bias correction never adds more than this to a TTFT prediction, seconds."""
_RECENT_WEIGHT = 0.05
"""Weight of each new request in the recent mean of log ratios (about the last 20-40 requests)."""
MIN_PREDICTION_S = 1e-6
MAX_PREDICTION_S = 86400.0
"""Predictions outside [MIN_PREDICTION_S, MAX_PREDICTION_S] seconds are not checked (no request is predicted to
take a day, and such values would swamp the statistics)."""
_SHORTFALL_WINDOW = 64
"""Requests whose TTFT shortfall the offset is the median of."""
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0)
"""Upper bounds of the predicted / observed histogram (`ErrorStats.ratio_counts`; +Inf follows): symmetric in log
around 1.0, so 0.8 and 1.25 are the same error in both directions."""
MAX_PENDING = 8192
"""Admitted requests tracked at most (oldest dropped first) when Release notices are lost."""


@dataclass(slots=True)
class ErrorStats:
    """Running error statistics of one metric (TTFT or E2E).

    Attributes:
        count: requests checked.
        sum_abs_pct: Σ |predicted − observed| / observed.
        sum_log_ratio: Σ log(predicted / observed).
        recent_log_ratio: exponentially weighted mean of log(predicted / observed) (weight `_RECENT_WEIGHT`).
        recent_shortfalls_s: observed − predicted of the last `_SHORTFALL_WINDOW` requests, seconds.
        ratio_counts: requests per `RATIO_BUCKETS` bucket of predicted / observed (not cumulative; the last one
            is +Inf), for the Prometheus histogram.
        sum_ratio: Σ predicted / observed.
    """

    count: int = 0
    sum_abs_pct: float = 0.0
    sum_log_ratio: float = 0.0
    recent_log_ratio: float = 0.0
    recent_shortfalls_s: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=_SHORTFALL_WINDOW))
    ratio_counts: list = dataclasses.field(default_factory=lambda: [0] * (len(RATIO_BUCKETS) + 1))
    sum_ratio: float = 0.0

    def add(self, predicted_s: float, observed_s: float) -> None:
        """Count one request (both in seconds; each is clamped to >= 1e-6)."""
        predicted_s, observed_s = max(predicted_s, 1e-6), max(observed_s, 1e-6)
        log_ratio = math.log(predicted_s / observed_s)
        self.count += 1
        self.sum_abs_pct += abs(predicted_s - observed_s) / observed_s
        self.sum_log_ratio += log_ratio
        weight = max(_RECENT_WEIGHT, 1.0 / self.count)
        self.recent_log_ratio += weight * (log_ratio - self.recent_log_ratio)
        self.recent_shortfalls_s.append(observed_s - predicted_s)
        ratio = predicted_s / observed_s
        self.sum_ratio += ratio
        self.ratio_counts[bisect.bisect_left(RATIO_BUCKETS, ratio)] += 1

    @property
    def mape(self) -> float:
        """Mean absolute percentage error as a fraction (0.2 = 20%); NaN before any request."""
        return self.sum_abs_pct / self.count if self.count else math.nan

    @property
    def bias(self) -> float:
        """Geometric mean of predicted / observed over every request (1.0 = unbiased); NaN before any."""
        return math.exp(self.sum_log_ratio / self.count) if self.count else math.nan

    def as_dict(self) -> dict:
        return {"count": self.count, "mape": self.mape, "bias": self.bias,
                "recent_bias": math.exp(self.recent_log_ratio) if self.count else math.nan,
                "recent_shortfall_s": self.recent_shortfall_s}

    @property
    def recent_shortfall_s(self) -> float:
        """Median of the recent shortfalls (observed − predicted), seconds; NaN before any request."""
        return statistics.median(self.recent_shortfalls_s) if self.recent_shortfalls_s else math.nan


@dataclass(slots=True)
class _Pending:
    admitted_s: float
    predicted_ttft_s: float
    predicted_e2e_s: float
    raw_ttft_s: float  # the prediction before the correction in force at admission
    raw_e2e_s: float
    observed_ttft_s: float | None = None
    ttft_observable: bool = True  # False: the engine had it before this admission was handled


class OutcomeTracker:
    """Predicted vs observed TTFT and E2E per request (see the module docstring).

    Args:
        bias_correction: whether `correction` corrects a persistent bias (else it is always 1.0).
        min_samples: requests checked before a correction applies.
    """

    def __init__(self, *, bias_correction: bool = False, min_samples: int = 50) -> None:
        self.bias_correction = bias_correction
        self.min_samples = min_samples
        self.ttft = ErrorStats()
        self.e2e = ErrorStats()
        # The corrections are learnt from the uncorrected predictions (else each correction would measure only
        # what the previous one left, and undo it).
        self._raw_ttft = ErrorStats()
        self._raw_e2e = ErrorStats()
        self.recent: collections.deque[tuple] = collections.deque(maxlen=RECENT_RECORDS)
        self._pending: dict[str, _Pending] = {}
        self.num_ttft_unobservable = 0

    def admit(self, request_id: str, now_s: float, predicted_ttft_s: float, predicted_e2e_s: float) -> None:
        """A request was admitted at ``now_s`` with these predictions (seconds from now; <= 0 or non-finite =
        none: the request is not checked)."""
        if not MIN_PREDICTION_S <= predicted_e2e_s <= MAX_PREDICTION_S:  # NaN fails too
            return
        ttft = predicted_ttft_s if MIN_PREDICTION_S <= predicted_ttft_s <= MAX_PREDICTION_S else math.nan
        self._pending[request_id] = _Pending(now_s, ttft, predicted_e2e_s,
                                             max(ttft - self.ttft_offset_s(), 1e-6),
                                             predicted_e2e_s / self.correction("e2e"))
        while len(self._pending) > MAX_PENDING:
            self._pending.pop(next(iter(self._pending)))

    def is_tracked(self, request_id: str) -> bool:
        return request_id in self._pending

    def awaits_first_token(self, request_id: str) -> bool:
        """Whether the request is tracked and its first token has not been observed yet."""
        pending = self._pending.get(request_id)
        return pending is not None and pending.observed_ttft_s is None and pending.ttft_observable

    def engine_arrival(self, request_id: str, at_s: float) -> None:
        """The engine received the request at ``at_s`` (same clock as ``admit``). Before the admission was handled
        (a late Admit), its TTFT from the admission would be too short by an unknown part: it is not checked."""
        pending = self._pending.get(request_id)
        if pending is not None and at_s < pending.admitted_s:
            pending.ttft_observable = False

    def first_token(self, request_id: str, at_s: float) -> None:
        """The engine produced the request's first token at ``at_s`` (same clock as ``admit``); later calls for
        the same request are ignored. A first token before the admission (a late Admit) leaves the TTFT
        unchecked."""
        pending = self._pending.get(request_id)
        if pending is not None and pending.observed_ttft_s is None:
            if at_s < pending.admitted_s:
                pending.ttft_observable = False
            else:
                pending.observed_ttft_s = max(at_s - pending.admitted_s, 1e-6)

    def release(self, request_id: str, now_s: float, scored: bool = True) -> tuple | None:
        """The request ended at ``now_s``: count its errors; returns its record ``(request_id, predicted TTFT,
        observed TTFT or None, predicted E2E, observed E2E)`` in seconds, or None if it was not tracked or not
        ``scored`` (the backend answered it with an error: its end says nothing of the prediction)."""
        pending = self._pending.pop(request_id, None)
        if pending is None or not scored:
            return None
        observed_e2e_s = max(now_s - pending.admitted_s, 1e-6)
        self.e2e.add(pending.predicted_e2e_s, observed_e2e_s)
        self._raw_e2e.add(pending.raw_e2e_s, observed_e2e_s)
        observed_ttft_s = pending.observed_ttft_s if pending.ttft_observable else None
        if not pending.ttft_observable and math.isfinite(pending.predicted_ttft_s):
            self.num_ttft_unobservable += 1
        if observed_ttft_s is not None and math.isfinite(pending.predicted_ttft_s):
            self.ttft.add(pending.predicted_ttft_s, observed_ttft_s)
            self._raw_ttft.add(pending.raw_ttft_s, observed_ttft_s)
        record = (request_id, pending.predicted_ttft_s, observed_ttft_s, pending.predicted_e2e_s, observed_e2e_s)
        self.recent.append(record)
        return record

    def correction(self, metric: str) -> float:
        """Factor to multiply E2E predictions by (``metric`` "e2e"): 1.0 unless bias correction is on and
        ``min_samples`` requests were checked (see the module docstring). TTFT is corrected by an offset
        (`ttft_offset_s`), so its factor is always 1.0."""
        stats = self._raw_e2e
        if metric != "e2e" or not self.bias_correction or stats.count < self.min_samples:
            return 1.0
        factor = math.exp(-stats.recent_log_ratio)
        return min(max(factor, 1.0 / MAX_CORRECTION), MAX_CORRECTION) if math.isfinite(factor) else 1.0

    def ttft_offset_s(self) -> float:
        """Seconds to add to TTFT predictions: the recent median shortfall (observed − predicted), bounded to
        [0, `MAX_TTFT_OFFSET_S`], once bias correction is on and ``min_samples`` TTFTs were checked; else 0.
        Additive because TTFT's persistent error is a delay the engine does not see (the API server's HTTP,
        tokenization and hand-over before the request reaches the scheduler), not a scale."""
        stats = self._raw_ttft
        if not self.bias_correction or stats.count < self.min_samples:
            return 0.0
        offset = stats.recent_shortfall_s
        return min(max(offset, 0.0), MAX_TTFT_OFFSET_S) if math.isfinite(offset) else 0.0

    def as_dict(self) -> dict:
        """Statistics and recent records, JSON-ready (NaN where nothing was measured)."""
        return {"ttft": self.ttft.as_dict(), "e2e": self.e2e.as_dict(), "bias_correction": self.bias_correction,
                "correction": {"ttft_offset_s": self.ttft_offset_s(), "e2e_factor": self.correction("e2e")},
                "num_pending": len(self._pending), "ttft_unobservable": self.num_ttft_unobservable,
                "recent": [list(r) for r in self.recent]}
