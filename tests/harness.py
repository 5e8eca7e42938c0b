"""Shared test harness: the dev tools' process and Redis helpers, plus what only tests need.

Every suite (engines, proxy, chaos, real vLLM) starts its servers through `ServerProcess`
(`kvrelay.devtools.process`) so that readiness is a condition with a timeout, never a sleep,
and every process is stopped with its children.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvrelay.devtools.process import (
    ManagedServer,
    ServerProcess,
    free_port,
    http_ready,
    tcp_ready,
    wait_until,
)
from kvrelay.devtools.redis import RedisServer, redis_server

__all__ = [
    "REPO_ROOT",
    "ManagedServer",
    "RedisServer",
    "ServerProcess",
    "free_port",
    "http_ready",
    "python_server",
    "redis_server",
    "tcp_ready",
    "wait_until",
]

REPO_ROOT = Path(__file__).resolve().parent.parent


def python_server(
    module_args: Sequence[str], ready: Callable[[], bool], **kwargs: object
) -> ServerProcess:
    """A `ServerProcess` running `python <module_args>` with this interpreter."""
    return ServerProcess([sys.executable, *module_args], ready, **kwargs)  # type: ignore[arg-type]
