"""Thousands of open streams through real Envoy (full-duplex) and one extproc (astrolabe, 2 predictor sidecars) in
front of 2 streaming `bench.fast_backend` instances, and two long requests meanwhile (`bench.streams.run`: one
run, ~2.5 minutes, shared by every test here). Its own tier: `make test-scale` (`.ci/run` runs it after
`make test`, which leaves it out to stay near 15 minutes).

The scale part: 2 rounds of `NUM_STREAMS` streams, each 20 chunks 1 s apart, opened at 250/s, so all of a round
are open together for ~10 s. The long part, while the rounds run: one streamed request with a chunk every ~19 s
for `LONG_S` seconds, and one non-streamed request whose backend sends nothing for `LONG_S` seconds. `LONG_S` is
past the usual 15/30/60/120 s timeouts; what bounds the silent one is the route's ``per_try_idle_timeout``
(``astrolabe envoy --per-try-idle-timeout-s``, default 300 s: Envoy answers 504 after that long without a byte)
and then the HCM's ``stream_idle_timeout`` (900 s); the route timeout is off (0 s), the ext_proc message timeout
only runs while Envoy waits for a processor reply (none is pending once the request is routed), and the client
sets no read timeout.

Memory bounds, from the measurement on this 2-core machine (bench/README.md, "Thousands of open streams"): the
extproc holds ~30 KiB per open stream (its ext_proc stream, routing state, the sidecar's pending Release) and
Envoy ~90 KiB (a downstream and an upstream HTTP/1.1 connection with their buffers, the ext_proc HTTP/2 stream).
The bounds are twice to three times that: a doubling of per-stream state fails, allocator noise does not. A leak
is what the second round leaves on top of the first: the first round grows the allocators' pools (Python's
arenas, Envoy's pool of upstream connections), which are not given back, so "after" is compared round to round
rather than to idle; a stream's whole state never freed would leave ~30 KiB per stream, the bound is 8. A
smaller leak hides in the allocator's free pools, so the extproc's live asyncio tasks are counted too (the extproc
runs under `bench.streams.counting_extproc_main`, which only adds a SIGUSR1 handler that writes the count).
"""

from __future__ import annotations

import pytest

from bench import streams

pytestmark = [pytest.mark.envoy, pytest.mark.slow, pytest.mark.scale]

NUM_STREAMS = 2000
TOKENS = 20
LONG_S = 130.0
EXTPROC_KIB_PER_STREAM_MAX = 64.0
ENVOY_KIB_PER_STREAM_MAX = 256.0
LEFT_KIB_PER_STREAM_MAX = 8.0


@pytest.fixture(scope="module")
def result() -> streams.ScaleResult:
    measured = streams.run(NUM_STREAMS, tokens=TOKENS, token_interval_s=1.0, open_rate=250.0, num_rounds=2,
                           body_mode="full-duplex", policy="astrolabe", long_s=LONG_S)
    print("\n" + streams.format_report(measured))
    return measured


def test_every_stream_is_open_at_once_and_completes_with_all_its_chunks(result):
    assert [r.num_open for r in result.rounds] == [NUM_STREAMS, NUM_STREAMS]
    assert [dict(r.outcomes) for r in result.rounds] == [{"ok": NUM_STREAMS}] * 2
    envoy = result.rounds[-1].envoy_at_open
    assert envoy["cluster.extproc.upstream_rq_active"] >= NUM_STREAMS  # one ext_proc stream each, all at once
    assert envoy["cluster.backends.upstream_rq_pending_overflow"] == 0  # no circuit breaker capped them


def test_the_extproc_stays_up_and_routes_afterwards(result):
    assert result.extproc_alive and result.routes_after


def test_memory_per_open_stream_is_bounded(result):
    for i in range(2):
        assert 0 < result.kib_per_stream("extproc", i) < EXTPROC_KIB_PER_STREAM_MAX
        assert 0 < result.kib_per_stream("envoy", i) < ENVOY_KIB_PER_STREAM_MAX


def test_ended_streams_leave_no_memory_behind(result):
    """Envoy's RSS settles; the extproc's after a round stays below what the first round held open (Python's
    arenas return memory unevenly: its after-round RSS moved 131-154 MiB between runs, so a per-stream difference of
    two rounds is noise; a leak shows in the task count, test_ended_streams_leave_no_task_behind). Measured over 4
    rounds: +1.4 KiB per stream per round in the extproc (its tagger cache of 4,096 prompts fills meanwhile; not
    attributed further)."""
    assert result.growth_kib_per_stream("envoy") < LEFT_KIB_PER_STREAM_MAX
    assert result.rounds[-1].after.extproc_bytes < result.rounds[0].open.extproc_bytes * 1.05
    # and the extproc gives back some of what its open streams held (Python's arenas keep the rest)
    assert result.rounds[-1].after.extproc_bytes < result.rounds[-1].open.extproc_bytes


def test_ended_streams_leave_no_task_behind(result):
    """The extproc's live asyncio tasks after round 2 minus after round 1, per stream: a few Release notifications
    may still run (hence not 0), a task per stream is a leak that RSS shows only once the allocator's free pools
    are used up."""
    assert result.tasks_left_per_stream < 0.05


def test_a_slow_stream_moving_for_minutes_is_never_cut(result):
    streamed = next(r for r in result.long if r.kind == "streamed")
    assert streamed.outcome == "ok" and streamed.received == 8  # a chunk every 130 / 7 = 18.6 s
    assert streamed.duration_s >= LONG_S - 1  # it did last that long (the backend's schedule)


def test_a_silent_completion_for_minutes_is_never_cut(result):
    silent = next(r for r in result.long if r.kind == "silent")
    assert silent.outcome == "ok" and silent.received > 0
    assert silent.duration_s >= LONG_S - 1
