"""What the predictor sidecars checked themselves: predicted vs observed TTFT/E2E per request, and calibration.

Each sidecar keeps running error statistics of the predictions it made for the requests admitted to it
(``predictor.outcomes``, in its ``State``). `read_sidecar_states` fetches them over gRPC; `checks_between` turns
two readings (before and after one policy's replays) into the figures of that policy alone, pooled over the
sidecars (`SidecarChecks`). Used by the demo and ``bench accuracy``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc

from predictor.api import pb, pb_grpc


@dataclass(frozen=True, slots=True)
class SidecarChecks:
    """Pooled over the sidecars, for the requests between two readings.

    Attributes:
        ttft_count / e2e_count: requests whose predicted TTFT / E2E was checked against the observed one.
        ttft_mape / e2e_mape: their mean absolute percentage error (fraction); NaN with none.
        num_sidecars: sidecars read. num_calibrated: of them, those whose step-time model was refitted online.
        residual: mean over the calibrated sidecars of their step-time model's error on measured steps (fraction);
            NaN with none.
    """

    ttft_count: int
    ttft_mape: float
    e2e_count: int
    e2e_mape: float
    num_sidecars: int
    num_calibrated: int
    residual: float


def read_sidecar_states(addresses: Sequence[str], timeout_s: float = 5.0) -> dict[str, dict]:
    """``State`` of each sidecar (``host:port``), parsed; a sidecar that does not answer is left out."""
    states = {}
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            try:
                reply = pb_grpc.PredictorStub(channel).State(pb.StateRequest(), timeout=timeout_s)
            except grpc.RpcError:
                continue
            states[address] = json.loads(reply.state_json)
    return states


def _sums(state: dict, metric: str) -> tuple[int, float]:
    stats = (state.get("outcomes") or {}).get(metric) or {}
    count = int(stats.get("count") or 0)
    mape = stats.get("mape")
    return count, (mape * count if count and mape is not None else 0.0)


def checks_between(before: Mapping[str, dict], after: Mapping[str, dict]) -> SidecarChecks:
    """The checks made between two `read_sidecar_states` readings (sidecars missing from ``before`` count from 0)."""
    totals = {"ttft": [0, 0.0], "e2e": [0, 0.0]}
    residuals = []
    for address, state in after.items():
        for metric, total in totals.items():
            count, abs_sum = _sums(state, metric)
            count0, abs_sum0 = _sums(before.get(address, {}), metric)
            total[0] += count - count0
            total[1] += abs_sum - abs_sum0
        calibration = state.get("calibration") or {}
        if calibration.get("source") == "online" and calibration.get("residual") is not None:
            residuals.append(calibration["residual"])

    def mape(metric: str) -> float:
        count, abs_sum = totals[metric]
        return abs_sum / count if count > 0 else math.nan

    return SidecarChecks(totals["ttft"][0], mape("ttft"), totals["e2e"][0], mape("e2e"), len(after), len(residuals),
                         sum(residuals) / len(residuals) if residuals else math.nan)
