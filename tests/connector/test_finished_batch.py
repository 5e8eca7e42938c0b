"""`POST /v1/finished`: the published params of several finished requests in one signed call.

The proxy coalesces the lookups of streams that end together on one holder
(`kvrelay.proxy.engines`); the batch answers at once with what is published and leaves
the rest to `GET /v1/finished/{id}`, which waits for a late publication.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import aiohttp
import pytest
from prometheus_client import REGISTRY

import kvrelay.connector.scheduler
from kvrelay.connector.protocol import MAX_FINISHED_BATCH, PATH_FINISHED_BATCH
from kvrelay.connector.scheduler import ConnectorScheduler
from kvrelay.connector.sidechannel_client import AsyncSideChannelClient, _Exchange
from kvrelay.devtools import nixl_peer
from kvrelay.proxy.engines.finished_lookups import FinishedLookups
from tests.connector.sidechannel_helpers import hold_params

MakeScheduler = Callable[..., ConnectorScheduler]
HOST = "127.0.0.1"


def test_batch_answers_published_ids_at_once_and_omits_the_others(
    make_scheduler: MakeScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long wait bound for single lookups: the batch must not use it.
    monkeypatch.setattr(kvrelay.connector.scheduler, "FINISHED_WAIT_S", 30.0)
    sched = make_scheduler()
    first = hold_params(sched, "r-1", client="c-1")
    second = hold_params(sched, "r-2", n_tokens=20, client="c-2")

    async def ask() -> dict[str, dict[str, object]]:
        client = AsyncSideChannelClient(nixl_peer.SECRET.encode(), timeout_s=10)
        try:
            return await client.finished_batch(
                HOST, sched.side_channel_port, ["c-1", "unknown", "c-2", "c-1"]
            )
        finally:
            await client.close()

    start = time.monotonic()
    assert asyncio.run(ask()) == {"c-1": first, "c-2": second}
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("ids", [[], [f"c-{i}" for i in range(MAX_FINISHED_BATCH + 1)]])
def test_batch_refuses_an_empty_or_oversized_list(
    make_scheduler: MakeScheduler, ids: list[str]
) -> None:
    sched = make_scheduler()

    async def status_of_raw_batch() -> int:
        # The client's typed helper refuses both lists itself; send the bytes another client
        # could send, signed, and read the (signed) answer's status.
        client = AsyncSideChannelClient(nixl_peer.SECRET.encode(), timeout_s=10)
        try:
            body = json.dumps({"request_ids": ids}).encode()
            raw = _Exchange("POST", PATH_FINISHED_BATCH, body, lambda status, _: status)
            return await client._call(HOST, sched.side_channel_port, raw)
        finally:
            await client.close()

    assert asyncio.run(status_of_raw_batch()) == 400


def test_an_unsigned_batch_is_refused(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler()
    hold_params(sched, "r-1", client="c-1")

    async def ask() -> int:
        async with aiohttp.ClientSession() as session:
            url = f"http://{HOST}:{sched.side_channel_port}{PATH_FINISHED_BATCH}"
            async with session.post(url, json={"request_ids": ["c-1"]}) as resp:
                return resp.status

    assert asyncio.run(ask()) == 401


def test_lookups_that_arrive_together_share_one_call(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler()
    published = {f"c-{i}": hold_params(sched, f"r-{i}", client=f"c-{i}") for i in range(10)}

    def calls(kind: str) -> float:
        value = REGISTRY.get_sample_value("kvrelay_finished_calls_total", {"call": kind})
        return value or 0.0

    async def look_up() -> list[dict[str, object] | None]:
        client = AsyncSideChannelClient(nixl_peer.SECRET.encode(), timeout_s=10)
        try:
            lookups = FinishedLookups(client)
            return await asyncio.gather(
                *(lookups.get(HOST, sched.side_channel_port, rid) for rid in published)
            )
        finally:
            await client.close()

    batch_before, single_before = calls("batch"), calls("single")
    assert asyncio.run(look_up()) == list(published.values())
    # The first lookup's call carries all ten: they were queued before it went out.
    assert calls("batch") - batch_before == 1
    assert calls("single") == single_before
