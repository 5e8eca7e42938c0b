"""Stopping the proxy's background loops (health probes, discovery, fleet sync) one way.

Each loop is a task the app starts at start-up; at shutdown it is cancelled and awaited with a
bound, so a loop stuck in a client library cannot hold up the proxy's exit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[None] | None], bound_s: float = 10.0
) -> None:
    """Cancel every task and wait (at most `bound_s` seconds) for them to end."""
    live = [task for task in tasks if task is not None]
    for task in live:
        task.cancel()
    if live:
        # `wait` never raises the tasks' CancelledError; a task that ignores the cancel is
        # left behind after the bound.
        await asyncio.wait(live, timeout=bound_s)
