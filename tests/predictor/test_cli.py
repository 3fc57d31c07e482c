"""Tests for predictor.cli: `astrolabe predictor fit` end to end on the shipped H200 profile."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from astrolabe.cli import main as astrolabe_main
from predictor.sim.batch_time import PROFILE_CSV_PATH, LinearBatchTimeModel, load_profile, mape, split_holdout

MAX_HELDOUT_MAPE_PERCENT = 8.0


@pytest.mark.parametrize("model", ["llama-2-7b", "qwen2-7b"])
def test_fit_prints_heldout_mape_within_8_percent(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_path = tmp_path / "coeffs.json"
    assert astrolabe_main(["predictor", "fit", str(PROFILE_CSV_PATH), "--model", model, "-o", str(out_path)]) == 0
    stdout = capsys.readouterr().out
    overall = float(re.search(r"held-out MAPE overall\s+([\d.]+)%", stdout).group(1))
    assert overall <= MAX_HELDOUT_MAPE_PERCENT
    for kind in ("prefill", "decode", "mixed"):
        assert re.search(rf"held-out MAPE {kind}\s+[\d.]+%", stdout)
    fitted = LinearBatchTimeModel.from_json(out_path)
    assert fitted.model == model
    _, heldout = split_holdout(load_profile(PROFILE_CSV_PATH, model))
    assert abs(100 * mape(fitted, heldout) - overall) < 0.01


def test_split_is_fixed_stratified_and_disjoint() -> None:
    rows = load_profile(PROFILE_CSV_PATH, "llama-2-7b")
    train, heldout = split_holdout(rows)
    assert len(train) + len(heldout) == len(rows)
    assert not set(train) & set(heldout)
    assert {r.kind for r in heldout} == {"prefill", "decode", "mixed"}
    assert split_holdout(list(reversed(rows))) == (train, heldout)
    for kind in ("prefill", "decode", "mixed"):  # 1 in 5 of each kind, rounded
        num_rows = sum(r.kind == kind for r in rows)
        assert sum(r.kind == kind for r in heldout) == (num_rows + 2) // 5


def test_fit_errors_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "c.json"
    assert astrolabe_main(["predictor", "fit", str(PROFILE_CSV_PATH), "--model", "no-such", "-o", str(out_path)]) == 1
    assert "no rows for model" in capsys.readouterr().err
    assert not out_path.exists()
    with pytest.raises(SystemExit) as exc_info:
        astrolabe_main(["predictor", "fit", str(PROFILE_CSV_PATH)])
    assert exc_info.value.code == 2


def test_console_entry_point_runs_fit(tmp_path: Path) -> None:
    out_path = tmp_path / "c.json"
    proc = subprocess.run(
        [sys.executable, "-m", "astrolabe", "predictor", "fit", str(PROFILE_CSV_PATH), "--model", "llama-2-7b",
         "-o", str(out_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "held-out MAPE overall" in proc.stdout
    assert out_path.exists()
