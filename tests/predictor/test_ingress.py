"""The Admit -> engine delay: the estimator, and a sidecar that measures it from the plugin's arrivals."""

import asyncio
import json
import math
import time

import httpx
import pytest

from predictor.api import pb
from predictor.ingress import MAX_INGRESS_S, IngressDelayEstimator
from predictor.server import ABSORB_INTERVAL_S
from tests.predictor.test_state_source import _state_text, plugin_sidecar


def test_the_estimate_is_the_median_of_the_window_once_there_are_enough():
    estimator = IngressDelayEstimator(window=5, min_samples=3)
    estimator.observe(0.1, 0.0)
    estimator.observe(0.9, 0.0)
    assert estimator.delay_at(0.0) == 0.0  # two samples: not trusted yet
    estimator.observe(0.2, 0.0)
    assert estimator.delay_at(0.0) == pytest.approx(0.2)
    for delay_s in (3.0, 3.0, 3.0, 3.0):  # the window keeps the last five: 0.2 and older roll out
        estimator.observe(delay_s, 1.0)
    assert estimator.delay_at(1.0) == pytest.approx(3.0)
    status = estimator.as_dict(1.0)
    assert (status["num_samples"], status["num_fresh"], status["num_observed"], status["in_use"]) == (5, 5, 7, True)


def test_stale_delays_stop_counting():
    """An instance the router avoids measures nothing new: its old, high estimate must not keep it avoided."""
    estimator = IngressDelayEstimator(window=64, min_samples=3, max_age_s=10.0)
    for i in range(5):
        estimator.observe(0.8, 100.0 + i)
    assert estimator.delay_at(105.0) == pytest.approx(0.8)
    assert estimator.delay_at(112.0) == pytest.approx(0.8)  # samples at 102-104 are still fresh: 3 of them
    assert estimator.delay_at(113.5) == 0.0 and not estimator.as_dict(113.5)["in_use"]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, MAX_INGRESS_S + 1, "0.1", None])
def test_impossible_delays_are_counted_and_ignored(bad):
    estimator = IngressDelayEstimator(window=4, min_samples=1)
    estimator.observe(0.05, 0.0)
    estimator.observe(bad, 0.0)
    assert estimator.delay_at(0.0) == pytest.approx(0.05)
    assert (estimator.num_observed, estimator.num_rejected) == (1, 1)


def test_a_clock_tick_early_counts_as_zero():
    estimator = IngressDelayEstimator(window=4, min_samples=1)
    estimator.observe(-0.002, 0.0)
    assert estimator.delay_at(0.0) == 0.0 and estimator.num_rejected == 0


@pytest.mark.parametrize("window, min_samples, max_age_s", [(0, 1, 1.0), (4, 0, 1.0), (4, 5, 1.0), (4, 2, 0.0)])
def test_bad_settings_are_refused(window, min_samples, max_age_s):
    with pytest.raises(ValueError):
        IngressDelayEstimator(window=window, min_samples=min_samples, max_age_s=max_age_s)


@pytest.mark.parametrize("mode", ["online", "off"])
async def test_a_sidecar_measures_the_delay_from_admit_to_the_engine_and_adds_it_to_predictions(tmp_path, mode):
    """Ten admitted requests reach the engine's scheduler 0.3 s after their Admit (the plugin's ``arrivals``):
    with ``ingress_delay: online`` the sidecar's TTFT and E2E predictions grow by 0.3 s; with ``off`` it still
    measures the delay (State shows it) and predicts as before."""
    path = tmp_path / "state.json"
    path.write_text(_state_text(arrivals=[]))
    ask = pb.PredictRequest(request_id="p", num_prompt_tokens=10, num_predicted_output_tokens=10)
    async with plugin_sidecar(path, ingress_delay=mode) as (sidecar, stub):
        before = await stub.Predict(ask, timeout=5)
        admitted_s = {}
        for i in range(10):
            await stub.Admit(pb.AdmitRequest(request_id=f"r{i}/x", num_prompt_tokens=10,
                                             num_predicted_output_tokens=10), timeout=5)
            admitted_s[i] = sidecar.plugin.admits.admitted_at_s(f"r{i}/x")
        # The engine names them cmpl-<x-request-id>-0-<suffix>; they arrived 0.3 s after their Admit and
        # finished since (empty queues again; their Release has not come yet, and they are not counted as
        # still on their way).
        arrivals = [[f"cmpl-r{i}-0-1a2b3c4d", admitted_s[i] + 0.3] for i in range(10)]
        path.write_text(_state_text(seq=2, published_monotonic_s=time.monotonic(), arrivals=arrivals))
        # absorbed off the prediction's path, within ABSORB_INTERVAL_S
        deadline_s = time.monotonic() + 5
        while True:
            state = json.loads((await stub.State(pb.StateRequest(), timeout=5)).state_json)
            if state["ingress"]["num_observed"] == 10 or time.monotonic() > deadline_s:
                break
            await asyncio.sleep(ABSORB_INTERVAL_S / 4)
        after = await stub.Predict(ask, timeout=5)
    ingress = state["ingress"]
    assert ingress["num_observed"] == 10 and ingress["delay_s"] == pytest.approx(0.3, abs=1e-6)
    assert ingress["mode"] == mode and ingress["in_use"]
    shift = 0.3 if mode == "online" else 0.0
    assert after.ttft_s - before.ttft_s == pytest.approx(shift, abs=1e-3)
    assert after.e2e_s - before.e2e_s == pytest.approx(shift, abs=1e-3)
    assert after.queue_s == pytest.approx(before.queue_s, abs=1e-6)  # the engine's own queue only


