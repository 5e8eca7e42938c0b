"""A real, throw-away `redis-server` on a free loopback port (no persistence)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvrelay.devtools.process import ManagedServer, ServerProcess, free_port, tcp_ready


@dataclass
class RedisServer(ManagedServer):
    """`redis-server` on 127.0.0.1, restartable on the same port (to test outages)."""

    port: int = field(default_factory=free_port)
    password: str | None = None
    process: ServerProcess | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: run `make redis` (Debian: redis-server)")
        argv = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
        ]
        if self.password:
            argv += ["--requirepass", self.password]
        # A server a test crashed is reaped, and its log removed, before it starts again.
        self.stop()
        self.process = ServerProcess(
            argv, tcp_ready("127.0.0.1", self.port), name=f"redis-{self.port}", ready_timeout=15
        ).start()
        return self

    def restart(self) -> None:
        self.stop()
        self.start()


@contextlib.contextmanager
def redis_server(password: str | None = None) -> Iterator[RedisServer]:
    """A started `RedisServer`, stopped when the block ends."""
    server = RedisServer(password=password).start()
    try:
        yield server
    finally:
        server.stop()
