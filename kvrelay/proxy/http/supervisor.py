"""Worker supervision for `--workers N`: start N worker processes, restart any that exits.

The parent waits on every worker at once (not one after another), so a worker that dies is
reaped at once, logged with its exit code, its Prometheus multiprocess live-gauge files are
marked dead (so `/metrics` on the survivors stops counting its in-flight requests), and a new
worker takes its slot after a back-off that doubles while the slot keeps failing quickly. The
others keep serving the shared port throughout: one worker's death never stops the proxy.

SIGTERM/SIGINT stop the restarts and forward SIGTERM to every live worker, each of which drains
its in-flight streams (aiohttp's shutdown timeout); the parent returns once all have exited.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import connection
from multiprocessing.context import SpawnProcess
from types import FrameType

from prometheus_client import multiprocess

log = logging.getLogger(__name__)

# A worker that lived this long before exiting is treated as healthy: its slot's back-off resets.
STABLE_AFTER_S = 30.0
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0


@dataclass
class WorkerSlot:
    """One worker position: the running process (or None while waiting to restart)."""

    index: int
    proc: SpawnProcess | None = None
    started_at: float = 0.0
    backoff_s: float = FIRST_BACKOFF_S
    restart_at: float | None = None
    restarts: int = field(default=0)


class Supervisor:
    """Runs `count` processes made by `make_process(index)` until SIGTERM/SIGINT."""

    def __init__(self, count: int, make_process: Callable[[int], SpawnProcess]) -> None:
        self._make = make_process
        self._slots = [WorkerSlot(i) for i in range(count)]
        self._stopping = False
        # Self-pipe: the signal handler writes one byte so the wait below wakes at once.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    @property
    def pids(self) -> list[int]:
        return [s.proc.pid for s in self._slots if s.proc is not None and s.proc.pid is not None]

    def _start(self, slot: WorkerSlot) -> None:
        slot.proc = self._make(slot.index)
        slot.proc.start()
        slot.started_at = time.monotonic()
        slot.restart_at = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stopping = True
        for slot in self._slots:
            proc = slot.proc
            if proc is not None and proc.pid is not None and proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _reap(self, slot: WorkerSlot) -> None:
        """The slot's process has exited: log it, mark its metrics dead, schedule a restart."""
        proc = slot.proc
        assert proc is not None and proc.pid is not None
        proc.join()
        pid, code = proc.pid, proc.exitcode
        proc.close()
        slot.proc = None
        _mark_metrics_dead(pid)
        if self._stopping:
            log.info("worker %d (pid %d) exited with %s", slot.index, pid, code)
            return
        lived = time.monotonic() - slot.started_at
        if lived >= STABLE_AFTER_S:
            slot.backoff_s = FIRST_BACKOFF_S
        delay = slot.backoff_s
        slot.backoff_s = min(slot.backoff_s * 2, MAX_BACKOFF_S)
        slot.restart_at = time.monotonic() + delay
        slot.restarts += 1
        log.error(
            "worker %d (pid %d) exited with %s after %.1fs; restarting it in %.1fs "
            "(the other workers keep serving)",
            slot.index,
            pid,
            code,
            lived,
            delay,
        )

    def run(self) -> int:
        """Serve until signalled; returns 0 after every worker has exited."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for slot in self._slots:
            self._start(slot)
        try:
            while True:
                running = {s.proc.sentinel: s for s in self._slots if s.proc is not None}
                if self._stopping and not running:
                    return 0
                timeout = self._next_restart_in()
                ready = connection.wait([*running, self._wake_r], timeout)
                for handle in ready:
                    if handle == self._wake_r:
                        with contextlib.suppress(BlockingIOError, OSError):
                            os.read(self._wake_r, 64)
                    elif isinstance(handle, int) and handle in running:
                        self._reap(running[handle])
                if not self._stopping:
                    now = time.monotonic()
                    for slot in self._slots:
                        due = slot.restart_at is not None and slot.restart_at <= now
                        if slot.proc is None and due:
                            self._start(slot)
                            log.warning(
                                "worker %d restarted (pid %s)",
                                slot.index,
                                slot.proc.pid if slot.proc else None,
                            )
        finally:
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _next_restart_in(self) -> float | None:
        if self._stopping:
            return None
        pending = [s.restart_at for s in self._slots if s.proc is None and s.restart_at]
        if not pending:
            return None
        return max(0.0, min(pending) - time.monotonic())


def _mark_metrics_dead(pid: int) -> None:
    """Drop a dead worker's live-gauge files (prometheus-client multiprocess mode)."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return
    try:
        multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
    except OSError as exc:  # a metrics directory problem must not stop supervision
        log.warning("could not mark worker pid %d dead in %s: %s", pid, path, exc)
