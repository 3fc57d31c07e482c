"""``astrolabe tagger serve``: the tagger as a gRPC service with grpc.health.v1, and its async client.

Owns: generating the Python stubs of ``tagger/tagger.proto``, the servicer (a thin translation onto
``tagger.serve.TaggerService``), server start-up with health, and :class:`TaggerClient`. Imports grpc; the
in-process path (``tagger.serve``) does not import this module.

Tracing (``astrolabe.tracing``, the ``OTEL_*`` variables): with it on, ``Estimate`` continues the caller's trace
from the call's metadata in a SERVER span, with the estimate as a child span ``astrolabe.length_estimate``;
:class:`TaggerClient` sends the current span's context with each call.

NOTE (generated code): the stubs are NOT committed. :func:`load_stubs` runs ``grpc_tools.protoc`` into
``tagger/_generated/`` (ignored by git through a ``.gitignore`` written there) when a stub is missing or older
than ``tagger.proto``, so the stubs always match the ``.proto`` and need no staleness test. The proto is compiled
as ``tagger/_generated/tagger.proto`` from a scratch include root so that the generated gRPC module imports its
messages as ``tagger._generated.tagger_pb2`` (protoc derives imports from the include path). Files are written
to a scratch folder and moved into place with ``os.replace``, so concurrent importers never see half a stub.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace

from astrolabe.tracing import LENGTH_ESTIMATE_SPAN, NUM_PREDICTED_OUTPUT_TOKENS, Tracing, grpc_metadata, setup_tracing
from tagger.features import HistoryStats
from tagger.serve import TaggerService, load_service

logger = logging.getLogger(__name__)

PROTO_PATH = Path(__file__).resolve().parent / "tagger.proto"
GENERATED_DIR = Path(__file__).resolve().parent / "_generated"
SERVICE_NAME = "astrolabe.tagger.v1.Tagger"
TRACED_METHODS = (f"/{SERVICE_NAME}/Estimate",)
_STUBS = ("tagger_pb2.py", "tagger_pb2_grpc.py")


class StubGenerationError(RuntimeError):
    """``grpc_tools.protoc`` failed on ``tagger.proto``."""


def _stubs_stale() -> bool:
    proto_mtime_ns = PROTO_PATH.stat().st_mtime_ns
    for name in (*_STUBS, "__init__.py"):
        path = GENERATED_DIR / name
        if not path.exists() or (name in _STUBS and path.stat().st_mtime_ns < proto_mtime_ns):
            return True
    return False


def generate_stubs() -> None:
    """Compile ``tagger.proto`` into ``tagger/_generated/`` (always; see :func:`load_stubs`).

    Raises:
        StubGenerationError: protoc reported an error.
    """
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory(prefix="tagger-protoc-") as scratch:
        include_root = Path(scratch) / "src"
        (include_root / "tagger" / "_generated").mkdir(parents=True)
        shutil.copyfile(PROTO_PATH, include_root / "tagger" / "_generated" / "tagger.proto")
        out_root = Path(scratch) / "out"
        out_root.mkdir()
        args = ["protoc", f"-I{include_root}", f"--python_out={out_root}", f"--grpc_python_out={out_root}",
                str(include_root / "tagger" / "_generated" / "tagger.proto")]
        if protoc.main(args) != 0:
            raise StubGenerationError(f"grpc_tools.protoc failed on {PROTO_PATH}")
        GENERATED_DIR.mkdir(exist_ok=True)
        (GENERATED_DIR / ".gitignore").write_text("*\n", encoding="utf-8")
        (GENERATED_DIR / "__init__.py").write_text('"""Generated from tagger/tagger.proto; do not edit."""\n')
        for name in _STUBS:
            tmp = GENERATED_DIR / f".{name}.{os.getpid()}.tmp"
            shutil.copyfile(out_root / "tagger" / "_generated" / name, tmp)
            os.replace(tmp, GENERATED_DIR / name)
    importlib.invalidate_caches()
    logger.info("generated tagger gRPC stubs in %s", GENERATED_DIR)


def load_stubs() -> tuple[ModuleType, ModuleType]:
    """``(tagger_pb2, tagger_pb2_grpc)``, regenerated first if missing or older than the ``.proto``.

    Raises:
        StubGenerationError: regeneration was needed and failed.
    """
    if _stubs_stale():
        generate_stubs()
    return (importlib.import_module("tagger._generated.tagger_pb2"),
            importlib.import_module("tagger._generated.tagger_pb2_grpc"))


pb2, pb2_grpc = load_stubs()


class TaggerServicer(pb2_grpc.TaggerServicer):
    """Translates ``Estimate`` messages onto a :class:`TaggerService` (in a span per estimate when ``tracer``)."""

    def __init__(self, service: TaggerService, tracer: trace.Tracer | None = None) -> None:
        self.service = service
        self._tracer = tracer

    async def _estimate(self, request) -> int:
        return await self.service.estimate(
            request.prompt_text if request.HasField("prompt_text") else None,
            list(request.prompt_token_ids),
            request.max_tokens if request.HasField("max_tokens") else None,
            HistoryStats.from_sizes([(m.role, m.num_chars) for m in request.history]),
        )

    async def Estimate(self, request, context):  # noqa: N802 - gRPC method name
        if self._tracer is None:
            num_tokens = await self._estimate(request)
        else:
            with self._tracer.start_as_current_span(LENGTH_ESTIMATE_SPAN) as span:
                num_tokens = await self._estimate(request)
                if span.is_recording():
                    span.set_attributes({"astrolabe.tagger_kind": self.service.kind,
                                         NUM_PREDICTED_OUTPUT_TOKENS: num_tokens,
                                         "astrolabe.prompt_chars": len(request.prompt_text)})
        return pb2.EstimateResponse(num_output_tokens=num_tokens, tagger_kind=self.service.kind)


async def start_server(service: TaggerService, listen: str,
                       tracing: Tracing | None = None) -> tuple[grpc.aio.Server, int]:
    """Start a ``grpc.aio`` server with the tagger and health services; returns it and its bound port.

    Args:
        service: the in-process tagger service to expose.
        listen: ``host:port`` (port 0 picks a free port).
        tracing: the process's tracing (None = off); the caller shuts it down.

    Raises:
        RuntimeError: the address cannot be bound.
    """
    tracing = tracing or Tracing.off()
    server = grpc.aio.server(interceptors=tracing.server_interceptors(TRACED_METHODS))
    tracer = tracing.tracer("astrolabe.tagger") if tracing.enabled else None
    pb2_grpc.add_TaggerServicer_to_server(TaggerServicer(service, tracer), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(listen)
    if port == 0:
        raise RuntimeError(f"cannot bind {listen}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info("tagger (%s) serving on port %d", service.kind, port)
    return server, port


async def run_server(service: TaggerService, listen: str, grace_s: float = 2.0,
                     tracing: Tracing | None = None) -> None:
    """Serve until cancelled or sent SIGTERM/SIGINT, then stop with ``grace_s`` seconds of grace (``tracing``: as
    :func:`start_server`)."""
    server, _ = await start_server(service, listen, tracing)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await server.stop(grace_s)
        service.close()
        logger.info("tagger server stopped")


async def serve_grpc(path: Path | str | None, listen: str) -> None:
    """Run ``astrolabe tagger serve`` until cancelled (`run_server` over `tagger.serve.load_service`), traced as
    the ``OTEL_*`` variables say (``astrolabe.tracing``; service name ``astrolabe-tagger``).

    Raises:
        tagger.serve.TaggerLoadError: see `tagger.serve.load_tagger`.
        astrolabe.tracing.TracingConfigError: an invalid ``OTEL_*`` value.
    """
    tracing = setup_tracing("astrolabe-tagger")
    try:
        await run_server(load_service(path), listen, tracing=tracing)
    finally:
        tracing.shutdown()


class TaggerClient:
    """Async client of ``astrolabe tagger serve``.

    Args:
        target: ``host:port`` of the server.
        timeout_s: deadline of each call, seconds.
    """

    def __init__(self, target: str, timeout_s: float = 0.5) -> None:
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = pb2_grpc.TaggerStub(self._channel)
        self.timeout_s = timeout_s

    async def estimate(self, prompt_text: str | None, prompt_token_ids=None, max_tokens: int | None = None,
                       history_sizes: Sequence[tuple[str, int]] = ()) -> int:
        """Predicted output tokens, as :meth:`tagger.serve.TaggerService.estimate` (``history_sizes``: ``(role,
        characters)`` of a chat request's messages before its last user message; the current span's context, if
        any, travels as metadata).

        Raises:
            grpc.aio.AioRpcError: the call failed or passed its deadline.
        """
        request = pb2.EstimateRequest(prompt_token_ids=list(prompt_token_ids or ()), history=[
            pb2.HistoryMessage(role=role, num_chars=num_chars) for role, num_chars in history_sizes])
        if prompt_text is not None:
            request.prompt_text = prompt_text
        if max_tokens is not None:
            request.max_tokens = max_tokens
        response = await self._stub.Estimate(request, timeout=self.timeout_s,
                                             metadata=grpc_metadata(trace.get_current_span()))
        return response.num_output_tokens

    async def close(self) -> None:
        await self._channel.close()
