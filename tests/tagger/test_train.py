"""tagger.train: a complete light tagger directory, and the length-bucketed batches."""

import random

import pytest

import json

import numpy as np

from tagger.artifact import EVAL_FILE, ERRORS_FILE, read_meta
from tagger.errors import FIRST_ERRORS_FILE, LengthErrorModel
from tagger.quantiles import QUANTILE_LEVELS, LengthQuantiles
from tagger.data import load_examples, split_by_conversation
from tagger.serve import load_length_fallback, load_tagger
from tagger.train import length_bucketed_batches, train_light


def test_train_light_writes_a_loadable_directory(tmp_path):
    split = split_by_conversation(load_examples()[:400], seed=1)
    rows = train_light(split, tmp_path)
    assert [r.name for r in rows] == ["light tagger", "baseline: global median", "baseline: linreg on prompt length"]
    assert rows[0].num_examples == len(split.test_first) > 0  # the returned rows are the first-exchange view's
    meta = read_meta(tmp_path)
    assert meta["kind"] == "light" and meta["split_seed"] == 1 and meta["num_train_examples"] == len(split.train)
    assert meta["num_test_examples"] == len(split.test) and meta["num_test_first_examples"] == len(split.test_first)
    report = json.loads((tmp_path / EVAL_FILE).read_text())
    assert set(report["all-exchange"]["coverage"]) == {str(q) for q in QUANTILE_LEVELS}
    assert len(LengthErrorModel.load(tmp_path / ERRORS_FILE).true_tokens) == len(split.test)
    assert len(LengthErrorModel.load(tmp_path / FIRST_ERRORS_FILE).true_tokens) == len(split.test_first)
    quantiles = LengthQuantiles.load(tmp_path)
    assert np.all(np.diff(quantiles.offsets, axis=2) >= 0)
    assert load_tagger(tmp_path).predict_log1p(["hello"]).shape == (1,)
    assert load_length_fallback(tmp_path).intercept == pytest.approx(meta["length_fallback"]["intercept"])


@pytest.mark.parametrize("n, batch_size", [(0, 4), (1, 4), (103, 8)], ids=["empty", "one", "ragged"])
def test_length_bucketed_batches_cover_every_index_once(n, batch_size):
    lengths = [random.Random(i).randrange(1, 200) for i in range(n)]
    batches = length_bucketed_batches(lengths, batch_size, random.Random(0), chunk_batches=3)
    assert sorted(i for b in batches for i in b) == list(range(n))
    assert all(1 <= len(b) <= batch_size for b in batches)
    assert batches == length_bucketed_batches(lengths, batch_size, random.Random(0), chunk_batches=3)
