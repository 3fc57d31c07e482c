"""``dynamo-kv``: NVIDIA Dynamo's KV router cost, with its approximate indexer (``--no-kv-events``).

Rule, per request with n block keys (prompt tokens: ``approx_prefix_index.prompt_tokens``):
- overlap(w) = the run of the request's leading block keys that endpoint w holds in the approximate index (the
  radix tree's ``find_matches``: an endpoint drops out at its first missing block; found by bisection, since what an
  endpoint holds is a set of whole prefixes: ``approx_prefix_index.leading_run``);
- prefill blocks(w) = (w's active prefill tokens + prompt tokens - overlap(w) * block_size) / block_size;
- decode blocks(w) = w's active blocks (distinct block keys of its active requests) + the request's blocks not
  among them (all past the leading run it shares with them);
- logit(w) = ``overlap_score_weight`` * prefill blocks(w) + decode blocks(w);
- temperature 0 (default): the smallest logit, ties uniformly at random; temperature > 0: softmax sampling of the
  logits normalised by their range (lower is better).
Bookkeeping fed by its own decisions: the chosen endpoint's index gains the request's blocks, expiring ``ttl_s``
after the decision (clock: ``RoutingRequest.arrival_time_s``; an entry routed again is renewed), the oldest
decisions' entries pruned down to ``prune_target_ratio * max_tree_size`` when the index exceeds ``max_tree_size``;
its active blocks and prefill tokens grow by the request's, released in ``on_finished``.
Defaults (``KvRouterConfig``): overlap_score_weight 1.0, router_temperature 0.0, router_ttl_secs 120,
router_max_tree_size 2**20, router_prune_target_ratio 0.8; block_size = the pool's KV block size (16).
Precise variant (``dynamo-kv-precise``, or ``precise: true``): overlap(w) = ``EndpointView.num_prefix_blocks_cached``
(the engine's published cache state, as Dynamo's ``KvIndexer`` sees it from KV events; unknown = 0); no approximate
index is kept.
Without block keys: overlap and new blocks are 0, the cost is load only (prefill tokens of the request from its ids
or text, upstream's behaviour for a request without a token sequence).
Cost per decision: O(endpoints x log(block keys)) dict lookups, plus O(block keys) to record the decision.

Source: ai-dynamo/dynamo ``lib/llm/src/kv_router/scheduler.rs`` (DefaultWorkerSelector.select_worker: the logit,
softmax_sample), ``lib/llm/src/kv_router/sequence.rs`` (ActiveSequences: potential_blocks_and_tokens, new_blocks,
new_tokens, mark_prefill_completed), ``lib/llm/src/kv_router.rs`` / ``lib/llm/src/kv_router/config.rs``
(KvRouterConfig defaults, PruneConfig for the approximate indexer), ``docs/router/kv_cache_routing.md``
(``--no-kv-events``: TTL expiry and pruning). The newest selector (``lib/kv-router/src/scheduling/selector/
default.rs``) generalises the logit with an overlap credit and a prefill load scale; this is the classic form.
Simplified: active prefill tokens are released when the request ends (upstream: at its first token, when prefill
completes) and active blocks hold the prompt's blocks only (``router_track_output_blocks`` is off by default
upstream); no router-side queue (``router_queue_threshold``); the prompt's partial last block is not counted.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from extproc.policies.approx_prefix_index import leading_run, prompt_tokens
from extproc.policies.base import (
    EndpointView,
    Policy,
    build_params,
    check_number,
    min_random_tie,
    reject_unknown_params,
)

TYPE = "dynamo-kv"
PRECISE_TYPE = "dynamo-kv-precise"


@dataclass(frozen=True, slots=True)
class Params:
    """``overlap_score_weight`` (>= 0), ``router_temperature`` (>= 0), ``ttl_s`` (> 0, seconds),
    ``max_tree_size`` (index entries, >= 1), ``prune_target_ratio`` in (0, 1], ``block_size`` (tokens, >= 1),
    ``precise`` (overlaps from ``EndpointView.num_prefix_blocks_cached``, Dynamo with KV events)."""

    overlap_score_weight: float = 1.0
    router_temperature: float = 0.0
    ttl_s: float = 120.0
    max_tree_size: int = 2 ** 20
    prune_target_ratio: float = 0.8
    block_size: int = 16
    precise: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.precise, bool):
            raise ValueError(f"policy {TYPE!r}: precise must be true or false, got {self.precise!r}")
        check_number(TYPE, "overlap_score_weight", self.overlap_score_weight, 0)
        check_number(TYPE, "router_temperature", self.router_temperature, 0)
        check_number(TYPE, "ttl_s", self.ttl_s, 0, low_open=True)
        check_number(TYPE, "prune_target_ratio", self.prune_target_ratio, 0, 1, low_open=True)
        check_number(TYPE, "max_tree_size", self.max_tree_size, 1, integer=True)
        check_number(TYPE, "block_size", self.block_size, 1, integer=True)


@dataclass(slots=True)
class _Active:
    """One endpoint's active requests as the router sees them (``ActiveSequences``)."""

    blocks: Counter[int]
    """Block key -> number of active requests holding it."""
    prefill_tokens: int = 0


