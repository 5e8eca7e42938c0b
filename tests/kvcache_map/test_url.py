"""`open_map`: URL schemes, query options, keyword overrides, and errors that keep secrets."""

from __future__ import annotations

import pytest

from kvrelay.kvcache_map import KVMap, MemoryMap, RedisMap, open_map
from tests.harness import RedisServer
from tests.kvcache_map.helpers import key, make_entry


async def test_memory_url_options() -> None:
    m = open_map("memory://?max_entries=7&sweep_interval_ms=250")
    try:
        assert isinstance(m, MemoryMap) and isinstance(m, KVMap)
        assert m.max_entries == 7 and m.sweep_interval == 0.25
    finally:
        await m.close()
    plain = open_map("memory://")
    assert isinstance(plain, MemoryMap)
    await plain.close()
    override = open_map("memory://?max_entries=7", max_entries=9)
    assert isinstance(override, MemoryMap) and override.max_entries == 9
    await override.close()


async def test_redis_url_options(redis: RedisServer) -> None:
    m = open_map(
        f"{redis.url}?prefix=app.one&timeout_ms=80&sweep_interval_ms=300&shadow_grace_s=5"
        "&max_connections=4&sweep_batch=10&sweep=false"
    )
    try:
        assert isinstance(m, RedisMap)
        assert m.prefix == "app.one" and m.timeout == 0.08 and m.sweep_interval == 0.3
        entry = make_entry()
        await m.put(key("c"), entry, ttl=60)
        assert await m.take(key("c")) == entry
    finally:
        await m.close()
    default = open_map(redis.url)
    assert isinstance(default, RedisMap)
    assert default.prefix == "kvrelay" and default.timeout == 0.1
    await default.close()


async def test_rediss_scheme_accepted() -> None:
    # Nothing connects until the first operation, so this only checks the URL is understood.
    m = open_map("rediss://:pw@example.invalid:6380/2?timeout_ms=20")
    assert isinstance(m, RedisMap)
    await m.close()


@pytest.mark.parametrize(
    "url",
    [
        "memory://?max_entries=0",
        "memory://?max_entries=ten",
        "memory://?colour=blue",
        "redis://127.0.0.1:1/0?prefx=x",
        "redis://127.0.0.1:1/0?prefix=bad prefix",
        "redis://127.0.0.1:1/0?timeout_ms=0",
        "redis://127.0.0.1:1/0?sweep=maybe",
        "postgres://h/db",
        "",
    ],
)
def test_bad_urls_rejected(url: str) -> None:
    with pytest.raises(ValueError):
        open_map(url)


def test_errors_do_not_echo_the_password() -> None:
    with pytest.raises(ValueError) as info:
        open_map("redis://:hunter2@127.0.0.1:1/0?nope=1")
    assert "hunter2" not in str(info.value)
    with pytest.raises(ValueError) as info:
        open_map("redis://:hunter2@127.0.0.1:1/0?timeout_ms=x")
    assert "hunter2" not in str(info.value)
