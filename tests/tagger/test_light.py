"""tagger.light: ridge fit, save/load, the shipped tagger."""

import numpy as np
import pytest

from tagger.artifact import TaggerLoadError, tokens_from_log1p
from tagger.data import Example, load_split
from tagger.evaluate import evaluate_tagger
from tagger.light import LIGHT_FILE, LightTagger
from tagger.serve import SHIPPED_LIGHT_DIR, load_tagger


def _synthetic(n=200):
    """Replies are long for 'essay' prompts and short for 'yes or no' prompts, whatever the prompt length."""
    rng = np.random.default_rng(0)
    examples = []
    for i in range(n):
        filler = " ".join(f"w{j}" for j in rng.integers(0, 50, rng.integers(1, 30)))
        long_reply = i % 2 == 0
        prompt = f"write an essay about {filler}" if long_reply else f"answer yes or no : {filler}"
        examples.append(Example(str(i), prompt, 10, int(rng.integers(600, 900) if long_reply else rng.integers(1, 5))))
    return examples


def test_fit_learns_words_that_predict_length():
    tagger = LightTagger.fit(_synthetic(), alpha=1.0, num_buckets=1 << 12)
    pred = tokens_from_log1p(tagger.predict_log1p(["write an essay about w3 w4", "answer yes or no : w3 w4"]))
    assert pred[0] > 300 and pred[1] < 20


def test_save_load_roundtrip(tmp_path):
    tagger = LightTagger.fit(_synthetic(50), alpha=1.0, num_buckets=1 << 10)
    tagger.save(tmp_path)
    loaded = LightTagger.load(tmp_path)
    prompts = ["write an essay about w1", "", "x" * 5000]
    # weights are stored as float32
    assert np.allclose(loaded.predict_log1p(prompts), tagger.predict_log1p(prompts), atol=1e-4)


@pytest.mark.parametrize("alpha", [0.0, -1.0], ids=["zero", "negative"])
def test_fit_rejects_bad_alpha(alpha):
    with pytest.raises(ValueError):
        LightTagger.fit(_synthetic(10), alpha=alpha)


def test_load_errors(tmp_path):
    with pytest.raises(TaggerLoadError):
        LightTagger.load(tmp_path)
    (tmp_path / LIGHT_FILE).write_bytes(b"not npz")
    with pytest.raises(TaggerLoadError):
        LightTagger.load(tmp_path)
    with pytest.raises(TaggerLoadError):
        load_tagger(tmp_path)  # no tagger.json


def test_shipped_light_tagger_is_small_and_beats_both_baselines():
    assert (SHIPPED_LIGHT_DIR / LIGHT_FILE).stat().st_size < 5 * 2**20
    split = load_split()
    tagger = load_tagger(None)
    assert tagger.kind == "light"
    rows, pred = evaluate_tagger(tagger, split.train, split.test)
    light, median, length = rows
    assert light.mae_tokens < min(median.mae_tokens, length.mae_tokens)
    assert light.kendall_tau > length.kendall_tau + 0.1
    assert pred.shape == (len(split.test),) and pred.min() >= 1
