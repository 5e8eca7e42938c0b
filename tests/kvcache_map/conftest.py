"""Fixtures of the kvcache_map suite: one map per backend (memory, real Redis, a real 3-master
Redis Cluster, a real master + replica behind three sentinels)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator

import pytest

from kvrelay.kvcache_map import KVMap, open_map
from tests.harness import RedisServer
from tests.kvcache_map.helpers import Recorder
from tests.kvcache_map.topologies import RedisCluster, SentinelSet

# Contract tests are about behaviour, not latency: a generous Redis timeout keeps them stable
# on a loaded machine. The fail-fast tests use the 100 ms default explicitly.
CONTRACT_TIMEOUT_MS = 2000
FAST_SWEEP_MS = 20


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A 3-master Redis Cluster shared by the suite (tests use their own key prefixes)."""
    cluster = RedisCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def redis_sentinels() -> Iterator[SentinelSet]:
    """Master + replica + three sentinels shared by the suite (own key prefix per test)."""
    sentinels = SentinelSet()
    try:
        yield sentinels.start()
    finally:
        sentinels.stop()


@pytest.fixture(params=["memory", "redis", "redis-cluster", "redis-sentinel"])
async def kvmap(request: pytest.FixtureRequest, recorder: Recorder) -> AsyncIterator[KVMap]:
    """The same contract suite runs against each backend."""
    redis_opts = f"timeout_ms={CONTRACT_TIMEOUT_MS}&sweep_interval_ms={FAST_SWEEP_MS}"
    if request.param == "memory":
        url = f"memory://?max_entries=1000&sweep_interval_ms={FAST_SWEEP_MS}"
    elif request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis")
        url = f"{server.url}?{redis_opts}"
    else:
        fixture = "redis_cluster" if request.param == "redis-cluster" else "redis_sentinels"
        topology: RedisCluster | SentinelSet = request.getfixturevalue(fixture)
        # The topology outlives the test: a fresh prefix keeps each test's keys apart.
        url = f"{topology.url}?{redis_opts}&prefix=t{secrets.token_hex(6)}"
    m = open_map(url, on_evict=recorder)
    try:
        yield m
    finally:
        await m.close()
