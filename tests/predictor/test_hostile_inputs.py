"""Regression tests for a break-it pass on calibration, outcome checks and sidecar flags (its state-file cases are
in test_state_source.py): every
hostile input is refused or ignored with a clear error, never a crash, a NaN answer or a traceback."""

from __future__ import annotations

import json
import math
import random
import shutil

import numpy as np
import pytest

from astrolabe.cli import main as astrolabe_main
from predictor.calibration import StepSample, StepTimeCalibrator
from predictor.model_shape import nearest_shipped_model, read_model_shape
from predictor.outcomes import OutcomeTracker
from predictor.server import Sidecar, SidecarConfig
from predictor.sim.batch_time import LinearBatchTimeModel
from tagger.serve import SHIPPED_LIGHT_DIR

PRIOR = LinearBatchTimeModel.default("llama-2-7b")


def _normal_steps(n: int, rng: random.Random) -> list[StepSample]:
    out = []
    for _ in range(n):
        seqs = rng.randint(1, 32)
        out.append(StepSample(seqs, 0, seqs * 500, seqs, 2 * PRIOR.step_time_from_counts_s(seqs, 0, seqs * 500, seqs)))
    return out


@pytest.mark.parametrize("duration", [1e-310, 5e-324, 1e-12, 1e308, 1e5])
def test_absurd_step_durations_are_ignored_and_a_refit_never_raises(duration):
    rng = random.Random(0)
    calibrator = StepTimeCalibrator(PRIOR, min_samples=16)
    steps = _normal_steps(100, rng)
    calibrator.observe(steps[:50] + [StepSample(4, 0, 100, 4, duration)] * 60 + steps[50:])
    for _ in range(5):  # refit directly: maybe_refit waits for new steps
        calibrator.refit()
    status = calibrator.status()
    assert math.isfinite(status.residual) and status.residual < 0.05
    assert calibrator.model.step_time_from_counts_s(1, 0, 1, 1) > 0


def test_absurd_predictions_are_not_checked_and_never_poison_the_statistics():
    tracker = OutcomeTracker(bias_correction=True, min_samples=2)
    for i, (ttft, e2e) in enumerate([(5e-324, 5e-324), (1.7e308, 1.7e308), (float("nan"), 1e300), (-1, -1)]):
        tracker.admit(f"bad{i}", 0.0, ttft, e2e)
        assert tracker.release(f"bad{i}", 3.0) is None
    tracker.admit("tiny-ttft", 0.0, 5e-324, 1.0)  # E2E checked, TTFT not
    tracker.first_token("tiny-ttft", 0.1)
    tracker.release("tiny-ttft", 2.0)
    tracker.admit("ok", 0.0, 0.1, 1.0)
    tracker.release("ok", 2.0)
    assert tracker.e2e.count == 2 and tracker.ttft.count == 0
    assert tracker.correction("e2e") == pytest.approx(2.0) and math.isfinite(tracker.e2e.mape)


async def test_the_state_is_strict_json_before_the_first_reconciliation():
    sidecar = Sidecar(SidecarConfig(backend="127.0.0.1:1", state_source="ledger"))
    text = json.dumps(sidecar.state())

    def refuse(token):
        raise AssertionError(f"non-standard JSON token {token}")

    state = json.loads(text, parse_constant=refuse)
    assert state["state_age_s"] is None


@pytest.mark.parametrize("flags", [
    ["--metrics-listen", "bogus"], ["--metrics-listen", "127.0.0.1:99999"], ["--metrics-listen", ":9000"],
    ["--listen", "bogus"], ["--time-scale", "inf"], ["--calibration-min-samples", "0"],
    ["--kv-events-endpoint", "tcp://*:5557"], ["--kv-events-endpoint", "tcp://127.0.0.1:99999"],
    ["--kv-events-endpoint", "127.0.0.1:5557"], ["--kv-events-endpoint", "tcp://127.0.0.1"]])
def test_bad_sidecar_flags_exit_2(flags):
    assert astrolabe_main(["predictor", "serve", "--backend", "127.0.0.1:1", *flags]) == 2


def test_an_unbindable_metrics_address_exits_2():
    assert astrolabe_main(["predictor", "serve", "--backend", "127.0.0.1:1", "--listen", "127.0.0.1:0",
                           "--metrics-listen", "192.0.2.1:0"]) == 2  # TEST-NET-1: not an address of this host


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"num_hidden_layers": 2, "hidden_size": 1' +
                                  "0" * 400 + "}", b"\xff\xfe".decode("latin-1")])
def test_a_hostile_model_config_is_a_value_error_naming_the_file(tmp_path, text):
    path = tmp_path / "config.json"
    path.write_text(text, encoding="latin-1")
    with pytest.raises(ValueError, match="config.json"):
        read_model_shape(path)


def test_a_small_mha_config_without_heads_finds_a_shape(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64}))
    name, distance = nearest_shipped_model(read_model_shape(path))
    assert name and math.isfinite(distance)


# ---- a break-it pass on the SGLang paths: hostile /metrics and /get_server_info --------------------------------

def _sglang_text(running: str, waiting: str = "0", usage: str = "0.1", pages: str = "512") -> str:
    return (f"sglang:num_running_reqs {running}\nsglang:num_queue_reqs {waiting}\nsglang:token_usage {usage}\n"
            f"sglang:page_size 16\nsglang:num_pages {pages}\n")


@pytest.mark.parametrize("running", ["NaN", "+Inf", "-Inf", "-5", "1e6", "1e30"])
def test_a_count_that_is_no_count_makes_the_scrape_unreadable(running):
    from predictor.backend_metrics import MetricsFormatError, parse_backend_metrics
    with pytest.raises(MetricsFormatError, match="not a count of requests"):
        parse_backend_metrics(_sglang_text(running))


