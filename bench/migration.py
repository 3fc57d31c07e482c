"""Llumnix's live KV-cache migration, run by the cluster simulation beside the ``llumnix`` dispatch policy.

Owns `MigrationParams` (the knobs and their defaults), the cost model (`kv_bytes_per_token`,
`stage_transfer_s`), Llumnix's rules (`migration_load`, `num_killed_requests`, `pair_instances`,
`pick_request`) and `MigrationController`, which applies them to the simulated engines in virtual time.
Imports ``predictor.sim`` only. ``bench.cluster_sim`` calls it for a policy spec that carries `MigrationParams`
(label ``llumnix-migrate``); production code never imports it: migration is not a dispatch choice, and
Astrolabe itself does not migrate (DESIGN.md).

Sources, read in AlibabaPAI/llumnix: the initial release @37d8e5ea (2024-07-06, the code published with Sun et
al., "Llumnix: Dynamic Scheduling for Large Language Model Serving", OSDI 2024) for every rule and default
below, unless marked; HEAD @24220fb8 for what changed since (same stage protocol; other defaults, noted per
field of `MigrationParams`).

NOTE: the model, step by step.
1. Every ``polling_interval_s`` the global scheduler polls every instance (``LLMEngineManager.
   _update_instance_info_loop``) and, every ``pair_migration_frequency``-th poll, pairs instances
   (``GlobalScheduler.check_migrate``). An instance's migration load is minus its freeness (paper §4.4.2:
   F = (M - sum V) / B): free blocks minus the head-of-line waiting request's blocks (its virtual usage), per
   running request plus one for the queue (`migration_load`, ``instance_info.MigrateLoadComputation``, load
   metric ``consumed_speed`` with ``enable_prefill_migrate``). The controller reads the engines' exact state
   at the poll (a llumlet reports after every step).
2. Pairing (``migration_scheduler.PrefillConstrained``, the default ``check_migrate_policy``): sources are
   instances with load > ``migrate_out_threshold`` or with preempted requests waiting, most loaded first;
   destinations are instances with load < the threshold and none preempted, least loaded first; the i-th
   source pairs with the i-th destination (`pair_instances`). A pair is skipped when either side is still in a
   migration (``LLMEngineManager._migrate``: one migration per instance at a time).
3. The source picks one running request that is past its prefill (`pick_request`, ``migrate_policy`` LCFS =
   LCR: the last one in its running list; ``LocalMigrationScheduler``). None: no migration this poll.
4. Stages (``MigrationCoordinator.migrate_out_onestage`` / ``migrate_out_multistage``). A stage takes the
   blocks the request filled since the previous stage. If there are more than ``last_stage_max_blocks``, the
   destination reserves all but the last (still being written) and they are copied while the request keeps
   decoding on the source; at the stage's end the migration aborts if the request finished, was preempted or
   left the running list (``should_abort_migration``), or if this was stage ``max_stages`` (the loop gives up).
   Otherwise (few blocks left) the last stage: the destination reserves the rest (the migration aborts if it
   has no room; the request simply carries on at the source), the request leaves the source's running list and
   makes no progress (its KV stays held at the source) while the rest is copied, then it joins the
   destination's running list with all its blocks and its progress and timestamps, and the source frees its
   copy (``Llumlet.migrate_out``: ``free_src_request`` after ``FINISHED_DONE``).
5. Cost of a stage: `stage_transfer_s` = ``stage_overhead_s`` + blocks x bytes per block / bandwidth. The copy
   runs beside the engine steps, not instead of them: every backend copies on its own CUDA stream
   (``MigrationWorker.send_cpu_cache`` / ``recv_cpu_cache`` with ``self.migration_stream`` in
   ``backends/vllm/worker.py``; HEAD ``RayRpcMigrationBackend`` / ``RayColMigrationBackend.do_send`` /
   ``do_recv``) from threaded Ray actors (``max_concurrency=4``), so the engines keep stepping. What they lose is
   the interference: while a stage copies, the steps of both the source and the destination take
   (1 + ``copy_interference_frac``) as long (`predictor.sim.Engine.step_time_factor`). ``blocking_copy=True``
   instead stalls both engines for the whole stage (a copy on the compute stream: the paper's "blocking copy"
   strawman; `predictor.sim.Engine.stall_until`). The migrated request's own stall is its last stage.

Known differences from Llumnix:
- blocks are counts (no block tables); the head-of-line demand is ceil(tokens / block_size) blocks where
  Llumnix divides without rounding; our engines have no watermark (vLLM V1 has none), so ``watermark_blocks``
  defaults to 0;
- the initial release commits the request at the destination when its last stage starts, before the blocks
  are copied; we commit when the copy ends (HEAD's order). Our V1 engines cap their running list at
  ``max_num_seqs``: a last stage starts only if the destination has a free slot, and if the slot was taken by the
  time the copy ends the request waits (still stalled, KV held at both ends) until the next poll frees one;
- no failures, no scaling, no priorities, no prefill-decode disaggregation.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from predictor.sim import (
    Engine,
    RequestStatus,
    Scheduler,
    SimRequest,
    blocks_for_tokens,
)

logger = logging.getLogger(__name__)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of KV cache one token occupies: layers x 2 (K and V) x KV heads x head size x bytes per element.

    Raises:
        ValueError: an argument is < 1.
    """
    if min(num_layers, num_kv_heads, head_dim, dtype_bytes) < 1:
        raise ValueError("kv_bytes_per_token needs every argument >= 1")
    return num_layers * 2 * num_kv_heads * head_dim * dtype_bytes


