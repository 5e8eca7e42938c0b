"""Small helpers for the kvcache_map suite: sample entries, a recording `on_evict`, and an
async bounded wait (conditions, never sleeps, decide when a test moves on)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from kvrelay.kvcache_map import ConversationKey, EvictionReason, KVEntry, KVMap, MemoryMap, RedisMap


def make_entry(**overrides: Any) -> KVEntry:
    fields: dict[str, Any] = {
        "engine_id": "decode-0",
        "host": "127.0.0.1",
        "port": 7601,
        "url": "http://127.0.0.1:8201",
        "request_id": "req-1",
        "block_ids": [[3, 4, 5]],
        "num_tokens": 40,
        "block_hashes": ["0123456789abcdef", "fedcba9876543210"],
        "fingerprint": "fp-abc",
        "expires_at": time.time() + 480.0,
        "release_token": "tok-1",
        "tp_size": 1,
    }
    fields.update(overrides)
    return KVEntry(**fields)


def key(conversation: str, tenant: str = "tenant-a") -> ConversationKey:
    return ConversationKey(tenant=tenant, conversation_id=conversation)


class Recorder:
    """An `on_evict` callback that records what it was told."""

    def __init__(self) -> None:
        self.events: list[tuple[ConversationKey, KVEntry, EvictionReason]] = []
        self.fail = False  # raise after recording, as a failing release would

    async def __call__(self, key: ConversationKey, entry: KVEntry, reason: EvictionReason) -> None:
        self.events.append((key, entry, reason))
        if self.fail:
            raise RuntimeError("release failed")

    def reasons(self) -> Counter[EvictionReason]:
        return Counter(reason for _, _, reason in self.events)

    def keys(self, reason: EvictionReason | None = None) -> Counter[ConversationKey]:
        return Counter(k for k, _, r in self.events if reason is None or r is reason)


async def eventually(
    condition: Callable[[], Awaitable[bool] | bool],
    within: float = 10.0,
    what: str = "condition",
) -> None:
    """Re-check `condition` (sync or async) until true; TimeoutError after `within` s."""
    deadline = time.monotonic() + within
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {within:.1f}s waiting for {what}")
        await asyncio.sleep(0.01)


async def drain(m: KVMap) -> None:
    """Wait for the `on_evict` callbacks the map has started (both backends offer `drain`)."""
    assert isinstance(m, MemoryMap | RedisMap)
    await m.drain()
