"""tagger.data: every exchange with its history, the seeded split by conversation, the first-exchange view."""

import io
import json
import subprocess
import sys

import pytest

from tagger.data import (
    SPLIT_SEED,
    DataError,
    Example,
    conversation_group,
    examples_from_exchanges,
    first_exchange_view,
    load_split,
    split_by_conversation,
)
from tagger.sharegpt import parse_sharegpt_exchanges, record_exchanges


def _turns(*pairs):
    return {"id": "x", "conversations": [{"from": who, "value": text} for who, text in pairs]}


def test_every_exchange_of_a_record_with_the_turns_before_it():
    record = _turns(("system", "be brief"), ("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("human", "q3"),
                    ("gpt", "a3"), ("bing", "late"), ("human", "q4"))
    found = record_exchanges(record)
    assert [(turn, prompt, reply) for turn, prompt, reply, _ in found] == [(1, "q1", "a1"), (4, "q3", "a3")]
    assert found[0][3] == (("system", "be brief"),)
    assert found[1][3] == (("system", "be brief"), ("user", "q1"), ("assistant", "a1"), ("user", "q2"))
    # a record that starts with the assistant (a later part of a cut conversation) keeps its exchanges
    assert [t for t, *_ in record_exchanges(_turns(("gpt", "a0"), ("human", "q1"), ("gpt", "a1")))] == [1]
    assert record_exchanges({"conversations": "nope"}) == [] and record_exchanges(None) == []


def test_parsed_exchanges_count_tokens_of_prompt_and_reply():
    text = json.dumps([_turns(("human", "a b"), ("gpt", "c d e"), ("human", "f"), ("gpt", "g h i j"))])
    exchanges = parse_sharegpt_exchanges(io.StringIO(text), lambda texts: [len(t.split()) for t in texts])
    assert [(e.turn, e.num_prompt_tokens, e.num_output_tokens, len(e.history)) for e in exchanges] == [
        (0, 2, 3, 0), (2, 1, 4, 2)]


def test_examples_drop_blank_prompts_and_empty_replies_but_keep_repeats():
    text = json.dumps([_turns(("human", "hi"), ("gpt", "a"), ("human", " "), ("gpt", "b"), ("human", "hi"),
                              ("gpt", ""), ("human", "hi"), ("gpt", "c"))])
    examples = examples_from_exchanges(parse_sharegpt_exchanges(io.StringIO(text), lambda t: [len(x) for x in t]))
    assert [(e.turn, e.prompt) for e in examples] == [(0, "hi"), (6, "hi")]


def _examples(num_conversations, parts=1):
    out = []
    for c in range(num_conversations):
        for p in range(parts):
            history = ()
            for turn in range(2):
                out.append(Example(f"c{c}_{p}", f"prompt {c}/{p}/{turn}", 2, turn + 1, 2 * turn, history))
                history += (("user", "q"), ("assistant", "a"))
    return out


@pytest.mark.parametrize("n, test_frac, num_test", [(10, 0.2, 2), (2, 0.2, 1), (3, 0.9, 2), (101, 0.2, 20)],
                         ids=["even", "smallest", "large-frac", "rounding"])
def test_split_holds_out_whole_conversations(n, test_frac, num_test):
    split = split_by_conversation(_examples(n, parts=2), seed=7, test_frac=test_frac)
    test_groups = {conversation_group(e.id) for e in split.test}
    assert len(test_groups) == num_test and len(split.train) + len(split.test) == 4 * n
    assert test_groups.isdisjoint({conversation_group(e.id) for e in split.train})  # parts stay together
    assert all(not e.history for e in split.test_first) and len(split.test_first) == 2 * num_test


def test_split_is_reproducible_and_depends_on_seed():
    examples = _examples(50)
    assert split_by_conversation(examples, seed=3) == split_by_conversation(examples, seed=3)
    assert split_by_conversation(examples, seed=3).test != split_by_conversation(examples, seed=4).test


@pytest.mark.parametrize("n, test_frac", [(10, 0.0), (10, 1.0), (1, 0.2)], ids=["zero", "one", "too-few"])
def test_split_rejects_bad_input(n, test_frac):
    with pytest.raises(DataError):
        split_by_conversation(_examples(n), test_frac=test_frac)


def test_first_exchange_view_drops_repeats_and_prompts_that_open_a_training_conversation():
    train = [Example("t", "hi", 1, 5)]
    test = [Example("a", " hi ", 1, 7), Example("b", "write", 1, 9), Example("c", "write", 1, 3),
            Example("d", "later", 1, 4, 2, (("user", "q"), ("assistant", "a")))]
    assert [e.id for e in first_exchange_view(test, train)] == ["b"]


def test_conversation_group_joins_the_parts_of_a_cut_conversation():
    assert conversation_group("QWJhYvA_0") == conversation_group("QWJhYvA_12") == "QWJhYvA"
    assert conversation_group("plain") == "plain"


def test_standard_split_of_sharegpt():
    split = load_split()
    assert split.seed == SPLIT_SEED
    total = len(split.train) + len(split.test)
    assert total > 60_000 and 0.15 < len(split.test) / total < 0.25
    assert {conversation_group(e.id) for e in split.train}.isdisjoint({conversation_group(e.id) for e in split.test})
    assert len(split.test_first) > 1_500 and all(not e.history for e in split.test_first)
    assert not {e.prompt.strip() for e in split.train if not e.history} & {e.prompt.strip() for e in split.test_first}
    assert all(e.num_output_tokens >= 1 for e in split.train + split.test)
    assert sum(1 for e in split.train if e.history) > 30_000  # later turns are most of the data


def test_the_tagger_reads_sharegpt_without_importing_the_benchmarks():
    """Production code must not import bench/: the tagger's data path loads only tagger.sharegpt."""
    code = "import sys, tagger.data; print(sorted(m for m in sys.modules if m.split('.')[0] == 'bench'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
