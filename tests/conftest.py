"""Shared pytest fixtures. Suites reuse these instead of copying server set-up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.engines import EngineFactory, EngineSim
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
    `tests.engines.CONNECTOR_SECRET`) unless started with `connector=False`."""
    factory = EngineFactory()
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def pd_engines(engine_factory: EngineFactory) -> tuple[EngineSim, EngineSim]:
    """A prefill engine and a decode engine (enginesim, real NIXL), stopped after the test."""
    return engine_factory("P", "--role", "prefill"), engine_factory("D", "--role", "decode")
