"""tagger.errors: the measured error model."""

import random

import numpy as np
import pytest

from tagger.errors import ErrorModelError, LengthErrorModel


def test_errors_are_conditioned_on_true_length(tmp_path):
    true = np.array([10] * 50 + [1000] * 50)
    pred = np.array([20] * 50 + [500] * 50)  # short over-predicted x2, long under-predicted x0.5
    model = LengthErrorModel.from_predictions(pred, true, num_bins=2)
    rng = random.Random(0)
    assert {model.sample(10, rng) for _ in range(20)} == {20}
    assert {model.sample(1000, rng) for _ in range(20)} == {500}
    assert model.sample(1000, rng, max_tokens=300) == 300
    loaded = LengthErrorModel.load(model.save(tmp_path))
    assert loaded.sample(10, random.Random(1)) == 20
    assert LengthErrorModel.load(tmp_path).quantiles((0.5,))[0.5] == pytest.approx(1.0)  # halves of x2 and x0.5


def test_same_seed_same_samples():
    rng_true = np.random.default_rng(1)
    true = rng_true.integers(1, 1000, 500)
    model = LengthErrorModel.from_predictions(true * rng_true.uniform(0.5, 2, 500) + 1, true)
    a = [model.sample(300, random.Random(5)) for _ in range(3)]
    assert a == [model.sample(300, random.Random(5)) for _ in range(3)]


@pytest.mark.parametrize("pred, true", [([], []), ([1, 2], [1]), ([0], [5])], ids=["empty", "shape", "zero"])
def test_rejects_bad_samples(pred, true):
    with pytest.raises(ErrorModelError):
        LengthErrorModel.from_predictions(np.array(pred), np.array(true))


def test_load_missing_file(tmp_path):
    with pytest.raises(ErrorModelError):
        LengthErrorModel.load(tmp_path / "nope.npz")


def test_shipped_light_tagger_has_an_error_sample():
    from tagger.serve import SHIPPED_LIGHT_DIR

    model = LengthErrorModel.load(SHIPPED_LIGHT_DIR)
    assert sum(len(b) for b in model.log_errors_by_bin) > 1000
    assert 1 <= model.sample(200, random.Random(0))
