"""`astrolabe predictor profile` against a real vLLM server: a profile CSV that `fit` reads, and coefficients."""

from __future__ import annotations

import subprocess
import sys

import pytest

from predictor.sim import LinearBatchTimeModel, load_profile

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_profile_writes_a_fittable_csv(vllm_stack, tmp_path):
    # Both servers at once: on this shared CPU a server's step time depends on whether the other is busy, and the
    # sidecars calibrate online from these steps; profiling one alone left its sidecar with a model ~2x too fast
    # for the next test's load on both (Po2 then sent 42 of 48 requests to it).
    runs = [subprocess.Popen(
        [sys.executable, "-m", "astrolabe", "predictor", "profile", "--backend", server.address,
         "-o", str(tmp_path / f"profile-{i}.csv"), "--fit", str(tmp_path / f"coeffs-{i}.json"), "--repeats", "1",
         "--prefill-shapes", "1x16,1x64,2x64,4x32", "--decode-shapes", "1x32,4x32,8x64", "--decode-tokens", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i, server in enumerate(vllm_stack.vllm)]
    for run in runs:
        _, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr
    csv_path, coeffs_path = tmp_path / "profile-0.csv", tmp_path / "coeffs-0.json"
    rows = load_profile(csv_path, "tiny-llama")
    assert [r.kind for r in rows] == ["prefill"] * 4 + ["decode"] * 3
    assert all(0 < r.time_s < 5 for r in rows)
    model = LinearBatchTimeModel.from_json(coeffs_path)
    assert model.c0_s >= 0 and min(model.c1_s_per_token, model.c2_s_per_token2, model.c3_s_per_token,
                                   model.c4_s_per_seq) >= 0
    # `astrolabe predictor fit` reads the same CSV (its held-out split keeps 5 of these 7 rows for the fit).
    fit = subprocess.run([sys.executable, "-m", "astrolabe", "predictor", "fit", str(csv_path), "--model",
                          "tiny-llama", "-o", str(tmp_path / "fit.json")], capture_output=True, text=True,
                         timeout=120)
    assert fit.returncode == 0, fit.stderr
    assert "held-out MAPE" in fit.stdout
