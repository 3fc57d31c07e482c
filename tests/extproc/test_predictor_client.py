"""PredictorClient against real in-process gRPC sidecars: down vs late, escalation in a row, loop lag, bursts.

Backoffs and late streaks run on a ManualClock; deadlines are real (gRPC and asyncio timers), kept short.
"""

import asyncio
import math
import concurrent.futures
import hashlib
import time

import grpc
import pytest

from extproc.config import ConfigError, parse_config
from extproc.predictor_client import OUTCOMES, PredictorClient, PredictorClientConfig
from predictor.api import pb, pb_grpc

DEADLINE_S = 0.05
SLACK_DEADLINE_S = 5.0
"""Deadline for tests about what an answer holds, not when it comes (a first call on a busy machine can take
longer than DEADLINE_S, and would count as late)."""
MIN_BACKOFF_S = 0.2


class ManualClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class ScriptedPredictor(pb_grpc.PredictorServicer):
    """Answers after ``delay_s(i)`` for the i-th call (None: never), or fails with ``abort_code``."""

    def __init__(self, delay_s=lambda i: 0.0, abort_code=None, state_age_s=0.0) -> None:
        self.delay_s, self.abort_code, self.state_age_s = delay_s, abort_code, state_age_s
        self.num_calls = 0

    async def Predict(self, request, context):  # noqa: N802
        delay_s = self.delay_s(self.num_calls)
        self.num_calls += 1
        if self.abort_code is not None:
            await context.abort(self.abort_code, "scripted failure")
        await asyncio.sleep(3600 if delay_s is None else delay_s)
        return pb.PredictResponse(ttft_s=0.1, e2e_s=1.0, state_age_s=self.state_age_s)


async def serve(servicer, port=0):
    """A sidecar on this event loop; ``port`` 0 picks a free one."""
    server = grpc.aio.server()
    pb_grpc.add_PredictorServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


class ThreadedPredictor(pb_grpc.PredictorServicer):
    """Answers after ``delay_s``, on a worker thread of a synchronous server."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def Predict(self, request, context):  # noqa: N802
        time.sleep(self.delay_s)
        return pb.PredictResponse(ttft_s=0.1, e2e_s=1.0, state_age_s=0.0)


@pytest.fixture
def threaded_sidecar():
    """A sidecar served by its own threads, so that blocking the test's event loop does not block it."""
    servers = []

    def start(servicer, num_workers=8):
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=num_workers))
        pb_grpc.add_PredictorServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0).wait(5.0)


@pytest.fixture
async def sidecars():
    started = []

    async def start(servicer, port=0):
        server, port = await serve(servicer, port)
        started.append(server)
        return server, port

    yield start
    for server in started:
        await server.stop(0)


@pytest.fixture
async def make_client():
    clients = []

    def make(clock=None, **overrides):
        fields = {"predict_timeout_s": DEADLINE_S, "min_backoff_s": MIN_BACKOFF_S, "max_backoff_s": 10 * MIN_BACKOFF_S}
        client = PredictorClient(PredictorClientConfig(**(fields | overrides)), clock=clock or ManualClock())
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


async def ask(client, address, i=0):
    return await client.predict(address, f"req-{i}", 100, 50)


async def dead_address(sidecars):
    """An address where a sidecar was and no longer is (the port stays free for a restart)."""
    server, port = await sidecars(ScriptedPredictor())
    await server.stop(0)
    return port


def outcomes(**counts):
    return dict.fromkeys(OUTCOMES, 0) | counts


async def test_dead_sidecar_backs_off_then_is_used_as_soon_as_it_is_back(sidecars, make_client):
    port = await dead_address(sidecars)
    address = f"127.0.0.1:{port}"
    client = make_client()
    assert await ask(client, address) is None  # UNAVAILABLE: connection refused
    assert client.is_backing_off(address)
    assert await ask(client, address) is None  # skipped, not even asked
    assert client.outcomes[address] == outcomes(down=1, skipped_backoff=1) and client.num_calls == 1

    await sidecars(ScriptedPredictor(), port)  # restarted on the same port
    assert await client.wait_ready(address, timeout_s=3.0)
    # the backoff has not run out on the (manual) clock, but the channel reconnected: the next call probes
    assert not client.is_backing_off(address)
    assert await ask(client, address) is not None
    assert not client.is_backing_off(address)
    assert client.outcomes[address] == outcomes(ok=1, down=1, skipped_backoff=1)


