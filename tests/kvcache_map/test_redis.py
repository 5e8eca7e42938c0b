"""`RedisMap` specifics on a real redis-server: the multi-replica expiry sweep, Redis killed,
paused and restarted, corrupt stored values, and what is left in Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from kvrelay.devtools import FaultProxy
from kvrelay.kvcache_map import (
    ConversationKey,
    EvictionReason,
    KVEntry,
    MapUnavailableError,
    RedisMap,
    UnconfirmedPutError,
    encode_key,
    open_map,
)
from tests.harness import RedisServer, redis_server, wait_until
from tests.kvcache_map.helpers import Recorder, eventually, key, make_entry

# Generous: these tests are about behaviour; the fail-fast tests use the default (100 ms).
SLOW_OK = 2.0
# A bound on "fails fast" that still holds on a heavily shared machine; the configured
# timeout is 100 ms, and without it these calls would hang for seconds or forever.
FAIL_FAST_BOUND = 1.5


@pytest.fixture
async def raw(redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A plain client to look at (and tamper with) what the map stored."""
    client = aioredis.Redis.from_url(redis.url)
    try:
        yield client
    finally:
        await client.aclose()


def not_fates(keys: list[bytes]) -> set[bytes]:
    """The keys besides the puts' fate keys (`prefix:w:<id>`, which expire on their own)."""
    return {k for k in keys if b":w:" not in k}


async def no_keys_but(raw: aioredis.Redis, *allowed: bytes) -> bool:
    return set(await raw.keys("*")) <= set(allowed)


def redis_map(server: RedisServer, recorder: Recorder | None = None, **kwargs: object) -> RedisMap:
    kwargs.setdefault("timeout", SLOW_OK)
    return RedisMap.from_url(server.url, on_evict=recorder, **kwargs)  # type: ignore[arg-type]


async def test_two_replicas_report_each_expiry_exactly_once(
    redis: RedisServer, raw: aioredis.Redis
) -> None:
    rec_a, rec_b = Recorder(), Recorder()
    a = redis_map(redis, rec_a, sweep_interval=0.01)
    b = redis_map(redis, rec_b, sweep_interval=0.01)
    try:
        # Taken and deleted first: their deadlines pass before the reported ones', and their
        # TTL leaves a loaded machine time to take them before they expire.
        taken = [key(f"taken-{i}") for i in range(10)]
        deleted = [key(f"deleted-{i}") for i in range(10)]
        for k in taken + deleted:
            await a.put(k, make_entry(request_id=k.conversation_id), ttl=1.0)
        for k in taken:
            assert await b.take(k) is not None
        for k in deleted:
            assert await a.delete(k) is not None
        expiring = [key(f"exp-{i}") for i in range(40)]
        for i, k in enumerate(expiring):
            await (a if i % 2 else b).put(k, make_entry(request_id=k.conversation_id), ttl=1.0)

        def reported() -> int:
            return len(rec_a.events) + len(rec_b.events)

        await eventually(lambda: reported() >= len(expiring), what="all expiries reported")
        # Nothing is left to report, by either replica.
        assert await a.sweep_once() == 0
        assert await b.sweep_once() == 0
        await a.drain()
        await b.drain()
        events = rec_a.events + rec_b.events
        assert sorted(k.conversation_id for k, _, _ in events) == sorted(
            k.conversation_id for k in expiring
        )
        assert all(r is EvictionReason.EXPIRED for _, _, r in events)
        assert all(e.request_id == k.conversation_id for k, e, _ in events)
        # Index, values and shadows all cleaned up (a background sweep may hold its lock); the
        # puts' fate keys expire by themselves on Redis's clock.
        assert not_fates(await raw.keys("*")) <= {b"kvrelay:sweep-lock"}
        await eventually(lambda: no_keys_but(raw, b"kvrelay:sweep-lock"), what="fates expired")
        stats_a, stats_b = await a.stats(), await b.stats()
        assert stats_a.expired + stats_b.expired == len(expiring)
        assert stats_a.entries == 0
    finally:
        await a.close()
        await b.close()


