"""`astrolabe bench streams`: thousands of open streams through real Envoy and one extproc, and long quiet ones.

All real processes on loopback (`astrolabe.procs.ProcessGroup`): 2 `bench.fast_backend` instances (streaming mode),
by default each with its predictor sidecar (ledger mode), one extproc (``--policy``, default ``astrolabe``, k = 2:
the policy a user runs, so its per-request state, the in-flight ledgers and the pending sidecar ``Release``, is
in the figure; ``least-requests`` measures the ext_proc plumbing alone) and one Envoy (``astrolabe envoy --mode
full-duplex``, or ``--body-mode buffered``) with its default timeouts and circuit breakers. Two parts, run at once:

1. **Scale.** ``--rounds`` rounds, one after the other, of ``--streams`` streamed chat requests, opened at
   ``--open-rate`` per second (evenly spaced), each ``--tokens`` chunks ``--token-interval-s`` apart (the
   backend's schedule: the first at once), so every stream of a round is open at the same time once its last one
   opened (streams last longer than the ramp; `plan_check` says when they would not). Memory is the resident set
   (``VmRSS`` of ``/proc/PID/status``) of each process group: the extproc's, and Envoy's (the ``astrolabe envoy``
   launcher and the Envoy it runs), sampled **idle** (after a warm-up of short streams, nothing in flight), and
   per round **open** (the moment its last stream got its first chunk; the streams open then are counted) and
   **after** (its streams ended, the extproc's in-flight gauges down to the long requests). Memory per open
   stream = (open - idle) / streams open, KiB (the 2 long requests are in the open figure too: noise at
   thousands). What a stream leaves behind = (after the last round - after the first) / the later rounds'
   streams: the first round grows the allocators' pools (Python's arenas, Envoy's tcmalloc and its pool of
   upstream connections), which stay; a leak grows every round. Each stream ends ``ok`` (200, every chunk and
   ``[DONE]``) or with an error kind (``status 503``, ``short``: fewer chunks, an exception's class name).
   Afterwards: whether the extproc still runs and routes one more request.
2. **Long** (``--long-s`` > 0). Meanwhile, one streamed request that moves slowly (a chunk every
   `LONG_CHUNK_INTERVAL_S` for ``--long-s`` seconds) and one non-streamed request whose backend stays silent for
   ``--long-s`` seconds, then answers; both must complete (200, whole body). What could cut them: Envoy's route
   timeout (0 = off), its HCM ``stream_idle_timeout`` (900 s) and the route's ``per_try_idle_timeout``
   (``astrolabe envoy --per-try-idle-timeout-s``, 300 s) bound the silent one; the slow stream resets every idle
   timer with each chunk; the client here sets no read timeout.

Nothing here asserts on time; the figures are printed (``format_report``), and ``tests/integration/test_scale.py``
asserts on what `run` returns.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import resource
import signal
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from astrolabe.cli import HelpFormatter
from astrolabe.logs import setup_logging
from bench.extproc_drive import MODEL, START_TIMEOUT_S, start_extproc, start_fleet
from bench.fast_backend import DELAY_HEADER, DONE_EVENT, INSTANCE_HEADER, TOKEN_INTERVAL_HEADER
from astrolabe.procs import ManagedProcess, ProcessGroup, exit_status_of, free_port

logger = logging.getLogger(__name__)

POLICIES = ("astrolabe", "least-requests")
BODY_MODES = ("full-duplex", "buffered")
LONG_CHUNK_INTERVAL_S = 20.0
"""Longest gap between the long stream's chunks, seconds: past Envoy's default route timeout (15 s) and the usual
15/30 s read timeouts, far below any idle timeout the stack sets."""
FDS_PER_STREAM = 3
"""File descriptors one open stream costs the process that holds the most of them (Envoy: the client's connection,
the backend's; the ext_proc streams share a few HTTP/2 connections), rounded up."""
FD_HEADROOM = 1024
"""Descriptors kept for everything else (listeners, logs, the extproc's own connections)."""
TASKS_FLAG = "--extproc-counting-tasks"
"""``python -m bench.streams --extproc-counting-tasks FILE [astrolabe extproc args]``: `counting_extproc_main`."""
ENVOY_STATS = ("http.astrolabe_ingress.downstream_cx_active", "cluster.extproc.upstream_cx_active",
               "cluster.extproc.upstream_rq_active", "cluster.backends.upstream_cx_active",
               "cluster.backends.upstream_rq_pending_overflow", "cluster.extproc.upstream_rq_pending_overflow",
               "cluster.backends.upstream_rq_per_try_idle_timeout", "http.astrolabe_ingress.downstream_rq_idle_timeout")
"""Envoy admin counters and gauges read when every stream is open (connections, overflows, timeouts)."""


# --- pure helpers (unit-tested) -------------------------------------------------------------------------------

def vm_rss_bytes(status_text: str) -> int:
    """The resident set size in a ``/proc/PID/status`` text, bytes (0 when it has no ``VmRSS`` line: a zombie)."""
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            assert unit == "kB", line  # the kernel always writes kB (KiB)
            return int(value) * 1024
    return 0


def per_stream_kib(idle_bytes: int, open_bytes: int, num_open: int) -> float:
    """(open - idle) / ``num_open``, KiB per open stream; NaN when nothing was open."""
    return (open_bytes - idle_bytes) / num_open / 1024 if num_open > 0 else math.nan


def stream_outcome(status: int, num_chunks: int, done: bool, expected_chunks: int) -> str:
    """``ok`` for a 200 with ``expected_chunks`` chunks and ``[DONE]``; else what went wrong: ``status N``,
    ``short`` (fewer chunks or no ``[DONE]``), ``long`` (more chunks)."""
    if status != 200:
        return f"status {status}"
    if num_chunks > expected_chunks:
        return "long"
    return "ok" if num_chunks == expected_chunks and done else "short"


def plan_check(num_streams: int, tokens: int, token_interval_s: float, open_rate: float,
               fd_limit: int) -> list[str]:
    """What would keep ``num_streams`` streams from all being open at once: a ramp (``num_streams / open_rate``
    seconds) no shorter than a stream (``(tokens - 1) * token_interval_s`` seconds), or a descriptor limit
    below `FDS_PER_STREAM` per stream plus `FD_HEADROOM`. Empty when nothing would."""
    problems = []
    ramp_s, stream_s = num_streams / open_rate, (tokens - 1) * token_interval_s
    if ramp_s >= stream_s:
        problems.append(f"opening {num_streams} streams takes {ramp_s:g} s at {open_rate:g}/s, a stream lasts "
                        f"{stream_s:g} s: the first end before the last open (raise --tokens or --open-rate)")
    needed = num_streams * FDS_PER_STREAM + FD_HEADROOM
    if fd_limit < needed:
        problems.append(f"the file-descriptor limit (ulimit -n) is {fd_limit}, {num_streams} streams need "
                        f"~{needed}")
    return problems


def envoy_stats(text: str, names: Sequence[str] = ENVOY_STATS) -> dict[str, int]:
    """``name: value`` lines of Envoy's admin ``/stats`` text, for ``names`` (a name missing is left out)."""
    wanted, found = set(names), {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if name in wanted and value.strip().isdigit():
            found[name] = int(value)
    return found


# --- results ---------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Memory:
    """Resident set sizes of one moment, bytes: the extproc's process group and Envoy's."""

    extproc_bytes: int
    envoy_bytes: int


@dataclass(slots=True)
class LongResult:
    """One long request: its outcome (``ok`` or an error kind), duration (s), chunks (streamed) or bytes (not)."""

    kind: str
    outcome: str = "not run"
    duration_s: float = math.nan
    received: int = 0


@dataclass(slots=True)
class Round:
    """One round of the scale part: ``num_streams`` streams opened, held open together, ended.

    Attributes:
        outcomes: outcome (`stream_outcome`, or an exception's class name) -> streams.
        open: memory the moment the last stream got its first chunk; None if some stream never did.
        num_open: streams open at that moment.
        ramp_s: seconds from the first stream sent to that moment.
        envoy_at_open: `ENVOY_STATS` then.
        after: memory once every stream ended and the extproc counted them all released.
        tasks_after: the extproc's live asyncio tasks then (`counting_extproc_main`).
    """

    outcomes: Counter = field(default_factory=Counter)
    open: Memory | None = None
    num_open: int = 0
    ramp_s: float = math.nan
    envoy_at_open: dict[str, int] = field(default_factory=dict)
    after: Memory | None = None
    tasks_after: int = -1


@dataclass(slots=True)
class ScaleResult:
    """What `run` measured (module docstring).

    Attributes:
        num_streams: streams per round; tokens, token_interval_s: each one's chunks and their spacing (s).
        body_mode, policy: Envoy's ext_proc body mode, the extproc's policy.
        idle: memory before the first round (after the warm-up); tasks_idle: the extproc's asyncio tasks then.
        rounds: the scale part's rounds, in order.
        extproc_alive: the extproc process still ran after the rounds; routes_after: and routed one more request.
        long: the long part's requests (empty with ``long_s`` 0).
        fd_limit: this process's soft descriptor limit (the children inherit it).
    """

    num_streams: int
    tokens: int
    token_interval_s: float
    body_mode: str
    policy: str
    idle: Memory | None = None
    tasks_idle: int = -1
    rounds: list[Round] = field(default_factory=list)
    extproc_alive: bool = False
    routes_after: bool = False
    long: list[LongResult] = field(default_factory=list)
    fd_limit: int = 0

    @property
    def num_ok(self) -> int:
        """Streams that ended ``ok``, over every round."""
        return sum(r.outcomes["ok"] for r in self.rounds)

    def kib_per_stream(self, role: str, round_index: int = 0) -> float:
        """Memory per open stream of ``role`` (``extproc`` or ``envoy``) in round ``round_index``: (open - idle) /
        streams open, KiB; NaN without those samples."""
        rnd = self.rounds[round_index] if round_index < len(self.rounds) else None
        if self.idle is None or rnd is None or rnd.open is None:
            return math.nan
        return per_stream_kib(getattr(self.idle, f"{role}_bytes"), getattr(rnd.open, f"{role}_bytes"), rnd.num_open)

    def growth_kib_per_stream(self, role: str) -> float:
        """(after the last round - after the first) / the streams of the rounds between, KiB per stream: what a
        stream leaves behind once the allocator's pools have grown (the first round's); NaN with < 2 rounds."""
        afters = [r.after for r in self.rounds]
        if len(afters) < 2 or afters[0] is None or afters[-1] is None:
            return math.nan
        return per_stream_kib(getattr(afters[0], f"{role}_bytes"), getattr(afters[-1], f"{role}_bytes"),
                              self.num_streams * (len(afters) - 1))

    @property
    def tasks_left_per_stream(self) -> float:
        """The extproc's asyncio tasks still alive after the last round minus after the first, per stream of the
        later rounds: ~0 unless each stream leaves a task behind (Python's allocator hides that from RSS until
        its free pools are used up; a task count does not); NaN with < 2 rounds."""
        if len(self.rounds) < 2 or min(self.rounds[0].tasks_after, self.rounds[-1].tasks_after) < 0:
            return math.nan
        return (self.rounds[-1].tasks_after - self.rounds[0].tasks_after) / (self.num_streams * (len(self.rounds) - 1))


# --- processes -------------------------------------------------------------------------------------------------

def group_rss_bytes(pgid: int) -> int:
    """Sum of ``VmRSS`` over the live processes of process group ``pgid`` (Linux /proc), bytes."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                total += vm_rss_bytes((stat.parent / "status").read_text())
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    return total


def counting_extproc_main(argv: Sequence[str]) -> int:
    """``astrolabe extproc`` (``argv``: ``FILE`` then its flags) that, on each SIGUSR1, writes the number of its
    live asyncio tasks to ``FILE`` as ``<signal number> <tasks>`` (replaced atomically); nothing else changes."""
    from extproc.server import main as extproc_main  # noqa: PLC0415 (only the launched extproc needs it)

    out_path, extproc_argv, num_signals = argv[0], list(argv[1:]), 0

    def write(*_: object) -> None:
        nonlocal num_signals
        num_signals += 1
        with open(out_path + ".part", "w") as f:
            f.write(f"{num_signals} {len(asyncio.all_tasks())}")  # the handler runs on the loop's thread
        os.replace(out_path + ".part", out_path)

    signal.signal(signal.SIGUSR1, write)
    return extproc_main(extproc_argv)


def _count_tasks(proc: ManagedProcess, path: Path, num_signals: int, timeout_s: float = 30.0) -> int:
    """Signals ``proc`` (a `counting_extproc_main`) for the ``num_signals``-th time; returns its task count.

    Raises:
        TimeoutError: no answer within ``timeout_s`` seconds.
    """
    os.kill(proc.pid, signal.SIGUSR1)
    deadline_s = time.monotonic() + timeout_s
    while True:
        try:
            seq, count = path.read_text().split()
            if int(seq) == num_signals:
                return int(count)
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline_s or not proc.is_running():
            raise TimeoutError(f"{proc.name} did not count its tasks within {timeout_s:g} s")
        time.sleep(0.05)


def _start_backends(procs: ProcessGroup, tmp: Path, policy: str) -> dict[str, str | None]:
    """2 fast backends, with sidecars when ``policy`` uses them; backend -> sidecar (None: none)."""
    if policy == "astrolabe":
        return start_fleet(procs, tmp, time_scale=1.0, backend="fast")[0]
    fleet: dict[str, str | None] = {}
    for i in range(2):
        port = free_port()
        proc = procs.start([sys.executable, "-m", "bench.fast_backend", "--port", str(port)], name=f"fast-{i}",
                           log_path=tmp / f"fast-{i}.log")
        proc.wait_http(f"http://127.0.0.1:{port}/health", START_TIMEOUT_S)
        fleet[f"127.0.0.1:{port}"] = None
    return fleet


def _start_envoy(procs: ProcessGroup, tmp: Path, mode: str, extproc: str) -> tuple[ManagedProcess, str, str]:
    """An Envoy (``astrolabe envoy --mode``, its defaults) in front of ``extproc``; returns it, its URL and its
    admin URL once it is ready."""
    port, admin = free_port(), free_port()
    proc = procs.start([sys.executable, "-m", "astrolabe", "envoy", "--mode", mode, "--listen-port", str(port),
                        "--admin-port", str(admin), "--extproc", extproc],
                       name=f"envoy-{mode}", log_path=tmp / f"envoy-{mode}.log")
    proc.wait_http(f"http://127.0.0.1:{admin}/ready", START_TIMEOUT_S)
    return proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"


def _get(url: str, timeout_s: float = 5.0) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout_s) as response:
        return response.read().decode()


def _in_flight(metrics_url: str) -> float:
    """The sum of the extproc's ``astrolabe_extproc_in_flight_requests`` gauges."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in _get(metrics_url).splitlines()
               if line.startswith("astrolabe_extproc_in_flight_requests{"))


def _wait_idle(metrics_url: str, proc: ManagedProcess, allowed: int = 0, timeout_s: float = 60.0) -> None:
    """Until the extproc counts at most ``allowed`` requests in flight (every other ext_proc stream closed).

    Raises:
        TimeoutError: it still counted more after ``timeout_s`` seconds, or the extproc exited.
    """
    deadline_s = time.monotonic() + timeout_s
    while proc.is_running() and _in_flight(metrics_url) > allowed:
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"the extproc still had more than {allowed} requests in flight after {timeout_s:g} s")
        time.sleep(0.1)
    if not proc.is_running():
        raise TimeoutError(f"the extproc exited ({proc.returncode}) while waiting for it to drain")


