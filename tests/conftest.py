"""Shared pytest fixtures. Suites reuse these instead of copying server set-up.

At the end of a session (also one stopped by `-x`, Ctrl-C or SIGTERM) no redis-server the
suite started may still run: any left is killed and the session fails, naming them.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from types import FrameType

import pytest

from kvrelay.devtools import EngineFactory, EngineSim, ProxiedPair, ProxyFactory, live_children
from tests.harness import RedisServer, redis_server


def pytest_configure(config: pytest.Config) -> None:
    # SIGTERM (a `timeout` around pytest, a CI cancel) ends the session as Ctrl-C does, so
    # fixtures are torn down and their servers stopped instead of outliving pytest.
    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, interrupt)


@pytest.hookimpl(trylast=True)  # after pytest's own hook has torn the session fixtures down
def pytest_sessionfinish(session: pytest.Session) -> None:
    left = live_children("redis-server")
    if not left:
        return
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)  # reaped: no zombie left either
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"redis-server processes the suite started were still running: pids {left}"
    if reporter is not None:
        reporter.write_line(f"ERROR: {message} (killed now)", red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