async def test_concurrent_takes_across_replicas_single_winner(redis: RedisServer) -> None:
    a, b = redis_map(redis), redis_map(redis)
    try:
        for round_ in range(5):
            k = key(f"race-{round_}")
            await a.put(k, make_entry(), ttl=60)
            results = await asyncio.gather(*((a if i % 2 else b).take(k) for i in range(50)))
            assert sum(r is not None for r in results) == 1
    finally:
        await a.close()
        await b.close()


async def test_put_over_expired_unswept_entry_reports_expired_once(
    redis: RedisServer, raw: aioredis.Redis, recorder: Recorder
) -> None:
    m = redis_map(redis, recorder, sweep=False)
    try:
        k = key("c")
        await m.put(k, make_entry(request_id="old"), ttl=0.1)
        vkey = f"kvrelay:v:{encode_key(k)}"
        await eventually(lambda: _gone(raw, vkey), what="expiry")
        await m.put(k, make_entry(request_id="new"), ttl=60)
        assert await m.sweep_once() == 0  # the old entry was already reported by put
        await m.drain()
        assert [(e.request_id, r) for _, e, r in recorder.events] == [
            ("old", EvictionReason.EXPIRED)
        ]
        got = await m.get(k)
        assert got is not None and got.request_id == "new"
    finally:
        await m.close()


async def _gone(raw: aioredis.Redis, name: str) -> bool:
    return int(await raw.exists(name)) == 0


async def test_take_of_expired_entry_leaves_it_to_the_sweep(
    redis: RedisServer, raw: aioredis.Redis, recorder: Recorder
) -> None:
    m = redis_map(redis, recorder, sweep=False)
    try:
        k = key("c")
        await m.put(k, make_entry(), ttl=0.1)
        await eventually(lambda: _gone(raw, f"kvrelay:v:{encode_key(k)}"), what="expiry")
        assert await m.take(k) is None
        assert await m.sweep_once() == 1
        await m.drain()
        assert recorder.keys(EvictionReason.EXPIRED) == {k: 1}
    finally:
        await m.close()


async def test_corrupt_values_are_counted_misses(
    redis: RedisServer, raw: aioredis.Redis, recorder: Recorder
) -> None:
    m = redis_map(redis, recorder, sweep=False)
    try:
        garbage, wrong_type = key("garbage"), key("list")
        gkey = f"kvrelay:v:{encode_key(garbage)}"
        await raw.set(gkey, b"\x00not json")
        await raw.rpush(f"kvrelay:v:{encode_key(wrong_type)}", b"x")
        assert await m.get(garbage) is None
        assert await m.get(wrong_type) is None
        assert await m.take(garbage) is None
        assert await raw.exists(gkey) == 0  # the take removed the garbage
        assert await m.delete(wrong_type) is None
        # A put over garbage works, and there is nothing sensible to report.
        await raw.set(gkey, b"{}")
        entry = make_entry()
        await m.put(garbage, entry, ttl=60)
        assert await m.get(garbage) == entry
        stats = await m.stats()
        assert stats.corrupt == 5 and stats.unavailable_errors == 0
        assert stats.misses == 3 and stats.hits == 1
        await m.drain()
        assert recorder.events == []
    finally:
        await m.close()


async def test_corrupt_shadow_is_dropped_by_the_sweep(
    redis: RedisServer, raw: aioredis.Redis, recorder: Recorder
) -> None:
    m = redis_map(redis, recorder, sweep=False)
    try:
        good, bad = key("good"), key("bad")
        # bad first: when good is due, bad (an earlier expiry) is due too.
        await m.put(bad, make_entry(), ttl=0.1)
        await m.put(good, make_entry(), ttl=0.1)
        await raw.set(f"kvrelay:s:{encode_key(bad)}", b"garbage")
        # An index member that is no encoded key, with a valid value behind it.
        await raw.set("kvrelay:s:!!", make_entry().to_bytes())
        await raw.zadd("kvrelay:idx", {"!!": 0})

        async def swept() -> bool:
            return await m.sweep_once() > 0

        await eventually(swept, what="the good entry to be swept")
        await m.drain()
        assert recorder.keys() == {good: 1}
        assert (await m.stats()).corrupt == 2
        assert not_fates(await raw.keys("*")) == set()
        # The fate keys expire with the entries' TTL on Redis's own clock, which may lag the
        # TIME the sweep compared against by a moment.
        await eventually(lambda: no_keys_but(raw), what="the puts' fate keys to expire")
    finally:
        await m.close()


