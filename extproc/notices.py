"""Admit and Release notices to one sidecar over one long-lived stream (protocol v1.3, ``Notify`` in
``predictor/predictor.proto``).

A notice (the router sent a request to the sidecar's instance; a request ended) is fire-and-forget: nobody waits
for its answer. As one unary gRPC call each they were two calls per routed request, each a grpc.aio call object,
a task and a protobuf round trip on the router's event loop and on the sidecar's. Here the notices of one
event-loop turn travel as one ``NoticeBatch`` message on one stream per router and sidecar, opened once.

NOTE: the rule, per sidecar.

- **Unary until the sidecar says it reads.** The stream opens at the first notice. Until the sidecar's initial
  metadata (``NOTIFY_READY_KEY``) has arrived, `NoticeStream.offer` refuses and the caller sends the notice as a
  unary call: nothing is written into a stream the sidecar might not read. A sidecar that answers UNIMPLEMENTED
  (protocol v1.2 or older) is never asked again: unary for good.
- **One batch per turn.** A notice wakes the stream's writer, which runs after the current turn of the event loop:
  every notice queued meanwhile (at most `MAX_BATCH_NOTICES` a message) goes in the same message, Admits first,
  then Releases, each in the order queued (the sidecar handles them in that order, so an Admit always precedes its
  request's Release).
- **A broken stream loses what it held**, as unary calls to a dead sidecar do (the sidecar reconciles its counts
  with its engine: ``predictor/state_source.py``): notices queued but not written are dropped and counted
  (``num_lost``), later notices go unary, and the stream is reopened after a backoff (``min_backoff_s``, doubling
  to ``max_backoff_s``).
- **A sidecar that stops reading** (frozen) leaves its notices queued: at most `MAX_QUEUED_NOTICES`, then the
  oldest are dropped, in the order queued (``num_lost``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from predictor.api import NOTIFY_READY_KEY, pb

logger = logging.getLogger(__name__)

NOTICE_OUTCOMES = ("sent", "lost")
"""What became of a notice on a stream (``astrolabe_extproc_notices_total``'s ``outcome``): written in a message, or
lost (module docstring)."""
MAX_QUEUED_NOTICES = 10_000
"""Most notices waiting for one sidecar's stream (a frozen sidecar's): ~1 MB of messages."""
MAX_BATCH_NOTICES = 512
"""Most notices in one message: a sidecar handles a message in one go (a break-it pass sent 100k Admits in one and
held the sidecar's Predicts for 3.4 s); 512 take it ~10 ms."""


class NoticeStream:
    """The Notify stream to one sidecar; all methods run on the event loop.

    Args:
        address: the sidecar's ``host:port`` (for logs).
        open_call: opens a Notify call that writes the messages of the iterator it is given
            (``PredictorStub.Notify``).
        min_backoff_s, max_backoff_s: wait before reopening a broken stream, seconds: the first, and the cap of its
            doubling per failure in a row.
        on_gone: called with the number of Admits that left the queue: handed to gRPC in a batch, or lost.

    Attributes:
        ready: the sidecar reads this stream now (`offer` takes notices).
        unsupported: the sidecar has no Notify (protocol v1.2 or older).
        num_batches: messages written; num_notices: notices in them; num_lost: notices dropped (module docstring).
    """

    def __init__(self, address: str, open_call: Callable[[AsyncIterator[pb.NoticeBatch]], grpc.aio.StreamUnaryCall],
                 min_backoff_s: float, max_backoff_s: float, on_gone: Callable[[int], None] | None = None) -> None:
        self.address = address
        self._open_call = open_call
        self._min_backoff_s, self._max_backoff_s = min_backoff_s, max_backoff_s
        self._on_gone = on_gone
        self.ready = self.unsupported = False
        self.num_batches = self.num_notices = self.num_lost = 0
        self._queue: collections.deque[pb.AdmitRequest | pb.ReleaseRequest] = collections.deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def offer(self, admit: pb.AdmitRequest | None = None, release: pb.ReleaseRequest | None = None) -> bool:
        """Queues a notice for the next batch; False (nothing queued) while the stream is not ready: send it unary.
        Opens the stream if it is not open."""
        if not self.ready:
            self.start()
            return False
        queue = self._queue
        for notice in (admit, release):
            if notice is not None:
                queue.append(notice)
        if len(queue) > MAX_QUEUED_NOTICES:  # the oldest go
            self._lose([queue.popleft() for _ in range(len(queue) - MAX_QUEUED_NOTICES)])
        self._wake.set()
        return True

    def _lose(self, notices) -> None:
        self.num_lost += len(notices)
        num_admits = sum(isinstance(n, pb.AdmitRequest) for n in notices)
        if num_admits and self._on_gone is not None:
            self._on_gone(num_admits)

    def start(self) -> None:
        """Opens the stream in the background (once; never for a sidecar without Notify)."""
        if self._task is None and not self.unsupported:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"notify-{self.address}")

    async def close(self) -> None:
        """Ends the stream (what is still queued is dropped)."""
        self.ready = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _batches(self, wake: asyncio.Event) -> AsyncIterator[pb.NoticeBatch]:
        """The messages of one call; ``wake`` is that call's (a broken call's writer may outlive it in gRPC: it must
        not take the next call's notices)."""
        queue = self._queue
        while True:
            await wake.wait()
            if wake is not self._wake:
                return
            wake.clear()
            while queue:
                admits, releases = [], []
                for _ in range(min(len(queue), MAX_BATCH_NOTICES)):
                    notice = queue.popleft()
                    (admits if isinstance(notice, pb.AdmitRequest) else releases).append(notice)
                self.num_batches += 1
                self.num_notices += len(admits) + len(releases)
                if self._on_gone is not None and admits:
                    self._on_gone(len(admits))
                yield pb.NoticeBatch(admits=admits, releases=releases)
                if wake is not self._wake:
                    return

    async def _run(self) -> None:
        backoff_s = self._min_backoff_s
        while True:
            wake = self._wake = asyncio.Event()
            call = self._open_call(self._batches(wake))
            try:
                metadata = await call.initial_metadata()
                if metadata is not None and any(key == NOTIFY_READY_KEY for key, _ in metadata):
                    self.ready, backoff_s = True, self._min_backoff_s
                await call  # a Notify call ends only when it fails: the router never ends its side
                logger.warning("sidecar %s ended its notice stream; reopened", self.address)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    logger.info("sidecar %s has no notice stream (protocol v1.2 or older): Admit and Release are "
                                "unary calls", self.address)
                    self.unsupported = True
                    return
                logger.debug("notice stream to %s failed (%s: %s); notices go unary until it is reopened",
                             self.address, exc.code().name, exc.details())
            finally:
                self.ready = False
                call.cancel()
                self._wake = asyncio.Event()
                wake.set()  # its writer, if still waiting, ends
                lost = list(self._queue)
                self._queue.clear()
                self._lose(lost)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self._max_backoff_s)
