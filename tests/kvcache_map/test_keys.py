"""Key encoding: injective, reversible, and only safe characters ever reach Redis."""

from __future__ import annotations

import re

import pytest
import redis.asyncio as aioredis
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvrelay.kvcache_map import (
    MAX_CONVERSATION_ID_BYTES,
    MAX_TENANT_BYTES,
    ConversationKey,
    InvalidKeyError,
    KeyTooLongError,
    RedisMap,
    decode_key,
    encode_key,
)
from tests.harness import RedisServer
from tests.kvcache_map.helpers import make_entry

SAFE = re.compile(r"[A-Za-z0-9_-]*\.[A-Za-z0-9_-]+")

# Any code point, lone surrogates and control characters included.
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=60)
tenants = any_text
conversations = any_text.filter(bool)
nasty = st.sampled_from(
    ["", ".", "..", ":", "*", "?", "[a]", "{tag}", "\r\n", "\x00", " ", "a.b", "=", "\ud800", "é"]
)


@settings(deadline=None)
@given(tenants, conversations)
def test_encoding_is_safe_and_reversible(tenant: str, conversation: str) -> None:
    k = ConversationKey(tenant, conversation)
    encoded = encode_key(k)
    assert SAFE.fullmatch(encoded)
    assert decode_key(encoded) == k  # a left inverse: distinct keys never share an encoding


@settings(deadline=None)
@given(
    st.lists(nasty, max_size=4).map("".join),
    st.lists(nasty, min_size=1, max_size=4).map("".join).filter(bool),
    st.lists(nasty, max_size=4).map("".join),
    st.lists(nasty, min_size=1, max_size=4).map("".join).filter(bool),
)
def test_distinct_keys_never_collide(t1: str, c1: str, t2: str, c2: str) -> None:
    assume((t1, c1) != (t2, c2))
    assert encode_key(ConversationKey(t1, c1)) != encode_key(ConversationKey(t2, c2))


@settings(deadline=None)
@given(tenants, conversations)
def test_raw_user_text_never_appears_in_the_key(tenant: str, conversation: str) -> None:
    encoded = encode_key(ConversationKey(tenant, conversation))
    for part in (tenant, conversation):
        unsafe = [ch for ch in part if not re.fullmatch(r"[A-Za-z0-9_.-]", ch)]
        for ch in unsafe:
            assert ch not in encoded


def test_limits_are_in_bytes() -> None:
    encode_key(ConversationKey("t" * MAX_TENANT_BYTES, "c" * MAX_CONVERSATION_ID_BYTES))
    with pytest.raises(KeyTooLongError):
        encode_key(ConversationKey("ü" * (MAX_TENANT_BYTES // 2 + 1), "c"))
    with pytest.raises(KeyTooLongError, match="conversation id"):
        encode_key(ConversationKey("t", "c" * (MAX_CONVERSATION_ID_BYTES + 1)))
    assert issubclass(KeyTooLongError, ValueError)


def test_error_message_does_not_echo_the_id() -> None:
    secret = "s3cr3t-" * 100
    with pytest.raises(KeyTooLongError) as info:
        encode_key(ConversationKey(secret, "c"))
    assert "s3cr3t" not in str(info.value)


@pytest.mark.parametrize("text", ["", "abc", "a.b.c", "!!!.abc", "YQ.@@"])
def test_decode_rejects_foreign_text(text: str) -> None:
    with pytest.raises(InvalidKeyError):
        decode_key(text)


async def test_nasty_ids_in_real_redis_stay_apart_and_escaped(redis: RedisServer) -> None:
    ids = ["plain", "a:b", "a*", "{x}", "x\r\nSET evil 1\r\n", "\x00", "..", "é", "\ud800"]
    m = RedisMap.from_url(redis.url, timeout=2.0, prefix="app", sweep=False)
    raw = aioredis.Redis.from_url(redis.url)
    try:
        for tenant in ("t", "t:a"):
            for i, conv in enumerate(ids):
                await m.put(ConversationKey(tenant, conv), make_entry(request_id=f"{i}"), ttl=60)
        for tenant in ("t", "t:a"):
            for i, conv in enumerate(ids):
                got = await m.get(ConversationKey(tenant, conv))
                assert got is not None and got.request_id == f"{i}"
        keys = sorted(k.decode() for k in await raw.keys("*"))
        # value, shadow and the put's fate per entry, one index
        assert len(keys) == 2 * 3 * len(ids) + 1
        assert all(re.fullmatch(r"app:(idx|[vs]:[A-Za-z0-9_.-]+|w:[0-9a-f]{16})", k) for k in keys)
        assert await raw.exists("evil") == 0
    finally:
        await raw.aclose()
        await m.close()
