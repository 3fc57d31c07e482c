"""predictor.engine_flags: the vLLM engine-limit flags give the EngineConfig they name, as vLLM spells them."""

import argparse

import pytest

from predictor.engine_flags import add_engine_arguments, engine_from_args
from predictor.sim import EngineConfig


def _engine(argv, defaults=None) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, defaults)
    return engine_from_args(parser.parse_args(argv))


@pytest.mark.parametrize(("argv", "expected"), [
    ([], EngineConfig()),
    (["--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--block-size", "32", "--num-gpu-blocks", "64"],
     EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=32, num_gpu_blocks=64)),
    (["--no-enable-chunked-prefill"], EngineConfig(enable_chunked_prefill=False)),
    (["--no-enable-chunked-prefill", "--enable-chunked-prefill"], EngineConfig()),
], ids=["defaults", "limits", "no-chunked-prefill", "last-wins"])
def test_flags_give_the_engine_config(argv, expected):
    assert _engine(argv) == expected


def test_the_command_s_defaults_are_the_flags_defaults():
    defaults = EngineConfig(num_gpu_blocks=1024, enable_chunked_prefill=False)
    assert _engine([], defaults) == defaults


def test_a_limit_out_of_range_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        _engine(["--max-num-seqs", "64", "--max-num-batched-tokens", "32"])
