"""bench.gpu_tagger: the packed split, a CPU run of the GPU fine-tune, and the weights rebuilt from its chunks."""

import json

import numpy as np
import pytest

pytestmark = pytest.mark.tagger


def test_packed_split_keeps_the_views_and_cuts_prompts(tmp_path):
    from bench.gpu_tagger import PROMPT_CHARS, load_packed, write_packed
    from tagger.data import Example, first_exchange_view, split_by_conversation

    examples = [Example(f"c{i // 2}", ("long " * 1000 if i == 0 else f"prompt {i}"), 3, 10 + i, i % 2,
                        (("user", "earlier"),) if i % 2 else ()) for i in range(40)]
    split = split_by_conversation(examples, seed=3)
    write_packed(split, tmp_path)
    packed = load_packed(tmp_path)
    for original, back in ((split.train, packed.train), (split.test, packed.test)):
        assert [(e.id, e.prompt[:PROMPT_CHARS], e.num_output_tokens, e.turn, bool(e.history)) for e in original] \
            == [(e.id, e.prompt, e.num_output_tokens, e.turn, bool(e.history)) for e in back]
    assert max(len(e.prompt) for e in packed.train + packed.test) <= PROMPT_CHARS
    assert [e.id for e in first_exchange_view(packed.test, packed.train)] == [e.id for e in packed.test_first]


def test_a_cpu_run_returns_chunks_that_rebuild_the_chosen_tagger(tmp_path, monkeypatch):
    import bench.gpu_tagger as gpu
    from tagger.data import load_examples, split_by_conversation
    from tagger.model import default_checkpoint
    from tagger.serve import load_tagger

    monkeypatch.setattr(gpu, "CHUNK_BYTES", 20_000_000)  # several chunks from the 87 MB of fp16 weights
    data, out, rebuilt = tmp_path / "data", tmp_path / "out", tmp_path / "tagger"
    split = split_by_conversation(load_examples()[:400], seed=2)
    gpu.write_packed(split, data)
    (data / "minilm").symlink_to(default_checkpoint())
    out.mkdir()
    variants = ({"name": "a", "loss": "mse", "max_length": 16, "epochs": 1},
                {"name": "b", "loss": "mse+rank", "max_length": 16, "epochs": 1, "rank_weight": 2.0})
    gpu.run(data, out, deadline_s=600, device="cpu", variants=variants)
    results = json.loads((out / "results.json").read_text())
    assert [v["name"] for v in results["variants"]] == ["a", "b"] and results["chosen"] in ("a", "b")
    assert set(results["variants"][1]["kendall_tau"]) == {"test-first", "validation-first", "validation-all",
                                                          "test-all"}
    chunks = sorted(out.glob("weights.*"))
    assert len(chunks) >= 2 and all(c.stat().st_size <= 20_000_000 for c in chunks)
    gpu.unpack(out, rebuilt, split)
    meta = json.loads((rebuilt / "tagger.json").read_text())
    assert meta["weights_travelled_as"] == "fp16" and meta["max_length"] == 16
    assert meta["loss"] == ("mse" if results["chosen"] == "a" else "mse+rank")
    from tagger.quantiles import LengthQuantiles

    quantiles = LengthQuantiles.load(rebuilt)  # calibrated on the validation cut the weights never saw
    assert quantiles.offsets.shape[1] == gpu.CALIBRATION_NUM_BINS
    coverage = json.loads((rebuilt / "eval.json").read_text())["all-exchange"]["coverage"]
    assert list(coverage) == [str(level) for level in quantiles.levels]
    assert all(0.0 <= c <= 1.0 for c in coverage.values()) and list(coverage.values()) == sorted(coverage.values())
    prompts = ["Write a poem about the sea.", "yes?", "x " * 300]
    assert np.all(np.isfinite(load_tagger(rebuilt).predict_log1p(prompts)))
    with pytest.raises(ValueError, match="not one safetensors file"):
        for chunk in chunks[1:]:
            chunk.unlink()  # a lost chunk: the rest is not a model
        gpu.unpack(out, tmp_path / "broken", split)


def test_the_command_refuses_unknown_variants_and_missing_inputs(tmp_path, caplog):
    from bench.gpu_tagger import main

    with pytest.raises(SystemExit) as exc:
        main(["run", "--data", str(tmp_path), "-o", str(tmp_path / "out"), "--only", "rank-256,nope"])
    assert exc.value.code == 2
    assert main(["run", "--data", str(tmp_path / "missing"), "-o", str(tmp_path / "out"), "--device", "cpu"]) == 2
    assert main(["unpack", "--from", str(tmp_path), "-o", str(tmp_path / "t")]) == 2
    assert caplog.records[-1].levelname == "ERROR" and "chosen_tagger.json" in caplog.records[-1].getMessage()
    (tmp_path / "chosen_tagger.json").write_text("{}")
    assert main(["unpack", "--from", str(tmp_path), "-o", str(tmp_path / "t")]) == 2
    assert "lacks ['max_length', 'target_mean', 'target_std']" in caplog.records[-1].getMessage()


@pytest.mark.parametrize("argv, message", [
    (["--deadline-s", "nan"], "argument --deadline-s: must be finite"),
    (["--deadline-s", "30"], "argument --deadline-s: must be finite and >= 120"),
    (["--limit", "-5"], "argument --limit: must be >= 1"), (["--device", "nonsense"], "--device nonsense"),
    (["--device", "cuda"], "no CUDA device")])
