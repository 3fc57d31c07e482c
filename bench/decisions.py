"""What the extproc's decision logs say about a replay: routing overhead, basis of decisions, prediction quality.

Owns reading decision logs (``extproc.decision_log`` format) and joining them with the client's results
(``bench.loadgen.RequestResult``, by x-request-id), and three reductions:

- ``routing overhead``: per decision, the extproc's time from the request's headers to the destination
  (``routing_s``), p50 and p99;
- ``basis``: the share of decisions made on predictions (every probe answered), on partial predictions, or by
  the least-requests fallback;
- ``prediction quality`` of the chosen endpoint's prediction against what the client measured: MAPE and median
  absolute error of TTFT and E2E, and *hindsight agreement*: over pairs of requests sent within
  ``window_s`` of each other to different instances, the share whose predicted TTFTs are ordered as their
  measured TTFTs are (ties skipped). It asks the question the policy relies on: when two instances are compared
  at about the same moment, does the one predicted faster turn out faster? 0.5 is a coin, 1.0 is perfect.
  The client's TTFT includes Envoy's and the router's own time (a few ms), which the prediction does not.

Pure functions plus one file reader; no printing.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.loadgen import RequestResult

logger = logging.getLogger(__name__)

BASES = ("prediction", "partial", "fallback", "policy")


def read_decisions(paths: Iterable[Path]) -> list[dict]:
    """Every record of the decision logs at ``paths`` (missing files are skipped; a torn last line is dropped)."""
    records = []
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            continue
        for line in text.splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                logger.debug("torn line in %s", path)
    return records


@dataclass(frozen=True, slots=True)
class DecisionSummary:
    """A policy's decisions in one replay (seconds; shares in [0, 1]; NaN when not applicable).

    Attributes:
        num_decisions: records found.
        routing_p50_s, routing_p99_s: routing overhead (headers to destination).
        basis_share: basis -> share of decisions.
        num_scored: decisions joined with a successful result and a prediction of the chosen endpoint.
        ttft_mape, e2e_mape: mean absolute percentage error of the chosen endpoint's predictions (fractions).
        ttft_median_abs_error_s, e2e_median_abs_error_s: median absolute errors.
        ttft_hindsight_agreement: see the module docstring; NaN with fewer than 10 pairs.
        num_pairs: pairs behind the agreement.
    """

    num_decisions: int
    routing_p50_s: float
    routing_p99_s: float
    basis_share: dict[str, float]
    num_scored: int
    ttft_mape: float
    e2e_mape: float
    ttft_median_abs_error_s: float
    e2e_median_abs_error_s: float
    ttft_hindsight_agreement: float
    num_pairs: int


def _chosen_prediction(record: dict) -> dict | None:
    for candidate in record.get("candidates") or ():
        if candidate.get("endpoint") == record.get("destination") and candidate.get("ttft_s") is not None:
            return candidate
    return None


def hindsight_agreement(send_s: Sequence[float], instances: Sequence[str], predicted: Sequence[float],
                        measured: Sequence[float], window_s: float = 0.5) -> tuple[float, int]:
    """(agreement, pairs): see the module docstring. Inputs are per request, same order, seconds.

    NaN agreement with fewer than 10 pairs.
    """
    order = np.argsort(np.asarray(send_s, dtype=float), kind="stable")
    t = np.asarray(send_s, dtype=float)[order]
    inst = [instances[i] for i in order]
    pred = np.asarray(predicted, dtype=float)[order]
    meas = np.asarray(measured, dtype=float)[order]
    agree = pairs = 0
    for i in range(len(t)):
        j = i + 1
        while j < len(t) and t[j] - t[i] <= window_s:
            if inst[j] != inst[i]:
                dp, dm = pred[j] - pred[i], meas[j] - meas[i]
                if dp != 0 and dm != 0:
                    pairs += 1
                    agree += (dp > 0) == (dm > 0)
            j += 1
    return (agree / pairs if pairs >= 10 else math.nan), pairs


def summarize_decisions(records: Sequence[dict], results: Sequence[RequestResult],
                        window_s: float = 0.5) -> DecisionSummary:
    """Reduces one replay's decision records, joined with its results by request id."""
    routing = np.array([r["routing_s"] for r in records if r.get("routing_s") is not None], dtype=float)
    num = len(records)
    basis_share = {b: (sum(r.get("basis") == b for r in records) / num if num else math.nan) for b in BASES}
    by_id = {r.id: r for r in results}
    rows = []
    for record in records:
        result = by_id.get(record.get("request_id"))
        chosen = _chosen_prediction(record)
        if result is None or not result.ok or chosen is None or result.ttft_s is None or result.e2e_s is None:
            continue
        rows.append((result.send_offset_s, record["destination"], chosen["ttft_s"], result.ttft_s,
                     chosen["e2e_s"], result.e2e_s))
    if rows:
        send, inst, p_ttft, m_ttft, p_e2e, m_e2e = (list(c) for c in zip(*rows))
        p_ttft, m_ttft, p_e2e, m_e2e = (np.asarray(v, dtype=float) for v in (p_ttft, m_ttft, p_e2e, m_e2e))
        agreement, num_pairs = hindsight_agreement(send, inst, p_ttft, m_ttft, window_s)
        figures = (float(np.mean(np.abs(p_ttft - m_ttft) / m_ttft)), float(np.mean(np.abs(p_e2e - m_e2e) / m_e2e)),
                   float(np.median(np.abs(p_ttft - m_ttft))), float(np.median(np.abs(p_e2e - m_e2e))))
    else:
        agreement, num_pairs, figures = math.nan, 0, (math.nan,) * 4
    return DecisionSummary(
        num_decisions=num,
        routing_p50_s=float(np.percentile(routing, 50)) if len(routing) else math.nan,
        routing_p99_s=float(np.percentile(routing, 99)) if len(routing) else math.nan,
        basis_share=basis_share, num_scored=len(rows), ttft_mape=figures[0], e2e_mape=figures[1],
        ttft_median_abs_error_s=figures[2], e2e_median_abs_error_s=figures[3],
        ttft_hindsight_agreement=agreement, num_pairs=num_pairs)
