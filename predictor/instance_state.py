"""The ``InstanceState`` message (protocol v1.2, ``predictor.proto``): one instance's state as the simulation needs it.

The only reader and writer of that message. The sidecar encodes what its Predict would simulate from (the snapshot
with the expected output lengths already applied, its step-time model and its corrections, ``predictor/server.py``)
and streams it to the routers that watch it; a router decodes it once per message and predicts locally from it
(``extproc/fleet_state.py``) with the same simulation (``predictor.sim.predict``), so a local prediction equals the
sidecar's own for the same state, up to the state's age.

Requests travel as columns (packed repeated integers): about 6 bytes a request, parsed by protobuf's C code; a
256-request state is under 2 KB without block keys. With prefix caching (protocol v1.4) each request's prompt
block keys travel too, 8 bytes a key (``fixed64``), prefix-shared: a request whose keys begin like an earlier
request's (the latest one with the same first key: a shared system prompt, the previous turn of a conversation)
names it and sends only the keys past the shared run; and the instance's cached free block keys (eviction order),
8 bytes each. What that costs is printed by ``astrolabe bench prompt-keys --state`` (README).
Imports only the standard library, ``predictor.api`` and ``predictor.sim``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from predictor.api import pb
from predictor.sim import EngineConfig, LinearBatchTimeModel
from predictor.sim.scheduler import SGLANG_INIT_NEW_TOKEN_RATIO, SGLangState
from predictor.sim.snapshot import InstanceSnapshot, RequestState

MAX_REQUESTS = 8192
"""Most requests a decoded state may hold (a sidecar's ledger holds at most 4,096; a larger message is broken)."""


@dataclass(frozen=True, slots=True)
class Corrections:
    """What the sidecar adds to every simulated prediction (``predictor/server.py`` ``Sidecar._corrected``).

    Attributes:
        ingress_delay_s: measured delay between dispatch and the engine's arrival, seconds (added to TTFT and E2E).
        ttft_offset_s: the outcome tracker's TTFT bias correction, seconds (added to TTFT).
        e2e_factor: its E2E correction, a factor (E2E is multiplied by it, and kept >= TTFT).
    """

    ingress_delay_s: float = 0.0
    ttft_offset_s: float = 0.0
    e2e_factor: float = 1.0

    def apply(self, ttft_s: float, e2e_s: float) -> tuple[float, float]:
        """(TTFT, E2E) corrected, seconds."""
        ttft_s, e2e_s = ttft_s + self.ingress_delay_s, e2e_s + self.ingress_delay_s
        if self.ttft_offset_s or self.e2e_factor != 1.0:
            ttft_s += self.ttft_offset_s
            e2e_s = max(e2e_s * self.e2e_factor, ttft_s)
        return ttft_s, e2e_s


@dataclass(frozen=True, slots=True)
class WatchedState:
    """A decoded ``InstanceState``.

    Attributes:
        seq: the message's number on its stream.
        snapshot: the instance at the sender's time 0 (``now_s`` = 0; a prediction from it is measured from
            when the state was taken).
        batch_time: the sender's step-time model.
        corrections: what the sender adds to every prediction.
        lag_s: how far the state's clock stood ahead of the send time (a step in progress), seconds; added to
            predictions from it.
        state_age_s: age of the sender's state when sent, seconds.
        admits_seen: the highest ``admit_seq`` of the watching router's Admits the state includes.
        model_error: the sender's step-time model error, a fraction (0 = not known).
        state_source: ``ledger`` or ``vllm-plugin``.
        length_distribution: how the sender prices a tagger's requests (``predictor.residual_rules
            .LENGTH_DISTRIBUTIONS``; ``binned`` for a sender older than v1.6).
    """

    seq: int
    snapshot: InstanceSnapshot
    batch_time: LinearBatchTimeModel
    corrections: Corrections
    lag_s: float
    state_age_s: float
    admits_seen: int
    model_error: float
    state_source: str
    length_distribution: str = "binned"


def encode(snapshot: InstanceSnapshot, batch_time: LinearBatchTimeModel, corrections: Corrections, *, seq: int,
           lag_s: float, state_age_s: float, admits_seen: int, model_error: float,
           state_source: str, length_distribution: str = "") -> pb.InstanceState:
    """The message for ``snapshot`` (its requests' expected output lengths already applied; times relative to
    ``snapshot.now_s``). Non-finite ``state_age_s`` (never reconciled) travels as infinity; ``length_distribution``
    is the sender's (``predictor.residual_rules.LENGTH_DISTRIBUTIONS``, "" = not said)."""
    config = snapshot.config
    requests = (*snapshot.running, *snapshot.waiting)
    block_size = config.block_size
    message = pb.InstanceState(
        seq=seq, state_age_s=state_age_s, admits_seen=admits_seen, state_source=state_source,
        length_distribution=length_distribution, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        block_size=block_size, num_gpu_blocks=config.num_gpu_blocks,
        enable_chunked_prefill=config.enable_chunked_prefill,
        long_prefill_token_threshold=config.long_prefill_token_threshold, scheduling=config.scheduling,
        batch_time_model=batch_time.model, c0_s=batch_time.c0_s, c1_s_per_token=batch_time.c1_s_per_token,
        c2_s_per_token2=batch_time.c2_s_per_token2, c3_s_per_token=batch_time.c3_s_per_token,
        c4_s_per_seq=batch_time.c4_s_per_seq, model_error=model_error,
        ingress_delay_s=corrections.ingress_delay_s, ttft_offset_s=corrections.ttft_offset_s,
        e2e_factor=corrections.e2e_factor, lag_s=lag_s, num_running=len(snapshot.running),
        prompt_tokens=[r.num_prompt_tokens for r in requests],
        output_tokens=[r.num_output_tokens for r in requests],
        computed_tokens=[r.num_computed_tokens for r in requests],
        generated_tokens=[r.num_generated_tokens for r in requests],
        blocks_held=[-1 if r.num_blocks_held is None else r.num_blocks_held for r in requests],
        preemptions=[r.num_preemptions for r in requests],
        max_new_tokens=[r.max_new_tokens or 0 for r in requests],
        num_preemptions_total=snapshot.num_preemptions_total)
    if any(r.block_keys for r in requests):
        _encode_block_keys(requests, message)
    if snapshot.cached_block_keys:
        message.cached_block_keys.extend(snapshot.cached_block_keys)
    if config.scheduling_policy == "priority":
        message.scheduling_policy = config.scheduling_policy
        if any(r.priority for r in requests):
            message.priorities.extend(r.priority for r in requests)
        message.arrival_times_s.extend(r.arrival_time_s - snapshot.now_s for r in requests)
    if snapshot.sglang is not None:
        message.new_token_ratio = snapshot.sglang.new_token_ratio
        message.batch_is_full = snapshot.sglang.batch_is_full
        message.stale_reserved_tokens.extend(snapshot.sglang.stale_reserved_tokens)
    return message


def _shared_run(keys: tuple[int, ...], other: tuple[int, ...]) -> int:
    """Leading keys ``keys`` and ``other`` share. Binary search: in a hash chain key i is equal only if every key
    before it is (``predictor.sim.block_hash``)."""
    low, high = 0, min(len(keys), len(other))
    while low < high:
        mid = (low + high + 1) // 2
        if keys[mid - 1] == other[mid - 1]:
            low = mid
        else:
            high = mid - 1
    return low


def _encode_block_keys(requests, message: pb.InstanceState) -> None:
    """The block-key columns (module docstring): each request's keys, the run it shares with the latest earlier
    request whose first key is the same sent once."""
    latest: dict[int, int] = {}  # first key -> index of the latest request whose keys start with it
    flat: list[int] = []
    sources, shared, own = [], [], []
    for i, request in enumerate(requests):
        keys = request.block_keys or ()
        source = num_shared = 0
        if keys:
            j = latest.get(keys[0])
            if j is not None:
                num_shared = _shared_run(keys, requests[j].block_keys)
                source = j + 1
            latest[keys[0]] = i
        sources.append(source)
        shared.append(num_shared)
        own.append(len(keys) - num_shared)
        flat.extend(keys[num_shared:])
    message.block_keys_from.extend(sources)
    message.shared_block_keys.extend(shared)
    message.own_block_keys.extend(own)
    message.block_keys.extend(flat)


def _decode_block_keys(message: pb.InstanceState, num: int) -> list[tuple[int, ...] | None]:
    """Each request's block keys (None: none), from the columns `_encode_block_keys` wrote.

    Raises:
        ValueError: columns of another length than the requests', a reference to a later request, a shared run
            longer than the keys it refers to, or counts that do not add up to the keys sent.
    """
    if not (message.block_keys_from or message.shared_block_keys or message.own_block_keys):
        return [None] * num
    columns = (message.block_keys_from, message.shared_block_keys, message.own_block_keys)
    if any(len(column) != num for column in columns):
        raise ValueError(f"block-key columns of {[len(c) for c in columns]} entries for {num} requests")
    flat = message.block_keys
    keys: list[tuple[int, ...] | None] = []
    position = 0
    for i, (source, num_shared, num_own) in enumerate(zip(*columns)):
        prefix: tuple[int, ...] = ()
        if source or num_shared:
            if not 0 < source <= i or num_shared > len(keys[source - 1] or ()):
                raise ValueError(f"request {i}'s block keys refer to {num_shared} keys of request {source - 1}")
            prefix = keys[source - 1][:num_shared]
        if position + num_own > len(flat):
            raise ValueError(f"request {i}'s block keys run past the {len(flat)} keys sent")
        own = tuple(flat[position:position + num_own])
        position += num_own
        keys.append((prefix + own) or None)
    if position != len(flat):
        raise ValueError(f"{len(flat) - position} block keys sent that no request names")
    return keys


def _finite(value: float, what: str, low: float = 0.0) -> float:
    if not (math.isfinite(value) and value >= low):
        raise ValueError(f"{what} must be a finite number >= {low:g}, got {value!r}")
    return value


def decode(message: pb.InstanceState) -> WatchedState:
    """The state a message describes.

    Raises:
        ValueError: the message cannot describe an instance (columns of different lengths, more than
            `MAX_REQUESTS` requests, an invalid engine, a negative or non-finite figure, block-key columns that do
            not add up); the caller drops it.
            Request counters the simulation rejects (e.g. computed beyond prompt + generated) are found only
            when a prediction runs from the state: it raises ValueError then.
    """
    columns = (message.prompt_tokens, message.output_tokens, message.computed_tokens, message.generated_tokens,
               message.blocks_held, message.preemptions, message.max_new_tokens)
    num = len(message.prompt_tokens)
    if any(len(column) != num for column in columns):
        raise ValueError(f"request columns of different lengths: {[len(c) for c in columns]}")
    if num > MAX_REQUESTS or message.num_running > num:
        raise ValueError(f"{num} requests ({message.num_running} running): not a state")
    for name in ("priorities", "arrival_times_s"):
        if len(getattr(message, name)) not in (0, num):
            raise ValueError(f"{name}: {len(getattr(message, name))} entries for {num} requests")
    config = EngineConfig(max_num_seqs=message.max_num_seqs, max_num_batched_tokens=message.max_num_batched_tokens,
                          block_size=message.block_size, num_gpu_blocks=message.num_gpu_blocks,
                          enable_chunked_prefill=message.enable_chunked_prefill,
                          long_prefill_token_threshold=message.long_prefill_token_threshold,
                          scheduling=message.scheduling, scheduling_policy=message.scheduling_policy or "fcfs")
    # v1.5: an FCFS engine ignores both columns; without arrival times the columns' order is the arrival order
    priorities = message.priorities or [0] * num
    arrivals = [_finite(a, "arrival_times_s", -math.inf) for a in message.arrival_times_s] or [0.0] * num
    # a fitted coefficient may be slightly negative (predictor/calibration.py); a step priced <= 0 s is the
    # simulation's error to raise
    batch_time = LinearBatchTimeModel(
        message.batch_time_model or "unknown", *(_finite(getattr(message, name), name, -math.inf) for name in (
            "c0_s", "c1_s_per_token", "c2_s_per_token2", "c3_s_per_token", "c4_s_per_seq")))
    corrections = Corrections(_finite(message.ingress_delay_s, "ingress_delay_s"),
                              _finite(message.ttft_offset_s, "ttft_offset_s", -math.inf),
                              _finite(message.e2e_factor, "e2e_factor"))
    if corrections.e2e_factor == 0:
        corrections = Corrections(corrections.ingress_delay_s, corrections.ttft_offset_s, 1.0)
    num_running = message.num_running
    block_keys = _decode_block_keys(message, num)
    try:
        requests = [RequestState(f"r{i}", p, o, num_computed_tokens=c if i < num_running else 0,
                                 num_generated_tokens=g,
                                 num_blocks_held=(b if b >= 0 else None) if i < num_running else None,
                                 num_preemptions=n, max_new_tokens=m or None, block_keys=k, priority=q,
                                 arrival_time_s=a)
                    for i, (p, o, c, g, b, n, m, k, q, a) in enumerate(zip(*columns, block_keys, priorities,
                                                                          arrivals))]
        sglang = None
        if config.scheduling == "sglang":
            sglang = SGLangState(message.new_token_ratio or SGLANG_INIT_NEW_TOKEN_RATIO, message.batch_is_full,
                                 tuple(message.stale_reserved_tokens))
        snapshot = InstanceSnapshot(config=config, now_s=0.0, running=tuple(requests[:num_running]),
                                    waiting=tuple(requests[num_running:]),
                                    num_preemptions_total=message.num_preemptions_total, sglang=sglang,
                                    cached_block_keys=tuple(message.cached_block_keys))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a valid instance state: {exc}") from None
    return WatchedState(message.seq, snapshot, batch_time, corrections, _finite(message.lag_s, "lag_s"),
                        message.state_age_s if message.state_age_s >= 0 else math.inf, message.admits_seen,
                        message.model_error if math.isfinite(message.model_error) and message.model_error > 0 else 0.0,
                        message.state_source, message.length_distribution or "binned")
