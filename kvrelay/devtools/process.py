"""Server subprocesses with bounded readiness, stopped with their whole process group.

Readiness is always a condition polled with a deadline, never a sleep; a server that dies while
starting raises with its output so the failure is diagnosable. Each server runs in its own
session, so `stop()` and `kill()` reach its children too (vLLM's engine core, proxy workers).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Set (to anything but "" or "0"), every server's output file outlives `stop()`, its path
# written to stderr: how a benchmark's engine and proxy logs are kept for a diagnosis.
KEEP_LOGS_ENV = "KVRELAY_KEEP_SERVER_LOGS"

# Free ports are looked for from here up to the kernel's ephemeral range (Linux's default start
# when the range cannot be read).
_LOWEST_PORT = 10000
_EPHEMERAL_FALLBACK_LOW = 32768


def _ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_FALLBACK_LOW


# Every port `free_port` handed out in this process. The server it was for may not have bound it
# yet (an engine binds once its imports are done), so it looks free: two engines started side by
# side were once both handed one port, and the one that could not bind it was taken for ready
# because the other answered there.
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port(host: str = "127.0.0.1", preferred: int = 0) -> int:
    """A TCP port that was free on `host` a moment ago: `preferred` when it is, else another;
    never one this process was handed before (`_handed_out`).

    Chosen below the kernel's ephemeral range. A port the kernel hands out (`bind(0)`) is one
    it may also give an outgoing connection as its local port, and a server started minutes
    later (vLLM's side channel binds once the engine has loaded) then finds it in use.
    """
    candidates: list[int] = [preferred] if preferred else []
    low = _ephemeral_low()
    if low - 1 > _LOWEST_PORT:
        candidates += random.sample(range(_LOWEST_PORT, low), k=min(64, low - _LOWEST_PORT))
    candidates += [0] * 8  # no room below the range: let the kernel choose
    with _handed_out_lock:
        for candidate in candidates:
            if candidate in _handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, candidate))
                except OSError:
                    continue
                port = int(sock.getsockname()[1])
            if port not in _handed_out:  # the kernel's choice may be one handed out already
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no free port on {host}")


def _listening_sockets(port: int) -> set[str] | None:
    """`socket:[inode]` of each TCP socket listening on `port` (IPv4 and IPv6, Linux
    `/proc/net`); None where neither table can be read."""
    found: set[str] = set()
    read = False
    for table in ("tcp", "tcp6"):
        try:
            rows = Path("/proc/net", table).read_text().splitlines()[1:]
        except OSError:
            continue
        read = True
        for row in rows:
            # local_address is ADDR:PORT in hex, st 0A is LISTEN, inode the tenth column.
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rpartition(":")[2], 16) == port:
                found.add(f"socket:[{cols[9]}]")
    return found if read else None


def group_listens(pgid: int, port: int) -> bool:
    """Whether a process of process group `pgid` listens on TCP `port`: the server's own
    socket, not another process's on the same port (Linux `/proc`; true where it cannot tell)."""
    sockets = _listening_sockets(port)
    if sockets is None:
        return True
    if not sockets:
        return False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            text = stat.read_text()
            if int(text[text.rindex(")") + 2 :].split()[2]) != pgid:
                continue
            for fd in (stat.parent / "fd").iterdir():
                if os.readlink(fd) in sockets:
                    return True
    return False


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


def json_request(
    url: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 30.0
) -> tuple[int, Any]:
    """POST `body` as JSON to a started server (GET when it is None); (status, parsed JSON
    body, None when empty), error statuses included."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def live_children(name: str | None = None, parent: int | None = None) -> list[int]:
    """Pids of the children of `parent` (default: this process) running `name` (default: any)
    that have not exited (Linux `/proc`): what a test session must have stopped before it
    ends."""
    parent, found = os.getpid() if parent is None else parent, []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            text = stat.read_text()
            comm = text[text.index("(") + 1 : text.rindex(")")]
            state, ppid = text[text.rindex(")") + 2 :].split()[:2]
            if name in (None, comm) and int(ppid) == parent and state != "Z":
                found.append(int(stat.parent.name))
    return sorted(found)


def pinned(argv: Sequence[str], cpus: str | None) -> list[str]:
    """`argv` run under `taskset -c cpus` (same pid: taskset execs), or as is for None."""
    if cpus is None:
        return list(argv)
    taskset = shutil.which("taskset")
    if taskset is None:
        raise RuntimeError("taskset not found (util-linux): needed to place benchmark processes")
    return [taskset, "-c", cpus, *argv]


@dataclass
class ServerProcess:
    """A server subprocess started on a known port and stopped by `stop()`.

    `ready` is polled until true (bounded by `ready_timeout`); if the process exits first, the
    error shows its output. `env` is added to this process's environment; `cwd` defaults to the
    current directory; `cpus` pins it, and every process it starts, to those CPUs (`taskset`).
    With `port`, it is ready only once it listens there itself (`group_listens`): a server
    that cannot bind its port is not taken for ready because another process answers there.
    """

    argv: Sequence[str]
    ready: Callable[[], bool]
    env: dict[str, str] | None = None
    ready_timeout: float = 30.0
    name: str = "server"
    cwd: Path | None = None
    cpus: str | None = None
    port: int | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    log_path: Path | None = field(default=None, init=False)

    def start(self) -> ServerProcess:
        """Spawn the process and wait until it is ready (or raise with its output)."""
        self.spawn()
        self.wait_ready()
        return self

    def spawn(self) -> ServerProcess:
        """Spawn the process without waiting (several servers can then start side by side)."""
        fd, log = tempfile.mkstemp(prefix=f"kvrelay-{self.name}-", suffix=".log")
        self.log_path = Path(log)
        env = dict(os.environ)
        if self.env:
            env.update(self.env)
        with os.fdopen(fd, "wb") as out:
            self.proc = subprocess.Popen(
                pinned(self.argv, self.cpus),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.cwd,
                start_new_session=True,
            )
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait for `ready` (bounded); a timeout or an early exit stops it and raises."""
        limit = self.ready_timeout if timeout is None else timeout
        try:
            wait_until(self._ready_or_dead, limit, what=f"{self.name} to be ready")
        except TimeoutError:
            output = self.output()
            self.stop()
            raise TimeoutError(f"{self.name} not ready in {limit}s:\n{output}") from None
        assert self.proc is not None
        if self.proc.poll() is not None:
            code, output = self.proc.returncode, self.output()
            self.stop()
            raise RuntimeError(f"{self.name} exited with {code} while starting:\n{output}")

    def _ready_or_dead(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            return True
        # Its own session: the process group is the server and what it started.
        return self.ready() and (self.port is None or group_listens(self.proc.pid, self.port))

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        """The last 8000 characters the process wrote (stdout and stderr)."""
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
        """Stop gracefully (SIGTERM to the group), then SIGKILL after `timeout` seconds."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        # The leader is gone; children that ignored SIGTERM must not outlive it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.log_path is not None:
            if os.environ.get(KEEP_LOGS_ENV, "") not in ("", "0"):
                sys.stderr.write(f"{self.name}: output kept in {self.log_path}\n")
            else:
                with contextlib.suppress(OSError):
                    self.log_path.unlink()
            self.log_path = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ManagedServer:
    """Stop/kill/output for an object that owns one `ServerProcess` (or none yet)."""

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
