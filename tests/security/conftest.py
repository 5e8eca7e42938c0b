"""One secured fleet for the whole security suite: P + D enginesim, Redis and a proxy (Redis
map) with two tenant keys and an admin key, everything logging at INFO so the log tests see
the chattiest output.

Package-scoped to keep the suite fast (engines start once); tests that need a clean state
wait for the pools to go idle themselves. `/metrics` needs the fleet's metrics key and
request bodies must arrive within `BODY_READ_TIMEOUT_S`. Built from the shared `EngineFactory` and
`ProxyFactory` (kvrelay/devtools/engines.py, kvrelay/devtools/proxy_server.py), not copied set-up.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvrelay.devtools import EngineFactory, EngineSim, ProxyFactory, ProxyServer
from kvrelay.kvcache_map import ConversationKey, KVEntry, open_map
from kvrelay.proxy.turn import tenant_of
from tests.harness import RedisServer


@dataclass
class SecureFleet:
    prefill: EngineSim
    decode: EngineSim
    proxy: ProxyServer
    key_a: str
    key_b: str
    admin_key: str
    redis: RedisServer
    metrics_key: str

    def auth(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    @property
    def a(self) -> dict[str, str]:
        return self.auth(self.key_a)

    @property
    def b(self) -> dict[str, str]:
        return self.auth(self.key_b)

    def wait_clean(self, timeout: float = 20.0) -> None:
        self.prefill.wait_idle(timeout)
        self.decode.wait_idle(timeout)

    def entry(self, key: str, conversation_id: str) -> KVEntry | None:
        """The proxy's stored entry of a tenant's conversation, read from the Redis map (how a
        test learns a hold's request id and release token without trusting the proxy)."""

        async def read() -> KVEntry | None:
            kvmap = open_map(self.redis.url)
            try:
                return await kvmap.get(ConversationKey(tenant_of(key), conversation_id))
            finally:
                await kvmap.close()

        return asyncio.run(read())

    def logs(self) -> dict[str, str]:
        """The full log of every process so far (not only the tail `output()` keeps)."""
        out = {}
        for name, server in (("proxy", self.proxy.process), ("prefill", self.prefill.process),
                             ("decode", self.decode.process)):  # fmt: skip
            assert server is not None and server.log_path is not None
            out[name] = Path(server.log_path).read_text(errors="replace")
        return out


# Short, so the slow-body test is quick; far above what a loopback client needs.
BODY_READ_TIMEOUT_S = 3.0


@pytest.fixture(scope="package")
def secure_fleet() -> Iterator[SecureFleet]:
    engines, proxies, redis = EngineFactory(), ProxyFactory(), RedisServer()
    try:
        redis.start()
        prefill = engines("SP", "--role", "prefill", "--log-level", "INFO", "--lease-seconds", "30")
        decode = engines("SD", "--role", "decode", "--log-level", "INFO", "--lease-seconds", "30")
        key_a, key_b = "sk-a-" + secrets.token_hex(12), "sk-b-" + secrets.token_hex(12)
        admin_key = "adm-" + secrets.token_hex(12)
        metrics_key = "met-" + secrets.token_hex(12)
        proxy = proxies(
            [prefill], [decode], ready_path="/ready",
            api_keys=f"{key_a},{key_b}", admin_key=admin_key, log_level="INFO",
            map_url=redis.url, metrics_key=metrics_key,
            body_read_timeout_s=str(BODY_READ_TIMEOUT_S),
        )  # fmt: skip
        yield SecureFleet(prefill, decode, proxy, key_a, key_b, admin_key, redis, metrics_key)
    finally:
        proxies.close()
        engines.close()
        redis.stop()