async def test_failing_but_connected_sidecar_is_probed_once_per_backoff(sidecars, make_client):
    servicer = ScriptedPredictor(abort_code=grpc.StatusCode.INTERNAL)
    _, port = await sidecars(servicer)
    address, clock = f"127.0.0.1:{port}", ManualClock()
    client = make_client(clock)
    assert await ask(client, address) is None
    failed_s = clock.now_s
    clock.now_s = failed_s + MIN_BACKOFF_S * 0.99
    assert client.is_backing_off(address)  # the channel stays READY: no early probe for an erroring sidecar
    clock.now_s = failed_s + MIN_BACKOFF_S
    assert not client.is_backing_off(address)

    # the backoff ran out: of four requests at once, one probes and three are still skipped
    assert await asyncio.gather(*(ask(client, address, i) for i in range(4))) == [None] * 4
    assert servicer.num_calls == 2
    assert client.outcomes[address] == outcomes(down=2, skipped_backoff=3)
    failed_s = clock.now_s
    clock.now_s = failed_s + 2 * MIN_BACKOFF_S * 0.99  # the failed probe doubled the backoff
    assert client.is_backing_off(address)
    clock.now_s = failed_s + 2 * MIN_BACKOFF_S

    servicer.abort_code = None  # repaired: the probe's answer ends the backoff and its escalation
    assert await ask(client, address) is not None
    assert not client.is_backing_off(address)
    servicer.abort_code = grpc.StatusCode.INTERNAL
    assert await ask(client, address) is None
    clock.now_s = clock.now_s + MIN_BACKOFF_S
    assert not client.is_backing_off(address)  # back to min_backoff_s


@pytest.mark.parametrize("kind", ["down", "late"])
async def test_simultaneous_failures_escalate_once(sidecars, make_client, kind):
    if kind == "down":
        address = f"127.0.0.1:{await dead_address(sidecars)}"
    else:
        _, port = await sidecars(ScriptedPredictor(delay_s=lambda i: None))  # frozen
        address = f"127.0.0.1:{port}"
    clock = ManualClock()
    client = make_client(clock, late_backoff_after=1, late_backoff_span_s=0.0)
    assert await asyncio.gather(*(ask(client, address, i) for i in range(4))) == [None] * 4
    assert client.outcomes[address] == outcomes(**{kind: 4})
    failed_s = clock.now_s
    clock.now_s = failed_s + MIN_BACKOFF_S * 0.99
    assert client.is_backing_off(address)
    clock.now_s = failed_s + MIN_BACKOFF_S
    assert not client.is_backing_off(address)  # 0.2 s, not 0.2 * 2**3


async def test_sporadically_late_sidecar_never_backs_off(sidecars, make_client, caplog):
    servicer = ScriptedPredictor(delay_s=lambda i: 3 * DEADLINE_S if i % 3 == 0 else 0.0)
    _, port = await sidecars(servicer)
    address, clock = f"127.0.0.1:{port}", ManualClock()
    client = make_client(clock, late_backoff_after=2, late_backoff_span_s=0.0)
    for i in range(9):
        await ask(client, address, i)
        assert not client.is_backing_off(address)
        clock.now_s += 1.0
    assert client.outcomes[address] == outcomes(ok=6, late=3)
    # Said once a minute, with what to change: 3 late answers within 9 s make one line
    late_lines = [r.getMessage() for r in caplog.records if "answered later than predict_timeout_s" in r.getMessage()]
    assert len(late_lines) == 1 and "raise predictor_client.predict_timeout_s" in late_lines[0]


