"""Start enginesim processes for tests: free ports, real NIXL on loopback, bounded readiness.

Used through the fixtures in `tests/conftest.py` (`engine_factory`, `pd_engines`); the proxy
and chaos suites use the same engines.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvrelay.devtools.process import (
    ManagedServer,
    ServerProcess,
    free_port,
    http_ready,
    json_request,
    wait_until,
)
from kvrelay.devtools.prometheus import scrape
from kvrelay.devtools.ucx import LOOPBACK_UCX

CONNECTOR_SECRET = "kvrelay-test-connector-secret"
ENGINE_ENV = {
    "KVRELAY_CONNECTOR_SECRET": CONNECTOR_SECRET,
    **LOOPBACK_UCX,
    "PYTHONUNBUFFERED": "1",
}


@dataclass
class EngineSim(ManagedServer):
    """One running `python -m kvrelay.enginesim` process."""

    name: str
    args: Sequence[str] = ()
    connector: bool = True
    port: int = field(default_factory=free_port)
    side_channel_port: int = field(default_factory=free_port)
    process: ServerProcess | None = None
    # /metrics right after start: the state every test must return the pool to.
    baseline: dict[str, float] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> EngineSim:
        argv = [sys.executable, "-m", "kvrelay.enginesim", "--port", str(self.port), "--engine-id",
                self.name, "--log-level", "WARNING", "--exit-with-parent"]  # fmt: skip
        if self.connector:
            argv += ["--side-channel-port", str(self.side_channel_port)]
        # Test engines report `usage.prompt_tokens_details` (off by default, as in vLLM), as
        # the proxy's deployments are told to run them; `args` may say otherwise (last wins).
        argv += ["--enable-prompt-tokens-details", *self.args]
        self.process = ServerProcess(
            argv, http_ready(f"{self.url}/health"), env=ENGINE_ENV, ready_timeout=60,
            name=f"enginesim-{self.name}",
        ).start()  # fmt: skip
        self.baseline = self.metrics()
        return self

    def request(
        self, path: str, body: Any = None, headers: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> tuple[int, Any]:  # fmt: skip
        """POST JSON (GET when `body` is None); returns (status, parsed JSON body)."""
        return json_request(self.url + path, body, headers, timeout)

    def metrics(self) -> dict[str, float]:
        return scrape(self.url, timeout=5)

    def metric(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def pool_idle(self) -> bool:
        """Every block free, nothing held, nothing in flight (the starting state)."""
        m = self.metrics()
        return (
            m["enginesim_blocks_free"] == m["enginesim_blocks_total"]
            and m["enginesim_blocks_held_for_remote"] == 0
            and m["enginesim_requests_running"] == 0
            and m["enginesim_requests_waiting"] == 0
            and m["enginesim_requests_loading"] == 0
        )

    def wait_idle(self, timeout: float = 10.0) -> None:
        wait_until(self.pool_idle, timeout, what=f"{self.name}'s block pool to be idle")


class EngineFactory:
    """Starts engines for one test and stops them all afterwards."""

    def __init__(self) -> None:
        self.engines: list[EngineSim] = []

    def __call__(self, name: str, *args: str, connector: bool = True) -> EngineSim:
        engine = EngineSim(name, args, connector=connector)
        self.engines.append(engine)
        return engine.start()

    def many(self, *specs: tuple[str, Sequence[str]], connector: bool = True) -> list[EngineSim]:
        """Start several engines at once (start-up is mostly imports: overlap them)."""
        engines = [EngineSim(name, args, connector=connector) for name, args in specs]
        self.engines.extend(engines)
        with ThreadPoolExecutor(max_workers=len(engines)) as pool:
            list(pool.map(EngineSim.start, engines))
        return engines

    def close(self) -> None:
        for engine in self.engines:
            engine.stop()
