"""ShareGPT prompts truncated for the tiny vLLM model: token counts exact and within the caps."""

import random

import pytest

from bench.vllm_trace import tiny_trace, truncate_prompt
from tagger.sharegpt import SharegptPair
from tagger.tokenizer import count_tokens


@pytest.mark.parametrize("text, cap", [("one two three four five", 3), ("short", 10), ("unbelievably long", 2)],
                         ids=["words", "under-cap", "cut-inside-a-word"])
def test_truncate_prompt_counts_what_it_returns(text, cap):
    prefix, num_tokens = truncate_prompt(text, cap)
    assert text.startswith(prefix) and num_tokens == count_tokens(prefix) and 1 <= num_tokens <= cap


def test_truncate_prompt_rejects_a_zero_cap():
    with pytest.raises(ValueError):
        truncate_prompt("text", 0)


def test_tiny_trace_respects_the_caps_and_the_seed():
    pairs = [SharegptPair(f"id{i}", "word " * (50 + 40 * i), 50 + 40 * i, 10 + 30 * i) for i in range(8)]
    trace = tiny_trace(6, 2.0, random.Random(3), max_prompt_tokens=64, max_output_tokens=40, pairs=pairs)
    assert len(trace) == 6 and trace == tiny_trace(6, 2.0, random.Random(3), max_prompt_tokens=64,
                                                   max_output_tokens=40, pairs=pairs)
    assert all(r.num_prompt_tokens <= 64 and r.num_prompt_tokens == count_tokens(r.prompt) for r in trace)
    assert all(1 <= r.num_output_tokens <= 40 for r in trace)
    assert [r.arrival_offset_s for r in trace] == sorted(r.arrival_offset_s for r in trace)
