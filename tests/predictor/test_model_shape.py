"""Tests for predictor/model_shape.py: the cold-start model is chosen from the served model's config."""

import json

import pytest

from predictor.model_shape import SHIPPED_SHAPES, nearest_shipped_model, read_model_shape
from predictor.sim.batch_time import known_models


def test_every_shipped_model_has_a_shape_and_finds_itself():
    assert sorted(SHIPPED_SHAPES) == known_models()
    for name, shape in SHIPPED_SHAPES.items():
        assert nearest_shipped_model(shape) == (name, 0.0)


def test_a_config_file_or_directory_is_read_and_the_nearest_shape_chosen(tmp_path):
    # Mistral-7B-v0.1's config.json: grouped-query attention with 8 KV heads, like Llama-3-8B.
    mistral = {"architectures": ["MistralForCausalLM"], "num_hidden_layers": 32, "hidden_size": 4096,
               "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
               "vocab_size": 32000}
    (tmp_path / "config.json").write_text(json.dumps(mistral))
    shape = read_model_shape(tmp_path)
    assert nearest_shipped_model(shape)[0] == "llama-3-8b"
    mha = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4}  # no KV heads: MHA
    (tmp_path / "tiny.json").write_text(json.dumps(mha))
    assert read_model_shape(tmp_path / "tiny.json")["num_key_value_heads"] == 4
    nested = {"text_config": {"num_hidden_layers": 28, "hidden_size": 3584, "num_key_value_heads": 4}}
    (tmp_path / "vl.json").write_text(json.dumps(nested))
    assert nearest_shipped_model(read_model_shape(tmp_path / "vl.json"))[0] == "qwen2-7b"


@pytest.mark.parametrize("text", ["not json", "[]", json.dumps({"model_type": "bert"})])
def test_a_config_that_is_not_a_transformer_is_refused(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError):
        read_model_shape(tmp_path / "config.json")