@dataclass(slots=True)
class _Stack:
    """The processes a run measures, and where to reach them."""

    extproc: ManagedProcess
    envoy: ManagedProcess
    url: str
    admin_url: str
    metrics_url: str
    tasks_path: Path
    num_counts: int = 0

    def memory(self) -> Memory:
        return Memory(group_rss_bytes(self.extproc.pid), group_rss_bytes(self.envoy.pid))

    def tasks(self) -> int:
        """The extproc's live asyncio tasks (`counting_extproc_main`)."""
        self.num_counts += 1
        return _count_tasks(self.extproc, self.tasks_path, self.num_counts)


# --- the client ------------------------------------------------------------------------------------------------

def _chat_body(i: int, max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"stream {i}: tell me a long story"}],
            "max_tokens": max_tokens, "stream": stream}


async def _stream(session, url: str, i: int, tokens: int, interval_s: float, first_chunk: asyncio.Queue) -> str:
    """One streamed request; puts ``i`` on ``first_chunk`` at its first chunk; returns its outcome."""
    num_chunks, done, status = 0, False, 0
    try:
        async with session.post(f"{url}/v1/chat/completions", json=_chat_body(i, tokens, True),
                                headers={TOKEN_INTERVAL_HEADER: f"{interval_s:g}"}) as response:
            status = response.status
            async for line in response.content:
                if line == DONE_EVENT[:-1]:
                    done = True
                elif line.startswith(b"data: "):
                    num_chunks += 1
                    if num_chunks == 1:
                        first_chunk.put_nowait(i)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return type(exc).__name__
    return stream_outcome(status, num_chunks, done, tokens)


