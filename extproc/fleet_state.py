"""Prediction in the router (protocol v1.2): the sidecars' states as this replica watches them, and predictions
from them with no round trip on the request path.

Each sidecar streams its instance's state (``Watch``, ``predictor/instance_state.py``) every ``interval_s``: the
snapshot its own Predict would simulate from (expected output lengths applied), its step-time model and its
corrections. A decision then predicts each candidate locally with the same simulation (``predictor.sim.predict``,
the compiled fast path where it is built) from that state plus:

- **this replica's own dispatches the state does not include yet**: its Admits carry sequence numbers and each
  state says up to which one it includes (``admits_seen``); the later ones (``PredictorClient.admits_after``) are
  queued in as waiting requests. Exact, whatever the order of the messages: two decisions of one replica always
  see each other, however close together;
- **the state's age**: the state was taken ``age`` seconds ago, so the queue ahead of the new request has moved
  on by up to that much: TTFT and E2E shrink by ``min(age, the wait the state's own requests cause)`` (a request
  that would start at once gains nothing), plus ``min(time since the first unseen dispatch, the wait the unseen
  dispatches add)``: theirs began only when they were sent (measured through Envoy, discounting it by the state's
  age sent 25 of a 64-request burst to the instance whose state was oldest; not discounting it at all made an
  instance whose sidecar was starved of CPU for 200 ms look busy with requests it had served long before).

Other replicas' dispatches reach a decision with the next state that includes their Admits: at most
``interval_s`` plus one Admit's trip later (what that window costs is not measured yet: the cluster simulation
still routes on exact state). A state older than ``max_age_s`` (a frozen or cut-off sidecar) gives no prediction, as a late Predict
does; the decision then falls back as the router's rules say. A sidecar that does not know Watch (protocol v1.1 or
older) answers UNIMPLEMENTED and is asked by Predict from then on (`covers` is False for it).

New requests get the sidecar's default residual-length rules (``predictor.residual_rules``) here, with the length
distribution the sidecar's state names (``quantiles``, or ``binned`` for a sidecar run with
``--length-distribution binned``, one whose tagger directory has no ``quantiles.npz``, or one older than v1.6): a
sidecar run with other ``--residual-lengths`` or ``--length-errors`` than the defaults predicts a new request's
length differently from its watchers.

Cost: a message is decoded (``predictor.instance_state.decode``, O(requests)) only when a prediction first reads it;
at 50 states a second per sidecar most are replaced unread. Counters: ``outcomes[address][o]`` for o in
`OUTCOMES`, one per `predict` call.
NOTE: runs on the event loop; `predict` is synchronous and O(requests on the instance) (the simulation).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass

import grpc

from extproc.policies.base import Prediction
from extproc.predictor_client import PredictorClient
from predictor.api import pb
from predictor.instance_state import WatchedState, decode
from predictor.residual_rules import ResidualRules
from predictor.sim.batch_time import BatchTimeModel
from predictor.sim.predict import Prediction as SimPrediction, predict, predict_idle
from predictor.sim.snapshot import InstanceSnapshot, RequestState

logger = logging.getLogger(__name__)

OUTCOMES = ("ok", "no_state", "stale_state", "invalid")
"""Outcomes of `FleetState.predict`: a prediction; no state received yet (or the stream is down); a state older
than ``max_age_s`` (or the sidecar's own older than ``max_state_age_s``); a request the state cannot serve, or a
state that cannot be used."""
MAX_EXPECTED_CACHED = 4096
"""Distinct (output tokens, cap, length source) whose expected output `FleetState` remembers before it starts over."""


def leading_blocks(block_keys: Sequence[int], cached: Container[int], held: Container[int]) -> tuple[int, int]:
    """(leading keys of ``block_keys`` in ``cached``, walked until the first miss; of those, the leading ones in
    ``held``): ``EndpointView.num_prefix_blocks_cached`` and ``num_prefix_blocks_in_use`` from a state's key sets
    (``held``: its requests' prompt keys; ``cached``: those and its cached free blocks' keys)."""
    num = 0
    for key in block_keys:
        if key not in cached:
            break
        num += 1
    num_in_use = 0
    while num_in_use < num and block_keys[num_in_use] in held:
        num_in_use += 1
    return num, num_in_use


@dataclass(slots=True)
class _Watched:
    """One sidecar: its last message and when it arrived (monotonic seconds), that message decoded (once, when a
    prediction first needs it: most messages are replaced before any candidate reads them), the task that follows
    its stream."""

    message: pb.InstanceState | None = None
    received_s: float = 0.0
    decoded: WatchedState | None = None
    task: asyncio.Task | None = None
    unsupported: bool = False
    failing: bool = False
    # (a message, the block keys it holds or caches, those its requests hold), built when first asked
    keys: tuple[pb.InstanceState, set[int], set[int]] | None = None

    @property
    def state(self) -> WatchedState | None:
        """The last message decoded, or None (none yet, or one that cannot be used: logged once by the caller).

        Raises:
            ValueError: the last message cannot describe an instance (``predictor.instance_state.decode``).
        """
        if self.message is None:
            return None
        if self.decoded is None or self.decoded.seq != self.message.seq:
            self.decoded = decode(self.message)
        return self.decoded


@dataclass(frozen=True, slots=True)
class PricedState:
    """`predict_from_state`'s answer.

    Attributes:
        snapshot: the state with the unseen dispatches queued in.
        result: the new request's prediction on ``snapshot`` (seconds from the state's clock).
        idle: its prediction on the instance idle.
        queue_s: ``result``'s TTFT less the idle TTFT, seconds (>= 0): the wait the requests there cause.
        shift_s: how much of that wait has passed since the state was taken, seconds (>= 0): taken off the TTFT,
            E2E and queue by the caller.
    """

    snapshot: InstanceSnapshot
    result: SimPrediction
    idle: SimPrediction
    queue_s: float
    shift_s: float


def predict_from_state(snapshot: InstanceSnapshot, new: RequestState, unseen: Sequence[RequestState],
                       batch_time: BatchTimeModel, age_s: float, since_first_s: float) -> PricedState:
    """A new request priced on a state ``age_s`` seconds old with this router's ``unseen`` dispatches (the ones the
    state does not include yet, oldest first, the first sent ``since_first_s`` seconds ago) queued in after its
    waiting requests. The state's queue has moved on while it travelled, by up to its age; the wait the unseen
    dispatches add began only when they were sent (by up to ``since_first_s``): ``shift_s``. Shared by
    `FleetState.predict` and the cluster simulation's stale states (``bench/cluster_sim.py``).

    Raises:
        ValueError: a request that can never fit the instance (as ``predictor.sim.predict.predict``).
    """
    new = snapshot.fit_request(new)
    idle = predict_idle(snapshot, new, batch_time)
    state_queue_s = 0.0  # the wait the state's own requests cause (only needed beside unseen dispatches)
    if unseen:
        if age_s > 0 and (snapshot.running or snapshot.waiting):
            state_queue_s = max(predict(snapshot, new, batch_time).ttft_s - idle.ttft_s, 0.0)
        snapshot = dataclasses.replace(snapshot, waiting=(*snapshot.waiting, *map(snapshot.fit_request, unseen)))
    result = predict(snapshot, new, batch_time)
    queue_s = max(result.ttft_s - idle.ttft_s, 0.0)
    if unseen:
        shift_s = min(age_s, state_queue_s) + min(since_first_s, max(queue_s - state_queue_s, 0.0))
    else:
        shift_s = min(age_s, queue_s)
    return PricedState(snapshot, result, idle, queue_s, shift_s)


class FleetState:
    """Watches sidecars and predicts from their states.

    Args:
        client: the predictor client: its channels (TLS included), its router id, its numbered Admits and its
            backoff settings (``min_backoff_s`` .. ``max_backoff_s`` between two attempts to watch a sidecar).
        interval_s: the interval asked of each sidecar, seconds.
        max_age_s: a state received longer ago than this gives no prediction, seconds.
        max_state_age_s: nor one whose sidecar's own state (since its last reconciliation) is older, seconds.
        clock: monotonic clock, seconds.

    Attributes:
        outcomes: sidecar address -> outcome (`OUTCOMES`) -> number of `predict` calls.
    """

    def __init__(self, client: PredictorClient, *, interval_s: float = 0.02, max_age_s: float = 0.25,
                 max_state_age_s: float = 2.0, clock=time.monotonic) -> None:
        self._client = client
        self.interval_s = interval_s
        self.max_age_s = max_age_s
        self.max_state_age_s = max_state_age_s
        self._clock = clock
        self._residual = ResidualRules()
        self._expected_cache: dict[tuple[int, int | None, int, str], int] = {}
        self._watched: dict[str, _Watched] = {}
        self.outcomes: dict[str, dict[str, int]] = {}
        self._warned_block_size = False
        self._warned_fcfs: set[str] = set()

    def watch(self, addresses) -> None:
        """Starts following each sidecar of ``addresses`` not followed yet (in the background: a sidecar that is
        down is retried with the client's backoff)."""
        for address in addresses:
            if address not in self._watched:
                entry = self._watched[address] = _Watched()
                self.outcomes[address] = dict.fromkeys(OUTCOMES, 0)
                entry.task = asyncio.get_running_loop().create_task(self._follow(address, entry))

    async def first_states(self, timeout_s: float) -> bool:
        """Waits until every watched sidecar has sent a state (or refused Watch), at most ``timeout_s`` seconds;
        True if all did. The extproc waits so at start: its first decisions would otherwise have no state."""
        deadline_s = self._clock() + timeout_s
        while any(e.message is None and not e.unsupported for e in self._watched.values()):
            if self._clock() >= deadline_s:
                return False
            await asyncio.sleep(0.005)
        return True

    def covers(self, address: str) -> bool:
        """Whether predictions for ``address`` are made here (it is watched and did not refuse Watch)."""
        entry = self._watched.get(address)
        return entry is not None and not entry.unsupported

    def state(self, address: str) -> tuple[WatchedState, float] | None:
        """The last state of ``address`` and its age, seconds; None before the first."""
        entry = self._watched.get(address)
        try:
            state = entry.state if entry is not None else None
        except ValueError:
            return None
        return None if state is None else (state, self._clock() - entry.received_s)

    def forget(self, address: str) -> None:
        """Stops following a sidecar that left the pool."""
        entry = self._watched.pop(address, None)
        self.outcomes.pop(address, None)
        if entry is not None and entry.task is not None:
            entry.task.cancel()

    async def close(self) -> None:
        tasks = [e.task for e in self._watched.values() if e.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._watched.clear()

    async def _follow(self, address: str, entry: _Watched) -> None:
        config = self._client.config
        backoff_s = config.min_backoff_s
        while True:
            call = self._client.stub(address).Watch(
                pb.WatchRequest(router_id=self._client.router_id, interval_s=self.interval_s))
            try:
                async for message in call:
                    entry.message, entry.received_s = message, self._clock()
                    self._client.forget_admits_through(address, message.admits_seen)
                    if entry.failing:
                        logger.info("sidecar %s: its state stream works again", address)
                    entry.failing, backoff_s = False, config.min_backoff_s
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    logger.info("sidecar %s does not stream its state (protocol v1.1 or older): asked by Predict",
                                address)
                    entry.unsupported, entry.message = True, None
                    return
                if not entry.failing:
                    logger.warning("sidecar %s: its state stream failed (%s: %s); retried with backoff, its "
                                   "candidates get no prediction meanwhile", address, exc.code().name,
                                   exc.details())
                entry.failing = True
            finally:
                call.cancel()
            entry.message = entry.decoded = None
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, config.max_backoff_s)

    def prefix_blocks(self, address: str, block_keys: Sequence[int], block_size: int) -> tuple[int, int] | None:
        """(``EndpointView.num_prefix_blocks_cached``, ``EndpointView.num_prefix_blocks_in_use``): the leading
        blocks of ``block_keys`` that ``address``'s last state holds or caches (its requests' prompt blocks and its
        cached free blocks), walked until the first miss, and of those the leading ones its requests (running or
        waiting) hold in their prompts.

        The sets of a state's keys are built once per message, when first asked, from the message's key columns
        without decoding the rest (every key a request holds is in ``InstanceState.block_keys`` once: a shared run
        refers to keys sent for an earlier request): O(keys in the state), about 2 ms for 20,000 keys (held or
        cached) on this machine under load, for each endpoint whose state changed since the last decision. None: no
        state, or one of another block size than ``block_size`` (tokens per block of the keys). A stale state still
        answers: it is the router's last view of that cache."""
        entry = self._watched.get(address)
        message = None if entry is None else entry.message
        if message is None:
            return None
        if message.block_size != block_size:
            if not self._warned_block_size:
                self._warned_block_size = True
                logger.warning("the sidecar at %s reports KV blocks of %d tokens, prefix_cache.block_size is %d: "
                               "no prompt's keys can match its cache (set prefix_cache.block_size to the engines' "
                               "--block-size); logged once", address, message.block_size, block_size)
            return None
        if entry.keys is None or entry.keys[0] is not message:
            in_use = set(message.block_keys)
            entry.keys = (message, in_use.union(message.cached_block_keys), in_use)
        return leading_blocks(block_keys, entry.keys[1], entry.keys[2])

    def predict(self, address: str, num_prompt_tokens: int, num_output_tokens: int, *,
                max_tokens: int | None = None, length_source: int = 0, block_keys: tuple[int, ...] | None = None,
                block_size: int = 0, priority: int = 0) -> Prediction | None:
        """The prediction for a new request at ``address`` from its last state (module docstring).

        Args:
            address: the sidecar's ``host:port`` (watched).
            num_prompt_tokens: prompt tokens.
            num_output_tokens: predicted output tokens, before the ``max_tokens`` cap (applied here).
            max_tokens: the request's output cap, tokens (None: not given).
            length_source: where ``num_output_tokens`` came from (``predictor.residual_rules.LENGTH_SOURCE_*``).
            block_keys: the prompt's KV block keys (None: none), computed at ``block_size`` tokens per block:
                the simulation finds the prefix the state holds or caches, and so do this replica's unseen
                dispatches' keys. A state of another block size ignores them (no hit predicted).
            priority: the request's priority at the engine (vLLM's: lower = earlier): where the state's engine
                runs the "priority" scheduling policy it queues by it, and so do the unseen dispatches by theirs.

        Returns:
            The prediction (``num_requests`` counts this replica's unseen dispatches too, which are in the
            simulation), or None: no state yet, a stale state, or a request the state cannot serve (the outcome
            is counted in ``outcomes``).
        """
        entry = self._watched.get(address)
        counts = self.outcomes.get(address)
        if entry is None or counts is None:
            return None
        try:
            state = entry.state
        except ValueError as exc:
            if not entry.failing:
                logger.warning("sidecar %s sent a state that cannot be used (%s); its candidates get no prediction "
                               "until it sends a good one", address, exc)
            entry.failing = True
            counts["invalid"] += 1
            return None
        if state is None:
            counts["no_state"] += 1
            return None
        age_s = self._clock() - entry.received_s
        if not (age_s <= self.max_age_s and state.state_age_s + age_s <= self.max_state_age_s):
            counts["stale_state"] += 1
            return None
        snapshot = state.snapshot
        if priority and snapshot.config.scheduling_policy != "priority" and address not in self._warned_fcfs:
            self._warned_fcfs.add(address)
            logger.warning("requests carry an engine priority (objectives.engine_priority) but the sidecar at %s "
                           "says its engine schedules %s: vLLM refuses a request that names a priority under fcfs "
                           "(HTTP 400); start the engine and its sidecar with --scheduling-policy priority, or turn "
                           "engine_priority off; logged once per sidecar", address,
                           snapshot.config.scheduling_policy)
        unseen = self._client.admits_after(address, state.admits_seen)
        keyed = block_size == snapshot.config.block_size
        # under the "priority" policy the unseen dispatches queue behind the state's requests of their priority
        unseen_arrival_s = snapshot.new_arrival_time_s() if unseen else 0.0
        try:
            new = RequestState("new", max(num_prompt_tokens, 1),
                               self._expected(num_output_tokens, max_tokens, length_source, state.length_distribution),
                               max_new_tokens=max_tokens,
                               block_keys=block_keys if keyed else None, priority=priority)
            priced = predict_from_state(
                snapshot, new, [RequestState(f"unseen-{a.seq}", max(a.num_prompt_tokens, 1),
                                             self._expected(a.num_output_tokens, a.max_tokens, a.length_source,
                                                            state.length_distribution),
                                             max_new_tokens=a.max_tokens, block_keys=a.block_keys if keyed else None,
                                             priority=a.priority, arrival_time_s=unseen_arrival_s)
                                for a in unseen],
                state.batch_time, age_s, max(self._clock() - unseen[0].sent_s, 0.0) if unseen else 0.0)
        except ValueError:  # e.g. a prompt larger than the instance's KV cache (Predict's INVALID_ARGUMENT)
            counts["invalid"] += 1
            return None
        result, idle, queue_s, shift_s = priced.result, priced.idle, priced.queue_s, priced.shift_s
        snapshot = priced.snapshot
        ttft_s, e2e_s = state.corrections.apply(result.ttft_s + state.lag_s - shift_s,
                                                result.e2e_s + state.lag_s - shift_s)
        if not (math.isfinite(ttft_s) and math.isfinite(e2e_s)):
            counts["invalid"] += 1
            return None
        counts["ok"] += 1
        return Prediction(ttft_s, e2e_s, state.state_age_s + age_s, queue_s - shift_s,
                          num_requests=len(snapshot.running) + len(snapshot.waiting), model_error=state.model_error,
                          idle_e2e_s=state.corrections.apply(idle.ttft_s, idle.e2e_s)[1])

    def _expected(self, num_output_tokens: int, max_tokens: int | None, length_source: int,
                  length_distribution: str) -> int:
        """The residual rules' expected output of a request not started yet, tokens, as the sidecar whose state
        says ``length_distribution`` prices it (memoised: the rules are fixed, and every prediction prices this
        replica's unseen dispatches again)."""
        key = (num_output_tokens, max_tokens, length_source, length_distribution)
        expected = self._expected_cache.get(key)
        if expected is None:
            if len(self._expected_cache) >= MAX_EXPECTED_CACHED:
                self._expected_cache.clear()
            expected = self._expected_cache[key] = self._residual.for_source(
                length_source, length_distribution).expected_output_tokens(max(num_output_tokens, 1), 0,
                                                                           max_tokens or None)
        return expected
