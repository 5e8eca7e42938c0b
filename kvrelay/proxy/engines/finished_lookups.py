"""Fetching D's finished params: lookups to one holder coalesced into few side-channel calls.

Stock vLLM puts no params in a stream, so every streamed turn that D holds for ends with a
question to D's side channel. Under load many streams on one D end within a round trip of each
other, and one call each costs a signed HTTP exchange on both sides; on D that exchange runs on
a thread sharing the engine's interpreter. So per holder at most one batch call
(`POST /v1/finished`, CONTRACTS §2) is in flight: a lookup that finds none in flight goes out
at once, alone, and lookups arriving meanwhile go together in the next call, up to
`MAX_FINISHED_BATCH` ids. Idle, nothing waits longer than before; busy, the calls per turn drop.

The batch answers at once with what the holder has published. An id it lacks (the scheduler
publishes a moment after the stream's last token) is asked for alone, the call on which the
holder waits for the publication. A holder whose connector predates the batch endpoint (404 or
405) is asked one id at a time for `UNSUPPORTED_RECHECK_S`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvrelay.connector.protocol import MAX_FINISHED_BATCH
from kvrelay.connector.sidechannel_client import AsyncSideChannelClient, SideChannelError
from kvrelay.proxy.telemetry import metrics

# How long a holder without the batch endpoint is asked one id at a time before trying again
# (an upgraded connector is noticed within this).
UNSUPPORTED_RECHECK_S = 300.0

Address = tuple[str, int]
Params = dict[str, Any]


class _NotInBatch:
    """The batch answer lacked the id: ask for it alone."""


_ASK_ALONE = _NotInBatch()


@dataclass
class _Holder:
    """Lookups waiting for one holder's next batch call, and whether one is in flight."""

    queue: deque[tuple[str, asyncio.Future[Params | _NotInBatch]]] = field(default_factory=deque)
    sending: bool = False
    single_until: float = 0.0  # before this (monotonic) the holder gets single lookups only


class FinishedLookups:
    """Finished-params lookups of one proxy worker, batched per holder (see the module doc)."""

    def __init__(self, client: AsyncSideChannelClient) -> None:
        self._client = client
        self._holders: dict[Address, _Holder] = {}
        self._senders: set[asyncio.Task[None]] = set()

    async def get(self, host: str, port: int, request_id: str) -> Params | None:
        """D's params for `request_id`, None when the holder has none; raises
        `SideChannelError` when the holder cannot be asked."""
        holder = self._holders.get((host, port))
        if holder is None:
            holder = self._holders[(host, port)] = _Holder()
        if holder.single_until <= time.monotonic():
            answer = await self._enqueue(holder, (host, port), request_id)
            if not isinstance(answer, _NotInBatch):
                return answer
        metrics.FINISHED_CALLS.labels("single").inc()
        return await self._client.finished(host, port, request_id)

    def _enqueue(
        self, holder: _Holder, address: Address, request_id: str
    ) -> asyncio.Future[Params | _NotInBatch]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Params | _NotInBatch] = loop.create_future()
        holder.queue.append((request_id, future))
        if not holder.sending:
            holder.sending = True
            task = loop.create_task(self._send(holder, address))
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)
        return future

    async def _send(self, holder: _Holder, address: Address) -> None:
        """Batch calls until the holder's queue is empty; every future gets an outcome."""
        batch: list[tuple[str, asyncio.Future[Params | _NotInBatch]]] = []
        try:
            while holder.queue:
                batch = [holder.queue.popleft()]
                while holder.queue and len(batch) < MAX_FINISHED_BATCH:
                    batch.append(holder.queue.popleft())
                batch = [(rid, fut) for rid, fut in batch if not fut.done()]  # callers gone
                if batch:
                    await self._call(holder, address, batch)
                batch = []
        except BaseException as exc:
            # Cancelled at shutdown (or a bug): nobody may wait forever on this holder.
            for _, future in [*batch, *holder.queue]:
                if not future.done():
                    future.set_exception(SideChannelError(f"finished lookup abandoned: {exc!r}"))
            holder.queue.clear()
            raise
        finally:
            holder.sending = False

    async def _call(
        self,
        holder: _Holder,
        address: Address,
        batch: list[tuple[str, asyncio.Future[Params | _NotInBatch]]],
    ) -> None:
        ids = list(dict.fromkeys(rid for rid, _ in batch))  # the same id twice: asked once
        metrics.FINISHED_CALLS.labels("batch").inc()
        metrics.FINISHED_BATCH_IDS.observe(len(ids))
        try:
            found: dict[str, Params] = await self._client.finished_batch(*address, ids)
        except SideChannelError as exc:
            if exc.status in (404, 405):
                holder.single_until = time.monotonic() + UNSUPPORTED_RECHECK_S
                outcome: BaseException | None = None
            else:
                outcome = exc
            for _, future in batch:
                if future.done():
                    continue
                if outcome is None:
                    future.set_result(_ASK_ALONE)
                else:
                    future.set_exception(SideChannelError(str(outcome), exc.status))
            return
        for rid, future in batch:
            if not future.done():
                future.set_result(found.get(rid, _ASK_ALONE))