@pytest.mark.parametrize(("late_backoff_after", "late_backoff_span_s", "step_s", "num_late_before_backoff"), [
    (3, 1.0, 0.4, 4),  # the span decides: 3 late calls within 0.8 s are not enough
    (3, 0.1, 0.4, 3),  # the count decides
    (1, 0.0, 0.0, 1),
], ids=["span", "count", "first"])
async def test_frozen_sidecar_backs_off_after_count_and_span(sidecars, make_client, late_backoff_after,
                                                             late_backoff_span_s, step_s, num_late_before_backoff):
    _, port = await sidecars(ScriptedPredictor(delay_s=lambda i: None))
    address, clock = f"127.0.0.1:{port}", ManualClock()
    client = make_client(clock, late_backoff_after=late_backoff_after, late_backoff_span_s=late_backoff_span_s)
    for i in range(num_late_before_backoff):
        clock.now_s += step_s if i else 0.0
        assert not client.is_backing_off(address)
        assert await ask(client, address, i) is None
    assert client.is_backing_off(address)
    assert client.outcomes[address] == outcomes(late=num_late_before_backoff)
    clock.now_s = probe_s = clock.now_s + MIN_BACKOFF_S
    assert await ask(client, address) is None  # the probe is late too: backoff doubled
    clock.now_s = probe_s + MIN_BACKOFF_S
    assert client.is_backing_off(address)
    clock.now_s = probe_s + 2 * MIN_BACKOFF_S
    assert not client.is_backing_off(address)


async def test_a_call_the_loop_sent_late_is_not_held_against_the_sidecar(sidecars, make_client):
    _, port = await sidecars(ScriptedPredictor(delay_s=lambda i: None))
    address = f"127.0.0.1:{port}"
    client = make_client(late_backoff_after=1, late_backoff_span_s=0.0, max_loop_lag_s=DEADLINE_S)
    assert await client.wait_ready(address, timeout_s=3.0)
    call = asyncio.create_task(ask(client, address))
    # runs after the predict has created its call and before gRPC's task sends it: the router's own lag
    asyncio.get_running_loop().call_soon(time.sleep, 4 * DEADLINE_S)
    assert await call is None
    assert client.outcomes[address] == outcomes(late=1) and client.num_late_excused == 1
    assert not client.is_backing_off(address)
    assert await ask(client, address) is None  # sent on time and late: the sidecar's fault
    assert client.num_late_excused == 1 and client.is_backing_off(address)


async def test_an_answer_that_arrived_while_the_loop_was_blocked_is_used(threaded_sidecar, make_client):
    address = threaded_sidecar(ThreadedPredictor(delay_s=DEADLINE_S))
    client = make_client(predict_timeout_s=2 * DEADLINE_S, max_loop_lag_s=1.0)
    assert await client.wait_ready(address, timeout_s=3.0)

    async def block_across_the_deadline():
        await asyncio.sleep(DEADLINE_S / 2)
        time.sleep(3 * DEADLINE_S)  # the answer (at 1x) and the deadline (at 2x) both fall in here

    for i in range(3):
        blocker = asyncio.create_task(block_across_the_deadline())
        assert await ask(client, address, i) is not None
        await blocker
    assert client.outcomes[address] == outcomes(ok=3)


async def test_burst_with_a_busy_event_loop_keeps_predicting(threaded_sidecar, make_client):
    # loaded: 200 calls at once queue for its 8 workers; its own threads, so the busy loop below is the extproc's
    address = threaded_sidecar(ThreadedPredictor(delay_s=0.002))
    # every block of the loop outlasts the deadline: had the deadline run from the call's creation rather than
    # from its sending, calls created before a block would have no time left when it ends
    chunk_s = 0.25
    client = make_client(predict_timeout_s=0.8 * chunk_s, max_loop_lag_s=2 * chunk_s, late_backoff_after=2,
                         late_backoff_span_s=0.0)
    assert await client.wait_ready(address, timeout_s=3.0)
    blob, num_chunks, done = bytes(1 << 20), 0, False

    async def burn_cpu():  # hashing releases the GIL: it blocks the event loop, not the sidecar's thread
        nonlocal num_chunks
        while not done:
            end_s = time.monotonic() + chunk_s
            while time.monotonic() < end_s:
                hashlib.sha256(blob).digest()
            num_chunks += 1
            await asyncio.sleep(0)

    async def ask_and_check(i):
        prediction = await ask(client, address, i)
        assert not client.is_backing_off(address)
        return prediction

    burner = asyncio.create_task(burn_cpu())
    await asyncio.sleep(0)
    predictions = await asyncio.gather(*(ask_and_check(i) for i in range(200)))
    done = True
    await burner
    assert num_chunks >= 2  # the loop really was blocked while the calls were in flight
    counts = client.outcomes[address]
    assert counts["skipped_backoff"] == counts["down"] == 0
    assert sum(p is not None for p in predictions) == counts["ok"] > 100


