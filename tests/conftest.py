"""Shared pytest fixtures. Suites reuse these instead of copying server set-up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvrelay.devtools.engines import EngineFactory, EngineSim
from kvrelay.devtools.proxy_server import ProxiedPair, ProxyFactory
from tests.harness import RedisServer, redis_server


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A real redis-server on a free port for one test, stopped afterwards."""
    with redis_server() as server:
        yield server


@pytest.fixture
def engine_factory() -> Iterator[EngineFactory]:
    """Start enginesim processes (`engine_factory("P", "--lease-seconds", "5")`); all stopped
    afterwards. Engines host the real connector (real NIXL over loopback, shared test secret
    `kvrelay.devtools.engines.CONNECTOR_SECRET`) unless started with `connector=False`."""
    factory = EngineFactory()
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def pd_engines(engine_factory: EngineFactory) -> tuple[EngineSim, EngineSim]:
    """A prefill engine and a decode engine (enginesim, real NIXL), stopped after the test."""
    p, d = engine_factory.many(("P", ["--role", "prefill"]), ("D", ["--role", "decode"]))
    return p, d


@pytest.fixture
def proxy_factory() -> Iterator[ProxyFactory]:
    """Start kvrelay proxies (`proxy_factory([p], [d], map_url=...)`, settings as keyword
    arguments → `KVRELAY_*` env); all stopped afterwards."""
    factory = ProxyFactory()
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def pd_fleet(pd_engines: tuple[EngineSim, EngineSim], proxy_factory: ProxyFactory) -> ProxiedPair:
    """One prefill and one decode enginesim and a proxy (in-memory map) in front of them."""
    prefill, decode = pd_engines
    return ProxiedPair(prefill, decode, proxy_factory([prefill], [decode], ready_path="/ready"))
