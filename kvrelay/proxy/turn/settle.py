"""Step 6 of a turn: D's final params are stored as the conversation's entry (or released)
before the answer's last bytes leave, so the client's next turn finds them.

Params come from D's JSON answer, from its stream, or, for a stream that carried none (a stock
engine's), from D's side channel once D finished. The turn waits for the store at most
`side_channel_timeout`: past it the store finishes in the background, and a client that leaves
meanwhile cancels only the wait, never the storing. Once the storing is handed to its task the
task owns D's hold (`Owed`'s `DECODE_HOLD` is settled); before that, a turn that ends early
frees D's hold, fetching D's params from its side channel when D may already have held.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Coroutine
from typing import Any

from kvrelay.connector.protocol import HoldRef
from kvrelay.proxy.fleet import Backend
from kvrelay.proxy.turn.answer import Relayed
from kvrelay.proxy.turn.decode_leg import Served
from kvrelay.proxy.turn.owed import Debt, Owed
from kvrelay.proxy.turn.store import Store

# A D that streamed without params publishes them on its side channel when it finishes;
# a cancelled one may take a moment to finish. Bounded retries, then the lease frees them.
_FINISHED_RETRY_DELAYS = (0.0, 0.2, 0.5, 1.0)


class Settle:
    """Storing one turn's D params, between the answer's body and its last bytes."""

    __slots__ = ("_owed", "_store")

    def __init__(self, store: Store, owed: Owed) -> None:
        self._store = store  # the turn's storing: its worker's parts, its report, its request
        self._owed = owed

    def owe_hold(self, backend: Backend) -> None:
        """D (`backend`) was asked to hold: until its params are handled the turn owes the
        hold, and frees it (through D's side channel) if it ends first."""
        self._owed.owe(Debt.DECODE_HOLD, functools.partial(self._release_hold_later, backend))

    async def after(self, relayed: Relayed, served: Served) -> None:
        """Store what D's complete answer left (`relayed`), waiting at most the side-channel
        timeout."""
        params, backend, hold = relayed.params, served.backend, served.hold
        if relayed.streamed:
            await self._wait(self._from_stream(params, backend, hold))
        elif isinstance(params, dict):
            self._store.report.finished_params("response")
            if self._store.storing.kvmap.in_process:
                # Nothing here waits, so nothing can interrupt it: a cancellation (the client
                # leaving) is delivered only at a wait. No task, and no wait for one.
                await self._put(params, backend, hold)
            else:
                await self._wait(self._put(params, backend, hold))
        elif hold:
            self._no_params()

    def in_background(self, relayed: Relayed, served: Served) -> None:
        """The client left after D finished its stream: the turn is complete, so D's params are
        stored all the same, by a task nobody waits for."""
        self._spawn(self._from_stream(relayed.params, served.backend, served.hold))

    async def _from_stream(
        self, params: dict[str, Any] | None, backend: Backend, hold: bool
    ) -> None:
        """Store D's params of a finished stream: from the stream or from D's side channel."""
        if params is not None:
            self._store.report.finished_params("stream")
            await self._put(params, backend, hold)
        elif hold:
            fetched = await self._fetch_finished(backend)
            if fetched is not None:
                self._store.report.finished_params("side_channel")
                await self._put(fetched, backend, hold)
            else:
                self._no_params()

    async def _put(self, params: dict[str, Any], backend: Backend, hold: bool) -> None:
        self._owed.settle(Debt.DECODE_HOLD)  # from here on the store frees or stores them
        await self._store.put(params, backend, hold)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[Any]:
        """Run the storing of D's params as a tracked task that a client leaving cannot cancel.

        From here on the task owns D's hold: the failure path must not release it too.
        """
        self._owed.settle(Debt.DECODE_HOLD)
        return self._store.storing.releaser.spawn(work)

    async def _wait(self, work: Coroutine[Any, Any, None]) -> None:
        """Wait for the entry to be stored, at most the side-channel timeout; a client that
        leaves meanwhile cancels only this wait, never the storing."""
        task = self._spawn(work)
        if task.done():
            return
        # One future and one timer rather than `asyncio.wait` (sets, a waiter per call): this
        # runs on every turn that stores params.
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def wake(_: object = None) -> None:
            if not waiter.done():
                waiter.set_result(None)

        task.add_done_callback(wake)
        timer = loop.call_later(self._store.storing.settings.side_channel_timeout, wake)
        try:
            await waiter
        finally:
            timer.cancel()
            task.remove_done_callback(wake)

    def _no_params(self) -> None:
        self._owed.settle(Debt.DECODE_HOLD)  # nothing to store; a stock D's lease frees it
        self._store.report.finished_params("missing")

    async def _fetch_finished(self, backend: Backend) -> dict[str, Any] | None:
        storing = self._store.storing
        address = storing.side_channel_of(backend)
        if address is None:
            return None
        request_id = self._store.ctx.request_id
        return await storing.releaser.finished_params(address[0], address[1], request_id)

    def _release_hold_later(self, backend: Backend) -> None:
        """D may have finished (and held) before the turn was abandoned: free that hold."""
        storing = self._store.storing
        address = storing.side_channel_of(backend)
        if address is None:
            return
        releaser, request_id = storing.releaser, self._store.ctx.request_id

        async def fetch_and_release() -> None:
            for delay in _FINISHED_RETRY_DELAYS:
                if delay:
                    await asyncio.sleep(delay)
                params = await releaser.finished_params(address[0], address[1], request_id)
                if params is not None:
                    await releaser.release("decode", HoldRef.from_params(params))
                    return

        releaser.spawn(fetch_and_release())
