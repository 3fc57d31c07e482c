"""tagger.serve: batching, caching, capping, fallbacks, off-loop execution."""

import asyncio
import math
import threading

import pytest

from tagger.serve import LengthFallback, TaggerService, cap_tokens, load_service


class RecordingTagger:
    """A real (tiny) tagger: predicts log1p(len(prompt) * 10) and records every batch and its thread."""

    kind = "light"

    def __init__(self, fail=False):
        self.batches = []
        self.histories = []
        self.threads = set()
        self.fail = fail

    def predict_log1p(self, prompts, histories=None):
        self.batches.append(list(prompts))
        self.histories.append(list(histories) if histories is not None else None)
        self.threads.add(threading.current_thread())
        if self.fail:
            raise RuntimeError("model down")
        return [math.log1p(len(p) * 10) for p in prompts]


@pytest.fixture
def make_service():
    services = []

    def make(tagger, **kwargs):
        services.append(TaggerService(tagger, **kwargs))
        return services[-1]

    yield make
    for s in services:
        s.close()


async def test_concurrent_requests_are_batched_off_the_event_loop(make_service):
    tagger = RecordingTagger()
    # a long delay: only the size bound flushes, so the batch count does not depend on timing
    service = make_service(tagger, max_batch_size=4, max_batch_delay_s=60.0)
    results = await asyncio.gather(*(service.estimate("x" * (i + 1)) for i in range(8)))
    assert results == [10 * (i + 1) for i in range(8)]
    assert [len(b) for b in tagger.batches] == [4, 4]
    assert threading.main_thread() not in tagger.threads


async def test_a_lone_request_is_flushed_by_the_delay(make_service):
    tagger = RecordingTagger()
    service = make_service(tagger, max_batch_size=16, max_batch_delay_s=0.0)
    assert await service.estimate("abc") == 30
    assert tagger.batches == [["abc"]]


async def test_cache_hits_skip_the_model_and_are_bounded(make_service):
    tagger = RecordingTagger()
    service = make_service(tagger, cache_size=2, max_batch_delay_s=0.0)
    assert await service.estimate("aa") == 20
    assert await service.estimate("aa", None, 5) == 5  # cached value, new cap
    assert len(tagger.batches) == 1 and service.num_cache_hits == 1
    await service.estimate("bb")
    await service.estimate("cc")  # evicts "aa"
    await service.estimate("aa")
    assert len(tagger.batches) == 4


async def test_duplicate_concurrent_prompts_share_one_prediction(make_service):
    tagger = RecordingTagger()
    service = make_service(tagger, max_batch_delay_s=0.0)
    assert await asyncio.gather(service.estimate("same"), service.estimate("same")) == [40, 40]
    assert tagger.batches == [["same"]]


@pytest.mark.parametrize("text, token_ids, max_tokens, expected", [
    (None, None, None, round(math.expm1(5.0))),
    (None, list(range(math.floor(math.e**2) - 1)), None, round(math.expm1(5.0 + 0.5 * math.log1p(6)))),
    ("", [1, 2], 3, 3),
], ids=["nothing", "token-ids-only", "empty-text-capped"])
async def test_without_text_the_length_fallback_is_used(make_service, text, token_ids, max_tokens, expected):
    tagger = RecordingTagger()
    service = make_service(tagger, length_fallback=LengthFallback(slope=0.5, intercept=5.0))
    assert await service.estimate(text, token_ids, max_tokens) == expected
    assert tagger.batches == []


async def test_model_failure_falls_back_instead_of_raising(make_service):
    service = make_service(RecordingTagger(fail=True), length_fallback=LengthFallback(0.0, math.log1p(42)),
                           max_batch_delay_s=0.0)
    assert await service.estimate("hello", [1, 2, 3], None) == 42


@pytest.mark.parametrize("value, cap, expected", [
    (math.log1p(100), None, 100), (math.log1p(100), 50, 50), (math.log1p(100), 0, 100), (-3.0, None, 1),
    (1e9, None, round(math.expm1(20))),
],
                         ids=["plain", "capped", "zero-cap-ignored", "floor-1", "overflow-guard"])
def test_cap_tokens(value, cap, expected):
    assert cap_tokens(value, cap) == expected


def test_bad_bounds_rejected():
    with pytest.raises(ValueError):
        TaggerService(RecordingTagger(), max_batch_size=0)


async def test_shipped_light_service_end_to_end():
    service = load_service(None)
    try:
        assert service.kind == "light"
        long_ask = await service.estimate("Write a detailed 2000 word essay on the history of Rome.")
        short_ask = await service.estimate("Reply with only yes or no: is 7 prime?")
        assert long_ask > short_ask >= 1
        assert await service.estimate("Write a detailed essay on Rome.", None, 16) <= 16
    finally:
        service.close()


async def test_cheap_models_tag_short_prompts_inline_and_long_ones_in_the_worker(make_service):
    tagger = RecordingTagger()
    service = make_service(tagger, inline_max_chars=20)
    assert await service.estimate("short prompt") == round(math.expm1(math.log1p(120)))
    assert tagger.threads == {threading.current_thread()} and service.num_inline == 1 and service.num_batches == 0
    await service.estimate("x" * 21)  # too long to tag inline: the worker thread
    assert service.num_batches == 1 and len(tagger.threads) == 2
    assert await service.estimate("short prompt") and service.num_cache_hits == 1  # inline results are cached


async def test_inline_model_failure_falls_back(make_service):
    service = make_service(RecordingTagger(fail=True), inline_max_chars=100,
                           length_fallback=LengthFallback(slope=0.0, intercept=math.log1p(7)))
    assert await service.estimate("anything") == 7


def test_light_tagger_service_tags_inline_by_default():
    service = load_service(None)
    try:
        assert service.inline_max_chars > 0
    finally:
        service.close()


async def test_the_history_reaches_the_model_and_keys_the_cache(make_service):
    from tagger.features import HistoryStats

    tagger = RecordingTagger()
    service = make_service(tagger, max_batch_delay_s=0.0)
    history = HistoryStats.of([("user", "q"), ("assistant", "a" * 30)])
    await service.estimate("same")
    await service.estimate("same", None, None, history)
    await service.estimate("same", None, None, history)  # cached under the (prompt, history) key
    assert tagger.batches == [["same"], ["same"]] and service.num_cache_hits == 1
    assert tagger.histories[1] == [history]
