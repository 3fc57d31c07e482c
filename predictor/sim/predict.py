"""Predicted TTFT and end-to-end latency of a new request on one instance, by simulating it forward.

Owns `Prediction`, `predict` (fast) and `predict_by_stepping` (the plain reference: one `Engine.step()` per
iteration of the real `Scheduler`). Both append the new request to the instance's waiting queue at the
snapshot's time and simulate until that request finishes. Pure and synchronous: imports only the standard
library and `predictor.sim`.

`predict` has two paths:
- vLLM V1 rules (`EngineConfig.scheduling` "vllm-v1") with batch-time models that price a step from its counts
  (`LinearBatchTimeModel`: `step_time_from_counts_s`, `decode_run_time_from_counts_s`) use
  `predictor.sim.fast_predict`, an event-driven re-implementation of the V1 rules doing O(1)-O(log n) work per
  event. It is VERIFIED against `Scheduler` by the Hypothesis test
  `tests/predictor/sim/test_predict.py::test_predict_equals_stepping_and_leaves_state_unchanged` (>= 1000
  generated states and configs: same TTFT/E2E up to float rounding, same step and preemption counts);
- states where a request's block keys reach past its prompt (fast_predict models prefix caching for prompt keys
  only, and refuses them), the SGLang rules ("sglang"; fast_predict does not know them) and other models use
  `_predict_with_scheduler`:
  the real `Scheduler`, skipping pure-decode runs (verified for SGLang by
  `tests/predictor/sim/test_sglang_scheduler.py::test_sglang_predict_equals_stepping`). It costs O(running
  requests) per simulated step, far more than the event-driven path (`astrolabe bench sglang-model` measures it).

`predictor.sim.fast_predict` may be compiled with mypyc (the same source, a C extension beside the .py, built by
`pip install`; about 2.5x faster at 256 requests). The .py stays the reference: `predict(..., compiled=False)`
runs it even when the extension is loaded, the tests check that both give identical predictions, and an
extension older than its source is not used (`FAST_PREDICT_IMPLEMENTATION` says which one runs).

NOTE: why pure-decode runs may be skipped (both paths). When a step is a pure decode run (one decode per running
request, no prefill, no admission, no preemption), the following steps keep the same composition until the
next event: a completion (the request with the fewest output tokens left), or a block boundary that the free
blocks cannot cover (a preemption would follow). A waiting request cannot become admissible inside such a run:
the sequence cap, the token budget and the head-of-queue request stay fixed and free blocks only shrink, so
admission can only change after a completion. The first token of the new request is never inside a run (it is
sampled by a prefill step). So a run is applied at once and priced in closed form (`decode_run_time_s`).
With prefix caching (requests with block keys) the run's allocations may also evict cached blocks that the head
would hit. That does not make it admissible either: a block's parent is freed with it or later (every holder of a
block holds its parent and frees the child first; a snapshot's `cached_block_keys` keep that order, as their
contract states, and are queued behind the anonymous free blocks), so evictions shorten the head's hit from its end,
one block per allocated block; each allocated block lowers the free blocks by one, and each lost hit block lowers
the head's need by at most one (a free hit block it no longer takes, offset by one more new block unless its chunk
is capped by the budget), so the head's shortfall never shrinks (checked by
`tests/predictor/sim/test_predict_prefix_cache.py::test_predict_from_keyed_states_equals_stepping` and
`::test_predict_from_states_with_cached_free_blocks_equals_stepping`).

Under the SGLang rules the same holds for a different reason. There admission COULD become possible inside a
run, since the reservations shrink as requests generate (each running request reserves ratio x its remaining
cap) and the ratio decays every decode step; but SGLang does not look: a decode step with requests waiting
happens only after an admission was refused (for KV or the request cap), which marks the running batch full
(`batch_is_full`), and no admission is tried again until a request leaves the running batch (a completion, seen
one decode step later when the batch is filtered, or a retraction). So a run is skipped only while that mark is
set or nothing waits (`_num_skippable_steps`), it still ends before the first completion and before the first
step whose new KV pages exceed the free ones (where SGLang retracts), and the skipped steps' ratio decays are
applied one by one (`Scheduler.advance_decodes`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from dataclasses import dataclass, replace
from types import ModuleType

from predictor.sim import fast_predict as _fast_predict_loaded
from predictor.sim import kv_blocks as _kv_blocks
from predictor.sim import prefix_cache as _prefix_cache
from predictor.sim.batch_time import BatchTimeModel
from predictor.sim.engine import Engine
from predictor.sim.kv_blocks import blocks_for_tokens
from predictor.sim.request import RequestStatus, SimRequest
from predictor.sim.scheduler import ScheduledBatch, Scheduler
from predictor.sim.snapshot import InstanceSnapshot, RequestState

logger = logging.getLogger(__name__)


def _is_compiled(module: ModuleType) -> bool:
    return not (module.__file__ or "").endswith(".py")


_PYTHON_FAST_PREDICT = "predictor.sim._fast_predict_python"
"""Module name of the .py source of fast_predict when the compiled extension holds the real name."""


def _load_python_fast_predict(loaded: ModuleType = _fast_predict_loaded) -> ModuleType:
    """`loaded` (the imported fast_predict) if it runs from its .py source, else that source loaded under
    `_PYTHON_FAST_PREDICT` (once)."""
    if not _is_compiled(loaded):
        return loaded
    module = sys.modules.get(_PYTHON_FAST_PREDICT)
    if module is not None:
        return module
    path = os.path.join(os.path.dirname(loaded.__file__ or ""), "fast_predict.py")
    spec = importlib.util.spec_from_file_location(_PYTHON_FAST_PREDICT, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[_PYTHON_FAST_PREDICT] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _is_stale(module: ModuleType) -> bool:
    """True if `module` is compiled and older than its .py beside it (edited or checked out since the build); an
    extension with no source beside it (an installed wheel) is not stale."""
    if not _is_compiled(module):
        return False
    compiled_path = module.__file__ or ""
    source_path = os.path.join(os.path.dirname(compiled_path), module.__name__.rpartition(".")[2] + ".py")
    try:
        return os.path.getmtime(source_path) > os.path.getmtime(compiled_path)
    except OSError:
        return False


def _choose_fast_predict(loaded: ModuleType = _fast_predict_loaded) -> tuple[ModuleType, str]:
    """(the fast_predict module `predict` runs, its description) given the imported one: a compiled module
    unless it is older than the .py beside it (edited or checked out since the build: then the .py, with a
    warning), else the .py. A compiled block pool (`predictor.sim.kv_blocks`, `predictor.sim.prefix_cache`) older
    than its .py is only reported: Python has imported it, and the scheduler runs it too."""
    for pool_module in (_kv_blocks, _prefix_cache):
        if _is_stale(pool_module):
            logger.warning("%s is older than its .py: it runs all the same (rebuild with make install)",
                           pool_module.__file__)
    if not _is_compiled(loaded):
        return loaded, "python"
    if _is_stale(loaded):
        logger.warning("%s is older than its .py: using the .py (rebuild with make install)", loaded.__file__)
        return _load_python_fast_predict(loaded), "python (the compiled module is older than its source)"
    return loaded, "mypyc"


_FAST_PREDICT, FAST_PREDICT_IMPLEMENTATION = _choose_fast_predict()
"""The `predictor.sim.fast_predict` that `predict` runs and which one it is: "mypyc" (compiled) or "python"."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """Simulated latencies of one request, measured from the snapshot's time.

    Attributes:
        ttft_s: Until the end of the step that samples its first output token, seconds.
        e2e_s: Until the end of the step that samples its last output token, seconds (>= ttft_s).
        num_steps: Engine iterations between the snapshot and the request's completion.
        num_steps_simulated: Iterations simulated one by one (`schedule()` calls); the rest were skipped in
            closed form. Equals num_steps for `predict_by_stepping`.
        num_preemptions: Preemptions (of any request) during the simulated interval.
    """

    ttft_s: float
    e2e_s: float
    num_steps: int
    num_steps_simulated: int
    num_preemptions: int


def _target_request(snapshot: InstanceSnapshot, request: RequestState) -> SimRequest:
    """The new request as a fresh waiting `SimRequest` arriving at the snapshot's time (under the "priority" policy,
    after every request in it: `InstanceSnapshot.new_arrival_time_s`)."""
    if request.num_computed_tokens or request.num_generated_tokens:
        raise ValueError(f"new request {request.request_id!r} must have no computed or generated tokens")
    target = request.to_sim_request(RequestStatus.WAITING)
    target.arrival_time_s = (snapshot.new_arrival_time_s() if snapshot.config.scheduling_policy == "priority"
                             else snapshot.now_s)
    return target


def predict_by_stepping(
    snapshot: InstanceSnapshot, request: RequestState, batch_time: BatchTimeModel
) -> Prediction:
    """Reference prediction: step an `Engine` one iteration at a time until `request` finishes.

    Args:
        snapshot: Instance state; not modified.
        request: The new request (no progress); its id must not be in the snapshot.
        batch_time: Step execution-time model.

    Returns:
        The request's simulated TTFT and E2E from snapshot.now_s.

    Raises:
        ValueError: If the snapshot is invalid, or the request is invalid for it (see
            `InstanceSnapshot.to_scheduler` and `Scheduler.add_request`).
    """
    engine = Engine(snapshot.config, batch_time, now_s=snapshot.now_s)
    engine.scheduler = snapshot.to_scheduler()
    target = _target_request(snapshot, request)
    engine.add_request(target)
    num_steps = 0
    while target.finish_time_s is None:
        result = engine.step()
        assert result is not None, "engine idle before the target finished"
        num_steps += 1
    assert target.first_token_time_s is not None
    return Prediction(
        ttft_s=target.first_token_time_s - snapshot.now_s,
        e2e_s=target.finish_time_s - snapshot.now_s,
        num_steps=num_steps,
        num_steps_simulated=num_steps,
        num_preemptions=engine.scheduler.num_preemptions_total - snapshot.num_preemptions_total,
    )


def predict(
    snapshot: InstanceSnapshot, request: RequestState, batch_time: BatchTimeModel, *, compiled: bool = True
) -> Prediction:
    """Fast prediction: the same result as `predict_by_stepping`, far cheaper (see the module docstring).

    Gives the same times as `predict_by_stepping` up to float rounding and the same step and preemption
    counts (the property tests check this). Under the vLLM V1 rules with `LinearBatchTimeModel` it costs
    O(1)-O(log n) per event (completion, admission, prefill chunk, preemption); about 1 ms for a 256-request
    instance in pure Python, 0.46 ms compiled (`astrolabe bench predictor`). Requests with block keys add
    O(all keys) once and O(their blocks shared with other requests) to each admission and completion (the
    prefix-cache pool, compiled with fast_predict where the build can: 1.3 ms p50 at 256 keyed requests,
    `astrolabe bench predictor --shared-prefix 512`). Under the
    SGLang rules it steps the `Scheduler` (pure-decode runs skipped), O(running requests) per simulated step.

    Args:
        snapshot: Instance state; not modified.
        request: The new request (no progress); its id must not be in the snapshot.
        batch_time: Step execution-time model. With `step_time_from_counts_s` and
            `decode_run_time_from_counts_s` (as `LinearBatchTimeModel`) and the vLLM V1 rules the event-driven
            path (`predictor.sim.fast_predict`) is used, unless a request's block keys reach past its prompt or,
            under the "priority" policy, a preemption the walk does not follow (`fast_predict.NotModelled`:
            a victim other than the last running request in a step whose token budget binds, or a step the
            preemptions emptied); otherwise the `Scheduler` with decode runs skipped.
        compiled: False runs the pure-Python `fast_predict` even where the compiled one is loaded (the
            reference, for tests and benchmarks); the results are identical.

    Returns:
        The request's simulated TTFT and E2E from snapshot.now_s.

    Raises:
        ValueError: As `predict_by_stepping`, or if the model gives a non-positive step time.
    """
    if (
        snapshot.config.scheduling == "vllm-v1"
        and hasattr(batch_time, "step_time_from_counts_s")
        and hasattr(batch_time, "decode_run_time_from_counts_s")
    ):
        if request.num_computed_tokens or request.num_generated_tokens:
            raise ValueError(f"new request {request.request_id!r} must have no computed or generated tokens")
        module = _FAST_PREDICT if compiled else _load_python_fast_predict()
        try:
            result = module.simulate_until_finished(snapshot, request, batch_time)
        except module.NotModelled:
            return _predict_with_scheduler(snapshot, request, batch_time)
        return Prediction(
            ttft_s=result.ttft_s,
            e2e_s=result.e2e_s,
            num_steps=result.num_steps,
            num_steps_simulated=result.num_steps_simulated,
            num_preemptions=result.num_preemptions,
        )
    return _predict_with_scheduler(snapshot, request, batch_time)


def predict_idle(snapshot: InstanceSnapshot, request: RequestState, batch_time: BatchTimeModel) -> Prediction:
    """`predict` for ``request`` alone on ``snapshot``'s instance (same engine, nothing else on it): the request's
    own cost as this model prices it (its prefill chunks and decode steps); one small simulation.

    Raises:
        ValueError: as `predict`.
    """
    return predict(InstanceSnapshot(config=snapshot.config, now_s=snapshot.now_s), request, batch_time)


def marginal_cost_s(snapshot: InstanceSnapshot, request: RequestState, batch_time: BatchTimeModel,
                    base: Prediction) -> tuple[float, float]:
    """How much ``request``'s TTFT and E2E grow per request like it that arrives just before it, seconds.

    One more simulation: the same snapshot with a twin of ``request`` (same prompt and expected output) at the end
    of the waiting queue, ahead of ``request``. A router that dispatched m requests to the instance since asking,
    requests the sidecar's answer could not include, prices them as m times this (linear: near for the few
    requests a decision's round trip can miss; ``extproc/router.py``).

    Args:
        snapshot: Instance state, as given to `predict`; not modified.
        request: The new request, as given to `predict`.
        batch_time: Step execution-time model.
        base: ``predict(snapshot, request, batch_time)``.

    Returns:
        (TTFT growth, E2E growth), seconds, each >= 0; (0, 0) if the simulation with the twin cannot run.
    """
    twin = RequestState(f"{request.request_id}~ahead", request.num_prompt_tokens, request.num_output_tokens,
                        arrival_time_s=request.arrival_time_s, max_new_tokens=request.max_new_tokens,
                        block_keys=request.block_keys)
    try:
        later = predict(replace(snapshot, waiting=(*snapshot.waiting, twin)), request, batch_time)
    except ValueError:
        return 0.0, 0.0
    return max(later.ttft_s - base.ttft_s, 0.0), max(later.e2e_s - base.e2e_s, 0.0)


def _predict_with_scheduler(
    snapshot: InstanceSnapshot, request: RequestState, batch_time: BatchTimeModel
) -> Prediction:
    """`predict` for models without count-based pricing: the real `Scheduler`, skipping pure-decode runs
    with `Scheduler.advance_decodes` (priced by `decode_run_time_s` if the model has it, else step by step)."""
    scheduler = snapshot.to_scheduler()
    target = _target_request(snapshot, request)
    scheduler.add_request(target)
    run_time_s = getattr(batch_time, "decode_run_time_s", None)
    elapsed_s = 0.0
    num_steps = 0
    num_steps_simulated = 0
    while target.finish_time_s is None:
        batch = scheduler.schedule()
        num_steps_simulated += 1
        num_run_steps = _num_skippable_steps(scheduler, batch)
        if num_run_steps >= 2:
            if run_time_s is not None:
                duration_s = run_time_s(batch, num_run_steps)
            else:
                duration_s = _decode_run_time_by_steps_s(batch_time, batch, num_run_steps)
            scheduler.advance_decodes(batch, num_run_steps)
            num_steps += num_run_steps
        else:
            duration_s = batch_time.step_time_s(batch)
            num_steps += 1
            if not duration_s > 0:
                raise ValueError(f"batch-time model returned {duration_s!r} s for a batch of {batch.num_seqs} seqs")
            scheduler.update_after_step(batch, elapsed_s + duration_s)
        elapsed_s += duration_s
    assert target.first_token_time_s is not None
    return Prediction(
        ttft_s=target.first_token_time_s,
        e2e_s=target.finish_time_s,
        num_steps=num_steps,
        num_steps_simulated=num_steps_simulated,
        num_preemptions=scheduler.num_preemptions_total - snapshot.num_preemptions_total,
    )


def _num_skippable_steps(scheduler: Scheduler, batch: ScheduledBatch) -> int:
    """Steps, starting with `batch`, that are identical decode steps with no event; 0 if batch is not one.

    The run ends before the first step that would finish a request (the fewest output tokens left, m) or
    need more new blocks than are free now (cumulative need N(j) = Σ max(0, blocks(c_r + j) - held_r), with
    c_r the computed tokens before the step and held_r the blocks held after `batch` was reserved). Under the
    SGLang rules a run also needs the queue empty or the running batch marked full (see the module docstring's
    NOTE): otherwise the next step tries an admission.
    """
    running = scheduler.running
    if batch.num_prefill_tokens or batch.preempted_request_ids or batch.num_decode_seqs != len(running):
        return 0
    sglang_state = scheduler.sglang_state
    if sglang_state is not None and scheduler.waiting and not sglang_state.batch_is_full:
        return 0
    num_limit = min(r.num_output_tokens - r.num_generated_tokens for r in running) - 1
    if num_limit < 2:
        return num_limit
    block_size = scheduler.config.block_size
    num_free_blocks = scheduler.num_free_blocks
    # (computed tokens, blocks held) per running request, read once.
    progress = [(r.num_computed_tokens, scheduler.num_blocks_held(r.request_id)) for r in running]

    def num_new_blocks(num_run_steps: int) -> int:
        total = 0
        for num_computed, num_held in progress:
            extra = blocks_for_tokens(num_computed + num_run_steps, block_size) - num_held
            if extra > 0:
                total += extra
        return total

    if num_new_blocks(num_limit) <= num_free_blocks:
        return num_limit
    # N(j) is non-decreasing in j and N(1) = 0 (batch's blocks are reserved): find the largest j with
    # N(j) <= free by bisection.
    low, high = 1, num_limit  # N(low) fits, N(high) does not
    while high - low > 1:
        mid = (low + high) // 2
        if num_new_blocks(mid) <= num_free_blocks:
            low = mid
        else:
            high = mid
    return low


def _decode_run_time_by_steps_s(batch_time: BatchTimeModel, batch: ScheduledBatch, num_steps: int) -> float:
    """Sum of step times of `batch` and the num_steps - 1 decode steps after it (each adds one context token
    per decode); for models without a closed form."""
    total_s = 0.0
    step_batch = ScheduledBatch(
        num_scheduled_tokens=batch.num_scheduled_tokens,
        num_decode_seqs=batch.num_decode_seqs,
        decode_context_tokens=batch.decode_context_tokens,
    )
    for _ in range(num_steps):
        total_s += batch_time.step_time_s(step_batch)
        step_batch.decode_context_tokens += step_batch.num_decode_seqs
    return total_s
