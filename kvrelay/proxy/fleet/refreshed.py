"""`Refreshed`: an answer gathered from the fleet's engines, cached for `models_refresh_s`.

One refresh runs at a time and every caller waiting on it shares it; a caller that goes away
does not cancel it for the others. The model list and the engines' versions are built on it.
"""

from __future__ import annotations

import abc
import asyncio
import time

from kvrelay.proxy.fleet.shared import Fleet


class Refreshed(abc.ABC):
    """Caches what `_refresh` gathers; subclasses write `_refresh` and end it with `_fetched`."""

    def __init__(self, fleet: Fleet, timeout: float) -> None:
        self._fleet = fleet
        self._refresh_s = fleet.settings.models_refresh_s
        self._timeout = timeout
        self._fetched_at = -float("inf")
        self._refreshing: asyncio.Task[None] | None = None

    @property
    def _fresh(self) -> bool:
        return time.monotonic() - self._fetched_at < self._refresh_s

    def _fetched(self) -> None:
        self._fetched_at = time.monotonic()

    def _start_refresh(self) -> asyncio.Task[None]:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh())
        return self._refreshing

    async def refresh(self) -> None:
        """Fetch from the engines now (one fetch at a time; callers share it)."""
        # Shielded: a caller that goes away does not cancel the others' fetch.
        await asyncio.shield(self._start_refresh())

    @abc.abstractmethod
    async def _refresh(self) -> None:
        """Gather the answer from the engines, then call `_fetched`."""
