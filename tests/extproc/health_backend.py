"""A real HTTP server on loopback answering ``GET /health``, for the health-check tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web


@contextlib.asynccontextmanager
async def health_backend(handler: Callable[[web.Request], Awaitable[web.Response]],
                         num_ports: int = 1) -> AsyncIterator[list[str]]:
    """Serves ``handler`` at ``/health`` on ``num_ports`` free ports of 127.0.0.1; yields their ``ip:port``."""
    app = web.Application()
    app.router.add_get("/health", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    addresses = []
    try:
        for _ in range(num_ports):
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            addresses.append(f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        yield addresses
    finally:
        await runner.cleanup()
