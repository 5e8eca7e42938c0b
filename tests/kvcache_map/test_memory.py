"""`MemoryMap` specifics: the LRU bound, expiry on an injected clock, close() reporting."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.kvcache_map import ConversationKey, EvictionReason, MemoryMap, _memory
from tests.kvcache_map.helpers import Recorder, key, make_entry

EXPIRED = EvictionReason.EXPIRED


class Clock:
    """A manual clock, so TTL tests do not depend on the machine's speed."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_lru_bound_evicts_least_recently_used(recorder: Recorder) -> None:
    m = MemoryMap(max_entries=3, on_evict=recorder)
    try:
        entries = {name: make_entry(request_id=name) for name in "abcde"}
        for name in "abc":
            await m.put(key(name), entries[name], ttl=60)
        assert await m.get(key("a")) is not None  # a is now the most recent
        await m.put(key("d"), entries["d"], ttl=60)  # evicts b
        await m.put(key("e"), entries["e"], ttl=60)  # evicts c
        await m.drain()
        assert recorder.events == [
            (key("b"), entries["b"], EvictionReason.EVICTED),
            (key("c"), entries["c"], EvictionReason.EVICTED),
        ]
        assert len(m) == 3
        for name in "ade":
            assert await m.get(key(name)) == entries[name]
        assert (await m.stats()).evicted == 2
    finally:
        await m.close()


