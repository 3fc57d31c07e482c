"""The sidecar's /metrics: prediction-error histograms, state age, reconciliation and ingress figures."""


import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from predictor.api import pb
from predictor.outcomes import RATIO_BUCKETS, ErrorStats
from tests.predictor.test_state_source import _state_text, plugin_sidecar


def test_ratio_buckets_count_each_request_once_with_le_semantics():
    stats = ErrorStats()
    for predicted_s, observed_s in ((1.0, 1.0), (0.5, 1.0), (3.0, 1.0), (100.0, 1.0)):
        stats.add(predicted_s, observed_s)
    bounds = (*RATIO_BUCKETS, float("inf"))
    counted = {bounds[i]: c for i, c in enumerate(stats.ratio_counts) if c}
    assert counted == {1.0: 1, 0.5: 1, 4.0: 1, float("inf"): 1}  # 1.0 <= 1.0; 0.5 <= 0.5; 3 <= 4
    assert stats.sum_ratio == pytest.approx(104.5)


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


async def test_the_sidecars_metrics_show_every_checked_prediction_as_a_ratio(tmp_path):
    path = tmp_path / "state.json"
    path.write_text(_state_text())
    async with plugin_sidecar(path, metrics_listen="127.0.0.1:0") as (sidecar, stub):
        await stub.Predict(pb.PredictRequest(request_id="p", num_prompt_tokens=10,
                                             num_predicted_output_tokens=10), timeout=5)
        # Predicted E2E 1 hour: whatever the few ms until Release, the ratio lands in +Inf; predicted 1 us:
        # in the lowest bucket.
        for name, predicted_s in (("long", 3600.0), ("short", 1e-6)):
            await stub.Admit(pb.AdmitRequest(request_id=name, num_prompt_tokens=10,
                                             num_predicted_output_tokens=10, predicted_e2e_s=predicted_s),
                             timeout=5)
            await stub.Release(pb.ReleaseRequest(request_id=name), timeout=5)
        # a Release handled before its Admit (they travel on different calls): the Admit is not counted
        await stub.Release(pb.ReleaseRequest(request_id="late"), timeout=5)
        await stub.Admit(pb.AdmitRequest(request_id="late", num_prompt_tokens=10, num_predicted_output_tokens=10),
                         timeout=5)
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=5)).text
    families = _families(text)
    ratio = {(s.name, s.labels.get("le")): s.value for s in families["astrolabe_predictor_prediction_ratio"].samples
             if s.labels.get("metric") == "e2e"}
    assert ratio[("astrolabe_predictor_prediction_ratio_count", None)] == 2
    assert ratio[("astrolabe_predictor_prediction_ratio_bucket", "0.25")] == 1  # the 1 us prediction
    assert ratio[("astrolabe_predictor_prediction_ratio_bucket", "4.0")] == 1
    assert ratio[("astrolabe_predictor_prediction_ratio_bucket", "+Inf")] == 2  # and the 1 hour one
    age = families["astrolabe_predictor_state_age_seconds"].samples[0].value
    assert age == 0.0  # an idle engine's state is current
    corrections = {s.labels["kind"] for s in families["astrolabe_predictor_reconciliation_corrections"].samples
                   if s.name.endswith("_total")}
    assert corrections == {"added", "removed"}
    assert families["astrolabe_predictor_ingress_delay_seconds"].samples[0].value == 0.0
    # "long" and "short" were admitted (plugin mode: an admission record, no ledger entry) before their Release
    assert families["astrolabe_predictor_late_admits_ignored"].samples[0].value == 1
    simulation = {s.name: s.value for s in families["astrolabe_predictor_simulation_seconds"].samples}
    assert simulation["astrolabe_predictor_simulation_seconds_count"] == 1  # the one Predict
    # no label value comes from a request: only the metric names and the fixed label sets
    labels = {k: v for f in families.values() for s in f.samples for k, v in s.labels.items()}
    assert "long" not in labels.values() and "short" not in labels.values()