class DynamoKvPolicy(Policy):
    TYPE = TYPE

    def __init__(self, params: Params, rng: random.Random) -> None:
        self.params = params
        self._rng = rng
        self._index: dict[str, dict[int, float]] = {}
        """Endpoint -> block key -> when the approximate index forgets it, seconds."""
        self._size = 0
        self._order: deque[tuple[float, str, tuple[int, ...]]] = deque()
        """(expiry, endpoint, keys) per decision, oldest first (one TTL: also expiry order)."""
        self._active: dict[str, _Active] = {}
        self._requests: dict[tuple[str, str], list[tuple[tuple[int, ...], int]]] = {}

    def overlaps(self, keys: Sequence[int], endpoints: Sequence[EndpointView]) -> dict[str, int]:
        """Leading blocks of ``keys`` each endpoint holds in the approximate index (absent = 0)."""
        result = {}
        for e in endpoints:
            held = self._index.get(e.address)
            run = leading_run(keys, held) if held else 0
            if run:
                result[e.address] = run
        return result

    def _overlaps(self, keys: Sequence[int], endpoints: Sequence[EndpointView]) -> dict[str, int]:
        if not keys:
            return {}
        if self.params.precise:
            return {e.address: min(e.num_prefix_blocks_cached or 0, len(keys)) for e in endpoints}
        return self.overlaps(keys, endpoints)

    def logits(self, request, endpoints: Sequence[EndpointView]) -> list[float]:
        """The router's cost of each endpoint (same order), in blocks; lower is better."""
        p = self.params
        self._expire(request.arrival_time_s)
        keys = request.block_keys or ()
        overlaps = self._overlaps(keys, endpoints)
        isl = prompt_tokens(request, p.block_size)
        result = []
        for e in endpoints:
            active = self._active.get(e.address)
            new_tokens = max(isl - overlaps.get(e.address, 0) * p.block_size, 0)
            if active is None:
                prefill_tokens, decode_blocks = new_tokens, len(keys)
            else:
                prefill_tokens = active.prefill_tokens + new_tokens
                decode_blocks = len(active.blocks) + len(keys) - leading_run(keys, active.blocks)
            result.append(p.overlap_score_weight * prefill_tokens / p.block_size + decode_blocks)
        return result

    def choose(self, request, endpoints: Sequence[EndpointView]) -> EndpointView | None:
        p = self.params
        logits = self.logits(request, endpoints)
        if p.router_temperature > 0:
            index = self._softmax_sample(logits)
        else:
            index = min_random_tie(range(len(endpoints)), logits.__getitem__, self._rng)
        chosen = endpoints[index]
        keys = tuple(request.block_keys or ())
        overlap = self._overlaps(keys, (chosen,)).get(chosen.address, 0)
        new_tokens = max(prompt_tokens(request, p.block_size) - overlap * p.block_size, 0)
        if not p.precise:
            self._record(keys, chosen.address, request.arrival_time_s)
        active = self._active.setdefault(chosen.address, _Active(Counter()))
        active.blocks.update(keys)
        active.prefill_tokens += new_tokens
        self._requests.setdefault((request.request_id, chosen.address), []).append((keys, new_tokens))
        return chosen

    def on_finished(self, request, address: str) -> None:
        records = self._requests.get((request.request_id, address))
        if not records:
            return
        keys, tokens = records.pop()
        if not records:
            del self._requests[(request.request_id, address)]
        active = self._active.get(address)
        if active is None:  # dropped when its last blocks and tokens left: this record carried none
            return
        active.prefill_tokens -= tokens
        blocks = active.blocks
        for key in keys:
            count = blocks[key] - 1
            if count:
                blocks[key] = count
            else:
                del blocks[key]
        if not blocks and active.prefill_tokens <= 0:
            del self._active[address]

    def index_size(self) -> int:
        """(endpoint, block key) entries in the approximate index."""
        return self._size

    def _record(self, keys: tuple[int, ...], address: str, now_s: float) -> None:
        if not keys:
            return
        expiry = now_s + self.params.ttl_s
        held = self._index.setdefault(address, {})
        before = len(held)
        held.update(dict.fromkeys(keys, expiry))
        self._size += len(held) - before
        self._order.append((expiry, address, keys))
        if self._size > self.params.max_tree_size:
            target = int(self.params.prune_target_ratio * self.params.max_tree_size)
            while self._size > target:
                self._drop_oldest()

    def _expire(self, now_s: float) -> None:
        order = self._order
        while order and order[0][0] <= now_s:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        """Forgets the oldest decision's blocks, except those a later decision renewed (a prefix of them: what is
        left stays a set of whole prefixes)."""
        expiry, address, keys = self._order.popleft()
        held = self._index[address]
        before = len(held)
        for key in keys:
            if held.get(key) == expiry:
                del held[key]
        self._size -= before - len(held)
        if not held:
            del self._index[address]

    def _softmax_sample(self, logits: Sequence[float]) -> int:
        """Upstream ``softmax_sample``: logits scaled by their range, negated, divided by the temperature."""
        low, high = min(logits), max(logits)
        if high == low:
            return self._rng.randrange(len(logits))
        scaled = [-(v / (high - low)) / self.params.router_temperature for v in logits]
        top = max(scaled)
        weights = [math.exp(v - top) for v in scaled]
        return self._rng.choices(range(len(logits)), weights=weights)[0]


def build(params: Mapping[str, Any], rng: random.Random) -> DynamoKvPolicy:
    return DynamoKvPolicy(build_params(TYPE, Params, params), rng)


def build_precise(params: Mapping[str, Any], rng: random.Random) -> DynamoKvPolicy:
    """``dynamo-kv-precise``: ``dynamo-kv`` with ``precise: true`` (its own ``precise`` parameter is refused)."""
    reject_unknown_params(PRECISE_TYPE, params, {f.name for f in fields(Params)} - {"precise"})
    return build({**params, "precise": True}, rng)
