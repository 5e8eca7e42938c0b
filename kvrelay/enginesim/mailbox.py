"""Outputs from the engine thread to the HTTP loop: `Mailbox`.

The engine thread produces a step's outputs together (one per running request, a token each),
and waking the event loop once per output (`call_soon_threadsafe` writes to the loop's self-pipe
each time) cost the engine's process about a twentieth of its CPU at a few hundred tokens a
second. The mailbox wakes the loop once for whatever was posted since it last ran: outputs keep
their order, per request and overall.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


class Mailbox:
    """Calls posted from any thread, run on `loop` in the order they were posted, with one
    wake-up of the loop for each batch that was empty when posted to."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._posted: list[tuple[Callable[[Any], object], Any]] = []

    def post(self, call: Callable[[Any], object], arg: Any) -> None:
        with self._lock:
            wake = not self._posted
            self._posted.append((call, arg))
        if wake:
            self.loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        with self._lock:
            posted, self._posted = self._posted, []
        for call, arg in posted:
            call(arg)
