"""Process lifecycle shared by the long-running servers (extproc, predictor sidecar)."""

from __future__ import annotations

import asyncio
import signal


async def wait_for_termination() -> int:
    """Returns the number of the first SIGTERM or SIGINT the process receives (on the running loop)."""
    received: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: received.done() or received.set_result(int(s)))
    return await received
