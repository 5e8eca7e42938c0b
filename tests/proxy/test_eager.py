"""`start_eagerly`: work that never waits runs without a task; work that waits goes on in one
that behaves like a task started from the beginning (results, errors, cancellation, context)."""

from __future__ import annotations

import asyncio
import contextvars
import logging

import pytest

from kvrelay.proxy.eager import start_eagerly
from kvrelay.proxy.release import Releaser
from kvrelay.proxy.upstream import Upstream

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="caller")


async def _ready() -> None:
    return None


async def test_work_that_never_waits_is_done_on_return_without_a_task() -> None:
    done: list[str] = []

    async def work() -> None:
        await _ready()  # an await that does not suspend
        done.append("stored")

    before = len(asyncio.all_tasks())
    assert start_eagerly(work()) is None
    assert done == ["stored"]
    assert len(asyncio.all_tasks()) == before


async def test_work_that_waits_goes_on_in_a_task_that_gets_each_result() -> None:
    loop = asyncio.get_running_loop()
    first: asyncio.Future[int] = loop.create_future()
    second: asyncio.Future[str] = loop.create_future()
    seen: list[object] = []

    async def work() -> None:
        seen.append("started")
        seen.append(await first)
        seen.append(await second)

    task = start_eagerly(work())
    assert task is not None
    assert seen == ["started"]  # ran up to its first wait before start_eagerly returned
    first.set_result(1)
    await asyncio.sleep(0)
    second.set_result("two")
    await asyncio.wait_for(task, 5)
    assert seen == ["started", 1, "two"]


async def test_a_failed_wait_raises_inside_the_work() -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    caught: list[BaseException] = []

    async def work() -> None:
        try:
            await future
        except ConnectionError as exc:
            caught.append(exc)

    task = start_eagerly(work())
    assert task is not None
    future.set_exception(ConnectionError("map down"))
    await asyncio.wait_for(task, 5)
    assert [str(exc) for exc in caught] == ["map down"]


async def test_cancelling_the_task_cancels_the_work_at_its_wait() -> None:
    loop = asyncio.get_running_loop()
    never: asyncio.Future[None] = loop.create_future()
    cleaned: list[str] = []

    async def work() -> None:
        try:
            await never
        finally:
            cleaned.append("finally")

    task = start_eagerly(work())
    assert task is not None
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert cleaned == ["finally"]
    assert never.cancelled()  # the wait itself was cancelled, as in a plain task


async def test_an_error_before_any_wait_reaches_the_caller() -> None:
    async def work() -> None:
        raise ValueError("bad params")

    with pytest.raises(ValueError, match="bad params"):
        start_eagerly(work())


async def test_context_variables_set_by_the_work_stay_its_own() -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    seen: list[str] = []

    async def work() -> None:
        VAR.set("work")
        await future
        seen.append(VAR.get())  # after the wait it still sees what it set before it

    task = start_eagerly(work())
    assert task is not None
    assert VAR.get() == "caller"
    future.set_result(None)
    await asyncio.wait_for(task, 5)
    assert seen == ["work"]
    assert VAR.get() == "caller"


async def test_the_releaser_tracks_work_that_waits_and_logs_work_that_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    upstream = Upstream(connect_timeout=1.0)
    releaser = Releaser(None, upstream, timeout_s=1.0)
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()

    async def waits() -> None:
        await future

    async def fails() -> None:
        raise RuntimeError("boom")

    task = releaser.spawn_eagerly(waits())
    assert task is not None
    future.set_result(None)
    await asyncio.wait_for(releaser.drain(), 5)
    assert task.done()
    with caplog.at_level(logging.ERROR):
        assert releaser.spawn_eagerly(fails()) is None
    assert "background work failed" in caplog.text
    upstream.close()
