"""`DevFleet`: a whole dev fleet on 127.0.0.1 from one description, stopped as one.

N prefill and M decode enginesim engines (`engines.py`), a throw-away Redis when asked for
(`redis.py`) and a proxy in front of them (`proxy_server.py`), all with one environment
(`env.py`). Every process starts in its own process group, side by side, and each must be ready
within its bound; `stop()` stops them all, the proxy first, and a start that fails stops what
it had started. The demo runs one; the tests' fixtures and the benchmarks start the same
`EngineSim`, `ProxyServer` and `RedisServer` one by one when they need them apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.devtools.engines import DEV_ENGINE_ARGS, EngineFactory, EngineSim
from kvrelay.devtools.process import free_port
from kvrelay.devtools.proxy_server import ProxyServer
from kvrelay.devtools.redis import RedisServer


@dataclass
class DevFleet:
    """`prefill` P and `decode` D engines (`<name>P0`, `<name>D0`, ...: `--role` and then
    `engine_args` each), a Redis server when `redis` (the proxy's map), and a proxy on
    `proxy_port` (free when 0) with `proxy_settings` (`KVRELAY_*` without the prefix) and
    `proxy_args`; `flags`, `env` and `proxy_name` as `ProxyServer` takes them (`env` is the
    engines' too: None, the tests' `dev_env()`)."""

    prefill: int = 1
    decode: int = 1
    engine_args: Sequence[str] = ()
    engine_base_args: Sequence[str] = DEV_ENGINE_ARGS
    redis: bool = False
    proxy_settings: dict[str, str] = field(default_factory=dict)
    proxy_args: Sequence[str] = ()
    proxy_port: int = 0
    proxy_name: str = ""
    flags: bool = False
    env: dict[str, str] | None = None
    name: str = ""
    ready_timeout: float = 60.0
    engines: EngineFactory = field(default_factory=EngineFactory, init=False)
    redis_server: RedisServer | None = field(default=None, init=False)
    proxy: ProxyServer | None = field(default=None, init=False)

    def _engine(self, role: str, index: int) -> EngineSim:
        name = f"{self.name}{role[0].upper()}{index}"
        return EngineSim(
            name,
            ("--role", role, *self.engine_args),
            base_args=self.engine_base_args,
            env=self.env,
            ready_timeout=self.ready_timeout,
            process_name=self.name and name,
        )

    @property
    def prefill_engines(self) -> list[EngineSim]:
        return self.engines.engines[: self.prefill]

    @property
    def decode_engines(self) -> list[EngineSim]:
        return self.engines.engines[self.prefill :]

    def start(self) -> DevFleet:
        """Start every process side by side and wait until each is ready (bounded)."""
        try:
            if self.redis:
                self.redis_server = RedisServer().start()
            engines = [self._engine("prefill", i) for i in range(self.prefill)]
            engines += [self._engine("decode", i) for i in range(self.decode)]
            self.engines.engines.extend(engines)
            for engine in engines:
                engine.spawn()
            settings = dict(self.proxy_settings)
            if self.redis_server is not None:
                settings.setdefault("map_url", self.redis_server.url)
            self.proxy = ProxyServer(
                self.prefill_engines,
                self.decode_engines,
                settings,
                port=self.proxy_port or free_port(),
                flags=self.flags,
                args=self.proxy_args,
                env_base=self.env,
                name=self.proxy_name,
                ready_timeout=self.ready_timeout,
            )
            self.proxy.spawn("/ready")
            for process in (*(e.process for e in engines), self.proxy.process):
                assert process is not None
                process.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def alive(self) -> bool:
        """Every process of the fleet still runs."""
        return all(
            p is not None and p.alive
            for p in (
                *(e.process for e in self.engines.engines),
                self.proxy.process if self.proxy else None,
                *([self.redis_server.process] if self.redis_server else []),
            )
        )

    def stop(self) -> None:
        """Stop the proxy (it releases what the engines hold for it), the engines, Redis."""
        if self.proxy is not None:
            self.proxy.stop()
        self.engines.close()
        if self.redis_server is not None:
            self.redis_server.stop()

    def __enter__(self) -> DevFleet:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