LLAMA_2_7B_KV_BYTES_PER_TOKEN = kv_bytes_per_token(num_layers=32, num_kv_heads=32, head_dim=128, dtype_bytes=2)
"""524,288 bytes = 512 KiB per token: Llama-2-7B in fp16 (32 layers, 32 KV heads x 128 = 4096, 2 bytes); x 16
tokens per block = 8 MiB per KV block (the cluster benchmark's model shape)."""

REQUEST_POLICIES = ("LCR", "SR", "LR")
"""``request_policy`` choices: LCR = last running (initial release's ``LCFS``), SR = shortest running (``SJF``;
HEAD's default), LR = longest running (``LJF``); lengths are tokens (prompt + generated)."""


@dataclass(frozen=True, slots=True)
class MigrationParams:
    """Llumnix's migration settings and the cost model's (units in the names).

    Attributes:
        bandwidth_gbytes_per_s: Interconnect bandwidth of the KV copy, GB/s (1e9 bytes per second, not Gb/s);
            0 = no migration (the controller is off: the point equals plain ``llumnix`` exactly). Default 12.5
            GB/s = one 100 Gb/s NIC, the link a copy between instances on different nodes crosses; Llumnix's
            own backends stage the copy through pinned host memory (``rpc``/``gloo``), so they reach at most
            that. Sweep it (``--migration-bandwidths``): 1 GB/s is a loaded TCP path, 25 a PCIe 4.0 x16 link,
            400 NVLink-class.
        kv_bytes_per_token: KV cache bytes per token (`LLAMA_2_7B_KV_BYTES_PER_TOKEN`); x block_size = bytes
            per block.
        stage_overhead_s: Fixed orchestration time of one stage, seconds. Assumption, not a measurement: a
            stage of the initial release makes four Ray actor calls in series (the destination's
            ``migrate_in_pre_alloc``; ``send_blocks`` -> the destination workers' ``migrate_gpu_cache_ray_rpc``
            -> the ``RecvActor`` -> the source worker's ``send_cpu_cache``) and two CUDA stream synchronisations;
            at ~1 ms per Ray actor round trip that is ~5 ms.
        copy_interference_frac: While a stage copies, steps of the source and of the destination take
            (1 + this) as long, >= 0. Default 0.01: Llumnix reports that migration barely slows the requests
            running beside it (OSDI'24 §6.2, "near-zero overhead" in its README); the paper's exact figure could
            not be re-read here, so 1% is our assumption (vary it with ``--migration-interference``).
        blocking_copy: True: the copy blocks both engines for the whole stage (no step starts) instead.
        polling_interval_s: Seconds between polls (``polling_interval`` 0.05; HEAD ``POLLING_INTERVAL`` 0.05).
        pair_migration_frequency: Pair instances every this many polls (``check_migrate_frequency`` 1; HEAD
            ``PAIR_MIGRATION_FREQUENCY`` 1), >= 1.
        migrate_out_threshold: Load threshold of sources and destinations, in -blocks per request
            (``migrate_out_threshold`` 3.0: a source's freeness is below -3 blocks per request; HEAD -3.0 on its
            ``remaining_steps`` metric, another scale).
        request_policy: Which running request migrates, one of `REQUEST_POLICIES` (``migrate_policy`` LCFS =
            LCR; HEAD ``REQUEST_MIGRATION_POLICY`` SR).
        last_stage_max_blocks: A stage with at most this many new blocks is the last (``last_stage_max_blocks``
            4; HEAD 16), >= 1.
        max_stages: Stages before the migration gives up (``max_stages`` 3; HEAD 3), >= 1.
        watermark_blocks: Blocks subtracted from the free blocks in the load (vLLM V0's watermark; 0 here).

    Raises:
        ValueError: On construction, naming the field, if a value is out of range.
    """

    bandwidth_gbytes_per_s: float = 12.5
    kv_bytes_per_token: int = LLAMA_2_7B_KV_BYTES_PER_TOKEN
    stage_overhead_s: float = 0.005
    copy_interference_frac: float = 0.01
    blocking_copy: bool = False
    polling_interval_s: float = 0.05
    pair_migration_frequency: int = 1
    migrate_out_threshold: float = 3.0
    request_policy: str = "LCR"
    last_stage_max_blocks: int = 4
    max_stages: int = 3
    watermark_blocks: int = 0

    def __post_init__(self) -> None:
        checks = {
            "bandwidth_gbytes_per_s": self.bandwidth_gbytes_per_s >= 0 and math.isfinite(self.bandwidth_gbytes_per_s),
            "kv_bytes_per_token": self.kv_bytes_per_token >= 1,
            "stage_overhead_s": self.stage_overhead_s >= 0 and math.isfinite(self.stage_overhead_s),
            "copy_interference_frac": self.copy_interference_frac >= 0,
            "polling_interval_s": self.polling_interval_s > 0,
            "pair_migration_frequency": self.pair_migration_frequency >= 1,
            "request_policy": self.request_policy in REQUEST_POLICIES,
            "last_stage_max_blocks": self.last_stage_max_blocks >= 1,
            "max_stages": self.max_stages >= 1,
            "watermark_blocks": self.watermark_blocks >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"MigrationParams.{name}: bad value {getattr(self, name)!r}")

    @property
    def enabled(self) -> bool:
        """False when the bandwidth is 0: no migration ever starts."""
        return self.bandwidth_gbytes_per_s > 0