async def _long(session, url: str, long_s: float, streamed: bool) -> LongResult:
    """The long part's streamed or silent request (module docstring)."""
    result = LongResult("streamed" if streamed else "silent")
    tokens = math.ceil(long_s / LONG_CHUNK_INTERVAL_S) + 1  # chunks at most LONG_CHUNK_INTERVAL_S apart
    headers = ({TOKEN_INTERVAL_HEADER: f"{long_s / (tokens - 1):g}"} if streamed
               else {DELAY_HEADER: f"{long_s:g}"})
    start_s = time.monotonic()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=_chat_body(-1, tokens, streamed),
                                headers=headers) as response:
            body = await response.read()
            result.duration_s = time.monotonic() - start_s
            if streamed:
                result.received = body.count(b"data: ") - body.count(DONE_EVENT)
                result.outcome = stream_outcome(response.status, result.received, DONE_EVENT in body, tokens)
            else:
                result.received = len(body)
                ok = response.status == 200 and body.startswith(b"{") and INSTANCE_HEADER in response.headers
                result.outcome = "ok" if ok else f"status {response.status}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.outcome, result.duration_s = type(exc).__name__, time.monotonic() - start_s
    return result


async def _round(session, stack: _Stack, num_streams: int, tokens: int, interval_s: float, open_rate: float,
                 longs: Sequence[asyncio.Task] = ()) -> Round:
    """One round of the scale part (module docstring); ``longs``: requests in flight meanwhile, which the
    extproc's in-flight count may still hold when the round's streams have ended."""
    rnd, first_chunk, finished = Round(), asyncio.Queue(), 0
    start_s = time.perf_counter()

    async def one(i: int) -> str:
        nonlocal finished
        await asyncio.sleep(max(0.0, start_s + i / open_rate - time.perf_counter()))
        try:
            return await _stream(session, stack.url, i, tokens, interval_s, first_chunk)
        finally:
            finished += 1

    all_done = asyncio.ensure_future(asyncio.gather(*(one(i) for i in range(num_streams))))
    num_first = 0
    while num_first < num_streams and not all_done.done():
        getter = asyncio.ensure_future(first_chunk.get())
        await asyncio.wait([getter, all_done], return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            num_first += 1
        else:
            getter.cancel()
    if num_first == num_streams:
        rnd.ramp_s, rnd.num_open = time.perf_counter() - start_s, num_streams - finished
        rnd.open = stack.memory()
        rnd.envoy_at_open = envoy_stats(await asyncio.to_thread(_get, f"{stack.admin_url}/stats"))
    rnd.outcomes.update(await all_done)
    await asyncio.to_thread(_wait_idle, stack.metrics_url, stack.extproc, sum(not t.done() for t in longs))
    rnd.after = stack.memory()
    rnd.tasks_after = await asyncio.to_thread(stack.tasks)
    return rnd


async def _drive(result: ScaleResult, stack: _Stack, num_rounds: int, open_rate: float, long_s: float) -> None:
    """The long requests (``long_s`` > 0) and, meanwhile, ``num_rounds`` rounds, one after the other."""
    # No read or total timeout: a stream may legitimately stay quiet for minutes (the long part).
    timeout = aiohttp.ClientTimeout(total=None, connect=60, sock_read=None)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        longs = [asyncio.create_task(_long(session, stack.url, long_s, streamed)) for streamed in (True, False)
                 if long_s > 0]
        for _ in range(num_rounds):
            result.rounds.append(await _round(session, stack, result.num_streams, result.tokens,
                                              result.token_interval_s, open_rate, longs))
        result.long = list(await asyncio.gather(*longs))


async def _short_streams(stack: _Stack, num_streams: int) -> int:
    """``num_streams`` 2-chunk streams with no pause, all at once; returns how many ended ``ok``."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        outcomes = await asyncio.gather(*(_stream(session, stack.url, i, 2, 0.0, asyncio.Queue())
                                          for i in range(num_streams)))
    return outcomes.count("ok")


def _start(procs: ProcessGroup, tmp: Path, body_mode: str, policy: str) -> _Stack:
    """Backends (and sidecars), the extproc and Envoy, until a stream gets through.

    Raises:
        astrolabe.procs.ProcessStartError: a process did not start.
        TimeoutError: no stream got through Envoy within `START_TIMEOUT_S`.
    """
    fleet = _start_backends(procs, tmp, policy)
    metrics_port = free_port()
    tasks_path = tmp / "extproc-tasks.txt"
    extproc, address, _ = start_extproc(procs, tmp, "extproc", fleet, {"metrics_listen": f"127.0.0.1:{metrics_port}"},
                                        policy=policy, launcher=("-m", "bench.streams", TASKS_FLAG, str(tasks_path)))
    envoy, url, admin_url = _start_envoy(procs, tmp, body_mode, address)
    stack = _Stack(extproc, envoy, url, admin_url, f"http://127.0.0.1:{metrics_port}/metrics", tasks_path)
    deadline_s = time.monotonic() + START_TIMEOUT_S
    while asyncio.run(_short_streams(stack, 1)) < 1:  # Envoy's health check of the extproc passes first
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"no stream got through {url} within {START_TIMEOUT_S:g} s")
        time.sleep(0.1)
    return stack


def run(num_streams: int = 2000, *, tokens: int = 20, token_interval_s: float = 1.0, open_rate: float = 250.0,
        num_rounds: int = 2, body_mode: str = "full-duplex", policy: str = "astrolabe", long_s: float = 0.0,
        num_warmup: int = 200) -> ScaleResult:
    """Both parts (module docstring) on a fresh stack; the returned `ScaleResult` holds every figure.

    Args:
        num_streams: streams per round (>= 1); tokens: chunks each (>= 2); token_interval_s: seconds between them.
        open_rate: streams opened per second (> 0), evenly spaced.
        num_rounds: rounds of the scale part (>= 1; 2 tell a leak from the allocator's first growth).
        body_mode: Envoy's ext_proc request body mode (`BODY_MODES`); policy: the extproc's (`POLICIES`).
        long_s: the long part's duration, seconds (0: no long part).
        num_warmup: short streams, all at once, routed before the idle sample.

    Raises:
        ValueError: bad arguments.
        astrolabe.procs.ProcessStartError: a process did not start.
        TimeoutError: no stream got through at the start, or the extproc never drained its in-flight requests.
    """
    if min(num_streams, num_rounds) < 1 or tokens < 2 or token_interval_s < 0 or not open_rate > 0 or long_s < 0:
        raise ValueError("need streams and rounds >= 1, tokens >= 2, token_interval_s >= 0, open_rate > 0, "
                         "long_s >= 0")
    if body_mode not in BODY_MODES or policy not in POLICIES:
        raise ValueError(f"body_mode must be one of {BODY_MODES}, policy one of {POLICIES}")
    result = ScaleResult(num_streams, tokens, token_interval_s, body_mode, policy,
                         fd_limit=resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    with tempfile.TemporaryDirectory(prefix="astrolabe-streams-") as folder, ProcessGroup() as procs:
        stack = _start(procs, Path(folder), body_mode, policy)
        asyncio.run(_short_streams(stack, num_warmup))  # connections, tokenizer, tagger, the allocators' first pools
        _wait_idle(stack.metrics_url, stack.extproc)
        result.idle, result.tasks_idle = stack.memory(), stack.tasks()
        asyncio.run(_drive(result, stack, num_rounds, open_rate, long_s))
        result.extproc_alive = stack.extproc.is_running()
        result.routes_after = result.extproc_alive and asyncio.run(_short_streams(stack, 1)) == 1
    return result


# --- report ----------------------------------------------------------------------------------------------------

def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def format_report(result: ScaleResult) -> str:
    """The figures of `run` as text: outcomes per round, the memory table, Envoy's counters, the long part."""
    lines = [(f"{result.num_streams} streams per round ({result.tokens} chunks, {result.token_interval_s:g} s "
              f"apart), {len(result.rounds)} round(s), Envoy {result.body_mode}, extproc policy {result.policy}; "
              f"file-descriptor limit {result.fd_limit}")]
    for i, rnd in enumerate(result.rounds):
        errors = {k: v for k, v in sorted(rnd.outcomes.items()) if k != "ok"}
        lines.append(f"round {i + 1}: opened {result.num_streams}, open at once {rnd.num_open} (the last first chunk "
                     f"{rnd.ramp_s:.1f} s after the first request); completed with all chunks {rnd.outcomes['ok']}; "
                     f"errors: {errors or 'none'}")
    header = ["process", "idle MiB"]
    for i in range(len(result.rounds)):
        header += [f"r{i + 1} all open MiB", f"r{i + 1} after MiB", f"r{i + 1} KiB / open stream"]
    header.append("KiB left / stream / round")
    lines += ["", "| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for role in ("extproc", "envoy"):
        cells = [role, _mib(getattr(result.idle, f"{role}_bytes") if result.idle else None)]
        for i, rnd in enumerate(result.rounds):
            cells += [_mib(getattr(m, f"{role}_bytes") if m else None) for m in (rnd.open, rnd.after)]
            cells.append(f"{result.kib_per_stream(role, i):.1f}")
        growth = result.growth_kib_per_stream(role)
        cells.append("- (needs 2 rounds)" if math.isnan(growth) else f"{growth:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("RSS = VmRSS summed over the process group (envoy: the astrolabe envoy launcher + Envoy); idle after "
                 "the warm-up; per open stream = (all open - idle) / streams open; left = (after the last round - "
                 "after the first) / the streams of the later rounds")
    lines.append(f"extproc asyncio tasks: idle {result.tasks_idle}, after each round "
                 f"{', '.join(str(r.tasks_after) for r in result.rounds)}: "
                 f"{result.tasks_left_per_stream:.3f} left behind per stream")
    if result.rounds:
        lines.append("Envoy when all were open (last round): "
                     + ", ".join(f"{k} {v}" for k, v in result.rounds[-1].envoy_at_open.items()))
    lines.append(f"extproc still up: {'yes' if result.extproc_alive else 'NO'}; routes a request afterwards: "
                 f"{'yes' if result.routes_after else 'NO'}")
    for long in result.long:
        what = "chunks" if long.kind == "streamed" else "bytes"
        lines.append(f"long {long.kind} request: {long.outcome} after {long.duration_s:.1f} s ({long.received} {what})")
    return "\n".join(lines)


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="astrolabe bench streams", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--streams", type=int, default=2000, help="concurrent streams (default 2000)")
    parser.add_argument("--tokens", type=int, default=20, help="chunks per stream (default 20)")
    parser.add_argument("--token-interval-s", type=float, default=1.0, help="seconds between chunks (default 1)")
    parser.add_argument("--open-rate", type=float, default=250.0, help="streams opened per second (default 250)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of streams, one after the other (default 2)")
    parser.add_argument("--body-mode", choices=BODY_MODES, default="full-duplex", help="Envoy's ext_proc body mode")
    parser.add_argument("--policy", choices=POLICIES, default="astrolabe",
                        help="the extproc's policy (astrolabe: with 2 predictor sidecars)")
    parser.add_argument("--long-s", type=float, default=180.0,
                        help="seconds of the long streamed and silent requests, run meanwhile (0: none; default 180)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.streams < 1 or args.tokens < 2 or args.token_interval_s < 0 or not args.open_rate > 0 or args.long_s < 0:
        parser.error("need --rounds and --streams >= 1, --tokens >= 2, --token-interval-s >= 0, --open-rate > 0, --long-s >= 0")
    return args


def main(argv: Sequence[str]) -> int:
    """Entry point of `astrolabe bench streams`; prints the report; returns 0 (1: a stream or long request failed,
    or the extproc went down; 2: a process did not start)."""
    args = _parse_args(argv)
    setup_logging("WARNING")
    for problem in plan_check(args.streams, args.tokens, args.token_interval_s, args.open_rate,
                              resource.getrlimit(resource.RLIMIT_NOFILE)[0]):
        logger.warning("%s", problem)

    def go() -> int:
        result = run(args.streams, tokens=args.tokens, token_interval_s=args.token_interval_s,
                     open_rate=args.open_rate, num_rounds=args.rounds, body_mode=args.body_mode, policy=args.policy, long_s=args.long_s)
        print(format_report(result), flush=True)
        failed = (result.num_ok < args.streams * args.rounds or not result.routes_after
                  or any(long.outcome != "ok" for long in result.long))
        return 1 if failed else 0

    return exit_status_of(go)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == TASKS_FLAG:
        sys.exit(counting_extproc_main(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
