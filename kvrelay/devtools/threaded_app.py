"""An aiohttp application served from its own event loop on a background thread.

For fakes that synchronous code (tests, fixtures) starts and stops: the server keeps answering
while the caller blocks, state that lives on the server's loop is reached with `call`, and
`stop` (or leaving the `with` block) closes the site, stops the loop and joins the thread,
each step bounded.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")


class ThreadedApp:
    """`app` on 127.0.0.1:`port`, served by `loop` on a daemon thread named `name`."""

    def __init__(self, app: web.Application, port: int, name: str, timeout: float = 10.0) -> None:
        self.port = port
        self.name = name
        self.timeout = timeout
        self.loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app, access_log=None)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ThreadedApp:
        """Serve; returns once the site accepts connections (TimeoutError otherwise)."""
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", self.port)
            self.loop.run_until_complete(site.start())
            started.set()
            self.loop.run_forever()

        self._thread = threading.Thread(target=serve, name=self.name, daemon=True)
        self._thread.start()
        if not started.wait(timeout=self.timeout):
            raise TimeoutError(f"{self.name} did not start in {self.timeout:g}s")
        return self

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the server's loop and wait (bounded) for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=self.timeout)

    def stop(self) -> None:
        """Close the site, stop the loop, join the thread (each bounded); idempotent."""
        if self._thread is None:
            return
        self.call(self._runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=self.timeout)
        self._thread = None
        self.loop.close()

    def __enter__(self) -> ThreadedApp:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
