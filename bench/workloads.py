"""Request traces built from ShareGPT pairs: filters, arrival processes and seeded sampling; keyed workloads.

Owns: choosing the pairs (``tagger.sharegpt.SharegptPair``, read by ``tagger.sharegpt.load_sharegpt_pairs``) a
server's context can hold, and sampling a seeded arrival trace (Poisson, Gamma or uniform gaps) from them; and the
token-level shapes of the prefix-reuse workloads (block keys of every request): multi-turn sessions replayed from
ShareGPT conversations (`session_turns`) and a shared-prefix tenant mix (`shared_prefix_turns`).
Imports the stdlib, numpy, ``tagger.sharegpt`` and ``predictor.sim.block_hash``; must not import aiohttp, gRPC or
anything that starts processes.

NOTE: token ids. The keyed workloads need token ids only so that equal prefixes give equal block keys
(``predictor.sim.block_hash.block_keys``): each message (a ShareGPT turn, a tenant's context, a question, an answer)
gets pseudo token ids, as many as its token count, drawn by numpy's default generator seeded by a BLAKE2b hash of
the message's name (`pseudo_token_ids`), so the same message has the same ids in every process and run. A
prompt's ids are its messages' ids concatenated; no chat template tokens are added (a template adds a few tokens
per message to every prompt alike and changes no reuse).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from predictor.sim.block_hash import block_keys
from tagger.sharegpt import SharegptConversation, SharegptPair

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
        objective: the latency objective it names (the client sends it as ``x-gateway-inference-objective``, the
            Gateway API Inference Extension's header; the router looks it up in its configured objectives); None =
            none.
    """

    arrival_offset_s: float
    prompt: str
    num_prompt_tokens: int
    num_output_tokens: int
    id: str
    max_tokens: int | None = None
    router: int = 0
    objective: str | None = None


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


PSEUDO_VOCAB_SIZE = 32000
"""Pseudo token ids lie in [0, 32000): Llama-2's vocabulary size (only equality matters, `pseudo_token_ids`)."""


def pseudo_token_ids(name: str, num_tokens: int) -> np.ndarray:
    """Deterministic pseudo token ids of one message (module NOTE on token ids).

    Args:
        name: names the message uniquely (e.g. ``"<conversation id>/3"``, ``"tenant/7"``).
        num_tokens: its length, tokens (>= 0).

    Returns:
        ``num_tokens`` ids in [0, `PSEUDO_VOCAB_SIZE`), int64; the same for the same arguments in any process.
    """
    seed = int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, PSEUDO_VOCAB_SIZE, size=num_tokens, dtype=np.int64)


@dataclasses.dataclass(frozen=True, slots=True)
class KeyedTurn:
    """One request of a keyed workload: token counts and the block keys of its prompt AND reply.

    Attributes:
        num_prompt_tokens: prompt tokens (>= 1).
        num_output_tokens: reply tokens (>= 1).
        block_keys: keys of the full blocks of prompt + reply tokens, first block first; the prompt's own full
            blocks are the first ``num_prompt_tokens // block_size`` (an engine caches the reply's blocks too, so
            that a later prompt that repeats the reply hits them, as vLLM does).
    """

    num_prompt_tokens: int
    num_output_tokens: int
    block_keys: tuple[int, ...]


