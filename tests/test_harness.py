"""The harness itself: servers become ready, crash reports show output, nothing is left running."""

from __future__ import annotations

import sys

import pytest

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
