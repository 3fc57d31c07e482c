"""Tests for predictor.sim.block_hash: the block-key chain's prefix properties and its stability."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.sim.block_hash import block_key, block_keys

TOKENS = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=80)


@settings(max_examples=200, deadline=None)
@given(TOKENS, TOKENS, st.integers(1, 8))
def test_keys_are_equal_exactly_up_to_the_first_block_that_differs(a, b, block_size):
    keys_a, keys_b = block_keys(a, block_size), block_keys(b, block_size)
    assert len(keys_a) == len(a) // block_size  # a partial last block has no key
    for i in range(min(len(keys_a), len(keys_b))):
        same_prefix = a[:(i + 1) * block_size] == b[:(i + 1) * block_size]
        assert (keys_a[i] == keys_b[i]) == same_prefix


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=16, max_size=64), st.data())
def test_one_changed_token_changes_its_block_and_every_later_key(tokens, data):
    block_size = 4
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] += 1
    keys, changed_keys = block_keys(tokens, block_size), block_keys(changed, block_size)
    first_changed = position // block_size
    assert keys[:first_changed] == changed_keys[:first_changed]
    assert all(k != c for k, c in zip(keys[first_changed:], changed_keys[first_changed:]))


def test_extra_keys_change_every_key_and_a_shared_prefix_keeps_keys():
    tokens = list(range(40))
    plain = block_keys(tokens, 8)
    salted = block_keys(tokens, 8, extra_keys=("salt-1",))
    lora = block_keys(tokens, 8, extra_keys=("adapter-a",))
    assert len(plain) == 5
    assert all(p != s for p, s in zip(plain, salted))
    assert all(s != lo for s, lo in zip(salted, lora))
    assert block_keys(tokens[:35], 8) == plain[:4]
    assert block_keys(tokens + [7, 7, 7], 8)[:5] == plain
    # tagged encodings: ("ab", "c") is not ("a", "bc"), 1 is not "1"
    assert block_key(None, [1], ("ab", "c")) != block_key(None, [1], ("a", "bc"))
    assert block_key(None, [1], (1,)) != block_key(None, [1], ("1",))


def test_keys_are_64_bit_and_the_same_in_another_process():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    keys = block_keys(tokens, 4, extra_keys=("x",))
    assert all(0 <= k < 2**64 for k in keys)
    # vLLM's own hashes depend on PYTHONHASHSEED; ours must not.
    code = "from predictor.sim.block_hash import block_keys; print(block_keys([3,1,4,1,5,9,2,6], 4, ('x',)))"
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": ""}, cwd=Path(__file__).parents[3])
        assert out.stdout.strip() == repr(keys)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (([1, -1], 2), ValueError),
        (([1, 2**32], 2), ValueError),
        (([1, 2], 0), ValueError),
    ],
)
def test_bad_input_is_a_clear_error(args, error):
    with pytest.raises(error):
        block_keys(*args)


def test_bad_extra_key_and_parent_are_rejected():
    with pytest.raises(TypeError):
        block_key(None, [1], (1.5,))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        block_key(None, [1], (True,))
    with pytest.raises(ValueError):
        block_key(-1, [1])