def test_absurd_kv_sizes_and_usage_are_ignored_or_clamped():
    from predictor.backend_metrics import parse_backend_metrics
    for pages in ("NaN", "+Inf", "1e40", "-3"):
        assert parse_backend_metrics(_sglang_text("1", pages=pages)).num_gpu_blocks is None
    assert parse_backend_metrics(_sglang_text("1", usage="5")).kv_cache_usage_frac == 1.0
    assert parse_backend_metrics(_sglang_text("1", usage="NaN")).kv_cache_usage_frac == 0.0
    text = 'sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\nsglang:cache_config_info{page_size="²",num_pages="9"} 1\n'
    assert parse_backend_metrics(text).block_size is None


def test_the_ledger_holds_at_most_its_cap_of_phantoms(caplog):
    from predictor.ledger import MAX_LEDGER_REQUESTS, BackendObservation, Ledger
    from predictor.sim import EngineConfig
    ledger = Ledger(EngineConfig(num_gpu_blocks=100_000), PRIOR, 0.0)
    ledger.reconcile(BackendObservation(num_running=50_000, num_waiting=40_000), now_s=0.0)
    ledger.reconcile(BackendObservation(num_running=50_000, num_waiting=40_000), now_s=0.1)
    assert ledger.num_unfinished() == MAX_LEDGER_REQUESTS
    assert sum("keeps at most" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("info", [{"max_running_requests": 10**30, "chunked_prefill_size": "8"},
                                  {"max_running_requests": -1, "page_size": None, "max_total_num_tokens": float("nan")},
                                  {"internal_states": "x"}, {"internal_states": [1]}])
def test_absurd_server_info_limits_are_ignored(info):
    from predictor.server import sglang_engine_limits
    from predictor.sim import EngineConfig
    assert sglang_engine_limits(info, EngineConfig()) == EngineConfig()


async def test_a_sidecar_keeps_reconciling_through_hostile_scrapes_and_says_so_once(caplog):
    """One NaN scrape (or a deeply nested /get_server_info) must not end reconciliation: it skips that scrape,
    warns once, and works again when the text does."""
    from aiohttp import web

    from predictor.sim import EngineConfig
    state = {"metrics": _sglang_text("NaN"), "info": "[" * 100_000 + "]" * 100_000}

    async def metrics(_request):
        return web.Response(text=state["metrics"])

    async def info(_request):
        return web.Response(text=state["info"], content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/get_server_info", info)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    caplog.set_level("INFO", logger="predictor.server")
    sidecar = Sidecar(SidecarConfig(backend=f"127.0.0.1:{port}", listen="127.0.0.1:0", engine=EngineConfig(),
                                    reconcile_interval_s=0.02, backend_engine="sglang"))
    await sidecar.start()
    try:
        import asyncio
        await asyncio.sleep(0.3)
        assert sidecar.last_reconciled_s is None
        state["metrics"] = _sglang_text("3", "2")
        for _ in range(100):
            if sidecar.last_reconciled_s is not None:
                break
            await asyncio.sleep(0.02)
        assert sidecar.ledger.num_unfinished() == 5  # reconciled from the good text
        messages = [r.getMessage() for r in caplog.records]
        assert sum("reconciliation with the backend's /metrics fails" in m for m in messages) == 1
        assert any("works again" in m for m in messages)
    finally:
        await sidecar.stop()
        await runner.cleanup()


def test_a_taggers_broken_quantiles_stop_the_sidecar_at_start(tmp_path, caplog):
    shutil.copy(SHIPPED_LIGHT_DIR / "errors.npz", tmp_path / "errors.npz")
    with np.load(SHIPPED_LIGHT_DIR / "quantiles.npz") as good:
        np.savez(tmp_path / "quantiles.npz", levels=good["levels"][::-1], bin_edges=good["bin_edges"],
                 offsets=good["offsets"])
    assert astrolabe_main(["predictor", "serve", "--backend", "127.0.0.1:1", "--length-errors", str(tmp_path)]) == 2
    assert "levels must ascend" in caplog.text
    with pytest.raises(SystemExit):
        astrolabe_main(["predictor", "serve", "--backend", "127.0.0.1:1", "--length-distribution", "buckets"])


def test_the_sidecar_reads_its_taggers_files_once_at_start(tmp_path, monkeypatch, caplog):
    """`run` builds the residual rules once (checking the files and falling back to binned without quantiles.npz,
    with one warning) and the sidecar it starts uses those rules."""
    import predictor.server as server
    from tagger.errors import LengthErrorModel

    shutil.copy(SHIPPED_LIGHT_DIR / "errors.npz", tmp_path / "errors.npz")  # no quantiles.npz
    loads, started = [], []
    load = LengthErrorModel.load
    monkeypatch.setattr(LengthErrorModel, "load", staticmethod(lambda path: loads.append(path) or load(path)))

    async def start(self):
        started.append(self)

    async def nothing(*args, **kwargs):
        return None

    # The real serve() runs (it must hand the rules on); only what would bind ports or wait for a signal is stubbed.
    monkeypatch.setattr(server.Sidecar, "start", start)
    monkeypatch.setattr(server.Sidecar, "stop", nothing)
    monkeypatch.setattr(server, "wait_for_termination", nothing)
    assert astrolabe_main(["predictor", "serve", "--backend", "127.0.0.1:1", "--length-errors", str(tmp_path)]) == 0
    (sidecar,) = started
    assert len(loads) == 1 and caplog.text.count("has no quantiles.npz") == 1
    assert sidecar.config.length_distribution == "binned" == sidecar.residual.length_distribution
