"""Where the sidecar's instance state comes from: the vLLM plugin's state file, or the ledger.

`PluginStateReader` reads the file written inside vLLM's engine core by `predictor.vllm_plugin` (format in
`predictor.vllm_plugin.publisher`), re-parsing it only when it changed, and rejects it when its writer process is
gone or the file is older than ``max_age_s`` while requests are in flight. `plugin_snapshot` turns one such state
into the `InstanceSnapshot` the predictor simulates from: prompt, computed and generated tokens are the engine's
own; the expected output length of each request comes from the sidecar's own Admit records (`AdmitRecords`)
where the request is known, else from the mean of admitted lengths; either is capped by the request's
``max_tokens``. Requests admitted here that the engine has not shown yet are queued behind its waiting ones.

Choice of source (``--state-source``): ``ledger`` always uses the ledger; ``vllm-plugin`` uses the plugin's state
and falls back to the ledger only while none is readable (logged); ``auto`` = the plugin when its state is
readable, else the ledger. Imports only the standard library, `predictor.sim` and `predictor.calibration`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import stat as _stat
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from predictor.calibration import StepSample
from predictor.sim import EngineConfig
from predictor.sim.scheduler import SCHEDULING_POLICIES
from predictor.sim.residual import capped_tokens
from predictor.sim.snapshot import InstanceSnapshot, RequestState

logger = logging.getLogger(__name__)

STATE_SOURCE_LEDGER = "ledger"
STATE_SOURCE_PLUGIN = "vllm-plugin"
STATE_SOURCE_AUTO = "auto"
STATE_SOURCES = (STATE_SOURCE_AUTO, STATE_SOURCE_LEDGER, STATE_SOURCE_PLUGIN)

PLUGIN_STATE_FORMAT_VERSION = 1
"""The `predictor.vllm_plugin.publisher.STATE_FORMAT_VERSION` this reader understands."""

MAX_FREED_KEYS = 1 << 17
"""Keys of released requests `AdmitRecords` remembers (131,072 blocks: over 2 M tokens at 16 per block, more than
one GPU's KV cache holds), oldest dropped first."""

_EMA_WEIGHT = 0.05
"""Weight of each new admission in the running mean of output lengths (as the ledger's phantom means)."""

_ENGINE_ID_PREFIXES = ("chatcmpl-", "cmpl-")
"""How vLLM's OpenAI server starts the ids of chat and completion requests."""
_ENGINE_ID_SUFFIXES = (re.compile(r"-\d+$"), re.compile(r"-[0-9a-f]{8}$"), re.compile(r"-\d+-[0-9a-f]{8}$"))
"""What may follow the x-request-id in an engine id: the prompt index (completions), vLLM's random suffix
(``InputProcessor.assign_request_id``), both, or the emulator's counter."""


def x_request_id_candidates(engine_request_id: str) -> frozenset[str]:
    """The x-request-ids an engine request id can have been made from; empty if it has no known shape.

    vLLM's API server names a request ``chatcmpl-X`` or ``cmpl-X-<i>`` (``i``: the prompt index) for an
    ``x-request-id`` X, and its engine (0.32) appends ``-<8 hex>`` unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``;
    the emulator names it ``chatcmpl-X-<n>`` / ``cmpl-X-<n>``.
    X may itself contain hyphens, so each suffix shape gives one candidate (X = "r1" is not a candidate of
    ``chatcmpl-r12-5``).

    Source: vllm/entrypoints/openai/serving_engine.py ``OpenAIServing._base_request_id``,
    serving_completion.py / serving_chat.py, vllm/v1/engine/input_processor.py ``assign_request_id`` (vLLM 0.32).
    """
    body = next((engine_request_id[len(p):] for p in _ENGINE_ID_PREFIXES if engine_request_id.startswith(p)), "")
    if not body:
        return frozenset()
    cut = (m.start() for suffix in _ENGINE_ID_SUFFIXES if (m := suffix.search(body)) is not None)
    return frozenset((body, *(body[:i] for i in cut if i > 0)))


def x_request_id_of(admit_id: str) -> str:
    """The client's ``x-request-id`` part of an id the extproc admitted: it appends ``/<unique suffix>``
    (``extproc/router.py``), and the client's id may itself hold '/'; an id without one is taken whole."""
    return admit_id.rsplit("/", 1)[0]


@dataclass(frozen=True, slots=True)
class PluginState:
    """One parsed state file.

    Attributes:
        pid: the engine core's process id.
        seq: publication number (grows by one per write).
        published_monotonic_s: when it was written, seconds on ``time.monotonic()`` (host-wide).
        engine: the engine's limits and KV cache (vLLM names).
        num_free_blocks: free KV blocks (cached-but-unreferenced prefix blocks count as free, as in vLLM).
        num_preemptions_total: preemptions seen so far (a lower bound).
        running: rows ``[id, prompt, computed, generated, max_tokens, blocks_held, preemptions]``, schedule order.
        waiting: rows of the same shape, FCFS order.
        steps: the engine's last steps, oldest first: ``(step_index, StepSample)`` (empty from a plugin that
            does not record them).
        first_tokens: the last first-token events, ``(engine request id, time.monotonic() seconds)``.
        arrivals: the last requests the scheduler received, ``(engine request id, time.monotonic() seconds)``.
        priorities: under ``engine.scheduling_policy == "priority"``, ``(priority, arrival age in seconds)`` per
            request row, running rows first (``predictor.vllm_plugin.publisher``); empty = every request at
            priority 0, arrived in row order.
    """

    pid: int
    seq: int
    published_monotonic_s: float
    engine: EngineConfig
    num_free_blocks: int
    num_preemptions_total: int
    running: tuple[tuple, ...]
    waiting: tuple[tuple, ...]
    steps: tuple[tuple[int, StepSample], ...] = ()
    first_tokens: tuple[tuple[str, float], ...] = ()
    arrivals: tuple[tuple[str, float], ...] = ()
    priorities: tuple[tuple[int, float], ...] = ()

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + len(self.waiting)

    def age_s(self, now_s: float) -> float:
        """How old the state is at ``now_s``, seconds: 0 for an idle engine (it publishes on turning idle and does
        not publish again until work arrives, so an empty state from a live writer is current however old the
        file), else the time since it was written."""
        if not self.num_unfinished:
            return 0.0
        return max(now_s - self.published_monotonic_s, 0.0)


class PluginStateError(ValueError):
    """The state file is not in the expected format."""


_MAX_COUNT = 2**31 - 1
MAX_STATE_FILE_BYTES = 16 * 1024 * 1024
"""A larger state file is refused (a vLLM engine with thousands of requests writes well under 1 MB)."""


def _count(value, what: str, *, optional: bool = False, big: bool = False) -> int | None:
    if value is None and optional:
        return None
    limit = 2**62 if big else _MAX_COUNT
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise PluginStateError(f"{what} must be an integer in [0, {limit}], got {value!r}")
    return value


def _is_count(value, limit: int = _MAX_COUNT) -> bool:
    return type(value) is int and 0 <= value <= limit  # noqa: E721 (bool is not a count)


def _fast_row(row) -> tuple | None:
    """A request row that is plainly valid, as `_row` returns it; None to let `_row` say what is wrong."""
    if (type(row) is list and len(row) == 7 and type(row[0]) is str and row[0]  # noqa: E721
            and _is_count(row[1]) and _is_count(row[2]) and _is_count(row[3])
            and (row[4] is None or _is_count(row[4])) and (row[5] is None or _is_count(row[5]))
            and (row[6] is None or _is_count(row[6]))):
        return (row[0], row[1], row[2], row[3], row[4], row[5], row[6] or 0)
    return None


def _fast_step(row) -> tuple[int, StepSample] | None:
    """A step row that is plainly valid, as `_step` returns it; None to let `_step` say what is wrong."""
    if (type(row) is list and len(row) == 6 and _is_count(row[0]) and _is_count(row[1])  # noqa: E721
            and _is_count(row[2], 2**62) and _is_count(row[3], 2**62) and _is_count(row[4])
            and type(row[5]) is float and 0.0 <= row[5] < math.inf):  # noqa: E721
        return row[0], StepSample(row[1], row[2], row[3], row[4], row[5])
    return None


def _checked(rows: list, name: str, fast, slow) -> tuple:
    """Every row of ``rows`` through ``fast``, falling back to ``slow`` (which raises with the row's place)."""
    out = []
    for i, row in enumerate(rows):
        value = fast(row)
        out.append(value if value is not None else slow(row, f"{name}[{i}]"))
    return tuple(out)


def _scheduling_policy(value) -> str:
    if value not in SCHEDULING_POLICIES:
        raise PluginStateError(f"engine.scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                               f"got {str(value)[:40]!r}")
    return value


_INT32 = 2 ** 31
"""vLLM's request priority is a Python int; the sidecar protocol carries it as a 32-bit integer."""


def _priorities(rows, num_requests: int) -> tuple[tuple[int, float], ...]:
    """The ``priorities`` list checked: one ``[priority, arrival_age_s]`` per request row (priority an integer in
    int32, age a finite number >= 0); absent = ()."""
    if rows is None:
        return ()
    rows = _list(rows, "priorities")
    if len(rows) != num_requests:
        raise PluginStateError(f"priorities: {len(rows)} rows for {num_requests} requests")
    out = []
    for i, row in enumerate(rows):
        if not (isinstance(row, list) and len(row) == 2 and type(row[0]) is int  # noqa: E721 (not bool)
                and -_INT32 <= row[0] < _INT32 and type(row[1]) in (int, float)  # noqa: E721
                and math.isfinite(row[1]) and row[1] >= 0):
            raise PluginStateError(f"priorities[{i}] must be [int32 priority, arrival age >= 0], "
                                   f"got {str(row)[:80]}")
        out.append((row[0], float(row[1])))
    return tuple(out)


def _row(row, where: str) -> tuple:
    """One request row, checked: ``[id, prompt, computed, generated, max_tokens|null, blocks|null, preemptions]``."""
    if not isinstance(row, list) or len(row) != 7:
        raise PluginStateError(f"{where}: a request row must be a list of 7 fields, got {str(row)[:80]}")
    request_id, prompt, computed, generated, max_tokens, blocks, preemptions = row
    if not isinstance(request_id, str) or not request_id:
        raise PluginStateError(f"{where}: request id must be a non-empty string, got {request_id!r}")
    return (request_id, _count(prompt, f"{where} prompt tokens"), _count(computed, f"{where} computed tokens"),
            _count(generated, f"{where} generated tokens"), _count(max_tokens, f"{where} max_tokens", optional=True),
            _count(blocks, f"{where} blocks held", optional=True),
            _count(preemptions or 0, f"{where} preemptions"))


def _step(row, where: str) -> tuple[int, StepSample]:
    """One step row, checked: ``[index, num_tokens, prefill_attention_work, decode_context_tokens, num_seqs,
    duration_s]``."""
    if not isinstance(row, list) or len(row) != 6:
        raise PluginStateError(f"{where}: a step row must be a list of 6 fields, got {str(row)[:80]}")
    duration = row[5]
    if isinstance(duration, bool) or not isinstance(duration, int | float) or not math.isfinite(duration) \
            or duration < 0:
        raise PluginStateError(f"{where}: duration_s must be a finite number >= 0, got {duration!r}")
    return _count(row[0], f"{where} index"), StepSample(
        _count(row[1], f"{where} num_tokens"), _count(row[2], f"{where} prefill_attention_work", big=True),
        _count(row[3], f"{where} decode_context_tokens", big=True), _count(row[4], f"{where} num_seqs"),
        float(duration))


def _fast_first_token(row) -> tuple[str, float] | None:
    """A valid first-token (or arrival) row as ``(request id, time)``, else None."""
    if type(row) is list and len(row) == 2 and type(row[0]) is str and row[0]:  # noqa: E721
        at = row[1]
        if type(at) is float and -math.inf < at < math.inf:  # noqa: E721 (the writer's case: json floats)
            return row[0], at
        if not isinstance(at, bool) and isinstance(at, int | float) and math.isfinite(at):
            return row[0], float(at)
    return None


def _first_token(row, where: str) -> tuple[str, float]:
    parsed = _fast_first_token(row)
    if parsed is None:
        raise PluginStateError(f"{where}: a row must be [request id, time], got {str(row)[:80]}")
    return parsed


def parse_plugin_state(text: str, default_policy: str = "fcfs") -> PluginState:
    """Parse the state file's text, checking every field (types, ranges, row shapes). ``default_policy``: the
    engine's scheduling policy when the file names none (an older plugin): the sidecar's ``--scheduling-policy``.

    Raises:
        PluginStateError: not JSON, another format version, or missing/malformed fields.
    """
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise PluginStateError(f"malformed state file: {exc!r}"[:300]) from None
    if not isinstance(data, dict):
        raise PluginStateError("malformed state file: not a JSON object")
    if data.get("version") != PLUGIN_STATE_FORMAT_VERSION:
        raise PluginStateError(f"state format version {data.get('version')!r}, expected {PLUGIN_STATE_FORMAT_VERSION}")
    try:
        engine = data["engine"]
        if not isinstance(engine, dict):
            raise PluginStateError("engine must be an object")
        published = data["published_monotonic_s"]
        if isinstance(published, bool) or not isinstance(published, int | float) or not math.isfinite(published):
            raise PluginStateError(f"published_monotonic_s must be a finite number, got {published!r}")
        pid = _count(data["pid"], "pid")
        if pid < 1:
            raise PluginStateError(f"pid must be >= 1, got {pid}")
        running, waiting = data["running"], data["waiting"]
        if not isinstance(running, list) or not isinstance(waiting, list):
            raise PluginStateError("running and waiting must be lists")
        config = EngineConfig(max_num_seqs=_count(engine["max_num_seqs"], "engine.max_num_seqs"),
                              max_num_batched_tokens=_count(engine["max_num_batched_tokens"],
                                                            "engine.max_num_batched_tokens"),
                              block_size=_count(engine["block_size"], "engine.block_size"),
                              num_gpu_blocks=_count(engine["num_gpu_blocks"], "engine.num_gpu_blocks"),
                              enable_chunked_prefill=bool(engine["enable_chunked_prefill"]),
                              scheduling_policy=_scheduling_policy(engine.get("scheduling_policy", default_policy)))
        priorities = _priorities(data.get("priorities"), len(running) + len(waiting))
        return PluginState(
            pid=pid, seq=_count(data["seq"], "seq"), published_monotonic_s=float(published), engine=config,
            num_free_blocks=_count(data["num_free_blocks"], "num_free_blocks"),
            num_preemptions_total=_count(data["num_preemptions_total"], "num_preemptions_total"),
            running=_checked(running, "running", _fast_row, _row),
            waiting=_checked(waiting, "waiting", _fast_row, _row),
            steps=_checked(_list(data.get("steps", []), "steps"), "steps", _fast_step, _step),
            first_tokens=_checked(_list(data.get("first_tokens", []), "first_tokens"), "first_tokens",
                                  _fast_first_token, _first_token),
            arrivals=_checked(_list(data.get("arrivals", []), "arrivals"), "arrivals", _fast_first_token,
                              _first_token),
            priorities=priorities)
    except PluginStateError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
        raise PluginStateError(f"malformed state file: {exc!r}"[:300]) from None


MAX_HISTORY_ROWS = 4096
"""A state file's ``steps``, ``first_tokens`` or ``arrivals`` longer than this is refused (the plugin writes 64 / 256)."""


def _list(value, what: str) -> list:
    if not isinstance(value, list):
        raise PluginStateError(f"{what} must be a list")
    if len(value) > MAX_HISTORY_ROWS:
        raise PluginStateError(f"{what} has {len(value)} rows, more than {MAX_HISTORY_ROWS}")
    return value


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PluginStateReader:
    """Reads the plugin's state file; cheap when it has not changed (one ``stat``).

    Args:
        path: the state file (``ASTROLABE_VLLM_STATE_PATH`` of the vLLM server).
        max_age_s: a state older than this while it shows requests in flight is rejected, seconds (the engine
            publishes after every step, so an old non-empty state means a stuck or dead engine). An empty state
            stays valid while its writer lives: an idle engine does not publish.
    """

    def __init__(self, path: str, max_age_s: float = 2.0, default_policy: str = "fcfs") -> None:
        self.path = path
        self.max_age_s = max_age_s
        self.default_policy = default_policy
        self._cached: PluginState | None = None
        self._cached_key: tuple[int, int, int] | None = None
        self._error_key: tuple[int, int, int] | None = None
        self.last_error = "not read yet"

    def read(self, now_s: float) -> PluginState | None:
        """The current state, or None (reason in ``last_error``) if absent, malformed, stale or its writer died.

        Args:
            now_s: current time, seconds on ``time.monotonic()``.
        """
        key = None
        try:
            stat = os.stat(self.path)
            key = (stat.st_mtime_ns, stat.st_ino, stat.st_size)
            if key == self._error_key:  # the same bad file as last time: do not read it again
                return None
            if key != self._cached_key:
                self._cached, self._cached_key = None, None
                if not _stat.S_ISREG(stat.st_mode):
                    raise PluginStateError(f"{self.path} is not a regular file")
                if stat.st_size > MAX_STATE_FILE_BYTES:
                    raise PluginStateError(f"{self.path} is {stat.st_size} bytes, more than {MAX_STATE_FILE_BYTES}")
                with open(self.path, "rb") as f:
                    text = f.read(MAX_STATE_FILE_BYTES + 1).decode("utf-8")
                self._cached = parse_plugin_state(text, self.default_policy)
                self._cached_key = key
        except (OSError, PluginStateError, UnicodeDecodeError) as exc:
            self._cached, self._cached_key = None, None
            self._error_key = key if isinstance(exc, PluginStateError | UnicodeDecodeError) else None
            self.last_error = str(exc)[:300]
            return None
        self._error_key = None
        state = self._cached
        if not _pid_alive(state.pid):
            self.last_error = f"engine process {state.pid} is gone"
            return None
        if state.published_monotonic_s > now_s + 1.0:
            self.last_error = f"state is stamped {state.published_monotonic_s - now_s:.1f} s in the future"
            return None
        if state.num_unfinished and now_s - state.published_monotonic_s > self.max_age_s:
            self.last_error = f"state is {now_s - state.published_monotonic_s:.1f} s old with requests in flight"
            return None
        return state


@dataclass(frozen=True, slots=True)
class _Admission:
    num_prompt_tokens: int
    num_output_tokens: int
    admitted_s: float
    max_tokens: int | None = None
    length_source: int = 0
    block_keys: tuple[int, ...] | None = None
    priority: int = 0


def pending_id(request_id: str) -> str:
    """The id under which an admitted request the engine has not shown yet appears in a plugin snapshot."""
    return f"pending-{request_id}"


class AdmitRecords:
    """Requests the extproc admitted here (prompt and predicted output lengths, time), by request id.

    vLLM names a request ``cmpl-<x-request-id>-…`` or ``chatcmpl-<x-request-id>…``; the extproc admits it as
    ``<x-request-id>/<unique suffix>`` (clients may reuse ids). `expected_output_tokens` therefore matches an
    engine id to an admitted id, not yet matched, whose ``x-request-id`` part is one the engine id can have been
    made from (`x_request_id_candidates`); the longest such part wins (x-request-ids "a" and "a-1" both fit
    ``chatcmpl-a-1-0123abcd``), then the earliest admission.
    An admitted request that the engine's state has not shown yet is *pending* (`pending`): it is on its way
    (Envoy, the API server's tokenizer) and must count, or a burst of dispatches would all see the same
    instance as idle and herd onto it.

    Expected lengths: with ``residual`` rules (``predictor.residual_rules.ResidualRules``), an admitted request's
    expected total output is its rule's estimate from its predicted length, progress and cap, and a request
    nobody admitted here (sent around the router) gets the reply-length distribution conditioned on its
    progress (``residual.fixed``). Without rules: the admitted figure, else the running mean of admitted
    lengths, capped by ``max_tokens`` (the snapshot then applies the "10 more tokens" rule past it).

    Args:
        max_records: records kept (oldest dropped first), bounding memory when Release notices are lost.
        default_output_tokens: the mean before any admission, tokens.
        residual: the sidecar's residual-length rules, or None.
    """

    def __init__(self, max_records: int = 4096, default_output_tokens: int = 256, residual=None) -> None:
        self.max_records = max_records
        self.residual = residual
        self.mean_output_tokens = float(default_output_tokens)
        self._by_id: dict[str, _Admission] = {}
        self._engine_to_admit: dict[str, str | None] = {}
        self._seen: set[str] = set()
        # prompt block keys of released requests, in the order the engine freed them (each request's in reverse):
        # the approximate cached free blocks of plugin mode without KV events (`freed_keys`)
        self._freed: OrderedDict[int, None] = OrderedDict()

    def admit(self, request_id: str, num_output_tokens: int, num_prompt_tokens: int = 1,
              now_s: float = 0.0, *, max_tokens: int | None = None, length_source: int = 0,
              block_keys: tuple[int, ...] | None = None, priority: int = 0) -> None:
        """Record an admission at ``now_s`` (seconds, monotonic clock) of a request with ``num_output_tokens``
        PREDICTED output tokens (before the cap), its cap ``max_tokens`` (None = unknown), the prediction's
        ``length_source``, its prompt's ``block_keys`` (None = none sent) and its engine ``priority`` (vLLM's: lower
        = earlier)."""
        self._by_id[request_id] = _Admission(max(num_prompt_tokens, 1), num_output_tokens, now_s,
                                             max_tokens or None, length_source, block_keys, priority)
        self.mean_output_tokens += _EMA_WEIGHT * (capped_tokens(num_output_tokens, max_tokens)
                                                  - self.mean_output_tokens)
        while len(self._by_id) > self.max_records:
            self._by_id.pop(next(iter(self._by_id)))
        # An engine id seen before this admission may belong to it: let it be matched again.
        self._engine_to_admit = {k: v for k, v in self._engine_to_admit.items() if v is not None}

    def add_block_keys(self, request_id: str, block_keys: tuple[int, ...]) -> None:
        """Gives an admitted request (held without them, ``predictor.holds``) its prompt's block keys."""
        admission = self._by_id.get(request_id)
        if admission is not None:
            self._by_id[request_id] = dataclasses.replace(admission, block_keys=block_keys)

    def block_keys_of(self, engine_request_id: str) -> tuple[int, ...] | None:
        """The prompt block keys the router sent with the admission an engine request id belongs to, or None."""
        admit_id = self.admit_id_of(engine_request_id)
        admission = self._by_id.get(admit_id) if admit_id is not None else None
        return None if admission is None else admission.block_keys

    def admitted_at_s(self, request_id: str) -> float | None:
        """When ``request_id`` was admitted (``time.monotonic()`` seconds), or None if it has no record."""
        admission = self._by_id.get(request_id)
        return None if admission is None else admission.admitted_s

    def is_admitted(self, request_id: str) -> bool:
        """Whether ``request_id`` has an admission record (admitted and not released)."""
        return request_id in self._by_id

    def release(self, request_id: str) -> bool:
        """Ends ``request_id``'s admission record (its prompt's block keys count as freed, newest last); returns
        whether it had one."""
        admission = self._by_id.pop(request_id, None)
        self._seen.discard(request_id)
        if admission is not None and admission.block_keys:
            freed = self._freed
            for key in reversed(admission.block_keys):  # vLLM frees a request's blocks tail first
                freed[key] = None
                freed.move_to_end(key)
            while len(freed) > MAX_FREED_KEYS:
                freed.popitem(last=False)
        return admission is not None

    def freed_keys(self, num_free_blocks: int) -> tuple[int, ...]:
        """The prompt block keys of released requests that an engine with ``num_free_blocks`` free KV blocks
        would still cache, least recently freed first: the last ``num_free_blocks`` freed (vLLM reuses
        unhashed free blocks first and then evicts cached ones least recently freed first,
        vllm/v1/core/block_pool.py ``free_blocks``). An approximation: it knows only the prompts admitted here,
        and assumes the engine freed them when the router released them."""
        if num_free_blocks <= 0 or not self._freed:
            return ()
        keys = tuple(self._freed)
        return keys[-num_free_blocks:]

    def pending(self, engine_request_ids: list[str], now_s: float, grace_s: float) -> list[RequestState]:
        """Admitted requests the engine has never shown, admitted less than ``grace_s`` seconds before ``now_s``,
        as waiting `RequestState`s in admission order (after `expected_output_tokens` saw the engine's ids)."""
        self._seen.update(rid for eid in engine_request_ids if (rid := self.admit_id_of(eid)))
        return [RequestState(request_id=pending_id(rid), num_prompt_tokens=a.num_prompt_tokens,
                             num_output_tokens=self._expected(a, 0, a.max_tokens), arrival_time_s=now_s,
                             block_keys=a.block_keys, priority=a.priority)
                for rid, a in self._by_id.items() if rid not in self._seen and now_s - a.admitted_s < grace_s]

    def _expected(self, admission: _Admission, num_generated_tokens: int, max_tokens: int | None) -> int:
        cap = max_tokens or admission.max_tokens
        if self.residual is None:
            expected = admission.num_output_tokens
            return max(int(min(expected, int(cap)) if cap else expected), 1)
        return self.residual.for_source(admission.length_source).expected_output_tokens(
            max(admission.num_output_tokens, 1), num_generated_tokens, int(cap) if cap else None)

    def _match(self, engine_request_id: str) -> str | None:
        candidates = x_request_id_candidates(engine_request_id)
        if not candidates:
            return None
        matched = set(self._engine_to_admit.values())
        best, best_len = None, 0
        for rid in self._by_id:
            x_request_id = x_request_id_of(rid)
            if len(x_request_id) > best_len and x_request_id in candidates and rid not in matched:
                best, best_len = rid, len(x_request_id)
        return best

    def admit_id_of(self, engine_request_id: str) -> str | None:
        """The admitted request id an engine request id belongs to (matched once, then remembered), or None."""
        if engine_request_id not in self._engine_to_admit:
            self._engine_to_admit[engine_request_id] = self._match(engine_request_id)
            if len(self._engine_to_admit) > 4 * self.max_records:
                self._engine_to_admit.clear()
        return self._engine_to_admit.get(engine_request_id)

    def expected_output_tokens(self, engine_request_id: str, max_tokens: int | None,
                               num_generated_tokens: int = 0) -> int:
        """Expected total output length of an engine request that has generated ``num_generated_tokens``, tokens
        (>= 1; see the class docstring); capped by ``max_tokens`` when given."""
        admit_id = self.admit_id_of(engine_request_id)
        admission = self._by_id.get(admit_id) if admit_id is not None else None
        if admission is not None:
            return self._expected(admission, num_generated_tokens, max_tokens)
        if self.residual is not None:
            return self.residual.fixed.expected_output_tokens(1, num_generated_tokens, max_tokens or None)
        expected = round(self.mean_output_tokens)
        if max_tokens:
            expected = min(expected, int(max_tokens))
        return max(int(expected), 1)


def plugin_snapshot(state: PluginState, now_s: float,
                    expected_output_tokens: Callable[[str, int | None, int], int],
                    block_keys_of: Callable[[str], tuple[int, ...] | None] | None = None,
                    cached_keys: tuple[int, ...] = ()) -> InstanceSnapshot:
    """The `InstanceSnapshot` of a plugin state, as of ``now_s``.

    Args:
        state: the parsed state.
        now_s: the snapshot's time, seconds (predictions are measured from it; the state is at most one engine
            step plus the publish interval older).
        expected_output_tokens: maps (engine request id, max_tokens or None, generated tokens) to an expected
            total output length (> generated).
        block_keys_of: maps an engine request id to its prompt's block keys as the router sent them with its
            Admit (None: unknown); keys past the engine's own prompt length are cut (the router may count a
            prompt differently); None = no keys.
        cached_keys: the engine's cached block keys (`predictor.kv_events.KvEventIndex`), oldest stored first;
            those the running requests hold are left out, the rest become the snapshot's
            ``cached_block_keys``.

    Running requests whose blocks add up to more than the pool because they share blocks that no key names get a
    synthetic shared prefix (`explain_shared_blocks`).
    """
    block_size = state.engine.block_size

    def keys_of(request_id: str, num_prompt: int) -> tuple[int, ...] | None:
        keys = block_keys_of(request_id) if block_keys_of is not None else None
        return keys[:num_prompt // block_size] or None if keys else None

    priorities = state.priorities

    def request(row: tuple, running: bool, index: int) -> RequestState:
        request_id, num_prompt, num_computed, num_generated, max_tokens, num_blocks, num_preemptions = row
        priority, age_s = priorities[index] if priorities else (0, 0.0)
        num_prompt = max(int(num_prompt), 1)
        num_generated = int(num_generated)
        # A waiting request restarts from scratch in the simulator (a preempted one has freed its blocks).
        num_computed = min(int(num_computed), num_prompt + num_generated - 1) if running else 0
        return RequestState(request_id=str(request_id), num_prompt_tokens=num_prompt,
                            num_output_tokens=expected_output_tokens(str(request_id), max_tokens, num_generated),
                            arrival_time_s=now_s - age_s, num_computed_tokens=max(num_computed, 0),
                            num_generated_tokens=num_generated, priority=priority,
                            num_blocks_held=None if not running or num_blocks is None else int(num_blocks),
                            num_preemptions=int(num_preemptions or 0),
                            block_keys=keys_of(str(request_id), num_prompt))

    running = tuple(request(row, True, i) for i, row in enumerate(state.running[: state.engine.max_num_seqs]))
    # Blocks the engine holds beyond the rows' own (prefix-cache sharing, rounding) cannot exceed the pool.
    held = sum(r.num_blocks_held or 0 for r in running)
    if held > state.engine.num_gpu_blocks:
        running = tuple(RequestState(**{**_asdict(r), "num_blocks_held": None}) for r in running)
    running = explain_shared_blocks(running, state.engine.num_gpu_blocks, state.num_free_blocks, block_size)
    if cached_keys:
        held = {key for r in running if r.block_keys for key in r.block_keys[:r.num_computed_tokens // block_size]}
        cached_keys = tuple(key for key in cached_keys if key not in held)
        # no more than the free blocks (the index may hold blocks of requests whose keys are not known here: other
        # routers', decode blocks): the most recently freed stay
        num_free = state.engine.num_gpu_blocks - _num_blocks_in_use(running, block_size)
        cached_keys = cached_keys[-num_free:] if num_free > 0 else ()
    return InstanceSnapshot(config=state.engine, now_s=now_s, running=running,
                            waiting=tuple(request(row, False, len(state.running) + i)
                                          for i, row in enumerate(state.waiting)),
                            num_preemptions_total=state.num_preemptions_total, cached_block_keys=cached_keys)


UNEXPLAINED_SHARED_KEY_BASE = 0xA57B_5EED_0000_0000
"""First synthetic block key of `explain_shared_blocks` (key ``j`` of the chain is this + ``j``); block keys are
64-bit hashes (``predictor.sim.block_hash``), so a collision with a real one is a 2^-64-scale event."""


def _num_blocks_in_use(running: tuple[RequestState, ...], block_size: int) -> int:
    """KV blocks the running requests hold, each full computed block named by a key counted once; blocks."""
    seen: set[int] = set()
    total = 0
    for r in running:
        total += r.num_blocks_held if r.num_blocks_held is not None else -(-r.num_computed_tokens // block_size)
        if r.block_keys:
            keys = r.block_keys[:r.num_computed_tokens // block_size]
            total -= sum(1 for key in keys if key in seen)
            seen.update(keys)
    return total


def explain_shared_blocks(running: tuple[RequestState, ...], num_gpu_blocks: int, num_free_blocks: int,
                          block_size: int) -> tuple[RequestState, ...]:
    """The running requests, with a synthetic shared prefix where the engine shares blocks that no key explains.

    vLLM's running requests share the KV blocks of a common prompt prefix (prefix caching): their blocks add up
    to more than the engine holds. The sidecar rebuilds that sharing from the block keys the router sent with
    each Admit; a request it has no usable keys for (another router's, one sent with another block size, or a
    router without a tokenizer) counts all its blocks, and a state whose running requests then need more blocks
    than the pool has cannot be simulated ("N blocks wanted, 0 free"). Here the keyless requests get one
    synthetic key chain for their first ``m`` full computed blocks (keys from `UNEXPLAINED_SHARED_KEY_BASE`),
    ``m`` the smallest that brings the blocks in use down to what the engine reports in use (``num_gpu_blocks -
    num_free_blocks``), or failing that to the pool: the common case on real traffic is one shared system prompt
    or identical prompts. A new request never matches these keys (no hit is credited for them).

    Args:
        running: the running requests as `plugin_snapshot` built them (``num_blocks_held`` None or a count).
        num_gpu_blocks: the engine's KV blocks (vLLM's null block excluded).
        num_free_blocks: the engine's free blocks at the state's time (cached free blocks included, as vLLM
            counts them).
        block_size: tokens per KV block.

    Returns:
        ``running`` itself when its blocks fit the pool (or nothing can make them fit: the simulator then says
        why), else a copy with the keyless requests' leading keys set.
    """
    total = _num_blocks_in_use(running, block_size)
    if total <= num_gpu_blocks:
        return running
    keyless = [i for i, r in enumerate(running) if not r.block_keys]
    full = sorted(min(running[i].num_computed_tokens, running[i].num_prompt_tokens) // block_size
                  for i in keyless)
    target = max(num_gpu_blocks - max(num_free_blocks, 0), 0)
    # Sharing the chain's block j (1-based) saves one block per keyless request holding j full blocks, less the
    # one copy kept: total(m) = total(m - 1) - #{full >= m} + 1, constant between two distinct counts of full
    # blocks, so the walk goes from one to the next: O(requests), whatever the counts (a state may be hostile).
    m = previous = 0
    for index, num_full in enumerate(full):
        saving = len(full) - index - 1  # for m in (previous, num_full]: every request from this one on holds m
        if num_full == previous:
            continue
        if saving <= 0 or total <= target:
            break
        steps = min(-(-(total - target) // saving), num_full - previous)
        m, total = previous + steps, total - steps * saving
        previous = num_full
    if total > num_gpu_blocks or m == 0:
        return running
    chain = tuple(UNEXPLAINED_SHARED_KEY_BASE + j for j in range(m))
    out = list(running)
    for i in keyless:
        r = running[i]
        num_full = min(r.num_computed_tokens, r.num_prompt_tokens) // block_size
        if num_full:
            out[i] = dataclasses.replace(r, block_keys=chain[:min(m, num_full)])
    logger.debug("running requests share %d blocks that no key explains: a synthetic prefix of %d blocks", m, m)
    return tuple(out)


def _asdict(state: RequestState) -> dict:
    return {name: getattr(state, name) for name in RequestState.__slots__}


class _EventCursor:
    """Takes each row of one of a plugin state's event lists (``first_tokens``, ``arrivals``: ``(engine request id,
    time)``, oldest first) once: a state's rows newer than the newest taken before; a new writer process (another
    pid) starts over."""

    def __init__(self) -> None:
        self._pid = 0
        self._seen_s = float("-inf")

    def take(self, pid: int, rows: tuple[tuple[str, float], ...]) -> list[tuple[str, float]]:
        """The rows not taken before, newest first."""
        seen_s = self._seen_s if pid == self._pid else float("-inf")
        new = []
        for row in reversed(rows):  # newest first; stop at those taken before
            if row[1] <= seen_s:
                break
            new.append(row)
        if rows:
            self._seen_s, self._pid = max(seen_s, rows[-1][1]), pid
        return new


class PluginStateSource:
    """The sidecar's plugin side: reader, Admit records, and the choice between plugin and ledger.

    Args:
        mode: one of `STATE_SOURCES`.
        path: the plugin's state file; None = no plugin (``auto`` then means the ledger).
        max_age_s: see `PluginStateReader`.
        pending_grace_s: an admitted request the engine has not shown counts as waiting for this long, seconds
            (the ledger's ``visibility_grace_s``).
        residual: the sidecar's residual-length rules (``predictor.residual_rules.ResidualRules``), or None.
        kv_index: the engine's cached blocks from its KV events (`predictor.kv_events.KvEventIndex`), or None
            (then a plugin snapshot's cached free blocks are approximated from the keys of the requests released
            here, `AdmitRecords.freed_keys`).
        default_policy: the engine's scheduling policy where its state file names none (the sidecar's
            ``--scheduling-policy``; a file that names one wins).

    Raises:
        ValueError: unknown mode, or ``vllm-plugin`` without a path.
    """

    def __init__(self, mode: str, path: str | None, max_age_s: float = 2.0, pending_grace_s: float = 2.0,
                 residual=None, kv_index=None, default_policy: str = "fcfs") -> None:
        if mode not in STATE_SOURCES:
            raise ValueError(f"state source must be one of {', '.join(STATE_SOURCES)}, got {mode!r}")
        if mode == STATE_SOURCE_PLUGIN and not path:
            raise ValueError("state source vllm-plugin needs the plugin's state file (--vllm-state-path)")
        self.mode = mode
        self.pending_grace_s = pending_grace_s
        self.admits = AdmitRecords(residual=residual)
        self.kv_index = kv_index
        self.reader = (PluginStateReader(path, max_age_s, default_policy) if path and mode != STATE_SOURCE_LEDGER
                       else None)
        self.last_state: PluginState | None = None
        self._using_plugin: bool | None = None
        self._steps_seen: tuple[int, int] = (0, 0)  # (writer pid, last step index taken)
        self._first_tokens = _EventCursor()
        self._arrivals = _EventCursor()

    def new_steps(self, state: PluginState | None) -> list[StepSample]:
        """The steps of ``state`` not returned before (each step once; a new writer process starts over)."""
        if state is None or not state.steps:
            return []
        pid, last = self._steps_seen
        if pid != state.pid or state.steps[-1][0] < last:
            last = 0
        self._steps_seen = (state.pid, state.steps[-1][0])
        return [sample for index, sample in state.steps if index > last]

    def new_first_tokens(self, state: PluginState) -> list[tuple[str, float]]:
        """The first-token events of ``state`` not returned before, newest first (``_EventCursor``)."""
        return self._first_tokens.take(state.pid, state.first_tokens)

    def new_arrivals(self, state: PluginState) -> list[tuple[str, float]]:
        """The arrivals of ``state`` not returned before, newest first (``_EventCursor``)."""
        return self._arrivals.take(state.pid, state.arrivals)

    @property
    def in_use(self) -> bool:
        """True while the last ``snapshot`` came from the plugin's state (the ledger is then only a fallback)."""
        return bool(self._using_plugin)

    def read(self, now_s: float) -> PluginState | None:
        """The plugin's state as of ``now_s`` (also ``last_state``), or None when the ledger must be used; decides
        `in_use` (transitions logged). One ``stat`` when the file did not change."""
        state = self.reader.read(now_s) if self.reader is not None else None
        using = state is not None
        if self.reader is not None and using != self._using_plugin:
            if using:
                logger.info("state source: vllm-plugin (%s)", self.reader.path)
            else:
                logger.warning("state source: ledger (plugin state unavailable: %s)", self.reader.last_error)
            self._using_plugin = using
        self.last_state = state
        return state

    def snapshot(self, now_s: float) -> InstanceSnapshot | None:
        """The plugin's snapshot as of ``now_s``, or None when the ledger must be used (`read`)."""
        state = self.read(now_s)
        if state is None:
            return None
        index = self.kv_index
        if index is not None:
            cached = index.keys_in_eviction_order(state.num_free_blocks) if index.num_blocks else ()
        else:
            cached = self.admits.freed_keys(state.num_free_blocks)
        snapshot = plugin_snapshot(state, now_s, self.admits.expected_output_tokens, self.admits.block_keys_of,
                                   cached)
        # A request the scheduler received (``arrivals``) is no longer on its way, even when it already finished.
        engine_ids = [r.request_id for r in (*snapshot.running, *snapshot.waiting)]
        engine_ids += [request_id for request_id, _ in state.arrivals]
        pending = self.admits.pending(engine_ids, now_s, self.pending_grace_s)
        if not pending:
            return snapshot
        return dataclasses.replace(snapshot, waiting=snapshot.waiting + tuple(pending))
