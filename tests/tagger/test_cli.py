"""tagger.cli and its registration in `astrolabe`."""

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from astrolabe.cli import SUBCOMMANDS
from astrolabe.cli import main as astrolabe_main
from astrolabe.procs import free_port
from tagger.cli import main
from tagger.serve import SHIPPED_LIGHT_DIR


def test_registered_in_astrolabe():
    assert SUBCOMMANDS["tagger"][0] == "tagger.cli"


def test_eval_prints_the_table_with_both_baselines(capsys):
    assert astrolabe_main(["tagger", "eval", "--tagger", str(SHIPPED_LIGHT_DIR)]) == 0
    out = capsys.readouterr().out
    for needle in ("Kendall τ", "Spearman ρ", "MAE (tokens)", "light tagger", "baseline: global median",
                   "baseline: linreg on prompt length", "within 50", "within 100", "MAPE"):
        assert needle in out


@pytest.mark.parametrize("argv", [["train", "-o", "x"], ["train", "--kind", "gpt", "-o", "x"], []],
                         ids=["no-kind", "bad-kind", "no-command"])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


async def test_serve_process_is_healthy_logs_json_lines_and_stops_on_sigterm(tmp_path):
    port, log = free_port(), tmp_path / "tagger.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "astrolabe", "tagger", "serve", "--listen", f"127.0.0.1:{port}",
                                 "--log-format", "json"], stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), timeout=60)
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(line["message"] == f"tagger (light) serving on port {port}" for line in lines), lines


def test_ceiling_prints_the_noise_and_each_view_beside_the_shipped_tagger(capsys):
    assert main(["ceiling", "--bootstrap", "100"]) == 0
    out = capsys.readouterr().out
    for needle in ("repeated prompts:", "within-prompt sd", "two replies of one prompt", "| first-exchange | ",
                   "| all-exchange | ", "light tagger (shipped)", "100 resamples"):
        assert needle in out
    # scored as `tagger eval` scores it (whole tokens): the README's 0.368 on the first-exchange view
    assert "| first-exchange | 1987 | " in out and out.split("| first-exchange | 1987 | ")[1].split("|")[1].strip() \
        == f"{json.loads((SHIPPED_LIGHT_DIR / 'eval.json').read_text())['first-exchange']['rows'][0]['kendall_tau']:.3f}"


@pytest.mark.parametrize("argv", [["--bootstrap", "0"], ["--bootstrap", "99"], ["--tagger", "/nonexistent"]])
def test_ceiling_refuses_bad_arguments_at_once(argv, tmp_path, caplog):
    assert main(["ceiling", *argv]) == 2
    assert caplog.records and caplog.records[-1].levelname == "ERROR"


@pytest.mark.tagger
@pytest.mark.parametrize("device, cuda_devices, message", [
    ("bogus", 0, "Expected one of"), ("cuda", 0, "no CUDA device"), ("xpu", 0, "not supported"),
    ("mps", 1, "not supported"), ("cuda:7", 1, "no index 7"), ("cpu:1", 0, "no device index but 0")])
def test_train_refuses_a_device_torch_cannot_use_before_loading_data(device, cuda_devices, message, tmp_path,
                                                                     caplog, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda_devices)
    monkeypatch.setattr("tagger.data.load_split", lambda *a, **k: pytest.fail("loaded the split first"))
    assert main(["train", "--kind", "transformer", "--device", device, "-o", str(tmp_path / "t")]) == 2
    assert caplog.records[-1].levelname == "ERROR" and message in caplog.records[-1].getMessage()
    assert not (tmp_path / "t").exists()


@pytest.mark.tagger
def test_a_rank_weight_the_loss_does_not_use_is_warned_about(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("tagger.data.load_split", lambda *a, **k: pytest.fail("loaded the split"))
    main(["train", "--kind", "transformer", "--loss", "mse", "--rank-weight", "3", "--device", "bogus",
          "-o", str(tmp_path / "t")])
    assert any(r.levelname == "WARNING" and "--rank-weight is ignored" in r.getMessage() for r in caplog.records)
    caplog.clear()
    main(["train", "--kind", "transformer", "--loss", "mse+rank", "--rank-weight", "3", "--device", "bogus",
          "-o", str(tmp_path / "t")])
    assert not any(r.levelname == "WARNING" for r in caplog.records)


@pytest.mark.parametrize("argv", [["--max-length", "0"], ["--epochs", "0"], ["--batch-size", "0"], ["--lr", "nan"],
                                  ["--lr", "-1"], ["--threads", "0"], ["--max-train-minutes", "nan"],
                                  ["--max-train-minutes", "0"], ["--max-train-pairs", "0"], ["--rank-weight", "inf"],
                                  ["--alpha", "0"], ["--alpha", "inf"], ["--epochs", "two"]])
def test_train_refuses_numbers_out_of_range_before_loading_data(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("tagger.data.load_split", lambda *a, **k: pytest.fail("loaded the split first"))
    with pytest.raises(SystemExit) as exc:
        main(["train", "--kind", "transformer", *argv, "-o", str(tmp_path / "t")])
    assert exc.value.code == 2 and f"argument {argv[0]}" in capsys.readouterr().err


@pytest.mark.tagger
def test_train_refuses_what_the_default_encoder_cannot_read_and_a_file_as_output(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("tagger.data.load_split", lambda *a, **k: pytest.fail("loaded the split first"))
    assert main(["train", "--kind", "transformer", "--max-length", "600", "-o", str(tmp_path / "t")]) == 2
    assert "reads at most 512 tokens" in caplog.records[-1].getMessage()
    (tmp_path / "afile").write_text("x")
    assert main(["train", "--kind", "light", "-o", str(tmp_path / "afile")]) == 2
    assert "is not a directory" in caplog.records[-1].getMessage()


def test_train_warns_of_options_the_kind_does_not_use(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("tagger.data.load_split", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("stop")))
    with pytest.raises(RuntimeError, match="stop"):
        main(["train", "--kind", "light", "--epochs", "3", "--device", "xpu", "-o", str(tmp_path / "t")])
    assert any("ignored with --kind light: --device, --epochs" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with pytest.raises(RuntimeError, match="stop"):
        main(["train", "--kind", "transformer", "--alpha", "2", "--device", "cpu", "-o", str(tmp_path / "t")])
    assert any("ignored with --kind transformer: --alpha" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("command", ["eval", "serve"])
def test_a_transformer_tagger_without_its_weights_is_one_clear_error(command, tmp_path, caplog, monkeypatch):
    import shutil

    monkeypatch.setattr("tagger.data.load_split", lambda *a, **k: pytest.fail("loaded the split first"))
    shutil.copy(Path(__file__).parents[2] / "bench/results/tagger_encoder_gpu/tagger.json", tmp_path)  # no model/
    argv = [command, "--tagger", str(tmp_path)] + (["--listen", "127.0.0.1:0"] if command == "serve" else [])
    assert main(argv) == 2
    assert "without its weights (model/ is missing)" in caplog.records[-1].getMessage()
    assert main([command, "--tagger", str(tmp_path / "nowhere")] + argv[3:]) == 2
    assert "cannot read tagger metadata" in caplog.records[-1].getMessage()
