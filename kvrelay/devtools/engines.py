"""Start enginesim processes: free ports, real NIXL on loopback, bounded readiness.

`EngineSim` is every dev fleet's engine: the tests' (through the fixtures in `tests/conftest.py`,
`engine_factory`, `pd_engines`), the chaos fleet's, the demo's and the benchmarks' (`bench/
_common.py`, which also starts its zero-work fake engine as one with another `module`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvrelay.devtools.env import fleet_env
from kvrelay.devtools.process import (
    ManagedServer,
    ServerProcess,
    free_port,
    http_ready,
    json_request,
    wait_until,
)
from kvrelay.devtools.prometheus import scrape

CONNECTOR_SECRET = "kvrelay-test-connector-secret"
# Flags every dev engine gets unless its starter says otherwise (`base_args`): quiet, gone with
# the process that started it, and reporting `usage.prompt_tokens_details` (off by default, as
# in vLLM) as the proxy's deployments are told to run them.
DEV_ENGINE_ARGS = (
    "--log-level",
    "WARNING",
    "--exit-with-parent",
    "--enable-prompt-tokens-details",
)


def kv_events_args(port: int, replay_port: int | None = None) -> tuple[str, str]:
    """The flag that has an engine (vLLM's, so enginesim's too) publish its KV cache events
    over ZMQ on `port` (every interface: the wildcard endpoint binds) and, with
    `replay_port`, answer replay requests there."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    if replay_port is not None:
        config["replay_endpoint"] = f"tcp://*:{replay_port}"
    return ("--kv-events-config", json.dumps(config))


def dev_env() -> dict[str, str]:
    """The tests' fleet environment: the shared test secret (`CONNECTOR_SECRET`), and output
    unbuffered so that a server that dies leaves all it wrote in its log."""
    return {**fleet_env(CONNECTOR_SECRET), "PYTHONUNBUFFERED": "1"}


@dataclass
class EngineSim(ManagedServer):
    """One running `python -m kvrelay.enginesim` process (or another `module` taking its
    `--port`, `--engine-id` and `--side-channel-port`)."""

    name: str
    args: Sequence[str] = ()
    connector: bool = True
    port: int = field(default_factory=free_port)
    side_channel_port: int = field(default_factory=free_port)
    process: ServerProcess | None = None
    base_args: Sequence[str] = DEV_ENGINE_ARGS  # before `args` (last wins)
    env: dict[str, str] | None = None  # the whole environment; None: `dev_env()`
    module: str = "kvrelay.enginesim"
    cpus: str | None = None  # `taskset` CPU list, None: not pinned
    ready_timeout: float = 60.0
    process_name: str = ""  # its log's name, default `enginesim-<name>`

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def side_channel(self) -> str | None:
        """`host:port` of its side channel, None without the connector."""
        return f"127.0.0.1:{self.side_channel_port}" if self.connector else None

    def argv(self) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            self.module,
            "--port",
            str(self.port),
            "--engine-id",
            self.name,
        ]
        if self.connector:
            argv += ["--side-channel-port", str(self.side_channel_port)]
        return [*argv, *self.base_args, *self.args]

    def spawn(self) -> EngineSim:
        """Start the process without waiting for it (engines then start side by side)."""
        self.process = ServerProcess(
            self.argv(),
            http_ready(f"{self.url}/health"),
            env=dev_env() if self.env is None else self.env,
            ready_timeout=self.ready_timeout,
            name=self.process_name or f"enginesim-{self.name}",
            cpus=self.cpus,
            port=self.port,
        ).spawn()
        return self

    def start(self) -> EngineSim:
        """Start the process and wait until it answers `/health` (bounded)."""
        self.spawn()
        assert self.process is not None
        self.process.wait_ready()
        return self

    def request(
        self,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> tuple[int, Any]:
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
    """Starts engines for one test (or one fleet) and stops them all afterwards."""

    def __init__(self) -> None:
        self.engines: list[EngineSim] = []

    def __call__(self, name: str, *args: str, connector: bool = True) -> EngineSim:
        engine = EngineSim(name, args, connector=connector)
        self.engines.append(engine)
        return engine.start()

    def many(self, *specs: tuple[str, Sequence[str]], connector: bool = True) -> list[EngineSim]:
        """Start several engines at once (start-up is mostly imports: overlap them)."""
        return self.start_all([EngineSim(name, args, connector=connector) for name, args in specs])

    def start_all(self, engines: Sequence[EngineSim]) -> list[EngineSim]:
        """Start `engines` side by side; each is stopped with the others, even when one fails."""
        self.engines.extend(engines)
        with ThreadPoolExecutor(max_workers=max(1, len(engines))) as pool:
            list(pool.map(EngineSim.start, engines))
        return list(engines)

    def close(self) -> None:
        for engine in self.engines:
            engine.stop()