@pytest.mark.parametrize(("servicer", "outcome"), [
    (ScriptedPredictor(abort_code=grpc.StatusCode.INVALID_ARGUMENT), "invalid"),
    (ScriptedPredictor(state_age_s=float("inf")), "stale_state"),
], ids=["invalid-argument", "stale-state"])
async def test_answers_without_prediction_do_not_back_off(sidecars, make_client, servicer, outcome):
    _, port = await sidecars(servicer)
    address = f"127.0.0.1:{port}"
    client = make_client(max_state_age_s=2.0)
    for i in range(3):
        assert await ask(client, address, i) is None
    assert not client.is_backing_off(address)
    assert client.outcomes[address] == outcomes(**{outcome: 3}) and client.num_calls == 3


@pytest.mark.parametrize(("raw", "where"), [
    ({"late_backoff_after": 0}, "predictor_client.late_backoff_after"),
    ({"late_backoff_after": 1.5}, "predictor_client.late_backoff_after"),
    ({"late_backoff_span_s": 0}, "predictor_client.late_backoff_span_s"),
], ids=["zero-count", "float-count", "zero-span"])
def test_config_errors_name_the_key(raw, where):
    with pytest.raises(ConfigError, match=f"^{where}"):
        parse_config({"endpoints": [], "predictor_client": raw})


class NonsensePredictor(pb_grpc.PredictorServicer):
    """A broken sidecar: answers with the figures it is given."""

    def __init__(self, ttft_s: float, e2e_s: float) -> None:
        self.ttft_s, self.e2e_s = ttft_s, e2e_s
        self.requests = []

    async def Predict(self, request, context):  # noqa: N802
        self.requests.append(request)
        return pb.PredictResponse(ttft_s=self.ttft_s, e2e_s=self.e2e_s, state_age_s=0.0)


@pytest.mark.parametrize("ttft_s, e2e_s", [(math.nan, 1.0), (0.1, math.inf), (-1.0, 1.0), (2.0, 1.0)],
                         ids=["nan", "inf", "negative", "e2e-before-ttft"])
async def test_nonsense_answers_are_no_prediction_and_no_backoff(sidecars, make_client, ttft_s, e2e_s):
    _, port = await sidecars(NonsensePredictor(ttft_s, e2e_s))
    client = make_client(predict_timeout_s=SLACK_DEADLINE_S)  # about answers, not lateness: a loaded machine is fine
    address = f"127.0.0.1:{port}"
    assert await ask(client, address) is None and await ask(client, address, 1) is None
    assert client.outcomes[address]["invalid"] == 2 and not client.is_backing_off(address)


async def test_counts_beyond_uint32_are_cut_not_fatal(sidecars, make_client):
    servicer = NonsensePredictor(0.1, 1.0)
    _, port = await sidecars(servicer)
    client = make_client(predict_timeout_s=SLACK_DEADLINE_S)
    address = f"127.0.0.1:{port}"
    assert await client.predict(address, "r", 2**40, 2**40, max_tokens=2**40) is not None
    (sent,) = servicer.requests
    assert (sent.num_prompt_tokens, sent.num_predicted_output_tokens, sent.max_tokens) == (2**32 - 1, 2**32 - 1, 0)
    client.admit(address, "r", 2**40, 5, max_tokens=2**33)  # must not raise either
