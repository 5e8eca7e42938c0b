"""Shared test harness: free ports, server subprocesses with bounded readiness waits, Redis.

Every later suite (engines, proxy, chaos) starts its servers through `ServerProcess` so that
readiness is a condition with a timeout, never a sleep, and every process is stopped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_until(
    condition: Callable[[], bool],
    timeout: float,
    interval: float = 0.02,
    what: str = "condition",
) -> None:
    """Poll `condition` until it is true; raise TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


def tcp_ready(host: str, port: int) -> Callable[[], bool]:
    """Readiness probe: something accepts TCP connections on host:port."""

    def probe() -> bool:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return True
        return False

    return probe


def http_ready(url: str) -> Callable[[], bool]:
    """Readiness probe: GET `url` answers 2xx."""

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=0.5) as resp:
                return bool(200 <= resp.status < 300)
        except (OSError, urllib.error.URLError):
            return False

    return probe


@dataclass
class ServerProcess:
    """A server subprocess started on a known port and stopped by `stop()`.

    `ready` is polled until true (bounded by `ready_timeout`); if the process exits first, the
    error shows its output so a failed start is diagnosable.
    """

    argv: Sequence[str]
    ready: Callable[[], bool]
    env: dict[str, str] | None = None
    ready_timeout: float = 30.0
    name: str = "server"
    cwd: Path = REPO_ROOT
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    log_path: Path | None = field(default=None, init=False)

    def start(self) -> ServerProcess:
        fd, log = tempfile.mkstemp(prefix=f"kvrelay-{self.name}-", suffix=".log")
        self.log_path = Path(log)
        env = dict(os.environ)
        if self.env:
            env.update(self.env)
        with os.fdopen(fd, "wb") as out:
            self.proc = subprocess.Popen(
                list(self.argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.cwd,
                start_new_session=True,
            )
        try:
            wait_until(self._ready_or_dead, self.ready_timeout, what=f"{self.name} to be ready")
        except TimeoutError:
            output = self.output()
            self.stop()
            raise TimeoutError(
                f"{self.name} not ready in {self.ready_timeout}s:\n{output}"
            ) from None
        if self.proc.poll() is not None:
            code, output = self.proc.returncode, self.output()
            self.stop()
            raise RuntimeError(f"{self.name} exited with {code} while starting:\n{output}")
        return self

    def _ready_or_dead(self) -> bool:
        assert self.proc is not None
        return self.proc.poll() is not None or self.ready()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-8000:]

    def kill(self) -> None:
        """Kill abruptly (SIGKILL to the whole process group), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (SIGTERM), then SIGKILL after `timeout` seconds."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()
            self.log_path = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def python_server(
    module_args: Sequence[str], ready: Callable[[], bool], **kwargs: object
) -> ServerProcess:
    """A `ServerProcess` running `python <module_args>` with this interpreter."""
    return ServerProcess([sys.executable, *module_args], ready, **kwargs)  # type: ignore[arg-type]


class ManagedServer:
    """Stop/kill/output for a test server object that owns one `ServerProcess` (or none yet)."""

    process: ServerProcess | None

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def kill(self) -> None:
        """Crash it (SIGKILL), as a machine failure would."""
        if self.process is not None:
            self.process.kill()
            self.process.stop()
            self.process = None

    def output(self) -> str:
        return self.process.output() if self.process is not None else ""


@dataclass
class RedisServer(ManagedServer):
    """A real `redis-server` on a free loopback port, no persistence; restartable on its port."""

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
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
        ]  # fmt: skip
        if self.password:
            argv += ["--requirepass", self.password]
        self.process = ServerProcess(
            argv, tcp_ready("127.0.0.1", self.port), name=f"redis-{self.port}", ready_timeout=15
        ).start()
        return self

    def restart(self) -> None:
        self.stop()
        self.start()


@contextlib.contextmanager
def redis_server(password: str | None = None) -> Iterator[RedisServer]:
    server = RedisServer(password=password).start()
    try:
        yield server
    finally:
        server.stop()