def session_turns(conversation: SharegptConversation, block_size: int, max_model_len: int) -> list[KeyedTurn]:
    """A ShareGPT conversation replayed as a chat session: turn k's prompt is every earlier message (the human
    turns and the RECORDED replies) plus the k-th human message; its reply is the k-th recorded reply.

    A message of 0 tokens counts as 1 (every prompt and reply has at least one token). The session ends before
    the first turn whose prompt + reply exceeds ``max_model_len`` (a client then starts a new conversation).

    Args:
        conversation: per-message token counts, human and gpt alternating.
        block_size: tokens per KV block (>= 1).
        max_model_len: the served model's context, tokens.

    Returns:
        The turns in order; [] when even the first does not fit.
    """
    sizes = [max(n, 1) for n in conversation.num_message_tokens]
    turns: list[tuple[int, int]] = []
    total = 0
    for k in range(0, len(sizes) - 1, 2):
        prompt, reply = total + sizes[k], sizes[k + 1]
        if prompt + reply > max_model_len:
            break
        turns.append((prompt, reply))
        total = prompt + reply
    if not turns:
        return []
    ids = np.concatenate([pseudo_token_ids(f"{conversation.id}/{m}", sizes[m]) for m in range(2 * len(turns))])
    keys = block_keys(ids.tolist(), block_size)
    return [KeyedTurn(prompt, reply, keys[:(prompt + reply) // block_size]) for prompt, reply in turns]


@dataclasses.dataclass(frozen=True, slots=True)
class SharedPrefixShape:
    """The shared-prefix tenant mix (the shape of llm-d's shared-prefix benchmark, scaled to a fleet's KV cache).

    Attributes:
        num_tenants: tenants, each with its own shared context (>= 1).
        context_tokens: tokens of each tenant's context (>= 1).
        question_tokens: (low, high) of each user question's tokens, drawn uniformly (1 <= low <= high).
        answer_tokens: (low, high) of each answer's tokens, drawn uniformly (1 <= low <= high).
    """

    num_tenants: int
    context_tokens: int = 2048
    question_tokens: tuple[int, int] = (32, 256)
    answer_tokens: tuple[int, int] = (32, 256)

    def __post_init__(self) -> None:
        if self.num_tenants < 1 or self.context_tokens < 1:
            raise WorkloadError(f"num_tenants and context_tokens must be >= 1, got {self.num_tenants}, "
                                f"{self.context_tokens}")
        for name in ("question_tokens", "answer_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise WorkloadError(f"{name} must be (low, high) with 1 <= low <= high, got {(low, high)}")

    @classmethod
    def for_working_set(cls, working_set_frac: float, fleet_kv_tokens: int, context_tokens: int = 2048,
                        **kwargs) -> SharedPrefixShape:
        """The mix whose distinct contexts total ``working_set_frac`` x ``fleet_kv_tokens`` (rounded to whole
        tenants, at least 1).

        Raises:
            WorkloadError: ``working_set_frac`` not > 0, or a bad shape.
        """
        if not working_set_frac > 0:
            raise WorkloadError(f"working_set_frac must be > 0, got {working_set_frac}")
        num_tenants = max(1, round(working_set_frac * fleet_kv_tokens / context_tokens))
        return cls(num_tenants, context_tokens, **kwargs)


def shared_prefix_draws(shape: SharedPrefixShape, num_requests: int,
                        rng: random.Random) -> list[tuple[int, int, int]]:
    """(tenant, question tokens, answer tokens) of each of ``num_requests`` requests of the mix, in draw order:
    the tenant uniformly at random (as llm-d's benchmark spreads its prompts over the groups), the lengths
    uniformly in the shape's ranges. Request n's question is message ``"question/<n>"`` (`pseudo_token_ids`)."""
    return [(rng.randrange(shape.num_tenants), rng.randint(*shape.question_tokens), rng.randint(*shape.answer_tokens))
            for _ in range(num_requests)]


def shared_prefix_turns(shape: SharedPrefixShape, num_requests: int, rng: random.Random,
                        block_size: int) -> list[KeyedTurn]:
    """``num_requests`` requests of the mix: each picks a tenant uniformly at random (as llm-d's benchmark
    spreads its prompts over the groups) and asks a fresh question of its own; prompt = the tenant's context + the
    question, reply = the answer.

    Args:
        shape: the mix.
        num_requests: requests (>= 0).
        rng: seeded source of the tenants and lengths.
        block_size: tokens per KV block (>= 1).

    Returns:
        The requests, in draw order.
    """
    contexts = {}
    turns = []
    for n, (tenant, question, answer) in enumerate(shared_prefix_draws(shape, num_requests, rng)):
        if tenant not in contexts:
            contexts[tenant] = pseudo_token_ids(f"tenant/{tenant}", shape.context_tokens)
        ids = np.concatenate([contexts[tenant], pseudo_token_ids(f"question/{n}", question + answer)])
        prompt = shape.context_tokens + question
        turns.append(KeyedTurn(prompt, answer, block_keys(ids.tolist(), block_size)))
    return turns