def stage_transfer_s(num_blocks: int, block_size: int, params: MigrationParams) -> float:
    """Duration of one migration stage, seconds: ``stage_overhead_s`` + num_blocks x block_size x
    ``kv_bytes_per_token`` / (``bandwidth_gbytes_per_s`` x 1e9).

    Args:
        num_blocks: KV blocks the stage copies, >= 0.
        block_size: Tokens per KV block, >= 1.
        params: Bandwidth, bytes per token and overhead.

    Raises:
        ValueError: num_blocks < 0, block_size < 1, or migration disabled (bandwidth 0).
    """
    if num_blocks < 0 or block_size < 1:
        raise ValueError(f"need num_blocks >= 0 and block_size >= 1, got {num_blocks}, {block_size}")
    if not params.enabled:
        raise ValueError("stage_transfer_s: migration is disabled (bandwidth 0)")
    num_bytes = num_blocks * block_size * params.kv_bytes_per_token
    return params.stage_overhead_s + num_bytes / (params.bandwidth_gbytes_per_s * 1e9)


def migration_load(scheduler: Scheduler, watermark_blocks: int = 0) -> float:
    """Llumnix's migration load of an instance, -freeness, in blocks per request (higher = more loaded).

    -(free - watermark - blocks of the head-of-line waiting request) / (running + 1 if any request waits);
    -inf for an instance with nothing running or waiting. Blocks held by reservations count as used.

    Source: llumnix/instance_info.py ``MigrateLoadComputation.compute_instance_load`` (``consumed_speed``,
    ``enable_prefill_migrate``) @37d8e5ea; paper §4.4.2 (freeness F = (M - sum V) / B with the head-of-line
    request's demand as virtual usage).
    """
    num_requests = len(scheduler.running) + (1 if scheduler.waiting else 0)
    if num_requests == 0:
        return -math.inf
    num_available_blocks = scheduler.num_free_blocks - watermark_blocks
    if scheduler.waiting:
        num_available_blocks -= blocks_for_tokens(scheduler.waiting[0].num_tokens, scheduler.config.block_size)
    return -num_available_blocks / num_requests