async def test_prefixes_are_separate_namespaces(redis: RedisServer) -> None:
    a = redis_map(redis, prefix="one")
    b = redis_map(redis, prefix="two")
    try:
        await a.put(key("c"), make_entry(), ttl=60)
        assert await b.get(key("c")) is None
        assert await a.get(key("c")) is not None
    finally:
        await a.close()
        await b.close()


async def test_redis_killed_fails_fast_then_recovers_after_restart(redis: RedisServer) -> None:
    m = open_map(redis.url)  # default 100 ms timeout
    k = key("c")
    entry = make_entry()
    try:
        await m.put(k, entry, ttl=60)
        redis.kill()
        for attempt in (
            lambda: m.get(k),
            lambda: m.take(k),
            lambda: m.delete(k),
            lambda: m.put(k, entry, ttl=60),
        ):
            t0 = time.monotonic()
            with pytest.raises(MapUnavailableError):
                await attempt()
            assert time.monotonic() - t0 < FAIL_FAST_BOUND
        stats = await m.stats()
        assert stats.available is False and stats.entries is None
        assert stats.unavailable_errors >= 4

        redis.restart()  # same port, empty (no persistence)

        async def works() -> bool:
            try:
                await m.put(k, entry, ttl=60)
            except MapUnavailableError:
                return False
            return True

        await eventually(works, what="the map to work again")
        assert await m.take(k) == entry
        assert await m.take(k) is None
        stats = await m.stats()
        assert stats.available is True and stats.entries == 0
    finally:
        await m.close()


