"""The Redis map's script batching on a real redis-server: calls made while another is in
flight go as one pipeline, and each caller still gets exactly its own outcome (results, script
errors, NOSCRIPT after a flush, replica confirmation, a caller that gave up, Redis stopped)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from kvrelay.kvcache_map import MapUnavailableError, RedisMap, open_map
from kvrelay.kvcache_map._redis_batch import ScriptBatcher
from tests.harness import RedisServer
from tests.kvcache_map.helpers import key, make_entry

SLOW_OK = 2.0
FAIL_FAST_BOUND = 1.5  # as in test_redis.py: the 50 ms timeout, on a shared machine

# Replies with its argument, or a script error when the argument is "boom".
_ECHO = """
if ARGV[1] == 'boom' then return redis.error_reply('boom') end
return ARGV[1]
"""


@pytest.fixture
async def client(redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis.url)
    try:
        yield c
    finally:
        await c.aclose()


def _batcher(m: RedisMap) -> ScriptBatcher:
    batcher = m._batcher
    assert batcher is not None
    return batcher


async def test_concurrent_puts_and_takes_share_pipelines_and_keep_their_own_entries(
    redis: RedisServer,
) -> None:
    m = RedisMap.from_url(redis.url, timeout=SLOW_OK, sweep=False)
    keys = [key(f"c{i}") for i in range(64)]
    try:
        await asyncio.gather(
            *(m.put(k, make_entry(request_id=k.conversation_id), ttl=60) for k in keys)
        )
        after_puts = _batcher(m).pipelines_sent
        assert after_puts >= 1  # the first call went alone, the others queued behind it
        taken = await asyncio.gather(*(m.take(k) for k in keys))
        assert _batcher(m).pipelines_sent > after_puts
        assert [e.request_id if e else None for e in taken] == [k.conversation_id for k in keys]
        assert await asyncio.gather(*(m.take(k) for k in keys)) == [None] * len(keys)
    finally:
        await m.close()


async def test_a_script_error_reaches_its_own_caller_only(client: aioredis.Redis) -> None:
    batcher = ScriptBatcher(client, wait_replicas=0, wait_ms=0)
    echo = client.register_script(_ECHO)
    await echo(args=["load"])
    outcomes = await asyncio.gather(
        *(batcher.run(echo, [], [arg]) for arg in ("first", "a", "boom", "b")),
        return_exceptions=True,
    )
    assert batcher.pipelines_sent == 1  # "first" alone, the other three together
    assert outcomes[0] == (b"first", 0)
    assert outcomes[1] == (b"a", 0)
    assert isinstance(outcomes[2], ResponseError) and "boom" in str(outcomes[2])
    assert outcomes[3] == (b"b", 0)


async def test_calls_of_a_script_redis_lost_are_sent_again_and_run_once(
    client: aioredis.Redis,
) -> None:
    batcher = ScriptBatcher(client, wait_replicas=0, wait_ms=0)
    echo = client.register_script(_ECHO)
    counter = client.register_script("return redis.call('INCR', KEYS[1])")

    async def burst(calls: int) -> list[int]:
        outcomes = await asyncio.gather(
            batcher.run(echo, [], ["first"]),  # alone: the counter calls queue behind it
            *(batcher.run(counter, ["counted"], []) for _ in range(calls)),
        )
        assert outcomes[0] == (b"first", 0)
        return sorted(reply for reply, _ in outcomes[1:])

    assert await burst(2) == [1, 2]  # the scripts are loaded before the first pipeline
    assert batcher.pipelines_sent == 1
    await client.script_flush()  # as after a Redis restart: the batcher still counts on them
    assert await burst(5) == [3, 4, 5, 6, 7]
    assert batcher.pipelines_sent == 3  # answered NOSCRIPT, then sent again after a load
    assert int(await client.get("counted")) == 7  # NOSCRIPT ran nothing: no call ran twice


async def test_a_caller_that_gave_up_while_queued_is_left_out(redis: RedisServer) -> None:
    m = RedisMap.from_url(redis.url, timeout=SLOW_OK, sweep=False)
    try:
        await m.put(key("kept"), make_entry(request_id="kept"), ttl=60)
        in_flight = asyncio.create_task(m.take(key("other")))
        await asyncio.sleep(0)  # its call is sent: the next call queues behind it
        queued = asyncio.create_task(m.take(key("kept")))
        await asyncio.sleep(0)  # it queued; the pipeline goes out on the next iteration
        queued.cancel()
        assert await in_flight is None
        with pytest.raises(asyncio.CancelledError):
            await queued
        await _batcher(m).drain()
        kept = await m.take(key("kept"))  # the cancelled take never reached Redis
        assert kept is not None and kept.request_id == "kept"
    finally:
        await m.close()


async def test_unconfirmed_batched_writes_fail_each_caller(redis: RedisServer) -> None:
    # A lone server has no replica to confirm anything: every write, alone or in a pipeline
    # ended by one WAIT, is reported unconfirmed to its own caller.
    m = RedisMap.from_url(redis.url, timeout=SLOW_OK, sweep=False, wait_replicas=1)
    try:
        results = await asyncio.gather(
            *(m.put(key(f"w{i}"), make_entry(), ttl=60) for i in range(8)),
            return_exceptions=True,
        )
        assert _batcher(m).pipelines_sent >= 1
        assert all(isinstance(r, MapUnavailableError) for r in results), results
        assert all("not confirmed" in str(r) for r in results), results
    finally:
        await m.close()


async def test_redis_stopped_under_a_pipeline_fails_every_caller_fast(redis: RedisServer) -> None:
    m = open_map(redis.url)  # the 50 ms default timeout
    assert isinstance(m, RedisMap)
    assert redis.process is not None and redis.process.proc is not None
    pid = redis.process.proc.pid
    try:
        await m.put(key("c"), make_entry(), ttl=60)
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            results = await asyncio.gather(
                *(m.put(key(f"p{i}"), make_entry(), ttl=60) for i in range(20)),
                return_exceptions=True,
            )
            elapsed = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert all(isinstance(r, MapUnavailableError) for r in results), results
        assert elapsed < FAIL_FAST_BOUND
        await _batcher(m).drain()
        # Redis is back: the map answers, batched calls included.
        m_ok = await asyncio.gather(*(m.take(key("c")) for _ in range(4)))
        assert sum(e is not None for e in m_ok) == 1
    finally:
        await m.close()
