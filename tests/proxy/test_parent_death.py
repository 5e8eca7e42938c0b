"""`kill -9` of the supervisor takes its workers with it: none keeps serving the shared port.

Before, orphaned workers kept the port (SO_REUSEPORT), so a restarted proxy shared it with them
and half of one tenant's requests were served under the old settings.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from pathlib import Path

import pytest

from kvrelay.devtools import ProxyFactory
from tests.harness import RedisServer, wait_until

DEAD_ENGINE = "http://127.0.0.1:9"  # nothing listens: the workers need no engine to serve /health


def _workers(pid: int) -> list[int]:
    """The worker processes of supervisor `pid` (not multiprocessing's resource tracker)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    out.append(int(child))
    return out


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.timeout(120)
def test_workers_exit_and_free_the_port_when_the_supervisor_is_killed(
    redis: RedisServer, proxy_factory: ProxyFactory
) -> None:
    proxy = proxy_factory([DEAD_ENGINE], [DEAD_ENGINE], workers="2", map_url=redis.url)
    assert proxy.process is not None and proxy.process.proc is not None
    supervisor = proxy.process.proc.pid
    wait_until(lambda: len(_workers(supervisor)) == 2, 30, what="two workers")
    workers = _workers(supervisor)
    assert not _port_free(proxy.port)
    try:
        os.kill(supervisor, signal.SIGKILL)
        wait_until(lambda: not any(map(_running, workers)), 15,
                   what="the workers to exit after the supervisor's SIGKILL")  # fmt: skip
        wait_until(lambda: _port_free(proxy.port), 5, what="the port to be free")
    finally:
        for pid in workers:  # only if the check above failed: leave no orphan behind
            if _running(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


# The worker side alone, without the parent-death signal: the re-parenting check must stop it.
_GRANDCHILD = """
import os, sys, threading
from kvrelay.proxy.http import parent_watch
parent_watch._set_parent_death_signal = lambda signum: False
parent_watch.exit_with_parent(os.getppid(), poll_s=0.05)
open(sys.argv[1], "w").write(str(os.getpid()))
threading.Event().wait(60)
"""
_MIDDLE = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_the_reparenting_check_stops_a_worker_without_the_death_signal(tmp_path: Path) -> None:
    import subprocess
    import sys

    pid_file = tmp_path / "pid"
    middle = subprocess.Popen([sys.executable, "-c", _MIDDLE, _GRANDCHILD, str(pid_file)])
    grandchild = 0
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", 20,
                   what="the grandchild to start")  # fmt: skip
        grandchild = int(pid_file.read_text())
        assert _running(grandchild)
        middle.kill()
        middle.wait(10)
        wait_until(lambda: not _running(grandchild), 10, what="the orphan to stop itself")
    finally:
        middle.kill()
        middle.wait(10)
        if grandchild and _running(grandchild):
            os.kill(grandchild, signal.SIGKILL)
