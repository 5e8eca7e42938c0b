"""How the proxy coalesces finished-params lookups per holder (`kvrelay.proxy.engines`).

The holder here is a fake side-channel client that records each call and can hold one open, so
the tests choose what is in flight when a lookup arrives. The real endpoint, signed, is in
tests/connector/test_finished_batch.py; the end-to-end suites stream through it.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from kvrelay.connector.protocol import MAX_FINISHED_BATCH
from kvrelay.connector.sidechannel_client import AsyncSideChannelClient, SideChannelError
from kvrelay.proxy.engines.finished_lookups import FinishedLookups

HOLDER = ("10.0.0.5", 5600)


class FakeHolderClient:
    """Answers like a holder that published `published`; records every call."""

    def __init__(self, published: dict[str, dict[str, Any]], batch_status: int | None = 200):
        self.published = published
        self.batch_status = batch_status  # None: unreachable; 404: no batch endpoint
        self.batches: list[list[str]] = []
        self.singles: list[str] = []
        self.gate: asyncio.Event | None = None  # set: batch calls wait for it

    async def finished_batch(
        self, host: str, port: int, ids: list[str]
    ) -> dict[str, dict[str, Any]]:
        assert (host, port) == HOLDER
        self.batches.append(list(ids))
        if self.gate is not None:
            await self.gate.wait()
        if self.batch_status != 200:
            raise SideChannelError("holder says no", self.batch_status)
        return {rid: self.published[rid] for rid in ids if rid in self.published}

    async def finished(self, host: str, port: int, rid: str) -> dict[str, Any] | None:
        self.singles.append(rid)
        return self.published.get(rid)


def lookups_for(client: FakeHolderClient) -> FinishedLookups:
    return FinishedLookups(cast(AsyncSideChannelClient, client))


def params(rid: str) -> dict[str, Any]:
    return {"remote_request_id": rid, "remote_block_ids": [[1, 2]]}


async def until(condition: Any) -> None:
    """Let the loop run until `condition()` (bounded: these tests run no real I/O)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


def test_lookups_arriving_while_a_call_is_in_flight_go_together_in_the_next() -> None:
    ids = [f"r{i}" for i in range(6)]
    client = FakeHolderClient({rid: params(rid) for rid in ids})

    async def run() -> list[dict[str, Any] | None]:
        lookups = lookups_for(client)
        client.gate = asyncio.Event()
        first = asyncio.ensure_future(lookups.get(*HOLDER, ids[0]))
        await until(lambda: len(client.batches) == 1)
        rest = [asyncio.ensure_future(lookups.get(*HOLDER, rid)) for rid in ids[1:]]
        await until(lambda: all(not f.done() for f in rest))
        client.gate.set()
        return await asyncio.gather(first, *rest)

    assert asyncio.run(run()) == [params(rid) for rid in ids]
    assert client.batches == [ids[:1], ids[1:]]  # alone at once, then the five in one call
    assert client.singles == []


def test_a_batch_never_exceeds_the_protocol_bound() -> None:
    ids = [f"r{i}" for i in range(2 * MAX_FINISHED_BATCH + 3)]
    client = FakeHolderClient({rid: params(rid) for rid in ids})

    async def run() -> list[dict[str, Any] | None]:
        lookups = lookups_for(client)
        return await asyncio.gather(*(lookups.get(*HOLDER, rid) for rid in ids))

    assert asyncio.run(run()) == [params(rid) for rid in ids]
    assert [len(b) for b in client.batches] == [MAX_FINISHED_BATCH, MAX_FINISHED_BATCH, 3]


def test_an_id_the_batch_lacks_is_asked_for_alone() -> None:
    client = FakeHolderClient({"published": params("published")})

    async def run() -> list[dict[str, Any] | None]:
        lookups = lookups_for(client)
        return await asyncio.gather(lookups.get(*HOLDER, "published"), lookups.get(*HOLDER, "late"))

    assert asyncio.run(run()) == [params("published"), None]
    assert client.batches == [["published", "late"]]
    assert client.singles == ["late"]  # the call on which a real holder waits for it


def test_a_holder_without_the_batch_endpoint_is_asked_one_id_at_a_time() -> None:
    client = FakeHolderClient({"a": params("a"), "b": params("b")}, batch_status=404)

    async def run() -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        lookups = lookups_for(client)
        first = await lookups.get(*HOLDER, "a")
        second = await lookups.get(*HOLDER, "b")  # remembered: no batch tried
        return first, second

    assert asyncio.run(run()) == (params("a"), params("b"))
    assert client.batches == [["a"]]
    assert client.singles == ["a", "b"]


def test_an_unreachable_holder_fails_every_lookup_of_the_call() -> None:
    client = FakeHolderClient({"a": params("a")}, batch_status=None)

    async def run() -> list[BaseException | dict[str, Any] | None]:
        lookups = lookups_for(client)
        return await asyncio.gather(
            lookups.get(*HOLDER, "a"), lookups.get(*HOLDER, "b"), return_exceptions=True
        )

    outcomes = asyncio.run(run())
    assert all(isinstance(o, SideChannelError) for o in outcomes)
    assert client.singles == []


def test_a_caller_that_leaves_does_not_hold_up_the_others() -> None:
    client = FakeHolderClient({"a": params("a"), "b": params("b"), "c": params("c")})

    async def run() -> list[dict[str, Any] | None]:
        lookups = lookups_for(client)
        client.gate = asyncio.Event()
        first = asyncio.ensure_future(lookups.get(*HOLDER, "a"))
        await until(lambda: len(client.batches) == 1)
        gone = asyncio.ensure_future(lookups.get(*HOLDER, "b"))
        stays = asyncio.ensure_future(lookups.get(*HOLDER, "c"))
        await asyncio.sleep(0)
        gone.cancel()
        client.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await gone
        return [await first, await stays]

    assert asyncio.run(run()) == [params("a"), params("c")]
    assert client.batches == [["a"], ["c"]]  # the cancelled lookup was not asked for
