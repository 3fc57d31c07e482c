"""Prompt token counts and predicted output tokens for the astrolabe policy."""

import random

import pytest

from extproc.lengths import MAX_TOKENIZED_CHARS, OutputLengthConfig, OutputLengthEstimator, count_prompt_tokens
from extproc.request import RoutingRequest
from tagger.serve import load_service
from tagger.tokenizer import count_tokens


def req(text=None, ids=None, max_tokens=None, last_user=None):
    return RoutingRequest("r", "POST", "/v1/chat/completions", prompt_text=text, prompt_token_ids=ids,
                          max_tokens=max_tokens, last_user_message=last_user)


def test_prompt_tokens_exact_for_ids_and_short_texts():
    assert count_prompt_tokens(req(ids=(1, 2, 3))) == 3
    assert count_prompt_tokens(req(text="hello world")) == count_tokens("hello world")
    assert count_prompt_tokens(req(text="")) == 1


def test_long_prompt_is_extrapolated_close_to_the_exact_count():
    rng = random.Random(0)
    words = ["routing", "tokens", "the", "of", "prediction", "xylophone", "batch", "42", "KV-cache"]
    text = " ".join(rng.choice(words) for _ in range(30_000))
    assert len(text) > 10 * MAX_TOKENIZED_CHARS
    exact = count_tokens(text)
    assert count_prompt_tokens(req(text=text)) == pytest.approx(exact, rel=0.05)


@pytest.mark.parametrize(
    "source, max_tokens, expected",
    [("fixed", None, 256), ("fixed", 40, 40), ("oracle", 123, 123), ("oracle", None, 256)],
    ids=["fixed", "fixed-capped", "oracle", "oracle-without-max-tokens"],
)
async def test_sources(source, max_tokens, expected):
    estimator = OutputLengthEstimator(OutputLengthConfig(source=source))
    assert await estimator.estimate(req(text="hi", max_tokens=max_tokens)) == expected


async def test_tagger_source_reads_the_last_user_message_and_is_capped():
    service = load_service(None)  # the shipped light tagger
    try:
        estimator = OutputLengthEstimator(OutputLengthConfig(), service)
        assert estimator.config.source == "tagger"
        essay = "Write a detailed 2000 word essay about the history of the Roman empire, with sections."
        long_guess = await estimator.estimate(req(text="system prompt\n" + essay, last_user=essay))
        assert long_guess == await service.estimate(essay)
        assert await estimator.estimate(req(text=essay, last_user=essay, max_tokens=5)) == 5
    finally:
        service.close()


def test_tagger_source_needs_a_tagger():
    with pytest.raises(ValueError, match="no tagger"):
        OutputLengthEstimator(OutputLengthConfig(source="tagger"))