def num_killed_requests(scheduler: Scheduler) -> int:
    """Waiting requests that were preempted (Llumnix's ``num_killed_request``; ``SchedulerLlumnix.
    _get_num_killed_request`` counts swapped ones too, and V1 swaps none)."""
    return sum(1 for r in scheduler.waiting if r.status == RequestStatus.PREEMPTED)


def pair_instances(loads: Sequence[float], num_killed: Sequence[int], threshold: float) -> list[tuple[int, int]]:
    """(source, destination) instance pairs: the i-th most loaded source with the i-th least loaded destination.

    Args:
        loads: `migration_load` per instance, index order.
        num_killed: `num_killed_requests` per instance, same order.
        threshold: ``migrate_out_threshold``, blocks per request.

    Returns:
        Pairs in that order; sources have load > threshold or killed requests, destinations load < threshold
        and none killed (so no instance is both). Ties keep index order (Python's stable sort, as Llumnix's).

    Source: llumnix/global_scheduler/migration_scheduler.py ``PrefillConstrained.check_migrate`` @37d8e5ea.
    """
    ordered = sorted(range(len(loads)), key=lambda i: loads[i])
    destinations = [i for i in ordered if num_killed[i] == 0 and loads[i] < threshold]
    sources = [i for i in reversed(ordered) if num_killed[i] > 0 or loads[i] > threshold]
    return list(zip(sources, destinations))


def pick_request(scheduler: Scheduler, policy: str) -> SimRequest | None:
    """The running request to migrate out, or None when every running request is still in its prefill.

    A candidate has sampled a token and its KV covers all but that token (it decodes: Llumnix skips
    ``prefilling_seq_groups`` and aborts on ``get_output_len() == 0``). LCR: the last candidate in running order;
    SR / LR: the fewest / most tokens (prompt + generated), ties to the first / last in running order.

    Raises:
        ValueError: unknown policy.

    Source: llumnix/llumlet/local_migration_scheduler.py ``get_migrate_out_request`` and
    llumnix/backends/vllm/scheduler.py ``get_last_running_request`` / ``get_shortest_running_request`` /
    ``get_longest_running_request`` @37d8e5ea.
    """
    if policy not in REQUEST_POLICIES:
        raise ValueError(f"unknown request policy {policy!r}; known: {', '.join(REQUEST_POLICIES)}")
    candidates = [r for r in scheduler.running
                  if r.num_generated_tokens >= 1 and r.num_computed_tokens >= r.num_tokens - 1]
    if not candidates:
        return None
    if policy == "LCR":
        return candidates[-1]
    if policy == "SR":
        return min(candidates, key=lambda r: r.num_tokens)
    return max(reversed(candidates), key=lambda r: r.num_tokens)


@dataclass(slots=True)
class MigrationStats:
    """What the controller did, summed over the point.

    Attributes:
        num_started / num_completed: migrations begun / ended with the request running at the destination.
        num_aborted_src: aborted at the source (request finished, preempted or not decoding; too many stages).
        num_aborted_dst: aborted because the destination had no room (blocks, or a running slot at the last
            stage's start).
        num_stages: stages begun; num_blocks_copied: blocks copied by completed stages.
        stall_s: seconds migrated requests spent stalled (last stage, including waits for a slot).
        num_commit_waits: last stages whose end found the destination's running list full.
        per_request: request id -> [started, completed, aborted] for every request that was ever picked.
    """

    num_started: int = 0
    num_completed: int = 0
    num_aborted_src: int = 0
    num_aborted_dst: int = 0
    num_stages: int = 0
    num_blocks_copied: int = 0
    stall_s: float = 0.0
    num_commit_waits: int = 0
    per_request: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_aborted(self) -> int:
        return self.num_aborted_src + self.num_aborted_dst


