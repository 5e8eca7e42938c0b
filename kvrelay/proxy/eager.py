"""Starting a background coroutine eagerly: run it now, make a task only if it has to wait.

Storing D's params runs on every turn as work that a client leaving must not cancel, which
used to mean a task per turn. With the in-process map that work never waits on anything, so a
task (its creation, a trip through the event loop, and the caller's wait for it) is pure
overhead. `start_eagerly` runs the coroutine up to its first real suspension at once; if it
finishes there, no task exists. If it suspends (a Redis map, a side-channel call), the task
that carries on from that point is returned, and owns the rest exactly as a task started
from the beginning would.

The coroutine runs in a copy of the caller's context, before and after any suspension, as it
would in a task: context variables it sets (an OpenTelemetry span it opens and closes) stay
its own. This is what Python 3.12's eager task factory does, for one coroutine at a time and
on 3.11 too.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator
from typing import Any


def start_eagerly(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Run `coro` now; None when it finished without waiting, else the task that goes on.

    An exception raised before the first suspension propagates to the caller."""
    context = contextvars.copy_context()
    try:
        yielded = context.run(coro.send, None)
    except StopIteration:
        return None
    except BaseException:
        coro.close()
        raise
    return asyncio.get_running_loop().create_task(_carry_on(coro, yielded), context=context)


async def _carry_on(coro: Coroutine[Any, Any, None], yielded: Any) -> None:
    await _Resume(coro, yielded)


class _Resume:
    """Hands what the coroutine yielded (the future it waits on) to the task driving it, and
    passes the task's results and exceptions (a cancellation included) back in."""

    def __init__(self, coro: Coroutine[Any, Any, None], yielded: Any) -> None:
        self._coro = coro
        self._yielded = yielded

    def __await__(self) -> Generator[Any, Any, None]:
        coro, yielded = self._coro, self._yielded
        while True:
            try:
                sent = yield yielded
            except BaseException as exc:  # forwarded to the coroutine as is (cancellation too)
                try:
                    yielded = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    yielded = coro.send(sent)
                except StopIteration:
                    return
