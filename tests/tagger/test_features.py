"""tagger.features: stable hashing, normalisation, truncation."""

import numpy as np
import pytest

from tagger.features import DENSE_NAMES, MAX_WORDS, featurize, words


def test_words_lowercase_and_split_punctuation():
    assert words("Hello, World!\nOK") == ["hello", ",", "world", "!", "ok"]


def test_features_are_deterministic_and_normalised():
    a = featurize(["Write a poem about the sea.", "hi"], num_buckets=1 << 12)
    b = featurize(["Write a poem about the sea.", "hi"], num_buckets=1 << 12)
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a.values, b.values)
    for i in range(a.num_rows):
        row = a.values[a.indptr[i] : a.indptr[i + 1]]
        assert np.isclose(np.linalg.norm(row), 1.0)
    # "write a poem about the sea ." gives 7 unigrams + 6 bigrams (collisions could only merge buckets)
    assert 1 <= a.indptr[1] <= 13
    assert a.dense.shape == (2, len(DENSE_NAMES))
    assert np.all(a.indices < 1 << 12)


def test_empty_prompt_has_no_ngrams():
    batch = featurize([""])
    assert batch.indptr.tolist() == [0, 0] and batch.dense[0, 0] == 0.0
    assert batch.row_ids().tolist() == []


def test_long_prompt_is_bounded_but_length_features_see_everything():
    long_text = " ".join(f"w{i}" for i in range(10 * MAX_WORDS))
    batch = featurize([long_text])
    assert batch.indptr[1] <= 2 * MAX_WORDS
    assert np.isclose(batch.dense[0, 0], np.log1p(10 * MAX_WORDS))


def test_history_stats_read_roles_and_sizes_only():
    from tagger.features import HISTORY_NAMES, NO_HISTORY, HistoryStats

    history = [("system", "be brief"), ("user", "q" * 10), ("assistant", "a" * 100), ("user", "r"),
               ("assistant", "b" * 20)]
    stats = HistoryStats.of(history)
    assert stats == HistoryStats.from_sizes([(role, len(text)) for role, text in history])
    assert (stats.num_messages, stats.num_chars, stats.num_replies, stats.last_reply_chars) == (5, 139, 2, 20)
    features = stats.features()
    assert len(features) == len(HISTORY_NAMES) and features[-1] == 1.0
    assert NO_HISTORY.features() == [0.0] * len(HISTORY_NAMES) == HistoryStats.of([]).features()


def test_featurize_puts_the_history_in_the_dense_columns_and_checks_lengths():
    from tagger.features import DENSE_NAMES, PROMPT_NAMES, HistoryStats, featurize

    batch = featurize(["hello there", "hello there"], 1024, [HistoryStats(), HistoryStats.of([("assistant", "x")])])
    assert batch.dense.shape == (2, len(DENSE_NAMES))
    assert np.array_equal(batch.dense[0, :len(PROMPT_NAMES)], batch.dense[1, :len(PROMPT_NAMES)])
    assert not np.any(batch.dense[0, len(PROMPT_NAMES):]) and np.any(batch.dense[1, len(PROMPT_NAMES):])
    with pytest.raises(ValueError):
        featurize(["a", "b"], 1024, [HistoryStats()])
    taken = batch.take(np.array([1]))
    assert taken.num_rows == 1 and np.array_equal(taken.dense[0], batch.dense[1])
