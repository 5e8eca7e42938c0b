"""Shared pytest fixtures. Suites reuse these instead of copying server set-up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import RedisServer, redis_server


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A real redis-server on a free port for one test, stopped afterwards."""
    with redis_server() as server:
        yield server
