"""A supervised worker stops when its supervisor dies.

Without this a `kill -9` of the parent leaves its workers serving the shared port (SO_REUSEPORT),
so a restarted proxy shares it with them and half the traffic keeps the old settings. Two
mechanisms, because either alone has a gap: Linux's parent-death signal (`prctl`
PR_SET_PDEATHSIG) is immediate but is tied to the parent *thread* that started the worker and
exists only on Linux; a thread that checks every `POLL_S` whether the worker has been
re-parented covers the rest. Either sends the worker SIGTERM, its ordinary stop: aiohttp closes
the listening socket first (the port is free at once), then lets in-flight answers finish within
the shutdown timeout.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 1.0


def _set_parent_death_signal(signum: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


def _watch(parent_pid: int, signum: int, poll_s: float) -> None:
    stop = threading.Event()
    while not stop.wait(poll_s):
        if os.getppid() != parent_pid:
            log.error("the supervisor (pid %d) is gone: this worker stops", parent_pid)
            os.kill(os.getpid(), signum)
            return


def exit_with_parent(parent_pid: int, poll_s: float = POLL_S) -> None:
    """Have this process get SIGTERM once `parent_pid` is no longer its parent."""
    _set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent_pid:
        # The parent died before the death signal was armed: nothing will send it.
        log.error("the supervisor (pid %d) is already gone: this worker stops", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(
        target=_watch,
        args=(parent_pid, signal.SIGTERM, poll_s),
        daemon=True,
        name="kvrelay-parent-watch",
    ).start()
