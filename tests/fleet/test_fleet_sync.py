"""Admin changes reach every worker of a proxy and every proxy on the same Redis, and a proxy
that starts later reads the current fleet (the versioned fleet record + pub/sub)."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.devtools import EngineFactory, ProxyFactory, ProxyServer
from tests.harness import RedisServer, wait_until

ADMIN_KEY = "fleet-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# Each call is a new connection, so the kernel spreads them over the workers: 24 answers
# that all agree cover both workers of a two-worker proxy (a miss is 2^-23 likely).
CALLS = 24


def _decode_views(proxy: ProxyServer) -> list[dict[str, Any]]:
    views = []
    for _ in range(CALLS):
        status, body, _ = proxy.call("GET", "/admin/backends", headers=ADMIN)
        assert status == 200, body
        views.append({b["url"]: b["draining"] for b in body["decode"]})
    return views


def _everyone_sees(proxies: list[ProxyServer], expected: dict[str, bool]) -> bool:
    return all(view == expected for p in proxies for view in _decode_views(p))


def test_admin_changes_reach_every_worker_and_replica(
    engine_factory: EngineFactory, redis: RedisServer, proxy_factory: ProxyFactory
) -> None:
    p0, d0, d1 = engine_factory.many(
        ("P0", ["--role", "prefill"]), ("D0", ["--role", "decode"]), ("D1", ["--role", "decode"])
    )
    # A long poll interval: changes must arrive by pub/sub, not by the safety-net poll.
    common = {"map_url": redis.url, "admin_key": ADMIN_KEY, "fleet_sync_interval_s": "60"}
    a = proxy_factory([p0], [d0], ready_path="/ready", workers="2", **common)
    b = proxy_factory([p0], [d0], ready_path="/ready", **common)
    both = [a, b]
    assert _everyone_sees(both, {d0.url: False})

    status, body, _ = a.call("POST", "/admin/backends", {"role": "decode", "url": d1.url},
                             headers=ADMIN)  # fmt: skip
    assert status == 201, body
    wait_until(lambda: _everyone_sees(both, {d0.url: False, d1.url: False}), 15,
               interval=0.1, what="D1 in every worker of both proxies")  # fmt: skip

    # A proxy that starts now, configured with the old static list, gets the current fleet.
    c = proxy_factory([p0], [d0], ready_path="/ready", **common)
    assert _everyone_sees([c], {d0.url: False, d1.url: False})

    status, body, _ = b.call("POST", "/admin/backends/drain", {"role": "decode", "url": d0.url},
                             headers=ADMIN)  # fmt: skip
    assert status == 200 and body["draining"] is True, body
    wait_until(lambda: _everyone_sees([a, b, c], {d0.url: True, d1.url: False}), 15,
               interval=0.1, what="D0 draining everywhere")  # fmt: skip
    # Requests now go to D1 whichever worker or proxy takes them.
    d0_before = d0.metric("enginesim_requests_total")
    d1_before = d1.metric("enginesim_requests_total")
    for proxy in (a, a, a, b, c):
        status, _, _ = proxy.call(
            "POST", "/v1/completions", {"model": "kvrelay-sim", "prompt": "hi", "max_tokens": 2}
        )
        assert status == 200
    assert d0.metric("enginesim_requests_total") == d0_before
    assert d1.metric("enginesim_requests_total") == d1_before + 5

    status, body, _ = c.call("DELETE", "/admin/backends", {"role": "decode", "url": d1.url},
                             headers=ADMIN)  # fmt: skip
    assert status == 200, body
    wait_until(lambda: _everyone_sees([a, b, c], {d0.url: True}), 15, interval=0.1,
               what="D1 gone everywhere")  # fmt: skip
    status, body, _ = a.call("POST", "/admin/backends", {"role": "decode", "url": d0.url},
                             headers=ADMIN)  # fmt: skip
    assert status == 201, body  # adding a draining engine again puts it back in service
    wait_until(lambda: _everyone_sees([a, b, c], {d0.url: False}), 15, interval=0.1,
               what="D0 back in service everywhere")  # fmt: skip


async def test_fleet_record_lost_with_redis_is_restored_not_emptied(redis: RedisServer) -> None:
    """Redis restarts empty: the next change must not start from an empty fleet."""
    from kvrelay.kvcache_map import open_redis_client
    from kvrelay.proxy.fleet import Pool
    from kvrelay.proxy.fleet.fleet_sync import RedisFleetSync
    from tests.kvcache_map.helpers import eventually

    static = {"prefill": ["http://p0:8000"], "decode": ["http://d0:8000"]}
    pools = [{"prefill": Pool("prefill", 3, 2), "decode": Pool("decode", 3, 2)} for _ in "ab"]
    syncs = []
    for p in pools:
        client, prefix, _ = open_redis_client(redis.url)
        sync = RedisFleetSync(client, prefix, p, static, interval=0.1, pubsub=True)
        await sync.start()
        syncs.append(sync)
    try:
        assert await syncs[0].apply(
            {"op": "add", "role": "decode", "url": "http://d1:8000", "source": "admin"}
        )

        def decode_sets() -> list[set[str]]:
            return [set(p["decode"].backends) for p in pools]

        both = {"http://d0:8000", "http://d1:8000"}
        await eventually(lambda: decode_sets() == [both, both], what="d1 everywhere")
        redis.restart()  # same port, empty: the record is gone
        three = both | {"http://d2:8000"}

        async def added() -> bool:
            try:
                return await syncs[1].apply(
                    {"op": "add", "role": "decode", "url": "http://d2:8000", "source": "admin"}
                )
            except Exception:
                return False

        await eventually(added, what="a change after the restart")
        await eventually(lambda: decode_sets() == [three, three], what="nothing lost")
    finally:
        for sync in syncs:
            await sync.stop()


@pytest.mark.parametrize("topology", ["cluster", "sentinel"])
async def test_fleet_record_on_cluster_and_sentinel_maps(topology: str) -> None:
    """The record, its script and its notification work on the other map topologies (a
    cluster map has no asyncio pub/sub in redis-py: polling carries the change there)."""
    from kvrelay.kvcache_map import open_redis_client
    from kvrelay.proxy.fleet import Pool
    from kvrelay.proxy.fleet.fleet_sync import RedisFleetSync
    from tests.kvcache_map.helpers import eventually
    from tests.kvcache_map.topologies import RedisCluster, SentinelSet

    nodes = RedisCluster().start() if topology == "cluster" else SentinelSet().start()
    static = {"prefill": ["http://p0:8000"], "decode": ["http://d0:8000"]}
    pools = [{"prefill": Pool("prefill", 3, 2), "decode": Pool("decode", 3, 2)} for _ in "ab"]
    syncs = []
    try:
        for p in pools:
            client, prefix, cluster = open_redis_client(nodes.url)
            sync = RedisFleetSync(client, prefix, p, static, interval=0.2, pubsub=not cluster)
            await sync.start()
            syncs.append(sync)
        assert await syncs[0].apply(
            {"op": "add", "role": "decode", "url": "http://d1:8000", "source": "admin"}
        )
        both = {"http://d0:8000", "http://d1:8000"}
        await eventually(lambda: all(set(p["decode"].backends) == both for p in pools),
                         what="d1 in both processes")  # fmt: skip
    finally:
        for sync in syncs:
            await sync.stop()
        nodes.stop()