async def test_redis_paused_times_out_then_answers_correctly(redis: RedisServer) -> None:
    m = open_map(redis.url)  # default 100 ms timeout
    assert redis.process is not None and redis.process.proc is not None
    pid = redis.process.proc.pid
    k = key("c")
    entry = make_entry()
    try:
        await m.put(k, entry, ttl=60)
        os.kill(pid, signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            for _ in range(3):
                t0 = time.monotonic()
                with pytest.raises(MapUnavailableError):
                    await m.get(k)
                assert time.monotonic() - t0 < FAIL_FAST_BOUND
        finally:
            os.kill(pid, signal.SIGCONT)

        async def answers() -> bool:
            try:
                return await m.get(k) == entry
            except MapUnavailableError:
                return False

        await eventually(answers, what="the map to answer again")
        # Replies the paused calls never read must not be mistaken for later answers.
        other = make_entry(request_id="other")
        await m.put(key("d"), other, ttl=60)
        assert await m.take(key("d")) == other
        assert await m.take(k) == entry
    finally:
        await m.close()


async def test_paused_redis_with_a_small_pool_fails_every_caller_fast(redis: RedisServer) -> None:
    m = open_map(f"{redis.url}?max_connections=4")  # callers beyond 4 wait for the pool
    assert redis.process is not None and redis.process.proc is not None
    pid = redis.process.proc.pid
    try:
        await m.put(key("c"), make_entry(), ttl=60)
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            results = await asyncio.gather(
                *(m.get(key("c")) for _ in range(20)), return_exceptions=True
            )
            elapsed = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert all(isinstance(r, MapUnavailableError) for r in results), results
        assert elapsed < FAIL_FAST_BOUND
    finally:
        await m.close()


async def test_sweeper_survives_an_outage(recorder: Recorder) -> None:
    with redis_server() as server:
        m = redis_map(server, recorder, sweep_interval=0.01)
        try:
            await m.put(key("before"), make_entry(), ttl=60)
            server.kill()
            await eventually(lambda: not m.available, what="the sweeper to notice the outage")
            server.restart()
            await eventually(_put_works(m, key("after")), what="recovery")
            await eventually(lambda: len(recorder.events) == 1, what="sweep after recovery")
            assert recorder.keys(EvictionReason.EXPIRED) == {key("after"): 1}
        finally:
            await m.close()


def _put_works(m: RedisMap, k: ConversationKey) -> Callable[[], Awaitable[bool]]:
    async def attempt() -> bool:
        try:
            await m.put(k, make_entry(), ttl=0.05)
        except MapUnavailableError:
            return False
        return True

    return attempt


async def test_password_and_db_from_url() -> None:
    with redis_server(password="pw-1") as server:
        url = f"redis://:pw-1@127.0.0.1:{server.port}/3?timeout_ms=2000&prefix=x"
        m = open_map(url)
        bad = open_map(f"redis://:wrong@127.0.0.1:{server.port}/3")
        raw = aioredis.Redis.from_url(url.split("?")[0])
        try:
            entry = make_entry()
            await m.put(key("c"), entry, ttl=60)
            assert await m.get(key("c")) == entry
            assert await raw.exists(f"x:v:{encode_key(key('c'))}") == 1  # in db 3
            with pytest.raises(MapUnavailableError):
                await bad.get(key("c"))
        finally:
            await raw.aclose()
            await bad.close()
            await m.close()


async def test_stored_form_is_compact(redis: RedisServer, raw: aioredis.Redis) -> None:
    m = redis_map(redis)
    try:
        entry = make_entry()
        await m.put(key("c"), entry, ttl=60)
        stored = await raw.get(f"kvrelay:v:{encode_key(key('c'))}")
        assert stored == entry.to_bytes()
        assert KVEntry.from_bytes(stored) == entry
        ttl_ms = await raw.pttl(f"kvrelay:v:{encode_key(key('c'))}")
        assert 0 < ttl_ms <= 60_000  # the TTL is kept by Redis
    finally:
        await m.close()


# -- puts whose outcome is unknown --------------------------------------------------------------


async def test_a_put_that_timed_out_but_landed_settles_as_stored(redis: RedisServer) -> None:
    """Redis stores the put after the map's bound: the caller learns it was stored, so it
    keeps the blocks the entry points at; a later put of the same key is as usual."""
    relay = FaultProxy("127.0.0.1", redis.port).start()
    m = open_map(f"redis://127.0.0.1:{relay.listen_port}/0?timeout_ms=100")
    try:
        await m.put(key("warm"), make_entry(), ttl=60)  # connected, scripts loaded
        relay.set_delay(0.5)
        entry = make_entry(request_id="late")
        with pytest.raises(UnconfirmedPutError) as unconfirmed:
            await m.put(key("c"), entry, ttl=60)
        relay.heal()
        await asyncio.to_thread(wait_until, lambda: relay.counters.holding == 0, 10)

        async def settled() -> bool | None:
            try:
                return await unconfirmed.value.settle()
            except MapUnavailableError:
                return None

        await eventually(lambda: _is(settled, True), what="the put to settle")
        assert await unconfirmed.value.settle() is True  # idempotent
        assert await m.take(key("c")) == entry
    finally:
        await m.close()
        relay.stop()


async def test_a_put_settled_before_it_ran_stores_nothing(
    redis: RedisServer, raw: aioredis.Redis
) -> None:
    """The settle can overtake its put (another connection, a held-back packet): the put,
    when it runs, stores nothing, and the settle says so."""
    m = redis_map(redis)
    try:
        member = encode_key(key("c"))
        keys = [*m._layout.keys(member), m._layout.fate(member, "w1")]
        settle = m._unconfirmed("test", keys, 60_000)
        assert await settle.settle() is False
        args = [make_entry().to_bytes(), 60_000, 1000, member]
        result, _ = await m._write(m._put, keys, args)  # the late put
        assert result == [b"undone"]
        assert await m.get(key("c")) is None and await raw.zcard(m._layout.index(0)) == 0
        assert await settle.settle() is False
    finally:
        await m.close()


async def test_a_put_that_never_went_out_is_a_plain_failure(redis: RedisServer) -> None:
    m = open_map(redis.url)
    try:
        redis.kill()
        with pytest.raises(MapUnavailableError) as failed:
            await m.put(key("c"), make_entry(), ttl=60)
        assert not isinstance(failed.value, UnconfirmedPutError)
    finally:
        await m.close()


async def _is(probe: Callable[[], Awaitable[object]], expected: object) -> bool:
    return await probe() == expected
