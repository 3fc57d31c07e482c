"""An asyncio event loop in a thread, for a loopback server a blocking test drives (a DNS server, a fake API)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """Runs coroutines and calls on its own loop; ``with`` starts and stops it (the thread is joined)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)

    def __enter__(self) -> LoopThread:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        async def cancel_the_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_the_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 10.0) -> T:
        """Runs ``coro`` on the loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call(self, fn: Callable[[], T], timeout_s: float = 10.0) -> T:
        """Calls ``fn`` on the loop's thread (objects the loop owns are changed there) and returns its result."""

        async def call() -> T:
            return fn()

        return self.run(call(), timeout_s)
