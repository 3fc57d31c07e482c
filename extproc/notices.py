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
  every notice queued meanwhile goes in the same message, Admits first, then Releases, in the order queued (the
  sidecar handles them in that order, so an Admit always precedes its request's Release).
- **A broken stream loses what it held**, as unary calls to a dead sidecar do (the sidecar reconciles its counts
  with its engine: ``predictor/state_source.py``): notices queued but not written are dropped and counted
  (``num_lost``), later notices go unary, and the stream is reopened after a backoff (``min_backoff_s``, doubling
  to ``max_backoff_s``).
- **A sidecar that stops reading** (frozen) leaves its notices queued: at most `MAX_QUEUED_NOTICES`, then the
  oldest are dropped (``num_lost``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from predictor.api import NOTIFY_READY_KEY, pb

logger = logging.getLogger(__name__)

MAX_QUEUED_NOTICES = 10_000
"""Most notices waiting for one sidecar's stream (a frozen sidecar's): ~1 MB of messages."""


class NoticeStream:
    """The Notify stream to one sidecar; all methods run on the event loop.

    Args:
        address: the sidecar's ``host:port`` (for logs).
        open_call: opens a Notify call that writes the messages of the iterator it is given
            (``PredictorStub.Notify``).
        min_backoff_s, max_backoff_s: wait before reopening a broken stream, seconds: the first, and the cap of its
            doubling per failure in a row.
        on_written: called with the number of Admits of each batch handed to gRPC.

    Attributes:
        ready: the sidecar reads this stream now (`offer` takes notices).
        unsupported: the sidecar has no Notify (protocol v1.2 or older).
        num_batches: messages written; num_notices: notices in them; num_lost: notices dropped (module docstring).
    """

    def __init__(self, address: str, open_call: Callable[[AsyncIterator[pb.NoticeBatch]], grpc.aio.StreamUnaryCall],
                 min_backoff_s: float, max_backoff_s: float, on_written: Callable[[int], None] | None = None) -> None:
        self.address = address
        self._open_call = open_call
        self._min_backoff_s, self._max_backoff_s = min_backoff_s, max_backoff_s
        self._on_written = on_written
        self.ready = self.unsupported = False
        self.num_batches = self.num_notices = self.num_lost = 0
        self._admits: list[pb.AdmitRequest] = []
        self._releases: list[pb.ReleaseRequest] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def offer(self, admit: pb.AdmitRequest | None = None, release: pb.ReleaseRequest | None = None) -> bool:
        """Queues a notice for the next batch; False (nothing queued) while the stream is not ready: send it unary.
        Opens the stream if it is not open."""
        if not self.ready:
            self.start()
            return False
        if admit is not None:
            self._admits.append(admit)
        if release is not None:
            self._releases.append(release)
        excess = len(self._admits) + len(self._releases) - MAX_QUEUED_NOTICES
        if excess > 0:  # the oldest go; Admits first (a lost Release heals when the sidecar reconciles)
            num_admits = min(excess, len(self._admits))
            del self._admits[:num_admits], self._releases[:excess - num_admits]
            self.num_lost += excess
        self._wake.set()
        return True

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
        while True:
            await wake.wait()
            if wake is not self._wake:
                return
            wake.clear()
            if not (self._admits or self._releases):
                continue
            admits, releases, self._admits, self._releases = self._admits, self._releases, [], []
            batch = pb.NoticeBatch(admits=admits, releases=releases)
            self.num_batches += 1
            self.num_notices += len(admits) + len(releases)
            if self._on_written is not None and admits:
                self._on_written(len(admits))
            yield batch

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
                self.num_lost += len(self._admits) + len(self._releases)
                self._admits, self._releases = [], []
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self._max_backoff_s)
