"""ShareGPT requests sized for the tiny vLLM model (context 256 tokens): prompts truncated, outputs capped.

Used by the vLLM test tier (``tests/vllm``), ``bench/accuracy.py`` and the demo's vLLM backend. Token counts are
``tagger.tokenizer``'s, which is also the tiny model's tokenizer (``deploy/vllm/make_tiny_model.py``), so the
engine sees exactly ``num_prompt_tokens`` prompt tokens on ``/v1/completions``.
"""

from __future__ import annotations

import logging
import random

from bench.workloads import TraceRequest, arrival_offsets_s
from tagger.sharegpt import SharegptPair, load_sharegpt_pairs
from tagger.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)


def truncate_prompt(text: str, max_prompt_tokens: int) -> tuple[str, int]:
    """The longest prefix of ``text`` with at most ``max_prompt_tokens`` tokens, and its token count.

    Raises:
        ValueError: ``max_prompt_tokens < 1``.
    """
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    encoding = get_tokenizer().encode(text, add_special_tokens=False)
    if len(encoding.ids) <= max_prompt_tokens:
        return text, len(encoding.ids)
    end = encoding.offsets[max_prompt_tokens - 1][1]
    prefix = text[:end]
    # Re-count: a cut inside a word can tokenize differently than the same word whole.
    return prefix, len(get_tokenizer().encode(prefix, add_special_tokens=False).ids)


def tiny_trace(num_requests: int, rate_qps: float, rng: random.Random, *, max_prompt_tokens: int = 128,
               max_output_tokens: int = 96, pairs: list[SharegptPair] | None = None) -> list[TraceRequest]:
    """A Poisson trace of ShareGPT first turns, prompts truncated to ``max_prompt_tokens``, outputs capped.

    Args:
        num_requests: trace length.
        rate_qps: mean arrival rate, requests per second.
        rng: seeded source of the sample and the arrivals.
        max_prompt_tokens: prompt cap, tokens (prompt + output must fit the server's max_model_len).
        max_output_tokens: output cap, tokens (sent as ``max_tokens`` with ``ignore_eos``).
        pairs: ShareGPT pairs; None = load them (``tagger.sharegpt.load_sharegpt_pairs``).
    """
    pairs = pairs if pairs is not None else load_sharegpt_pairs()
    chosen = rng.sample(pairs, num_requests) if num_requests <= len(pairs) else rng.choices(pairs, k=num_requests)
    offsets_s = arrival_offsets_s(num_requests, rate_qps, rng)
    trace = []
    for index, (pair, offset_s) in enumerate(zip(chosen, offsets_s, strict=True)):
        prompt, num_prompt_tokens = truncate_prompt(pair.prompt, max_prompt_tokens)
        if num_prompt_tokens < 1:
            prompt, num_prompt_tokens = "hello", 1
        trace.append(TraceRequest(offset_s, prompt, num_prompt_tokens,
                                  max(1, min(pair.num_output_tokens, max_output_tokens)), f"{index}:{pair.id}"))
    return trace
