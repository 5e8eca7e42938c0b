"""Admin changes of one engine are linearizable, and a removed engine leaves `/metrics`.

Adds and removes of the same engine sent at once, over and over, to a two-worker proxy on the
Redis fleet record: every call gets the answer of its own change (201 for an add, 200 or 404
for a remove), never a 500, and afterwards every worker agrees with the record. An engine that
leaves the fleet takes its `kvrelay_backend_healthy` series with it, with one worker or several.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import httpx
from redis import Redis

from kvrelay.devtools import CONNECTOR_SECRET, EngineFactory, ProxyFactory, ProxyServer
from kvrelay.proxy.config import load_settings
from kvrelay.proxy.fleet import name_key
from kvrelay.proxy.fleet.engine_names import engine_name
from tests.harness import RedisServer, wait_until

ADMIN_KEY = "race-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
METRICS_KEY = "race-metrics-key"
ROUNDS = 30
CALLS = 24  # new connections per check: both workers answer some (see test_fleet_sync)


async def _storm(base: str, url: str) -> Counter[tuple[str, int]]:
    seen: Counter[tuple[str, int]] = Counter()
    body = {"role": "decode", "url": url}
    async with httpx.AsyncClient(base_url=base, headers=ADMIN, timeout=30) as client:

        async def call(method: str) -> tuple[str, int]:
            resp = await client.request(method, "/admin/backends", content=json.dumps(body),
                                        headers={"Content-Type": "application/json"})  # fmt: skip
            return method, resp.status_code

        for _ in range(ROUNDS):
            seen.update(await asyncio.gather(*(call(m) for m in ["DELETE", "POST"] * 4)))
    return seen


def _views(proxy: ProxyServer) -> list[set[str]]:
    views = []
    for _ in range(CALLS):
        with httpx.Client(headers=ADMIN, timeout=10) as client:  # a new connection each
            listed = client.get(proxy.url + "/admin/backends").json()
        views.append({b["url"] for b in listed["decode"]})
    return views


def _record(server: RedisServer) -> dict[str, Any]:
    with Redis(host="127.0.0.1", port=server.port) as client:
        raw = client.get("{kvrelay}:fleet")
    assert isinstance(raw, bytes), raw
    record: dict[str, Any] = json.loads(raw)
    return record


# The proxies here run with the tests' connector secret, which keys the engines' names.
_NAME_KEY = name_key(load_settings({"connector_secret": CONNECTOR_SECRET}, env_file=None))


def _series(url: str) -> str:
    name = engine_name("decode", url, _NAME_KEY)
    return f'kvrelay_backend_healthy{{backend="{name}",role="decode"}}'


def _health_series(proxy: ProxyServer) -> dict[str, float]:
    return {k: v for k, v in proxy.metrics().items() if k.startswith("kvrelay_backend_healthy")}


def test_concurrent_add_and_remove_of_one_engine_never_fail(
    engine_factory: EngineFactory, redis: RedisServer, proxy_factory: ProxyFactory
) -> None:
    p0, d0, d1 = engine_factory.many(
        ("RP0", ["--role", "prefill"]), ("RD0", ["--role", "decode"]), ("RD1", ["--role", "decode"])
    )
    proxy = proxy_factory([p0], [d0], ready_path="/ready", workers="2", map_url=redis.url,
                          admin_key=ADMIN_KEY, metrics_key=METRICS_KEY)  # fmt: skip
    seen = asyncio.run(_storm(proxy.url, d1.url))
    assert set(seen) <= {("POST", 201), ("DELETE", 200), ("DELETE", 404)}, seen
    assert seen[("POST", 201)] == ROUNDS * 4, seen

    # The last word is an add: every worker has D1, as the record says.
    status, body, _ = proxy.call("POST", "/admin/backends", {"role": "decode", "url": d1.url},
                                 headers=ADMIN)  # fmt: skip
    assert status == 201 and body["url"] == d1.url, body
    both = {d0.url, d1.url}
    wait_until(lambda: all(v == both for v in _views(proxy)), 15, interval=0.1,
               what="both workers with D1")  # fmt: skip
    record = _record(redis)
    assert set(record["decode"]) == both, record
    d1_series = _series(d1.url)
    wait_until(lambda: _health_series(proxy).get(d1_series) == 1.0, 15,
               what="D1's health series at 1")  # fmt: skip

    # Then a remove: D1 leaves every worker, the record, and /metrics.
    status, body, _ = proxy.call("DELETE", "/admin/backends", {"role": "decode", "url": d1.url},
                                 headers=ADMIN)  # fmt: skip
    assert status == 200, body
    wait_until(lambda: all(v == {d0.url} for v in _views(proxy)), 15, interval=0.1,
               what="D1 gone from both workers")  # fmt: skip
    record = _record(redis)
    assert set(record["decode"]) == {d0.url}, record
    wait_until(lambda: d1_series not in _health_series(proxy), 15,
               what="D1's health series gone from /metrics")  # fmt: skip
    assert _health_series(proxy), "the remaining engines keep their series"


def test_a_removed_engine_leaves_metrics_in_one_process(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    p0, d0, d1 = engine_factory.many(
        ("MP0", ["--role", "prefill"]), ("MD0", ["--role", "decode"]), ("MD1", ["--role", "decode"])
    )
    proxy = proxy_factory([p0], [d0, d1], ready_path="/ready", admin_key=ADMIN_KEY)
    series = _series(d1.url)
    assert _health_series(proxy)[series] == 1.0
    status, body, _ = proxy.call("DELETE", "/admin/backends", {"role": "decode", "url": d1.url},
                                 headers=ADMIN)  # fmt: skip
    assert status == 200, body
    assert series not in _health_series(proxy)
    status, body, _ = proxy.call("POST", "/admin/backends", {"role": "decode", "url": d1.url},
                                 headers=ADMIN)  # fmt: skip
    assert status == 201, body
    assert _health_series(proxy)[series] == 1.0  # back with the engine