def test_run_refuses_bad_arguments_before_loading_the_split(argv, message, tmp_path, capsys, monkeypatch):
    import torch

    from bench.gpu_tagger import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("bench.gpu_tagger.load_packed", lambda *a: pytest.fail("loaded the split"))
    with pytest.raises(SystemExit) as exc:
        main(["run", "--data", str(tmp_path), "-o", str(tmp_path / "out"), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_stray_file_beside_the_chunks_is_not_read_as_one(tmp_path):
    from bench.gpu_tagger import _CHUNK_RE

    assert [n for n in ("weights.0", "weights.12", "weights.0.bak", "weights.x", "weights.") if _CHUNK_RE.fullmatch(n)] \
        == ["weights.0", "weights.12"]


def test_a_tau_that_cannot_be_computed_is_null_and_never_chooses(tmp_path):
    import bench.gpu_tagger as gpu
    from tagger.data import load_examples, split_by_conversation
    from tagger.model import default_checkpoint

    data, out = tmp_path / "data", tmp_path / "out"
    split = split_by_conversation(load_examples()[:120], seed=2)
    gpu.write_packed(split, data)  # its validation cut holds one exchange: no pair to rank
    (data / "minilm").symlink_to(default_checkpoint())
    out.mkdir()
    variants = ({"name": "a", "loss": "mse", "max_length": 8, "epochs": 1},)
    with pytest.raises(SystemExit, match="none with a validation Kendall tau"):
        gpu.run(data, out, deadline_s=600, device="cpu", variants=variants)
    results = json.loads((out / "results.json").read_text())  # valid JSON: no bare NaN
    assert results["variants"][0]["kendall_tau"]["validation-first"] is None


@pytest.mark.parametrize("content, message", [
    (b"not gzip", "is not gzip'd JSON"), ("gzip:", "is not gzip'd JSON"), ("gzip:[1, 2]", "not a packed split"),
    ('gzip:{"train": []}', "not a packed split"),
    ('gzip:{"train": [5], "test": [], "test_first": [], "seed": 1, "test_frac": 0.2}', r"train\[0\] is not"),
    ('gzip:{"train": ["abcdef"], "test": [], "test_first": [], "seed": 1, "test_frac": 0.2}', r"train\[0\] is not"),
    ('gzip:{"train": [["c0", "p", 3, null, 0, false]], "test": [], "test_first": [], "seed": 1, "test_frac": 0.2}',
     r"train\[0\] is not"),
])
def test_a_bad_packed_split_is_named_not_a_traceback(content, message, tmp_path):
    import gzip

    from bench.gpu_tagger import load_packed

    data = gzip.compress(content[5:].encode()) if isinstance(content, str) else content
    (tmp_path / "split.json.gz").write_bytes(data[:-4] if content == "gzip:" else data)  # "gzip:": truncated
    with pytest.raises(ValueError, match=message) as exc:
        load_packed(tmp_path)
    assert "split.json.gz" in str(exc.value)


@pytest.mark.parametrize("meta, message", [
    ({"max_length": -5, "target_mean": 5.0, "target_std": 1.0}, "max_length must be an integer in 1..512"),
    ({"max_length": 0, "target_mean": 5.0, "target_std": 1.0}, "max_length must be"),
    ({"max_length": 16.7, "target_mean": 5.0, "target_std": 1.0}, "max_length must be"),
    ({"max_length": None, "target_mean": 5.0, "target_std": 1.0}, "max_length must be"),
    ({"max_length": 16, "target_mean": 5.0, "target_std": 0}, "target_std must be > 0"),
    ({"max_length": 16, "target_mean": "nan", "target_std": 1.0}, "target_mean must be a finite number"),
    ({"max_length": 16, "target_mean": 5.0, "target_std": "abc"}, "target_std must be a finite number"),
])
def test_unpack_refuses_a_bad_chosen_tagger_before_loading_anything(meta, message, tmp_path, monkeypatch):
    import bench.gpu_tagger as gpu

    monkeypatch.setattr("tagger.model.TransformerTagger.from_checkpoint", lambda *a, **k: pytest.fail("loaded"))
    (tmp_path / "chosen_tagger.json").write_text(json.dumps(meta).replace('"nan"', "NaN"))
    (tmp_path / "weights.0").write_bytes(b"x")
    with pytest.raises(ValueError, match=message):
        gpu.unpack(tmp_path, tmp_path / "t", split=None)


@pytest.mark.parametrize("names, message", [
    ((), "no weight chunks"), (("weights.0", "weights.1", "weights.01"), "appears twice"),
    (("weights.0", "weights.1", "weights.4"), r"chunk\(s\) \[2, 3\] missing"), (("weights.1",), r"\[0\] missing")])
def test_unpack_names_a_doubled_or_missing_chunk(names, message, tmp_path):
    from bench.gpu_tagger import _chunks

    for name in names:
        (tmp_path / name).write_bytes(b"x")
    with pytest.raises(ValueError, match=message):
        _chunks(tmp_path)


def test_run_refuses_an_output_directory_holding_an_earlier_run(tmp_path, capsys):
    from bench.gpu_tagger import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "weights.0").write_bytes(b"old")
    with pytest.raises(SystemExit) as exc:
        main(["run", "--data", str(tmp_path), "-o", str(out), "--device", "cpu"])
    assert exc.value.code == 2 and "earlier run's results" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit):
        main(["unpack", "--from", str(tmp_path), "-o", str(tmp_path / "afile")])
    assert "exists and is not a directory" in capsys.readouterr().err