async def test_a_request_the_engine_had_before_its_admit_was_handled_is_not_ttft_checked(tmp_path):
    """The router does not wait for Admit: one handled after its request reached the engine (the plugin's
    ``arrivals``) or after its first token would measure a TTFT of a few ms or of nothing. The sidecar leaves that
    TTFT unchecked (``ttft_unobservable``, and the metric) and still checks the E2E; an Admit in time is checked."""
    path = tmp_path / "state.json"
    path.write_text(_state_text(arrivals=[]))
    async with plugin_sidecar(path, metrics_listen="127.0.0.1:0") as (sidecar, stub):
        admitted_s = {}
        for name in ("late", "in-time"):
            await stub.Admit(pb.AdmitRequest(request_id=f"{name}/x", num_prompt_tokens=10,
                                             num_predicted_output_tokens=10, predicted_ttft_s=0.02,
                                             predicted_e2e_s=1.0), timeout=5)
            admitted_s[name] = sidecar.plugin.admits.admitted_at_s(f"{name}/x")
        late, in_time = admitted_s["late"], admitted_s["in-time"]
        path.write_text(_state_text(
            seq=2, published_monotonic_s=time.monotonic(),
            arrivals=[["cmpl-late-0-1a2b3c4d", late - 0.010], ["cmpl-in-time-0-1a2b3c4d", in_time + 0.005]],
            first_tokens=[["cmpl-late-0-1a2b3c4d", late + 0.002], ["cmpl-in-time-0-1a2b3c4d", in_time + 0.025]]))
        deadline_s = time.monotonic() + 5
        while sidecar.outcomes.awaits_first_token("in-time/x") and time.monotonic() < deadline_s:
            await asyncio.sleep(ABSORB_INTERVAL_S / 4)
        for name in ("late", "in-time"):
            await stub.Release(pb.ReleaseRequest(request_id=f"{name}/x"), timeout=5)
        outcomes = json.loads((await stub.State(pb.StateRequest(), timeout=5)).state_json)["outcomes"]
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=5)).text
    assert outcomes["ttft"]["count"] == 1 and outcomes["ttft"]["mape"] == pytest.approx(0.2, abs=1e-6)
    assert outcomes["e2e"]["count"] == 2 and outcomes["ttft_unobservable"] == 1
    records = {r[0]: r for r in outcomes["recent"]}
    assert records["late/x"][2] is None and records["in-time/x"][2] == pytest.approx(0.025, abs=1e-9)
    assert "astrolabe_predictor_ttft_unobservable_total 1.0" in metrics


async def test_an_arrival_read_before_its_admit_still_leaves_the_ttft_unchecked(tmp_path):
    """The state loop hands out each arrival once (every 0.1 s): one read before its Admit was handled matched no
    admission then, so the Admit looks back at the last state read (a review found the first token then scored
    2 ms after the late admission: a TTFT error of 900%)."""
    path = tmp_path / "state.json"
    path.write_text(_state_text(arrivals=[]))
    async with plugin_sidecar(path) as (sidecar, stub):
        arrival_s = time.monotonic()
        path.write_text(_state_text(seq=2, published_monotonic_s=arrival_s,
                                    arrivals=[["cmpl-late-0-1a2b3c4d", arrival_s]]))
        deadline_s = time.monotonic() + 5
        while (sidecar.plugin.last_state is None or not sidecar.plugin.last_state.arrivals) \
                and time.monotonic() < deadline_s:
            await asyncio.sleep(ABSORB_INTERVAL_S / 4)
        await asyncio.sleep(2 * ABSORB_INTERVAL_S)  # absorbed, matched to nothing
        await stub.Admit(pb.AdmitRequest(request_id="late/x", num_prompt_tokens=10,
                                         num_predicted_output_tokens=10, predicted_ttft_s=0.02,
                                         predicted_e2e_s=1.0), timeout=5)
        admitted_s = sidecar.plugin.admits.admitted_at_s("late/x")
        assert admitted_s > arrival_s
        path.write_text(_state_text(seq=3, published_monotonic_s=time.monotonic(),
                                    arrivals=[["cmpl-late-0-1a2b3c4d", arrival_s]],
                                    first_tokens=[["cmpl-late-0-1a2b3c4d", admitted_s + 0.002]]))
        await asyncio.sleep(3 * ABSORB_INTERVAL_S)
        await stub.Release(pb.ReleaseRequest(request_id="late/x"), timeout=5)
        outcomes = json.loads((await stub.State(pb.StateRequest(), timeout=5)).state_json)["outcomes"]
    assert outcomes["ttft_unobservable"] == 1 and outcomes["ttft"]["count"] == 0 and outcomes["e2e"]["count"] == 1
