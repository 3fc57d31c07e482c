"""Tests for bench/emulator/tokens.py: prompt ids, deterministic replies that tokenize back to their ids, keys."""

from __future__ import annotations

from bench.emulator.tokens import (
    PAD_TOKEN_ID,
    RecordedReply,
    Reply,
    prompt_token_ids,
    reply_text,
    reply_token_ids,
    reply_vocabulary,
    request_block_keys,
)
from predictor.sim.block_hash import block_keys
from tagger.tokenizer import count_tokens


def test_prompt_ids_are_the_shipped_tokenizers_without_special_tokens() -> None:
    text = "The quick brown fox jumps over the lazy dog, twice."
    ids = prompt_token_ids(text)
    assert len(ids) == count_tokens(text) and prompt_token_ids(text + " again")[:len(ids)] == ids
    assert prompt_token_ids("") == [PAD_TOKEN_ID]  # an engine request has at least one token


def test_a_reply_is_a_function_of_the_prompt_and_a_shorter_reply_is_a_prefix() -> None:
    prompt = prompt_token_ids("tell me a story")
    assert reply_token_ids(prompt, 50) == reply_token_ids(list(prompt), 50)
    assert reply_token_ids(prompt, 20) == reply_token_ids(prompt, 50)[:20]
    assert reply_token_ids(prompt_token_ids("tell me a joke"), 50) != reply_token_ids(prompt, 50)
    ids, words = reply_vocabulary()
    assert len(set(ids)) == len(ids) > 100 and all(w.isalpha() and w.islower() for w in words)


def test_reply_text_tokenizes_back_to_the_reply_ids_piece_by_piece() -> None:
    prompt = prompt_token_ids("user: hi\nassistant:")
    reply = reply_token_ids(prompt, 300)
    text = reply_text(reply)
    assert prompt_token_ids(text) == reply
    assert reply_text(reply[:7]) + reply_text(reply[7:]) == text  # streamed pieces concatenate to the text
    # A next chat turn that resends the reply: its prompt is the previous prompt, the reply, the new message.
    next_turn = prompt_token_ids(f"user: hi\nassistant: {text}\nuser: more\nassistant:")
    assert next_turn[:len(prompt) + len(reply)] == prompt + reply


def test_block_keys_cover_the_full_blocks_of_prompt_and_reply() -> None:
    prompt, reply = list(range(1000, 1050)), list(range(2000, 2030))
    keys = request_block_keys(prompt, reply, 16)
    assert len(keys) == 80 // 16 and keys == block_keys(prompt + reply, 16)
    assert request_block_keys(prompt, [], 16) == keys[:50 // 16]


RECORDED = "Sure! Here's a short poem:\n\nThe sea, the sea — unendingly blue,\nwhispers of salt-spray, 3.5 knots true."


def test_a_recorded_reply_is_generated_token_for_token_with_its_own_text() -> None:
    recorded = RecordedReply.of(RECORDED)
    n = len(recorded.token_ids)
    assert list(recorded.token_ids) == prompt_token_ids(RECORDED) and n > 20
    prompt = prompt_token_ids("user: a poem please\nassistant:")
    reply = Reply(prompt, n, recorded)
    assert reply.token_ids == list(recorded.token_ids) and reply.text(0, n) == RECORDED
    assert "".join(reply.text(i, min(i + 3, n)) for i in range(0, n, 3)) == RECORDED  # streamed in pieces
    capped = Reply(prompt, 10, recorded)
    assert capped.token_ids == reply.token_ids[:10] and prompt_token_ids(capped.text(0, 10)) == capped.token_ids
    longer = Reply(prompt, n + 5, recorded)  # past the recorded text: generated words
    assert longer.token_ids[:n] == reply.token_ids and longer.text(0, n + 5).startswith(RECORDED)
    assert prompt_token_ids(longer.text(0, n + 5)) == longer.token_ids
    assert longer.text(n - 2, n + 5) == reply.text(n - 2, n) + longer.text(n, n + 5)
    assert Reply(prompt, 4).token_ids == reply_token_ids(prompt, 4)  # no recorded reply: generated words
    assert RecordedReply.of("").token_ids == () and Reply(prompt, 2, RecordedReply.of("")).text(0, 2)
