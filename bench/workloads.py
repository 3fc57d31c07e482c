"""Request traces built from ShareGPT pairs: filters, arrival processes and seeded sampling.

Owns: choosing the pairs (``tagger.sharegpt.SharegptPair``, read by ``tagger.sharegpt.load_sharegpt_pairs``) a
server's context can hold, and sampling a seeded arrival trace (Poisson, Gamma or uniform gaps) from them.
Imports only the stdlib and ``tagger.sharegpt``; must not import aiohttp, gRPC or anything that starts processes.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from pathlib import Path

from tagger.sharegpt import SharegptPair

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repository root (benchmarks keep their outputs and caches under its git-ignored ``.cache/``)."""


class WorkloadError(ValueError):
    """A trace cannot be built from the given pairs and parameters."""


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a replay trace.

    Attributes:
        arrival_offset_s: send time in seconds after the replay starts (non-decreasing along a trace).
        prompt: the user message.
        num_prompt_tokens: tokens in ``prompt`` (``tagger.tokenizer``).
        num_output_tokens: tokens the reply has (the trace's true length).
        id: unique within the trace: ``"<index>:<sharegpt id>"``.
        max_tokens: the ``max_tokens`` cap the client sends; None = send ``num_output_tokens`` itself with
            ``ignore_eos`` (what an oracle length source needs; real vLLM honours it too). With a cap, the
            emulator is told the reply length through its test hook (``x-emulator-output-tokens``), which the
            router never reads: the router sees only what a real client would send.
        router: which router replica (gateway) the client sends it to, an index into the replay's base URLs.
    """

    arrival_offset_s: float
    prompt: str
    num_prompt_tokens: int
    num_output_tokens: int
    id: str
    max_tokens: int | None = None
    router: int = 0


def filter_pairs(
    pairs: Sequence[SharegptPair],
    *,
    min_prompt_tokens: int = 1,
    min_output_tokens: int = 1,
    max_model_len: int = 4096,
) -> list[SharegptPair]:
    """Pairs whose lengths a server with context ``max_model_len`` can serve.

    Args:
        pairs: candidate pairs.
        min_prompt_tokens: smallest accepted prompt, tokens.
        min_output_tokens: smallest accepted reply, tokens.
        max_model_len: largest accepted prompt + reply, tokens (vLLM's ``max_model_len``).

    Returns:
        The accepted pairs, input order.
    """
    return [
        p
        for p in pairs
        if p.num_prompt_tokens >= min_prompt_tokens
        and p.num_output_tokens >= min_output_tokens
        and p.num_prompt_tokens + p.num_output_tokens <= max_model_len
    ]


def arrival_offsets_s(
    num_requests: int, rate_qps: float, rng: random.Random, arrival: str = "poisson", *, cv: float = 1.0
) -> list[float]:
    """Send times of ``num_requests`` requests at mean rate ``rate_qps``.

    Args:
        num_requests: number of arrivals.
        rate_qps: mean arrival rate, requests per second (> 0).
        rng: seeded source of randomness (used for ``"poisson"`` and ``"gamma"``).
        arrival: ``"poisson"`` (exponential gaps; the first request waits one gap too), ``"gamma"`` (Gamma
            gaps with mean ``1 / rate_qps`` and coefficient of variation ``cv``: shape 1/cv², scale
            cv²/rate_qps; cv > 1 is burstier than Poisson, cv = 1 is Poisson) or ``"uniform"`` (constant gap
            ``1 / rate_qps``, first at 0).
        cv: coefficient of variation (std / mean) of the gaps for ``"gamma"`` (> 0); ignored otherwise.

    Returns:
        Non-decreasing offsets in seconds from the start of the replay.

    Raises:
        WorkloadError: ``rate_qps`` or ``cv`` is not positive, or ``arrival`` is unknown.
    """
    if not rate_qps > 0:
        raise WorkloadError(f"rate_qps must be > 0, got {rate_qps}")
    if arrival == "gamma":
        if not cv > 0:
            raise WorkloadError(f"cv must be > 0, got {cv}")
        shape = 1.0 / (cv * cv)
        scale_s = cv * cv / rate_qps
        offsets, t_s = [], 0.0
        for _ in range(num_requests):
            t_s += rng.gammavariate(shape, scale_s)
            offsets.append(t_s)
        return offsets
    if arrival == "poisson":
        offsets, t_s = [], 0.0
        for _ in range(num_requests):
            t_s += rng.expovariate(rate_qps)
            offsets.append(t_s)
        return offsets
    if arrival == "uniform":
        return [i / rate_qps for i in range(num_requests)]
    raise WorkloadError(f"arrival must be 'poisson', 'gamma' or 'uniform', got {arrival!r}")


def build_trace(
    pairs: Sequence[SharegptPair],
    num_requests: int,
    rate_qps: float,
    rng: random.Random,
    arrival: str = "poisson",
    *,
    max_output_tokens: int | None = None,
    cv: float = 1.0,
) -> list[TraceRequest]:
    """Sample a replay trace from ``pairs``; the same seed gives the same trace.

    Pairs are drawn without replacement when ``num_requests <= len(pairs)``, with replacement otherwise.

    Args:
        pairs: pairs to sample from (already filtered).
        num_requests: trace length (>= 0).
        rate_qps: mean arrival rate, requests per second (> 0).
        rng: seeded source of randomness for both sampling and arrivals.
        arrival: ``"poisson"``, ``"gamma"`` or ``"uniform"``, see :func:`arrival_offsets_s`.
        max_output_tokens: if set, each request's output is clipped to this many tokens.
        cv: coefficient of variation of the gaps for ``"gamma"``.

    Returns:
        Requests in arrival order.

    Raises:
        WorkloadError: no pairs, negative ``num_requests``, non-positive rate or cap, or unknown ``arrival``.
    """
    if num_requests < 0:
        raise WorkloadError(f"num_requests must be >= 0, got {num_requests}")
    if not pairs and num_requests:
        raise WorkloadError("no pairs to sample from")
    if max_output_tokens is not None and max_output_tokens < 1:
        raise WorkloadError(f"max_output_tokens must be >= 1, got {max_output_tokens}")
    if num_requests <= len(pairs):
        chosen = rng.sample(list(pairs), num_requests)
    else:
        chosen = rng.choices(list(pairs), k=num_requests)
    offsets_s = arrival_offsets_s(num_requests, rate_qps, rng, arrival, cv=cv)
    cap = max_output_tokens if max_output_tokens is not None else float("inf")
    return [
        TraceRequest(
            arrival_offset_s=offset_s,
            prompt=p.prompt,
            num_prompt_tokens=p.num_prompt_tokens,
            num_output_tokens=int(min(p.num_output_tokens, cap)),
            id=f"{i}:{p.id}",
        )
        for i, (p, offset_s) in enumerate(zip(chosen, offsets_s))
    ]
