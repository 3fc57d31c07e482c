"""Prompt token counts and predicted output tokens for the astrolabe policy."""

import random

import pytest

from extproc.lengths import (
    MAX_TOKENIZED_CHARS,
    OutputLengthConfig,
    OutputLengthEstimator,
    chat_history,
    count_prompt_tokens,
)
from extproc.request import RoutingRequest
from predictor.residual_rules import LENGTH_SOURCE_TAGGER, LENGTH_SOURCE_TAGGER_LATER_TURN
from tagger.features import NO_HISTORY, HistoryStats
from tagger.serve import load_service
from tagger.tokenizer import count_tokens


def req(text=None, ids=None, max_tokens=None, last_user=None, messages=None):
    return RoutingRequest("r", "POST", "/v1/chat/completions", prompt_text=text, prompt_token_ids=ids,
                          max_tokens=max_tokens, last_user_message=last_user, chat_messages=messages)


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
        # the sidecars get it before the cap (they price E[min(L, max_tokens)])
        assert await estimator.estimate_before_cap(req(text=essay, last_user=essay, max_tokens=5)) == (
            long_guess, LENGTH_SOURCE_TAGGER)
    finally:
        service.close()


def test_chat_history_is_every_message_before_the_last_user_message():
    messages = (("system", "be brief"), ("user", "q1"), ("assistant", "a" * 50), ("user", "q2"), ("assistant", "x"))
    assert chat_history(req(messages=messages)) == HistoryStats.of(messages[:3])
    assert chat_history(req(messages=(("user", "only"),))) == NO_HISTORY
    assert chat_history(req(messages=(("system", "s"),))) == NO_HISTORY  # no user message: nothing answers
    assert chat_history(req(text="completions")) == NO_HISTORY


async def test_a_later_turn_is_tagged_with_its_conversation():
    service = load_service(None)
    try:
        estimator = OutputLengthEstimator(OutputLengthConfig(), service)
        question = "Can you explain that in more detail?"
        first = await estimator.estimate(req(text=question, last_user=question, messages=(("user", question),)))
        long_answer = (("user", "Tell me about Rome."), ("assistant", "Rome " * 2000), ("user", question))
        later = await estimator.estimate(req(text=question, last_user=question, messages=long_answer))
        assert later == await service.estimate(question, None, None, HistoryStats.of(long_answer[:2]))
        assert later > first  # an assistant that answered at length is expected to again
    finally:
        service.close()


async def test_a_turn_after_a_reply_is_sent_as_a_later_turn():
    service = load_service(None)
    try:
        estimator = OutputLengthEstimator(OutputLengthConfig(), service)
        q = "What next?"
        sources = [(await estimator.estimate_before_cap(req(text=q, last_user=q, messages=m)))[1] for m in (
            (("user", q),), (("system", "be brief"), ("user", q)),  # a system prompt is not an earlier turn
            (("user", "hi"), ("assistant", "hello"), ("user", q)))]
        assert sources == [LENGTH_SOURCE_TAGGER, LENGTH_SOURCE_TAGGER, LENGTH_SOURCE_TAGGER_LATER_TURN]
        assert (await estimator.estimate_before_cap(req(text=q)))[1] == LENGTH_SOURCE_TAGGER  # completions
    finally:
        service.close()


def test_tagger_source_needs_a_tagger():
    with pytest.raises(ValueError, match="no tagger"):
        OutputLengthEstimator(OutputLengthConfig(source="tagger"))
