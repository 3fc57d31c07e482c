"""Cold start: the shipped step-time model whose architecture is nearest the served model's.

`nearest_shipped_model` reads the served model's Hugging Face ``config.json`` (a file, or a model directory
holding one: ``num_hidden_layers``, ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
``num_key_value_heads``, ``vocab_size``) and picks the shipped shape (`SHIPPED_SHAPES`) at the least distance in
log space over those fields. That model is only where calibration starts (`predictor.calibration`): the shipped
coefficients were measured on an H200, so another GPU, or a CPU, differs by a factor that the online refit
removes within seconds of traffic; nothing scales them here.

Shapes of the shipped models, from their ``config.json`` on the Hugging Face hub: meta-llama/Llama-2-7b-hf,
meta-llama/Meta-Llama-3-8B, Qwen/Qwen2-7B. Imports only the standard library.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
           "vocab_size")

SHIPPED_SHAPES: dict[str, dict[str, int]] = {
    "llama-2-7b": {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 11008,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000},
    "llama-3-8b": {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
    "qwen2-7b": {"num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944,
                 "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064},
}
"""Architecture of each shipped step-time model (``predictor/sim/<name>.json``)."""


def read_model_shape(path: str | Path) -> dict[str, int]:
    """The architecture fields of a ``config.json`` (or a directory holding one) that it has.

    ``num_key_value_heads`` defaults to ``num_attention_heads`` (multi-head attention), as in transformers.
    Nested ``text_config`` (multimodal configs) is read when the top level lacks the fields.

    Raises:
        OSError: unreadable file. ValueError: not JSON (or not UTF-8, or nested too deeply), or no positive
            ``num_hidden_layers``/``hidden_size`` below 2**40 (the message names the file).
    """
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, 4300-digit ints, nesting
        raise ValueError(f"{file}: not a JSON model config: {exc!r}"[:300]) from None
    if isinstance(data, dict) and "hidden_size" not in data and isinstance(data.get("text_config"), dict):
        data = data["text_config"]
    if not isinstance(data, dict):
        raise ValueError(f"{file}: not a JSON object")
    shape = {name: data[name] for name in _FIELDS
             if isinstance(data.get(name), int) and not isinstance(data.get(name), bool) and 0 < data[name] < 2**40}
    if "num_hidden_layers" not in shape or "hidden_size" not in shape:
        raise ValueError(f"{file}: no num_hidden_layers/hidden_size: not a transformer model config")
    shape.setdefault("num_key_value_heads",
                     shape.get("num_attention_heads", 0) or max(shape["hidden_size"] // 128, 1))
    return shape


def nearest_shipped_model(shape: dict[str, int]) -> tuple[str, float]:
    """(name of the nearest shipped model, its distance): the root mean square of log ratios over the fields
    both have (0 = the same architecture)."""
    def distance(reference: dict[str, int]) -> float:
        logs = [math.log(shape[f] / reference[f]) for f in _FIELDS if f in shape]
        return math.sqrt(sum(x * x for x in logs) / len(logs))

    name = min(SHIPPED_SHAPES, key=lambda n: (distance(SHIPPED_SHAPES[n]), n))
    return name, distance(SHIPPED_SHAPES[name])
