"""tagger.data: de-duplication and the seeded split."""

import subprocess
import sys

import pytest

from tagger.data import SPLIT_SEED, DataError, Example, examples_from_pairs, load_split, split_examples
from tagger.sharegpt import SharegptPair


def _pair(i, prompt, num_output_tokens=10):
    return SharegptPair(id=f"c{i}", prompt=prompt, num_prompt_tokens=3, num_output_tokens=num_output_tokens)


def test_examples_keep_first_of_duplicate_prompts_and_drop_empty():
    pairs = [_pair(0, "hi", 5), _pair(1, "  hi \n", 500), _pair(2, "", 9), _pair(3, "write", 0), _pair(4, "b", 7)]
    examples = examples_from_pairs(pairs)
    assert [(e.id, e.num_output_tokens) for e in examples] == [("c0", 5), ("c4", 7)]


def _examples(n):
    return [Example(f"c{i}", f"prompt {i}", 2, i + 1) for i in range(n)]


@pytest.mark.parametrize("n, test_frac, num_test", [(10, 0.2, 2), (2, 0.2, 1), (3, 0.9, 2), (101, 0.2, 20)],
                         ids=["even", "smallest", "large-frac", "rounding"])
def test_split_sizes_and_disjoint(n, test_frac, num_test):
    split = split_examples(_examples(n), seed=7, test_frac=test_frac)
    assert len(split.test) == num_test and len(split.train) == n - num_test
    assert {e.id for e in split.train}.isdisjoint({e.id for e in split.test})


def test_split_is_reproducible_and_depends_on_seed():
    examples = _examples(50)
    assert split_examples(examples, seed=3) == split_examples(examples, seed=3)
    assert split_examples(examples, seed=3).test != split_examples(examples, seed=4).test


@pytest.mark.parametrize("n, test_frac", [(10, 0.0), (10, 1.0), (1, 0.2)], ids=["zero", "one", "too-few"])
def test_split_rejects_bad_input(n, test_frac):
    with pytest.raises(DataError):
        split_examples(_examples(n), test_frac=test_frac)


def test_standard_split_of_sharegpt():
    split = load_split()
    assert split.seed == SPLIT_SEED
    assert len(split.test) == round(0.2 * (len(split.train) + len(split.test)))
    prompts_train = {e.prompt.strip() for e in split.train}
    assert not prompts_train & {e.prompt.strip() for e in split.test}
    assert all(e.num_output_tokens >= 1 for e in split.train + split.test)


def test_the_tagger_reads_sharegpt_without_importing_the_benchmarks():
    """Production code must not import bench/: the tagger's data path loads only tagger.sharegpt."""
    code = "import sys, tagger.data; print(sorted(m for m in sys.modules if m.split('.')[0] == 'bench'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
