"""Admit and Release on one Notify stream per sidecar (extproc/notices.py, protocol v1.3), against real sidecars
over gRPC: batched, counted by the sidecar as unary calls are, unary with a sidecar that has no Notify, and
reopened after the sidecar comes back."""

import asyncio
import time

import grpc
import pytest

from extproc import notices
from extproc.notices import NoticeStream
from extproc.predictor_client import PredictorClient, PredictorClientConfig
from predictor.api import pb, pb_grpc
from predictor.server import PredictorServicer, Sidecar, SidecarConfig
from tests.extproc.test_router import ENGINE, sidecars  # noqa: F401 (the fixture)


async def until(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def client(**fields):
    return PredictorClient(PredictorClientConfig(min_backoff_s=0.05, max_backoff_s=0.2, **fields))


def admit(predictors, address, i):
    predictors.admit(address, f"r{i}", 100, 50)


@pytest.fixture
async def streaming(sidecars):
    """A sidecar, its address, and a client whose notice stream to it is ready."""
    (sidecar,) = await sidecars(1)
    address = f"127.0.0.1:{sidecar.port}"
    predictors = client()
    predictors.connect([address])
    await until(lambda: predictors.notice_streams[address].ready)
    yield sidecar, address, predictors
    await predictors.close()


async def test_notices_of_one_turn_are_one_message_and_the_sidecar_counts_them(streaming):
    sidecar, address, predictors = streaming
    stream = predictors.notice_streams[address]
    for i in range(20):  # one turn of the event loop
        admit(predictors, address, i)
    assert predictors.num_admits_pending(address) == 20
    await until(lambda: sidecar.ledger.num_unfinished() == 20)
    assert stream.num_batches == 1 and stream.num_notices == 20
    assert sidecar.admits_seen(predictors.router_id) == 20  # admit_seq travels as on a unary Admit
    assert predictors.num_admits_pending(address) == 0
    for i in range(20):
        predictors.release(address, f"r{i}")
    await until(lambda: sidecar.ledger.num_unfinished() == 0)
    assert stream.num_batches == 2 and stream.num_lost == 0


async def test_a_big_turn_is_cut_into_messages_of_at_most_max_batch_notices(monkeypatch, streaming):
    monkeypatch.setattr(notices, "MAX_BATCH_NOTICES", 8)
    sidecar, address, predictors = streaming
    for i in range(20):
        admit(predictors, address, i)
    await until(lambda: sidecar.ledger.num_unfinished() == 20)
    assert predictors.notice_streams[address].num_batches == 3


async def test_notices_sent_before_the_stream_is_ready_go_unary(sidecars):
    (sidecar,) = await sidecars(1)
    address = f"127.0.0.1:{sidecar.port}"
    predictors = client()
    try:
        admit(predictors, address, 0)  # opens the stream, but goes as a unary call
        await until(lambda: sidecar.ledger.num_unfinished() == 1)
        stream = predictors.notice_streams[address]
        assert stream.num_notices == 0
        await until(lambda: stream.ready)
        admit(predictors, address, 1)
        await until(lambda: sidecar.ledger.num_unfinished() == 2)
        assert stream.num_notices == 1
    finally:
        await predictors.close()


async def test_a_sidecar_without_notify_gets_unary_calls(sidecars):
    """A v1.2 sidecar (no Notify: UNIMPLEMENTED) is never streamed to, and misses no notice."""
    (sidecar,) = await sidecars(1)

    class V12Servicer(PredictorServicer):
        Notify = pb_grpc.PredictorServicer.Notify  # the generated default: UNIMPLEMENTED

    server = grpc.aio.server()
    pb_grpc.add_PredictorServicer_to_server(V12Servicer(sidecar), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    predictors = client()
    try:
        predictors.connect([address])
        stream = predictors.notice_streams[address]
        await until(lambda: stream.unsupported)
        for i in range(5):
            admit(predictors, address, i)
        await until(lambda: sidecar.ledger.num_unfinished() == 5)
        for i in range(5):
            predictors.release(address, f"r{i}")
        await until(lambda: sidecar.ledger.num_unfinished() == 0)
        assert stream.num_notices == 0 and not stream.ready
    finally:
        await predictors.close()
        await server.stop(0)


async def test_an_invalid_admit_on_the_stream_is_skipped_and_the_stream_goes_on(streaming):
    sidecar, address, predictors = streaming
    stream = predictors.notice_streams[address]
    assert stream.offer(admit=pb.AdmitRequest(request_id=""))  # no request id: INVALID_ARGUMENT as a call
    admit(predictors, address, 1)
    await until(lambda: sidecar.ledger.num_unfinished() == 1)
    assert stream.ready


async def test_the_stream_is_reopened_when_the_sidecar_comes_back():
    sidecar = Sidecar(SidecarConfig(backend="127.0.0.1:1", listen="127.0.0.1:0", engine=ENGINE,
                                    discover_kv_cache=False))
    await sidecar.start()
    address = f"127.0.0.1:{sidecar.port}"
    predictors = client()
    restarted = None
    try:
        predictors.connect([address])
        stream = predictors.notice_streams[address]
        await until(lambda: stream.ready)
        await sidecar.stop(0)
        await until(lambda: not stream.ready)
        restarted = Sidecar(SidecarConfig(backend="127.0.0.1:1", listen=address, engine=ENGINE,
                                          discover_kv_cache=False))
        await restarted.start()
        await until(lambda: stream.ready, timeout_s=10.0)
        admit(predictors, address, 7)
        await until(lambda: restarted.ledger.num_unfinished() == 1)
        assert stream.num_notices == 1
    finally:
        await predictors.close()
        if restarted is not None:
            await restarted.stop(0)


async def test_a_stream_that_is_not_read_keeps_at_most_the_cap(monkeypatch, sidecars):
    """A frozen sidecar: what waits is bounded, the oldest go first; the Admits lost leave the pending count."""
    monkeypatch.setattr(notices, "MAX_QUEUED_NOTICES", 3)
    (sidecar,) = await sidecars(1)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}")
    gone = []
    stream = NoticeStream("frozen", pb_grpc.PredictorStub(channel).Notify, 0.05, 0.2, on_gone=gone.append)
    try:
        stream.ready = True  # as if the sidecar had said it reads, before the writer runs
        for i in range(4):
            assert stream.offer(admit=pb.AdmitRequest(request_id=f"a{i}"))
        assert stream.offer(release=pb.ReleaseRequest(request_id="a3"))
        assert stream.num_lost == 2 and sum(gone) == 2  # the oldest, in the order queued
        assert [n.request_id for n in stream._queue] == ["a2", "a3", "a3"]
    finally:
        await stream.close()
        await channel.close()


def test_notices_must_be_stream_or_unary():
    with pytest.raises(ValueError, match="notices"):
        PredictorClientConfig(notices="batch")


async def test_unary_notices_open_no_stream(sidecars):
    (sidecar,) = await sidecars(1)
    address = f"127.0.0.1:{sidecar.port}"
    predictors = client(notices="unary")
    try:
        predictors.connect([address])
        admit(predictors, address, 0)
        await until(lambda: sidecar.ledger.num_unfinished() == 1)
        assert predictors.notice_streams == {}
    finally:
        await predictors.close()
