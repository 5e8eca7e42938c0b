"""Shared test harness: the dev tools' process and Redis helpers, and the repository root.

Every suite (engines, proxy, chaos, real vLLM) starts its servers through `ServerProcess`
(`kvrelay.devtools.process`) so that readiness is a condition with a timeout, never a sleep,
and every process is stopped with its children. The fleets themselves (enginesim, proxy, fault
relay, chaos load, real vLLM) live in `kvrelay.devtools` too, shared with the benchmarks.
"""

from __future__ import annotations

from pathlib import Path

from kvrelay.devtools import (
    ManagedServer,
    RedisServer,
    ServerProcess,
    free_port,
    http_ready,
    redis_server,
    tcp_ready,
    wait_until,
)

__all__ = [
    "REPO_ROOT",
    "ManagedServer",
    "RedisServer",
    "ServerProcess",
    "free_port",
    "http_ready",
    "redis_server",
    "tcp_ready",
    "wait_until",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
