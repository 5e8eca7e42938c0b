"""The harness itself: servers become ready, crash reports show output, nothing is left running."""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence

import pytest

from kvrelay.devtools import EngineFactory, EngineSim
from tests.harness import RedisServer, ServerProcess, free_port, tcp_ready


def test_redis_fixture_serves_and_stops(redis: RedisServer) -> None:
    assert redis.process is not None and redis.process.alive
    assert tcp_ready("127.0.0.1", redis.port)()


def test_server_that_exits_reports_its_output() -> None:
    port = free_port()
    proc = ServerProcess(
        [sys.executable, "-c", "print('boom on start'); raise SystemExit(3)"],
        tcp_ready("127.0.0.1", port),
        name="crasher",
        ready_timeout=10,
    )
    with pytest.raises(RuntimeError, match="boom on start"):
        proc.start()
    assert not proc.alive


def test_server_never_ready_times_out_and_is_killed() -> None:
    port = free_port()
    proc = ServerProcess(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        tcp_ready("127.0.0.1", port),
        name="sleeper",
        ready_timeout=0.5,
    )
    with pytest.raises(TimeoutError):
        proc.start()
    assert not proc.alive


def test_free_port_never_hands_out_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The servers of two ports handed out one after the other may not have bound either yet:
    even when the random draw repeats itself, the second call gets another port."""

    def same_draw(population: Sequence[int], k: int) -> list[int]:
        return list(population[:k])

    monkeypatch.setattr(random, "sample", same_draw)
    ports = [free_port() for _ in range(3)]
    assert len(set(ports)) == len(ports), ports


def test_an_engine_that_cannot_bind_its_port_is_not_taken_for_ready(
    engine_factory: EngineFactory,
) -> None:
    """A second engine on the first's port fails to start; the first's answers on that port do
    not make it ready (a P and a D once both served by P: P counted both legs of each turn)."""
    first = engine_factory("first", connector=False)
    second = EngineSim("second", connector=False, port=first.port)
    engine_factory.engines.append(second)  # stopped with the others whatever happens
    with pytest.raises(RuntimeError, match="address already in use"):
        second.start()
    assert second.process is not None and not second.process.alive
    assert first.request("/health") == (200, {"status": "ok"})
