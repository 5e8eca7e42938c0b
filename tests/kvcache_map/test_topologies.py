"""Redis Cluster and Redis Sentinel maps against real multi-node topologies on loopback.

The contract suite (`test_contract.py`) already runs against both; these tests cover what is
specific to them: an entry's keys sharing one slot while entries spread over every master,
fail-fast when the nodes are gone, and a Sentinel failover in the middle of traffic that uses
no entry twice and reports no expiry twice.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import time

import pytest

from kvrelay.kvcache_map import EvictionReason, KVMap, MapUnavailableError, RedisMap, open_map
from kvrelay.kvcache_map._redis_topology import KeyLayout
from tests.harness import free_port
from tests.kvcache_map.helpers import Recorder, eventually, key, make_entry
from tests.kvcache_map.topologies import RedisCluster, SentinelSet, cli

FAIL_FAST_BOUND = 1.5


async def test_cluster_entry_keys_share_a_slot_and_entries_spread(
    redis_cluster: RedisCluster,
) -> None:
    m = open_map(redis_cluster.url + "?timeout_ms=2000&prefix=spread&sweep=false")
    try:
        for i in range(120):
            await m.put(key(f"c{i}"), make_entry(request_id=f"r{i}"), ttl=60)
        assert (await m.stats()).entries == 120
        # Each master holds some of the entries (16 shards over 3 masters' slots).
        assert all(int(cli(n.port, "DBSIZE").strip() or 0) > 0 for n in redis_cluster.nodes)
        layout = KeyLayout("spread", 16)
        for i in range(5):
            member = f"tenant-a.c{i}"
            slots = {cli(redis_cluster.nodes[0].port, "CLUSTER", "KEYSLOT", k).strip()
                     for k in layout.keys(member)}  # fmt: skip
            assert len(slots) == 1
        taken = await m.take(key("c7"))
        assert taken is not None and taken.request_id == "r7"
        assert await m.take(key("c7")) is None
    finally:
        await m.close()


@pytest.mark.parametrize("kind", ["cluster", "sentinel"])
async def test_cluster_and_sentinel_without_nodes_fail_fast(kind: str) -> None:
    if kind == "cluster":
        url = f"redis+cluster://127.0.0.1:{free_port()}"
    else:
        url = f"redis+sentinel://127.0.0.1:{free_port()},127.0.0.1:{free_port()}/svc"
    m = open_map(url)  # default 100 ms timeout
    try:
        for attempt in (
            lambda: m.get(key("c")),
            lambda: m.take(key("c")),
            lambda: m.put(key("c"), make_entry(), ttl=60),
        ):
            t0 = time.monotonic()
            with pytest.raises(MapUnavailableError):
                await attempt()
            assert time.monotonic() - t0 < FAIL_FAST_BOUND
        stats = await m.stats()
        assert stats.available is False and stats.entries is None
    finally:
        await m.close()


async def test_cluster_nodes_killed_fail_fast() -> None:
    cluster = RedisCluster().start()
    m = open_map(cluster.url + "?sweep=false")
    try:
        await eventually(lambda: _put_ok(m, "c"), what="the cluster map to answer")
        for node in cluster.nodes:
            node.kill()
        t0 = time.monotonic()
        with pytest.raises(MapUnavailableError):
            await m.take(key("c"))
        assert time.monotonic() - t0 < FAIL_FAST_BOUND
    finally:
        await m.close()
        cluster.stop()


async def _put_ok(m: KVMap, conversation: str) -> bool:
    try:
        await m.put(key(conversation), make_entry(), ttl=60)
    except MapUnavailableError:
        return False
    return True


def test_sentinel_url_needs_a_service_name() -> None:
    with pytest.raises(ValueError, match="service name"):
        open_map("redis+sentinel://127.0.0.1:26379")
    with pytest.raises(ValueError, match="wait_replicas"):
        open_map("redis+cluster://127.0.0.1:7000?wait_replicas=1")


@pytest.mark.chaos
async def test_sentinel_failover_mid_traffic_uses_no_entry_twice() -> None:
    """Two replicas' maps put and take under traffic while the master is killed; sentinels
    promote the replica and the old master returns as a replica. Every entry is taken or
    reported at most once in all, and the maps follow the new master without being rebuilt."""
    topology = SentinelSet().start()
    recorder = Recorder()
    opts = "?timeout_ms=300&sweep_interval_ms=50&prefix=failover"
    maps = [open_map(topology.url + opts, on_evict=recorder) for _ in range(2)]
    used: list[str] = []
    errors = attempts = 0
    ids = itertools.count()
    stop = asyncio.Event()
    rng = random.Random(7)

    async def client() -> None:
        nonlocal errors, attempts
        while not stop.is_set():
            attempts += 1
            n = next(ids)
            k = key(f"c{n % 40}")
            try:
                await rng.choice(maps).put(k, make_entry(request_id=f"r{n}"),
                                           ttl=rng.choice([0.2, 30.0]))  # fmt: skip
                taken = await rng.choice(maps).take(key(f"c{rng.randrange(40)}"))
            except MapUnavailableError:
                errors += 1
                await asyncio.sleep(0.01)  # pacing while Redis is away, not synchronisation
                continue
            if taken is not None:
                used.append(taken.request_id)

    tasks = [asyncio.create_task(client()) for _ in range(8)]
    try:
        await eventually(lambda: len(used) > 200, 30, what="traffic before the failover")
        old_master = topology.master_port()
        assert topology.replica is not None and old_master == topology.master.port
        replica = topology.replica.process
        assert replica is not None and replica.proc is not None
        # The replica falls behind (stopped) while traffic goes on, then the master dies: what
        # the master did in that window is what an asynchronous failover loses.
        os.kill(replica.proc.pid, signal.SIGSTOP)
        try:
            start = attempts
            await eventually(lambda: attempts > start + 40, 10, what="traffic while lagging")
            topology.master.kill()
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
        await eventually(lambda: topology.master_port() == topology.replica.port, 60,
                         what="the sentinels to promote the replica")  # fmt: skip
        # Writes need a replica to confirm them (wait_replicas=1): the old master comes back,
        # as its pod would, and the sentinels make it the new master's replica.
        topology.master.start()
        after = len(used)
        await eventually(lambda: len(used) > after + 200, 60,
                         what="traffic to flow through the new master")  # fmt: skip
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        for m in maps:
            assert isinstance(m, RedisMap)
            await m.drain()
            await m.close()
        topology.stop()
    assert errors > 0  # the failover was really in the middle of traffic
    reported = [e.request_id for _, e, r in recorder.events if r is not EvictionReason.REPLACED]
    replaced = [e.request_id for _, e, r in recorder.events if r is EvictionReason.REPLACED]
    every = used + reported + replaced
    twice = [rid for rid in set(every) if every.count(rid) > 1]
    assert not twice, [(r, used.count(r), reported.count(r), replaced.count(r)) for r in twice]
