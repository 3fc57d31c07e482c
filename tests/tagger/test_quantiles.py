"""tagger.quantiles: calibrated per-request quantiles of the reply length, and their coverage."""

import numpy as np
import pytest

from tagger.quantiles import QUANTILE_LEVELS, LengthQuantiles, QuantileError, coverage


def _sample(n, seed):
    """Estimates s, and true lengths log1p(L) = s + noise whose spread is 0.3 for first turns, 1.0 for later ones."""
    rng = np.random.default_rng(seed)
    s = rng.uniform(2, 7, n)
    history = rng.random(n) < 0.5
    true = np.maximum(1, np.rint(np.expm1(s + rng.normal(0, np.where(history, 1.0, 0.3)))))
    return s, true, history


def test_quantiles_are_calibrated_on_new_data_per_group():
    quantiles = LengthQuantiles.fit(*_sample(20_000, 0))
    s, true, history = _sample(20_000, 1)
    q = quantiles.quantiles_batch(s, history)
    assert q.shape == (len(s), len(QUANTILE_LEVELS)) and np.all(np.diff(q, axis=1) >= 0) and np.all(q >= 1)
    for group in (False, True):
        cover = coverage(q[history == group], true[history == group])
        assert np.allclose(cover, QUANTILE_LEVELS, atol=0.03), (group, cover)
    # a later turn's spread (1.0) is wider than a first turn's (0.3): its 90 % interval is too
    first = quantiles.quantile_tokens(4.0, False)
    later = quantiles.quantile_tokens(4.0, True)
    assert later[-2] / later[1] > 3 * first[-2] / first[1]
    assert quantiles.quantile_tokens(4.0, True) == tuple(quantiles.quantiles_batch(np.array([4.0]), [True])[0])


def test_a_group_without_examples_borrows_the_other():
    s, true, _ = _sample(2_000, 2)
    quantiles = LengthQuantiles.fit(s, true, np.zeros(len(s), dtype=bool))
    assert quantiles.quantile_tokens(4.0, True) == quantiles.quantile_tokens(4.0, False)


def test_save_and_load_round_trip(tmp_path):
    quantiles = LengthQuantiles.fit(*_sample(2_000, 3))
    quantiles.save(tmp_path)
    loaded = LengthQuantiles.load(tmp_path)
    assert loaded.levels == quantiles.levels and np.array_equal(loaded.offsets, quantiles.offsets)
    with pytest.raises(QuantileError):
        LengthQuantiles.load(tmp_path / "missing")


@pytest.mark.parametrize("args", [
    ([], [], []), ([1.0, 2.0], [3, 4], [True]), ([1.0], [0], [True]),
], ids=["empty", "mismatched", "zero-length"])
def test_bad_residuals_raise(args):
    with pytest.raises(QuantileError):
        LengthQuantiles.fit(*map(np.asarray, args))


def test_bad_levels_raise():
    with pytest.raises(QuantileError):
        LengthQuantiles.fit(np.ones(3), np.ones(3), np.zeros(3, dtype=bool), levels=(0.5, 0.1))


@pytest.mark.parametrize("change", ["levels-descending", "level-1", "no-levels", "nan-offset", "offsets-decreasing",
                                    "edges-1d", "edges-unsorted", "nan-level", "huge-offset", "levels-2d", "strings",
                                    "truncated", "empty-file"])
def test_a_malformed_file_is_refused_at_load(tmp_path, change):
    good = LengthQuantiles.fit(*_sample(2_000, 3))
    levels, edges, offsets = np.array(good.levels), good.bin_edges.copy(), good.offsets.copy()
    if change == "levels-descending":
        levels = levels[::-1].copy()
    elif change == "level-1":
        levels[-1] = 1.0
    elif change == "no-levels":
        levels, offsets = levels[:0], offsets[:, :, :0]
    elif change == "nan-offset":
        offsets[0, 0, 0] = np.nan
    elif change == "offsets-decreasing":
        offsets[1, 2] = offsets[1, 2, ::-1].copy()
    elif change == "edges-1d":
        edges = edges[0]
    elif change == "edges-unsorted":
        edges[0] = edges[0, ::-1].copy()
    elif change == "nan-level":
        levels[3] = np.nan
    elif change == "huge-offset":
        offsets[:, :, -1] = 700.0
    elif change == "levels-2d":
        levels = levels[None, :]
    elif change == "strings":
        offsets = offsets.astype(str)
    np.savez(tmp_path / "quantiles.npz", levels=levels, bin_edges=edges, offsets=offsets)
    if change == "truncated":
        data = (tmp_path / "quantiles.npz").read_bytes()
        (tmp_path / "quantiles.npz").write_bytes(data[:len(data) // 2])
    elif change == "empty-file":
        (tmp_path / "quantiles.npz").write_bytes(b"")
    with pytest.raises(QuantileError):
        LengthQuantiles.load(tmp_path)


def test_quantiles_never_fall_as_the_estimate_rises():
    estimates, true, history = _sample(6_000, 3)
    # a tagger whose long estimates are too long: higher bins get lower offsets, which drop at every bin edge
    true = np.maximum(1, np.expm1(np.log1p(true) - 0.6 * (estimates - estimates.mean()))).round()
    quantiles = LengthQuantiles.fit(estimates, true, history)
    assert np.any(np.diff(quantiles.offsets, axis=1) < 0)  # the drops this test is about
    grid = np.linspace(0.0, 9.0, 4_000)
    for has_history in (False, True):
        q = quantiles.quantiles_batch(grid, np.full(len(grid), has_history))
        assert np.all(np.diff(q, axis=0) >= -1e-9) and np.all(np.diff(q, axis=1) >= -1e-9)
        assert np.allclose([quantiles.quantile_tokens(x, has_history) for x in grid[::97]], q[::97])
