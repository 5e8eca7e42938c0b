"""Per-holder breaker for loads: a holder that stopped answering gets no new loads. Torch-free.

A holder whose side channel timed out (claim or handshake) or whose READs timed out is marked
down: new loads naming it fail at once (the engine recomputes them, or fails them under policy
`fail`) instead of queueing behind timeouts or adding quarantined blocks. After `retry_s`
one load is let through as a probe. The breaker closes when the holder shows it works again:
for a side-channel timeout, any answer of its side channel; for a READ timeout, a READ that
completes (an answering side channel says nothing about its NIXL progress). A probe that ends
without telling (e.g. the hold was gone) lets the next load probe. Thread-safe: the worker's
per-holder threads and its engine thread both report to it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

Holder = tuple[str, int]


class DownReason(StrEnum):
    SIDE_CHANNEL = "side_channel"  # a claim or handshake timed out or could not connect
    READ = "read"  # a NIXL READ timed out


@dataclass
class _Down:
    reason: DownReason
    retry_at: float
    probing: bool = False


class HolderBreaker:
    """Which holders get new loads (see module docstring)."""

    def __init__(self, retry_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down: dict[Holder, _Down] = {}

    def allow(self, holder: Holder) -> bool:
        """Whether a new load may contact `holder` (a probe, once per `retry_s`, when down)."""
        with self._lock:
            down = self._down.get(holder)
            if down is None:
                return True
            if down.probing or self._clock() < down.retry_at:
                return False
            down.probing = True
            return True

    def is_down(self, holder: Holder) -> bool:
        with self._lock:
            return holder in self._down

    def failed(self, holder: Holder, reason: DownReason) -> None:
        """The holder timed out: down (again) for `retry_s`."""
        with self._lock:
            current = self._down.get(holder)
            # A READ timeout outranks a side-channel one: only a completed READ clears it.
            if current is not None and current.reason is DownReason.READ:
                reason = DownReason.READ
            self._down[holder] = _Down(reason, self._clock() + self._retry_s)

    def answered(self, holder: Holder) -> None:
        """Its side channel answered: up again unless its READs are what timed out. Then the
        probe goes on (an answered claim says nothing about its READ): only the probe's READ
        ending (`read_done`, `failed`) or the load ending without one (`probe_over`) lets
        another load through."""
        with self._lock:
            down = self._down.get(holder)
            if down is not None and down.reason is DownReason.SIDE_CHANNEL:
                del self._down[holder]

    def read_done(self, holder: Holder) -> None:
        """A READ from it completed: up again."""
        with self._lock:
            self._down.pop(holder, None)

    def probe_over(self, holder: Holder) -> None:
        """A load ended without telling whether the holder works: the next one probes."""
        with self._lock:
            down = self._down.get(holder)
            if down is not None:
                down.probing = False

    def down_count(self) -> int:
        with self._lock:
            return len(self._down)
