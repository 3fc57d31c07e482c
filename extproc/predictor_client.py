"""gRPC client of the predictor sidecars: Predict with a deadline, fire-and-forget Admit and Release.

A sidecar that fails or times out never fails a request: ``predict`` returns None. After a failure the sidecar
is skipped (not even asked) for a backoff that doubles per consecutive failure, from ``min_backoff_s`` up to
``max_backoff_s``; the first success resets it. Two answers are None without backoff, since the sidecar works:
INVALID_ARGUMENT (this request cannot be served there, e.g. a prompt larger than its KV cache) and a state
older than ``max_state_age_s`` (the sidecar has not reconciled with its backend lately: the backend may be
down, and an idle-looking stale state would attract traffic to it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from extproc.policies.base import Prediction
from predictor.api import pb, pb_grpc

logger = logging.getLogger(__name__)

_METRICS = {"e2e": pb.METRIC_E2E, "ttft": pb.METRIC_TTFT}


@dataclass(frozen=True, slots=True)
class PredictorClientConfig:
    """Deadlines and backoff, seconds."""

    predict_timeout_s: float = 0.02
    notify_timeout_s: float = 0.5
    max_state_age_s: float = 2.0
    min_backoff_s: float = 0.5
    max_backoff_s: float = 10.0


class PredictorClient:
    """Talks to many sidecars, one cached channel each; all methods run on the event loop.

    Args:
        config: deadlines and backoff.
        clock: monotonic clock, seconds (injectable for tests).
    """

    def __init__(self, config: PredictorClientConfig, clock=time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.PredictorStub]] = {}
        self._failures: dict[str, int] = {}
        self._skip_until_s: dict[str, float] = {}
        self._tasks: set[asyncio.Task] = set()
        self.num_calls = 0

    def _stub(self, address: str) -> pb_grpc.PredictorStub:
        entry = self._stubs.get(address)
        if entry is None:
            channel = grpc.aio.insecure_channel(address)
            entry = self._stubs[address] = (channel, pb_grpc.PredictorStub(channel))
        return entry[1]

    def is_backing_off(self, address: str) -> bool:
        return self._clock() < self._skip_until_s.get(address, 0.0)

    def _failed(self, address: str, error: BaseException) -> None:
        failures = self._failures.get(address, 0) + 1
        self._failures[address] = failures
        backoff_s = min(self.config.min_backoff_s * 2 ** (failures - 1), self.config.max_backoff_s)
        self._skip_until_s[address] = self._clock() + backoff_s
        logger.warning("predictor %s failed (%s); skipped for %.1f s", address, _describe(error), backoff_s)

    def _succeeded(self, address: str) -> None:
        if self._failures.pop(address, 0):
            logger.info("predictor %s answers again", address)
        self._skip_until_s.pop(address, None)

    async def predict(self, address: str, request_id: str, num_prompt_tokens: int,
                      num_output_tokens: int, metric: str = "e2e") -> Prediction | None:
        """Asks one sidecar; None if it is backing off, fails, or misses the deadline."""
        if self.is_backing_off(address):
            return None
        self.num_calls += 1
        try:
            reply = await self._stub(address).Predict(
                pb.PredictRequest(request_id=request_id, num_prompt_tokens=num_prompt_tokens,
                                  num_predicted_output_tokens=num_output_tokens, metric=_METRICS[metric]),
                timeout=self.config.predict_timeout_s)
        except (grpc.RpcError, asyncio.TimeoutError) as exc:
            if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                logger.debug("predictor %s cannot serve request %s: %s", address, request_id, _describe(exc))
            else:
                self._failed(address, exc)
            return None
        self._succeeded(address)
        if not reply.state_age_s <= self.config.max_state_age_s:  # also catches inf (never reconciled)
            return None
        return Prediction(reply.ttft_s, reply.e2e_s, reply.state_age_s)

    def connect(self, addresses) -> None:
        """Opens channels to ``addresses`` in the background, so that first predictions do not pay the connect."""
        for address in addresses:
            channel = self._stubs.get(address, (None,))[0]
            if channel is None:
                self._stub(address)
                channel = self._stubs[address][0]
            task = asyncio.get_running_loop().create_task(_warm(channel))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def admit(self, address: str, request_id: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """Tells the chosen sidecar about the request, without waiting for the answer."""
        message = pb.AdmitRequest(request_id=request_id, num_prompt_tokens=num_prompt_tokens,
                                  num_predicted_output_tokens=num_output_tokens)
        self._notify(address, self._stub(address).Admit(message, timeout=self.config.notify_timeout_s))

    def release(self, address: str, request_id: str) -> None:
        """Tells the sidecar the request ended, without waiting for the answer."""
        self._notify(address, self._stub(address).Release(pb.ReleaseRequest(request_id=request_id),
                                                          timeout=self.config.notify_timeout_s))

    def _notify(self, address: str, call) -> None:
        async def run() -> None:
            try:
                await call
            except grpc.RpcError as exc:  # the sidecar reconciles with /metrics; a lost notice heals there
                logger.debug("notice to predictor %s lost: %s", address, _describe(exc))

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()


async def _warm(channel: grpc.aio.Channel) -> None:
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout=5.0)
    except (asyncio.TimeoutError, grpc.RpcError):
        pass  # the first Predict will tell


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    return type(error).__name__
