"""Fixtures of the kvcache_map suite: one map per backend (memory, real Redis)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvrelay.kvcache_map import KVMap, open_map
from tests.harness import RedisServer
from tests.kvcache_map.helpers import Recorder

# Contract tests are about behaviour, not latency: a generous Redis timeout keeps them stable
# on a loaded machine. The fail-fast tests use the 50 ms default explicitly.
CONTRACT_TIMEOUT_MS = 2000
FAST_SWEEP_MS = 20


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(params=["memory", "redis"])
async def kvmap(request: pytest.FixtureRequest, recorder: Recorder) -> AsyncIterator[KVMap]:
    """The same contract suite runs against each backend."""
    if request.param == "memory":
        url = f"memory://?max_entries=1000&sweep_interval_ms={FAST_SWEEP_MS}"
    else:
        server: RedisServer = request.getfixturevalue("redis")
        url = f"{server.url}?timeout_ms={CONTRACT_TIMEOUT_MS}&sweep_interval_ms={FAST_SWEEP_MS}"
    m = open_map(url, on_evict=recorder)
    try:
        yield m
    finally:
        await m.close()
