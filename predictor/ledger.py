"""The sidecar's model of its instance: admitted requests advanced in simulated time, reconciled with /metrics.

For an unmodified backend the sidecar cannot see the engine's queues. It keeps a ledger instead: every request
the extproc admitted here is added to a ``predictor.sim.Engine`` at its admission time, and the engine is
advanced on the sidecar's monotonic clock with the batch-time model, so the ledger's queues evolve as the
instance's would. Two things make it drift: requests that other routers sent (invisible to this ledger) and
the gap between predicted and true output lengths (plus lost Release notices). ``reconcile`` corrects the
drift from the backend's Prometheus gauges:

- more requests on the backend (running + waiting) than in the ledger: the difference is added as *phantom*
  requests with the mean lengths of recent admissions;
- fewer on the backend: requests leave the ledger, phantoms first, then the most overdue (furthest past their
  predicted length: their Release was most likely lost), but never one admitted within ``visibility_grace_s``
  (vLLM's gauges lag, and a burst of simultaneous dispatches must see each other before the backend shows them).

A request the extproc admitted stays in the simulation until its Release arrives (or reconciliation removes
it): the simulation never finishes it on its own, because only the predicted length is known, and a request
that outlives its prediction is still occupying its instance. Predictions use ``snapshot()``, which restores
each request's predicted output length; a request past it is assumed to need 10 more tokens
(``predictor.sim.snapshot.NUM_EXTRA_OUTPUT_TOKENS_WHEN_OVERDUE``, the reference system's rule). Phantoms do
finish at their (mean) length; reconciliation brings them back if the backend still shows them.

Prefix caching (vllm-v1 rules): an admitted request's prompt block keys (from the router, ``Admit.block_keys``)
go into its simulated request, so the ledger's scheduler models the instance's prefix cache as far as this
sidecar sees it: the prefixes of the requests it admitted, kept free after they leave and evicted, least recently
freed first, by the simulated allocations. It misses what other routers' requests cached unless they told this
sidecar (each Admit does), and phantoms carry no keys. ``prefix_cache_queries`` / ``prefix_cache_hits`` of its
scheduler count what it modelled (the sidecar's /metrics puts them beside the engine's own counters).

NOTE: all methods take the current time explicitly (seconds on the caller's monotonic clock) and run on one
thread (the sidecar's event loop).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from predictor.sim import BatchTimeModel, Engine, EngineConfig, SimRequest
from predictor.sim.residual import FixedExtraTokens, ResidualLengthModel, capped_tokens
from predictor.sim.snapshot import InstanceSnapshot

logger = logging.getLogger(__name__)

MAX_LEDGER_REQUESTS = 4096
"""Most requests the ledger holds: a backend reporting more gets no more phantoms (each Predict simulates them
all; an absurd gauge must not stall the sidecar), with one warning."""

_EMA_WEIGHT = 0.05
"""Weight of each new admission in the running mean of lengths used for phantom requests."""


@dataclass(frozen=True, slots=True)
class BackendObservation:
    """What the backend's /metrics said (vLLM names; SGLang's in ``predictor.backend_metrics``).

    Attributes:
        num_running: ``vllm:num_requests_running`` (SGLang ``sglang:num_running_reqs``).
        num_waiting: ``vllm:num_requests_waiting`` (``sglang:num_queue_reqs``).
        kv_cache_usage_frac: ``vllm:kv_cache_usage_perc`` (``sglang:token_usage``), a fraction 0..1.
        num_preemptions_total: ``vllm:num_preemptions_total`` (``sglang:num_retracted_requests_total``).
        num_gpu_blocks: from ``vllm:cache_config_info`` (SGLang: pages), or None.
        block_size: from ``vllm:cache_config_info`` (SGLang: ``page_size``), tokens, or None.
        engine: the format that was read: ``vllm`` or ``sglang``.
        prefix_cache_queries_total: ``vllm:prefix_cache_queries_total``, prompt tokens looked up in the prefix
            cache, tokens; None when the backend does not export it.
        prefix_cache_hits_total: ``vllm:prefix_cache_hits_total``, of those the tokens found cached; None likewise.
    """

    num_running: int
    num_waiting: int
    kv_cache_usage_frac: float = 0.0
    num_preemptions_total: int = 0
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    engine: str = "vllm"
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None


@dataclass(frozen=True, slots=True)
class _Admitted:
    """What the extproc said about an admitted request: predicted output tokens, cap (None), length source."""

    num_predicted_output_tokens: int
    max_tokens: int | None
    length_source: int


@dataclass(slots=True)
class ReconcileStats:
    """Running totals of reconciliation, for ``State`` and tests."""

    num_reconciliations: int = 0
    num_phantoms_added: int = 0
    num_requests_removed: int = 0
    last_difference: int = 0


class Ledger:
    """Admitted requests of one instance in simulated time.

    Args:
        config: the instance's engine limits and KV cache.
        batch_time: its step execution-time model.
        now_s: current time, seconds.
        visibility_grace_s: how long an admitted request is protected from removal by reconciliation.
        default_prompt_tokens: initial mean prompt length of phantom requests, tokens.
        default_output_tokens: initial mean output length of phantom requests, tokens.
        residual: length source -> residual rule (``predictor.residual_rules.ResidualRules.for_source``); None
            = the reference system's rule for every request.
    """

    def __init__(self, config: EngineConfig, batch_time: BatchTimeModel, now_s: float, *,
                 visibility_grace_s: float = 2.0, default_prompt_tokens: int = 256,
                 default_output_tokens: int = 256,
                 residual: Callable[[int], ResidualLengthModel] | None = None) -> None:
        self.engine = Engine(config, batch_time, now_s)
        self.visibility_grace_s = visibility_grace_s
        paper = FixedExtraTokens()
        self._residual = residual or (lambda _source: paper)
        self._admitted_at_s: dict[str, float] = {}
        self._admitted: dict[str, _Admitted] = {}
        self._mean_prompt_tokens = float(default_prompt_tokens)
        self._mean_output_tokens = float(default_output_tokens)
        self._num_phantoms = 0
        self._capped = False  # warned that the backend reported more than MAX_LEDGER_REQUESTS
        self._uncounted_queries = self._uncounted_hits = 0  # prefix-cache lookups of requests that never ran, tokens
        self.stats = ReconcileStats()

    @property
    def scheduler(self):
        return self.engine.scheduler

    def advance(self, now_s: float) -> None:
        """Runs the simulated instance up to ``now_s`` (a step in progress then completes)."""
        for step in self.engine.advance_to(now_s):
            for request in step.output.finished:
                self._forget(request.request_id)

    def _forget(self, request_id: str) -> None:
        self._admitted_at_s.pop(request_id, None)
        self._admitted.pop(request_id, None)

    def predicted_output_tokens(self, request_id: str) -> int | None:
        """The predicted output length an admitted request came with, or None if it is not in the ledger."""
        admitted = self._admitted.get(request_id)
        return None if admitted is None else admitted.num_predicted_output_tokens

    def expected_output_tokens(self, num_predicted_tokens: int, num_generated_tokens: int,
                               max_tokens: int | None = None, length_source: int = 0) -> int:
        """Expected total output tokens of a request with this prediction and progress (the ledger's rules)."""
        return self._residual(length_source).expected_output_tokens(num_predicted_tokens, num_generated_tokens,
                                                                    max_tokens)

    def snapshot(self) -> InstanceSnapshot:
        """The state to predict from, at the ledger's clock: every admitted request with its expected output
        length (residual rule applied to its predicted length and progress); phantoms keep their mean length."""
        snap = InstanceSnapshot.from_scheduler(self.scheduler, self.engine.now_s)
        admitted = self._admitted

        def restore(states):
            out = []
            for r in states:
                a = admitted.get(r.request_id)
                if a is not None:
                    r = dataclasses.replace(r, num_output_tokens=self.expected_output_tokens(
                        a.num_predicted_output_tokens, r.num_generated_tokens, a.max_tokens, a.length_source))
                out.append(r)
            return tuple(out)

        return dataclasses.replace(snap, waiting=restore(snap.waiting), running=restore(snap.running))

    def num_unfinished(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def admit(self, request_id: str, num_prompt_tokens: int, num_output_tokens: int, now_s: float, *,
              max_tokens: int | None = None, length_source: int = 0,
              block_keys: tuple[int, ...] | None = None, priority: int = 0) -> bool:
        """Adds a request dispatched here at ``now_s``; returns False if the id is already in the ledger.

        Args:
            request_id: the extproc's id of the request.
            num_prompt_tokens: prompt tokens (>= 1).
            num_output_tokens: PREDICTED output tokens (>= 1), before the ``max_tokens`` cap (the residual rule
                applies it: E[min(L, max_tokens)]).
            now_s: admission time, seconds.
            max_tokens: the request's output cap, tokens (None = unknown).
            length_source: where the prediction came from (``predictor.residual_rules.LENGTH_SOURCE_*``).
            block_keys: its prompt's full KV blocks' keys (None: unknown). The simulated instance looks them up in
                its prefix cache (a shorter prefill) and caches them as they fill; they stay cached, free, after
                the request leaves, until simulated allocations evict them (``predictor.sim.prefix_cache``).
            priority: its priority at the engine (vLLM's: lower = earlier; read under the "priority" policy).

        Raises:
            ValueError: token counts < 1, a request that can never fit this instance's KV cache, or more keys
                than the prompt's full blocks.
        """
        self.advance(now_s)
        if self.scheduler.get_request(request_id) is not None:
            return False
        num_prompt_tokens, num_output_tokens = max(num_prompt_tokens, 1), max(num_output_tokens, 1)
        config = self.scheduler.config
        # Open-ended: as long as the KV cache could ever hold, so that only Release ends it. An estimate past that
        # (a small instance, an estimate above max_tokens) is not refused: Predict priced it cut to the cache too
        # (`InstanceSnapshot.fit_request`); a prompt that cannot fit stays unservable (ValueError).
        num_open_ended_tokens = config.max_output_tokens(num_prompt_tokens)
        # max_new_tokens: SGLang's admission reserves KV by each request's cap (predictor.sim.scheduler).
        if block_keys and len(block_keys) > num_prompt_tokens // config.block_size:
            raise ValueError(f"{len(block_keys)} block keys for a prompt of {num_prompt_tokens} tokens "
                             f"(block_size {config.block_size}): more than its full blocks")
        self.engine.add_request(SimRequest(request_id, num_prompt_tokens, num_open_ended_tokens,
                                           arrival_time_s=max(now_s, self.engine.now_s),
                                           max_new_tokens=max_tokens or None, block_keys=block_keys or None,
                                           priority=priority))
        self._admitted_at_s[request_id] = now_s
        self._admitted[request_id] = _Admitted(num_output_tokens, max_tokens or None, length_source)
        self._mean_prompt_tokens += _EMA_WEIGHT * (num_prompt_tokens - self._mean_prompt_tokens)
        # what phantoms are made of: the estimate as Predict priced it (max_tokens, then the KV cache)
        num_priced_tokens = min(capped_tokens(num_output_tokens, max_tokens), num_open_ended_tokens)
        self._mean_output_tokens += _EMA_WEIGHT * (num_priced_tokens - self._mean_output_tokens)
        return True

    def add_block_keys(self, request_id: str, block_keys: tuple[int, ...], now_s: float) -> bool:
        """Gives a request admitted without keys (a held one, ``predictor.holds``) its prompt's ``block_keys`` once
        its Admit confirms it: it is taken out and queued again, with the keys and its arrival time, so that it
        starts over from its prefix-cache hit (a hold lasts one routing decision: it lost at most that much
        simulated progress). A held request carries no keys until then because a hold dropped unconfirmed must
        leave nothing cached: that request never ran on the instance. Returns whether the keys were added (not for
        a request gone, one with keys already, or keys the prompt cannot have).
        """
        self.advance(now_s)
        request = self.scheduler.get_request(request_id)
        if request is None or request.block_keys or \
                len(block_keys) > request.num_prompt_tokens // self.scheduler.config.block_size:
            return False
        self._discount(self.scheduler.abort_request(request_id))
        self.engine.add_request(SimRequest(request_id, request.num_prompt_tokens, request.num_output_tokens,
                                           arrival_time_s=request.arrival_time_s,
                                           max_new_tokens=request.max_new_tokens, block_keys=block_keys,
                                           priority=request.priority))
        return True

    def release(self, request_id: str, now_s: float, *, ran: bool = True) -> bool:
        """Removes a request that ended (``ran``) or never ran on the instance (not ``ran``: a hold dropped, its
        prefix-cache lookup taken back out of `prefix_cache_queries`); returns False if it had already left the
        ledger. A request the ledger does not hold (with the plugin's state in use the sidecar admits none into
        it) costs no simulation."""
        if self.scheduler.get_request(request_id) is None:  # advancing cannot bring it back
            self._forget(request_id)
            return False
        self.advance(now_s)
        self._forget(request_id)
        removed = self.scheduler.abort_request(request_id)
        if removed is not None and not ran:
            self._discount(removed)
        return removed is not None

    def _discount(self, request: SimRequest) -> None:
        """Takes a request's prefix-cache lookup (counted by the scheduler at its first admission) back out of the
        modelled counters."""
        if request.num_cached_tokens is not None:
            self._uncounted_queries += request.num_prompt_tokens
            self._uncounted_hits += request.num_cached_tokens

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens the simulated instance looked up in its prefix cache, tokens (vLLM's
        ``vllm:prefix_cache_queries`` as modelled; holds that never ran and lookups repeated by `add_block_keys`
        not counted)."""
        return self.scheduler.prefix_cache_queries - self._uncounted_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of `prefix_cache_queries`, the tokens found cached, tokens (``vllm:prefix_cache_hits`` as modelled)."""
        return self.scheduler.prefix_cache_hits - self._uncounted_hits

    def reconcile(self, observed: BackendObservation, now_s: float) -> int:
        """Moves the ledger's request count toward the backend's; returns the change (+ added, - removed)."""
        self.advance(now_s)
        self.stats.num_reconciliations += 1
        recent = {rid for rid, t in self._admitted_at_s.items() if now_s - t < self.visibility_grace_s}
        num_backend = observed.num_running + observed.num_waiting
        num_ledger = self.num_unfinished()
        if num_backend > num_ledger:
            change = self._add_phantoms(num_backend - num_ledger, now_s)
        else:
            change = -self._remove(num_ledger - len(recent & self._ids()) - num_backend, recent)
        self.stats.last_difference = num_backend - num_ledger
        return change

    def _ids(self) -> set[str]:
        return {r.request_id for r in self.scheduler.running} | {r.request_id for r in self.scheduler.waiting}

    def _add_phantoms(self, count: int, now_s: float) -> int:
        added = 0
        room = MAX_LEDGER_REQUESTS - self.num_unfinished()
        if count > room and not self._capped:
            logger.warning("the backend reports %d more requests than the ledger holds; it keeps at most %d",
                           count, MAX_LEDGER_REQUESTS)
            self._capped = True
        for _ in range(min(count, max(room, 0))):
            self._num_phantoms += 1
            try:
                self.engine.add_request(SimRequest(
                    f"phantom-{self._num_phantoms}", max(round(self._mean_prompt_tokens), 1),
                    max(round(self._mean_output_tokens), 1), arrival_time_s=max(now_s, self.engine.now_s)))
            except ValueError:  # cannot fit the KV cache with these means: nothing sensible to add
                break
            added += 1
        self.stats.num_phantoms_added += added
        return added

    def _remove(self, count: int, protected: set[str]) -> int:
        if count <= 0:
            return 0
        candidates = [r for r in (*self.scheduler.running, *self.scheduler.waiting) if r.request_id not in protected]
        def predicted(r) -> int:  # capped as Predict priced it: by max_tokens, then by the open-ended length
            a = self._admitted.get(r.request_id)
            if a is None:
                return r.num_output_tokens
            return min(capped_tokens(a.num_predicted_output_tokens, a.max_tokens), r.num_output_tokens)

        # phantoms first, then the furthest past (or closest to) their predicted length
        candidates.sort(key=lambda r: (not r.request_id.startswith("phantom-"), predicted(r) - r.num_generated_tokens))
        for request in candidates[:count]:
            self.scheduler.abort_request(request.request_id)
            self._forget(request.request_id)
        removed = min(count, len(candidates))
        self.stats.num_requests_removed += removed
        return removed
