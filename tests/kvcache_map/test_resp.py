"""The Redis map's lean client (`_resp.RespConnection`) on a real redis-server: RESP parsing
split at every byte, one connection shared by concurrent callers, replies kept in order when
callers give up, Redis paused, killed and restarted, and the map on uvloop (the proxy's
loop)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from kvrelay.kvcache_map import RedisMap, open_map
from kvrelay.kvcache_map._resp import RedisAddress, RespConnection, _Incomplete, pack, parse
from tests.harness import RedisServer, redis_server
from tests.kvcache_map.helpers import key, make_entry

SHORT = 0.2  # how long a caller waits on a paused Redis


def conn_to(server: RedisServer, stale_after: float = 30.0) -> RespConnection:
    address = RedisAddress("127.0.0.1", server.port, password=server.password, connect_timeout=2.0)
    return RespConnection(address, stale_after=stale_after)


@pytest.fixture
async def conn(redis: RedisServer) -> AsyncIterator[RespConnection]:
    c = conn_to(redis)
    try:
        yield c
    finally:
        c.close()


def test_pack_is_a_resp_array_of_bulk_strings() -> None:
    assert pack(("SET", "k", b"v\r\n", 12)) == (
        b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nv\r\n\r\n$2\r\n12\r\n"
    )


def test_parse_replies_whole_and_split_at_every_byte() -> None:
    replies = (
        b"$5\r\nhello\r\n"
        b"$-1\r\n"
        b":42\r\n"
        b"+OK\r\n"
        b"*3\r\n$7\r\nexpired\r\n*2\r\n:1\r\n$0\r\n\r\n$-1\r\n"
        b"*-1\r\n"
        b"-NOSCRIPT No matching script\r\n"
        b"-WRONGTYPE Operation against a key\r\n"
        b"$4\r\na\r\nb\r\n"  # a bulk string holding CRLF
    )
    expected = [b"hello", None, 42, b"OK", [b"expired", [1, b""], None], None]
    values = []
    pos = 0
    while pos < len(replies):
        got = parse(replies, pos)
        assert not isinstance(got, _Incomplete)
        value, pos = got
        values.append(value)
    assert values[:6] == expected
    assert isinstance(values[6], NoScriptError)
    assert type(values[7]) is ResponseError and str(values[7]).startswith("WRONGTYPE")
    assert values[8] == b"a\r\nb"
    # Every proper prefix that ends inside a reply is incomplete, never a wrong value.
    ends = []
    pos = 0
    while pos < len(replies):
        got = parse(replies, pos)
        assert not isinstance(got, _Incomplete)
        pos = got[1]
        ends.append(pos)
    start = 0
    for end in ends:
        for cut in range(start + 1, end):
            assert isinstance(parse(replies[:cut], start), _Incomplete), cut
        start = end


async def test_concurrent_callers_share_one_connection_and_get_their_own_replies(
    conn: RespConnection, redis: RedisServer
) -> None:
    replies = await asyncio.gather(*(conn.call("ECHO", f"m{i}") for i in range(500)))
    assert replies == [f"m{i}".encode() for i in range(500)]
    clients = await conn.call("CLIENT", "LIST")
    assert clients.count(b"cmd=client") == 1  # one connection carried all of them


async def test_error_replies_reach_their_caller_only(conn: RespConnection) -> None:
    await conn.call("SET", "a-string", "x")
    results = await asyncio.gather(
        conn.call("ECHO", "before"),
        conn.call("LPUSH", "a-string", "y"),
        conn.call("EVALSHA", "0" * 40, 0),
        conn.call("ECHO", "after"),
        return_exceptions=True,
    )
    assert results[0] == b"before" and results[3] == b"after"
    assert isinstance(results[1], ResponseError) and "WRONGTYPE" in str(results[1])
    assert isinstance(results[2], NoScriptError)


async def test_callers_that_gave_up_do_not_shift_the_replies(
    conn: RespConnection, redis: RedisServer
) -> None:
    assert await conn.call("ECHO", "warm") == b"warm"
    assert redis.process is not None and redis.process.proc is not None
    pid = redis.process.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        for i in range(5):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(SHORT):
                    await conn.call("ECHO", f"late-{i}")
    finally:
        os.kill(pid, signal.SIGCONT)
    # The late replies arrive first on the same connection and are dropped, in order.
    assert await conn.call("ECHO", "now") == b"now"


async def test_a_connection_owing_replies_too_long_is_replaced(redis: RedisServer) -> None:
    conn = conn_to(redis, stale_after=SHORT)
    try:
        first_id = await conn.call("CLIENT", "ID")
        assert redis.process is not None and redis.process.proc is not None
        pid = redis.process.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(SHORT):
                    await conn.call("ECHO", "late")
            await asyncio.sleep(SHORT)  # the owed reply is now older than stale_after
        finally:
            os.kill(pid, signal.SIGCONT)
        second_id = await conn.call("CLIENT", "ID")
        assert second_id != first_id  # a new connection, not the one still owing a reply
    finally:
        conn.close()


async def test_killed_redis_fails_waiting_calls_and_a_restart_is_reconnected() -> None:
    with redis_server() as server:
        conn = conn_to(server)
        try:
            assert await conn.call("SET", "k", "v") == b"OK"
            assert server.process is not None and server.process.proc is not None
            pending = asyncio.ensure_future(conn.call("BLPOP", "never", 0))
            behind = asyncio.ensure_future(conn.call("ECHO", "queued behind BLPOP"))
            other = conn_to(server)
            try:
                assert b"cmd=blpop" in await other.call("CLIENT", "LIST")  # it reached Redis
            finally:
                other.close()
            server.process.proc.kill()
            with pytest.raises(RedisConnectionError) as first:
                await asyncio.wait_for(pending, 5)
            with pytest.raises(RedisConnectionError) as second:
                await asyncio.wait_for(behind, 5)
            assert first.value is not second.value  # one exception per waiting call
            with pytest.raises(RedisConnectionError):
                await conn.call("ECHO", "down")
            server.start()
            # Redis came back empty (no persistence): the next call connects again.
            assert await conn.call("GET", "k") is None
        finally:
            conn.close()


def test_the_map_on_uvloop_uses_the_lean_client(redis: RedisServer) -> None:
    async def run() -> None:
        m = open_map(f"{redis.url}?timeout_ms=2000")
        assert isinstance(m, RedisMap)
        try:
            keys = [key(f"u{i}") for i in range(64)]
            await asyncio.gather(
                *(m.put(k, make_entry(request_id=k.conversation_id), ttl=60) for k in keys)
            )
            taken = await asyncio.gather(*(m.take(k) for k in keys))
            assert [e.request_id if e else None for e in taken] == [k.conversation_id for k in keys]
            assert m._resp is not None and m._resp._proto is not None  # the lean path ran
        finally:
            await m.close()

    uvloop.run(run())


async def test_tls_and_wait_replicas_maps_stay_on_redis_py(redis: RedisServer) -> None:
    waiting = RedisMap.from_url(redis.url, wait_replicas=1, sweep=False)
    plain = RedisMap.from_url(redis.url, sweep=False)
    try:
        assert waiting._resp is None
        assert plain._resp is not None
        tls_client = aioredis.Redis.from_url(f"rediss://127.0.0.1:{redis.port}")
        assert RespConnection.for_client(tls_client, stale_after=1.0) is None
        await tls_client.aclose()
    finally:
        await waiting.close()
        await plain.close()
