"""Process lifecycle shared by the long-running servers (extproc, predictor sidecar)."""

from __future__ import annotations

import asyncio
import gc
import signal


async def wait_for_termination() -> int:
    """Returns the number of the first SIGTERM or SIGINT the process receives (on the running loop)."""
    received: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: received.done() or received.set_result(int(s)))
    return await received


def settle_heap() -> None:
    """Call once start-up is done: moves every object allocated so far (modules, models, tokenizers, tables) out of
    the garbage collector's reach, so that collections on the request path scan only request-sized garbage.

    Source: ``gc.freeze`` (Python 3.7+), meant for exactly this: "freeze all objects tracked by gc ... move them to
    a permanent generation and ignore all the future collections". Without it a full collection in a server that
    loaded a tagger and Envoy's protobuf modules walks ~10^6 objects and pauses the event loop for milliseconds.
    """
    gc.collect()
    gc.freeze()