@dataclass(slots=True)
class _Migration:
    """One migration in flight."""

    src: int
    dst: int
    request: SimRequest
    key: str
    stage: int = 1
    num_sent_blocks: int = 0
    num_stage_blocks: int = 0
    is_last_stage: bool = False
    num_preemptions_at_start: int = 0
    stall_start_s: float = 0.0
    copying: bool = False


class MigrationController:
    """Llumnix's migration over a fleet of simulated engines, in virtual time (module NOTE).

    Drive it with `next_event_s` and `handle`: advance every engine to `next_event_s()`, then call
    `handle(that time)`; repeat while the time is within the run. ``on_moved(request_id, src, dst)`` is called when
    a request has moved (its instance's bookkeeping changes hands).

    Args:
        params: Settings; must be enabled (bandwidth > 0).
        engines: The fleet, index order.
        on_moved: Callback after a completed migration.

    Raises:
        ValueError: params disabled.
    """

    def __init__(self, params: MigrationParams, engines: Sequence[Engine],
                 on_moved: Callable[[str, int, int], None] = lambda request_id, src, dst: None) -> None:
        if not params.enabled:
            raise ValueError("MigrationController needs bandwidth_gbytes_per_s > 0")
        self.params = params
        self.engines = list(engines)
        self.stats = MigrationStats()
        self._on_moved = on_moved
        self._num_polls = 0
        self._next_poll_s = params.polling_interval_s
        self._migrating = [False] * len(self.engines)
        self._num_copies = [0] * len(self.engines)
        self._events: list[tuple[float, int, _Migration]] = []  # (stage end, seq, migration): a min-heap
        self._seq = itertools.count()

    @property
    def num_in_flight(self) -> int:
        """Migrations begun and not yet ended."""
        return len(self._events)

    def next_event_s(self) -> float:
        """Virtual time of the next poll or stage end, seconds."""
        return min(self._next_poll_s, self._events[0][0]) if self._events else self._next_poll_s

    def handle(self, now_s: float) -> None:
        """Process the stage ends and the poll due at or before ``now_s`` (engines already advanced there)."""
        while self._events and self._events[0][0] <= now_s:
            _, _, migration = heapq.heappop(self._events)
            self._stage_done(migration, now_s)
        if self._next_poll_s <= now_s:
            self._next_poll_s += self.params.polling_interval_s
            self._num_polls += 1
            if self._num_polls % self.params.pair_migration_frequency == 0:
                self._poll(now_s)

    # ---- global scheduler ---------------------------------------------------------------------------------
    def _poll(self, now_s: float) -> None:
        schedulers = [e.scheduler for e in self.engines]
        loads = [migration_load(s, self.params.watermark_blocks) for s in schedulers]
        killed = [num_killed_requests(s) for s in schedulers]
        for src, dst in pair_instances(loads, killed, self.params.migrate_out_threshold):
            if self._migrating[src] or self._migrating[dst]:
                continue
            request = pick_request(schedulers[src], self.params.request_policy)
            if request is None:
                continue
            self._migrating[src] = self._migrating[dst] = True
            migration = _Migration(src, dst, request, f"migration-{next(self._seq)}:{request.request_id}")
            self.stats.num_started += 1
            self.stats.per_request.setdefault(request.request_id, [0, 0, 0])[0] += 1
            logger.debug("%.3f s: migrate %s from %d to %d", now_s, request.request_id, src, dst)
            self._begin_stage(migration, now_s)

    # ---- one migration's stages ---------------------------------------------------------------------------
    def _decoding_at_source(self, m: _Migration) -> bool:
        scheduler = self.engines[m.src].scheduler
        r = m.request
        return (scheduler.get_request(r.request_id) is r and r.status == RequestStatus.RUNNING
                and r.num_preemptions == m.num_preemptions_at_start)

    def _begin_stage(self, m: _Migration, now_s: float) -> None:
        src, dst = self.engines[m.src], self.engines[m.dst]
        if m.stage == 1:
            m.num_preemptions_at_start = m.request.num_preemptions
        if not self._decoding_at_source(m):
            self._abort(m, dst_side=False)
            return
        num_held = src.scheduler.num_blocks_held(m.request.request_id)
        num_new = num_held - m.num_sent_blocks
        assert num_new >= 1, "a decoding request always has an unsent block"
        m.is_last_stage = num_new <= self.params.last_stage_max_blocks
        if m.is_last_stage:
            if (len(dst.scheduler.running) >= dst.scheduler.config.max_num_seqs
                    or not dst.reserve_blocks(m.key, num_new)):
                self._abort(m, dst_side=True)
                return
            # The request stops at the source; its KV stays held there until the copy ends.
            src.scheduler.abort_request(m.request.request_id)
            m.request.status = RequestStatus.RUNNING
            assert src.reserve_blocks(m.key, num_held)
            m.stall_start_s = now_s
            m.num_stage_blocks = num_new
        else:
            m.num_stage_blocks = num_new - 1  # the last block is still being written
            if not dst.reserve_blocks(m.key, m.num_stage_blocks):
                self._abort(m, dst_side=True)
                return
        self.stats.num_stages += 1
        end_s = now_s + stage_transfer_s(m.num_stage_blocks, src.scheduler.config.block_size, self.params)
        self._copy(m, end_s, start=True)
        heapq.heappush(self._events, (end_s, next(self._seq), m))

    def _stage_done(self, m: _Migration, now_s: float) -> None:
        if m.copying:
            self._copy(m, now_s, start=False)
            self.stats.num_blocks_copied += m.num_stage_blocks
        if m.is_last_stage:
            self._commit(m, now_s)
            return
        m.num_sent_blocks += m.num_stage_blocks
        if not self._decoding_at_source(m) or m.stage >= self.params.max_stages:
            self._abort(m, dst_side=False)
            return
        m.stage += 1
        self._begin_stage(m, now_s)

    def _commit(self, m: _Migration, now_s: float) -> None:
        src, dst = self.engines[m.src], self.engines[m.dst]
        if len(dst.scheduler.running) >= dst.scheduler.config.max_num_seqs:
            self.stats.num_commit_waits += 1
            retry_s = self._next_poll_s if self._next_poll_s > now_s else self._next_poll_s + self.params.polling_interval_s
            heapq.heappush(self._events, (retry_s, next(self._seq), m))
            return
        num_held = src.release_reserved_blocks(m.key)
        num_reserved = dst.release_reserved_blocks(m.key)
        assert num_held == num_reserved, (num_held, num_reserved)
        dst.scheduler.restore_running(m.request, num_reserved)
        self.stats.num_completed += 1
        self.stats.stall_s += now_s - m.stall_start_s
        self.stats.per_request[m.request.request_id][1] += 1
        self._migrating[m.src] = self._migrating[m.dst] = False
        self._on_moved(m.request.request_id, m.src, m.dst)

    def _abort(self, m: _Migration, dst_side: bool) -> None:
        self.engines[m.dst].release_reserved_blocks(m.key)
        assert not self.engines[m.src].release_reserved_blocks(m.key), "a stalled request is never aborted"
        if dst_side:
            self.stats.num_aborted_dst += 1
        else:
            self.stats.num_aborted_src += 1
        self.stats.per_request[m.request.request_id][2] += 1
        self._migrating[m.src] = self._migrating[m.dst] = False

    def _copy(self, m: _Migration, end_s: float, start: bool) -> None:
        """Apply (start) or lift the copy's cost on both engines (module NOTE, step 5)."""
        m.copying = start
        for i in (m.src, m.dst):
            engine = self.engines[i]
            if self.params.blocking_copy:
                if start:
                    engine.stall_until(end_s)
                continue
            self._num_copies[i] += 1 if start else -1
            engine.step_time_factor = 1.0 + self.params.copy_interference_frac * self._num_copies[i]


def with_bandwidth(params: MigrationParams, bandwidth_gbytes_per_s: float) -> MigrationParams:
    """``params`` with another bandwidth (GB/s). Raises ValueError as `MigrationParams`."""
    return dataclasses.replace(params, bandwidth_gbytes_per_s=bandwidth_gbytes_per_s)
