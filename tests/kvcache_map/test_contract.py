"""The `KVMap` contract, run against every backend (memory, and real Redis)."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.kvcache_map import (
    MAX_CONVERSATION_ID_BYTES,
    MAX_TENANT_BYTES,
    ConversationKey,
    EvictionReason,
    InvalidKeyError,
    KeyTooLongError,
    KVMap,
)
from tests.kvcache_map.helpers import Recorder, drain, eventually, key, make_entry


async def test_put_get_take_delete_roundtrip(kvmap: KVMap, recorder: Recorder) -> None:
    entry = make_entry()
    k = key("c1")
    assert await kvmap.get(k) is None
    await kvmap.put(k, entry, ttl=60)
    assert await kvmap.get(k) == entry
    assert await kvmap.get(k) == entry  # get does not consume
    assert await kvmap.take(k) == entry
    assert await kvmap.take(k) is None
    assert await kvmap.get(k) is None

    await kvmap.put(k, entry, ttl=60)
    assert await kvmap.delete(k) == entry
    assert await kvmap.delete(k) is None
    assert await kvmap.get(k) is None

    await drain(kvmap)
    assert recorder.events == []  # taken and deleted entries are the caller's, not reported
    stats = await kvmap.stats()
    assert (stats.puts, stats.takes, stats.deletes) == (2, 1, 1)
    assert stats.hits == 3 and stats.misses == 4  # get+take lookups; delete is neither
    assert stats.entries == 0 and stats.available


async def test_tenants_and_conversations_are_separate(kvmap: KVMap) -> None:
    a = make_entry(request_id="for-a")
    b = make_entry(request_id="for-b")
    await kvmap.put(ConversationKey("t1", "conv"), a, ttl=60)
    await kvmap.put(ConversationKey("t2", "conv"), b, ttl=60)
    assert await kvmap.get(ConversationKey("t1", "conv")) == a
    assert await kvmap.get(ConversationKey("t2", "conv")) == b
    assert await kvmap.get(ConversationKey("t1", "conv2")) is None
    # Parts that would collide under naive "tenant:conversation" joining.
    await kvmap.put(ConversationKey("x:y", "z"), a, ttl=60)
    assert await kvmap.get(ConversationKey("x", "y:z")) is None


async def test_fifty_concurrent_takers_exactly_one_wins(kvmap: KVMap) -> None:
    for round_ in range(3):
        k = key(f"race-{round_}")
        entry = make_entry(request_id=f"r{round_}")
        await kvmap.put(k, entry, ttl=60)
        results = await asyncio.gather(*(kvmap.take(k) for _ in range(50)))
        winners = [r for r in results if r is not None]
        assert winners == [entry]


async def test_put_over_existing_reports_replaced(kvmap: KVMap, recorder: Recorder) -> None:
    k = key("c")
    first, second = make_entry(request_id="first"), make_entry(request_id="second")
    await kvmap.put(k, first, ttl=60)
    await kvmap.put(k, second, ttl=60)
    assert await kvmap.get(k) == second
    await drain(kvmap)
    assert recorder.events == [(k, first, EvictionReason.REPLACED)]
    assert (await kvmap.stats()).replaced == 1


async def test_ttl_expiry_is_reported_once_and_entry_gone(kvmap: KVMap, recorder: Recorder) -> None:
    short, long_ = key("short"), key("long")
    taken = key("taken")
    e_short = make_entry(request_id="short")
    # The taken entry's deadline passes before the reported one's, so a report of it would
    # arrive first. Its TTL leaves a loaded machine time to take it before it expires.
    await kvmap.put(taken, make_entry(request_id="taken"), ttl=1.0)
    assert await kvmap.take(taken) is not None
    await kvmap.put(short, e_short, ttl=1.0)
    await kvmap.put(long_, make_entry(request_id="long"), ttl=60)

    # Reported by the sweeper without anyone touching the key again.
    await eventually(lambda: len(recorder.events) >= 1, what="expiry report")
    await drain(kvmap)
    assert recorder.events == [(short, e_short, EvictionReason.EXPIRED)]
    assert await kvmap.get(short) is None
    assert await kvmap.take(short) is None
    assert await kvmap.get(long_) is not None
    stats = await kvmap.stats()
    assert stats.expired == 1 and stats.entries == 1


async def test_expired_entry_is_a_miss_before_any_sweep(kvmap: KVMap) -> None:
    k = key("c")
    await kvmap.put(k, make_entry(), ttl=0.05)

    async def gone() -> bool:
        return await kvmap.get(k) is None

    await eventually(gone, what="entry to expire")
    assert await kvmap.take(k) is None


async def test_delete_returns_entry_and_is_not_reported(kvmap: KVMap, recorder: Recorder) -> None:
    k = key("c")
    entry = make_entry()
    # A TTL that leaves a loaded machine time to delete the entry before it expires.
    await kvmap.put(k, entry, ttl=1.0)
    assert await kvmap.delete(k) == entry
    # Put another short-lived entry and wait for ITS expiry report: by then a report of the
    # deleted one would have arrived too.
    marker = key("marker")
    await kvmap.put(marker, make_entry(request_id="marker"), ttl=1.0)
    await eventually(lambda: len(recorder.events) >= 1, what="marker expiry")
    await drain(kvmap)
    assert [k_ for k_, _, _ in recorder.events] == [marker]


@pytest.mark.parametrize(
    ("tenant", "conversation"),
    [
        ("t" * (MAX_TENANT_BYTES + 1), "c"),
        ("t", "c" * (MAX_CONVERSATION_ID_BYTES + 1)),
        ("é" * (MAX_TENANT_BYTES // 2 + 1), "c"),  # short in characters, long in bytes
        ("t", "💬" * (MAX_CONVERSATION_ID_BYTES // 4 + 1)),
    ],
)
async def test_over_long_ids_raise_typed_error(
    kvmap: KVMap, tenant: str, conversation: str
) -> None:
    k = ConversationKey(tenant, conversation)
    with pytest.raises(KeyTooLongError):
        await kvmap.put(k, make_entry(), ttl=60)
    for op in (kvmap.get, kvmap.take, kvmap.delete):
        with pytest.raises(KeyTooLongError):
            await op(k)


async def test_longest_allowed_ids_work(kvmap: KVMap) -> None:
    k = ConversationKey("t" * MAX_TENANT_BYTES, "é" * (MAX_CONVERSATION_ID_BYTES // 2))
    entry = make_entry()
    await kvmap.put(k, entry, ttl=60)
    assert await kvmap.take(k) == entry


async def test_invalid_keys_and_ttls_rejected(kvmap: KVMap) -> None:
    with pytest.raises(InvalidKeyError):
        await kvmap.get(ConversationKey("t", ""))
    with pytest.raises(InvalidKeyError):
        await kvmap.get(ConversationKey("t", 5))  # type: ignore[arg-type]
    for ttl in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            await kvmap.put(key("c"), make_entry(), ttl=ttl)
    assert (await kvmap.stats()).puts == 0


async def test_failing_callback_is_counted_not_raised(kvmap: KVMap, recorder: Recorder) -> None:
    recorder.fail = True
    k = key("c")
    second = make_entry(request_id="2")
    await kvmap.put(k, make_entry(request_id="1"), ttl=60)
    await kvmap.put(k, second, ttl=60)  # REPLACED → the callback raises
    await drain(kvmap)
    assert len(recorder.events) == 1
    assert (await kvmap.stats()).callback_errors == 1
    assert await kvmap.get(k) == second