async def test_a_large_map_evicts_the_oldest_of_the_new_keys_shard(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `SHARD_ENTRIES` the slot table is sharded (so no table rebuild stops the loop for
    all entries at once); the LRU bound still holds exactly, and the entry evicted is the
    oldest of the shard the new key went into, never the new key itself."""
    monkeypatch.setattr(_memory, "SHARD_ENTRIES", 4)
    m = MemoryMap(max_entries=16, on_evict=recorder)
    slots = m._data
    try:
        assert len(slots._shards) == 4
        names = [f"k{i}" for i in range(40)]
        order: list[ConversationKey] = []
        for name in names:
            await m.put(key(name), make_entry(request_id=name), ttl=60)
            order.append(key(name))
            assert len(m) == min(len(order), 16)
        await m.drain()
        evicted = [k for k, _, reason in recorder.events if reason is EvictionReason.EVICTED]
        assert len(evicted) == 40 - 16
        live = [k for k in order if k not in evicted]
        assert len(live) == 16 and order[-1] in live
        for k in live:
            assert await m.get(k) is not None
        # Each eviction took the oldest of some shard: within a shard, every evicted key was
        # put before every live one.
        for shard in slots._shards:
            shard_keys = [k for k in order if slots._shard(k) is shard]
            gone = [k for k in shard_keys if k in evicted]
            assert shard_keys[: len(gone)] == gone
    finally:
        await m.close()


def test_shard_count_follows_max_entries() -> None:
    assert len(MemoryMap(max_entries=_memory.SHARD_ENTRIES)._data._shards) == 1
    big = MemoryMap(max_entries=1_000_000)._data._shards
    assert len(big) == -(-1_000_000 // _memory.SHARD_ENTRIES)


async def test_ttl_on_manual_clock(recorder: Recorder) -> None:
    clock = Clock()
    m = MemoryMap(on_evict=recorder, clock=clock, sweep_interval=3600)
    try:
        await m.put(key("a"), make_entry(request_id="a"), ttl=10)
        await m.put(key("b"), make_entry(request_id="b"), ttl=20)
        clock.now += 9.999
        assert m.sweep_once() == 0
        assert await m.get(key("a")) is not None
        clock.now += 0.001
        assert await m.get(key("a")) is None  # expired on access, reported once
        assert m.sweep_once() == 0
        clock.now += 10
        assert m.sweep_once() == 1
        await m.drain()
        assert [(k, r) for k, _, r in recorder.events] == [
            (key("a"), EvictionReason.EXPIRED),
            (key("b"), EvictionReason.EXPIRED),
        ]
    finally:
        await m.close()


async def test_put_over_expired_reports_expired_not_replaced(recorder: Recorder) -> None:
    clock = Clock()
    m = MemoryMap(on_evict=recorder, clock=clock, sweep_interval=3600)
    try:
        await m.put(key("a"), make_entry(request_id="old"), ttl=1)
        clock.now += 2
        await m.put(key("a"), make_entry(request_id="new"), ttl=1)
        assert m.sweep_once() == 0  # the new entry is not due, the old one is gone
        await m.drain()
        assert [(e.request_id, r) for _, e, r in recorder.events] == [
            ("old", EvictionReason.EXPIRED)
        ]
    finally:
        await m.close()


def scheduled(m: MemoryMap) -> list[ConversationKey]:
    """Every key the map's expiry index lists, once per listing."""
    return [k for keys in m._buckets.values() for k in keys]


async def test_many_replacements_keep_expiry_index_exact(recorder: Recorder) -> None:
    clock = Clock()
    m = MemoryMap(on_evict=recorder, clock=clock, sweep_interval=3600)
    try:
        for i in range(5000):
            await m.put(key(f"c{i % 10}"), make_entry(request_id=f"r{i}"), ttl=5 + i % 3)
        assert sorted(scheduled(m), key=str) == sorted((key(f"c{i}") for i in range(10)), key=str)
        clock.now += 100
        assert m.sweep_once() == 10
        assert len(m) == 0
        await m.drain()
        assert recorder.reasons() == {EvictionReason.REPLACED: 4990, EvictionReason.EXPIRED: 10}
    finally:
        await m.close()


async def test_put_take_pairs_leave_nothing_in_the_expiry_index(recorder: Recorder) -> None:
    # A taken entry must leave no trace to clean up later: its cost would grow with the map.
    clock = Clock()
    m = MemoryMap(on_evict=recorder, clock=clock, sweep_interval=0.5)
    try:
        kept = make_entry(request_id="kept")
        await m.put(key("kept"), kept, ttl=30)
        for i in range(3000):
            clock.now += 0.01  # the pairs' deadlines move across 60 buckets
            await m.put(key("pair"), make_entry(request_id=f"p{i}"), ttl=10)
            assert await m.take(key("pair")) is not None
        assert scheduled(m) == [key("kept")]
        clock.now += 100
        m.sweep_once()
        await m.drain()
        assert recorder.events == [(key("kept"), kept, EXPIRED)]
        assert m._buckets == {} and m._due == []
    finally:
        await m.close()


async def test_sweep_reports_exactly_the_due_entries_across_buckets(recorder: Recorder) -> None:
    clock = Clock()
    m = MemoryMap(on_evict=recorder, clock=clock, sweep_interval=1.0)
    try:
        ttls = [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.25, 3.0, 7.5]
        for t in ttls:
            await m.put(key(f"t{t}"), make_entry(request_id=f"t{t}"), ttl=t)
        start = clock.now
        # Step through bucket edges and inside buckets; deadlines exactly at `now` are due.
        for elapsed in (0.1, 0.25, 0.6, 1.0, 1.2, 2.0, 2.9, 3.0, 7.0, 8.0):
            clock.now = start + elapsed
            m.sweep_once()
            await m.drain()
            reported = {k for k, _, _ in recorder.events}
            assert reported == {key(f"t{t}") for t in ttls if t <= elapsed}, elapsed
            assert len(m) == sum(1 for t in ttls if t > elapsed)
            assert sorted(scheduled(m), key=str) == sorted(
                (key(f"t{t}") for t in ttls if t > elapsed), key=str
            )
        assert recorder.reasons() == {EXPIRED: len(ttls)}
    finally:
        await m.close()


async def test_close_reports_what_is_left_as_deleted(recorder: Recorder) -> None:
    m = MemoryMap(on_evict=recorder)
    await m.put(key("a"), make_entry(), ttl=60)
    await m.put(key("b"), make_entry(), ttl=60)
    taken = key("t")
    await m.put(taken, make_entry(), ttl=60)
    assert await m.take(taken) is not None
    await m.close()
    assert recorder.keys(EvictionReason.DELETED) == {key("a"): 1, key("b"): 1}
    assert len(recorder.events) == 2
    with pytest.raises(RuntimeError, match="closed"):
        await m.get(key("a"))


async def test_close_without_reporting(recorder: Recorder) -> None:
    m = MemoryMap(on_evict=recorder, report_on_close=False)
    await m.put(key("a"), make_entry(), ttl=60)
    await m.close()
    assert recorder.events == []


def test_bad_options_rejected() -> None:
    for bad in (0, -1, True):
        with pytest.raises(ValueError):
            MemoryMap(max_entries=bad)
    with pytest.raises(ValueError):
        MemoryMap(sweep_interval=0)


async def test_put_requires_an_entry() -> None:
    m = MemoryMap()
    try:
        with pytest.raises(TypeError):
            await m.put(key("a"), {"engine_id": "x"}, ttl=1)  # type: ignore[arg-type]
    finally:
        await m.close()


async def test_close_does_not_hang_on_a_stuck_callback() -> None:
    started = asyncio.Event()

    async def stuck(*_: object) -> None:
        started.set()
        await asyncio.Event().wait()  # a release that never returns

    m = MemoryMap(on_evict=stuck, close_timeout=0.2)
    await m.put(key("a"), make_entry(), ttl=60)
    await m.put(key("a"), make_entry(request_id="2"), ttl=60)  # REPLACED → stuck callback
    await asyncio.wait_for(started.wait(), 10)
    await asyncio.wait_for(m.close(), 10)
    stats = await m.stats()
    assert stats.callback_errors == 2  # the replaced one and the one dropped at close


async def test_in_process_map_operations_never_wait() -> None:
    # The proxy stores a non-streamed turn inline when `in_process` (proxy `turn/answer.py`):
    # that is safe only while put and take complete without suspending, where no cancellation
    # can land.
    m = MemoryMap(max_entries=2)
    assert m.in_process
    for _ in range(3):  # the third put evicts
        put = m.put(key("t", f"c{_}"), make_entry(), 60.0)
        with pytest.raises(StopIteration):
            put.send(None)
    take = m.take(key("t", "c2"))
    with pytest.raises(StopIteration) as done:
        take.send(None)
    assert done.value.value is not None
    await m.close()
