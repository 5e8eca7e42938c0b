"""Releases sent to holders in the background: bounded retries, per-holder concurrency.

A release tells a holder it may free blocks nobody will read. Each holder (host, port) gets its
own queue and at most `per_holder` sender threads, created on demand and gone when the queue is
empty, so a holder that is slow, dead or blackholed delays only its own releases. A network
failure is retried with backoff up to `attempts` times; an answer (released, unknown, refused)
is final. Whatever is never delivered is left to the holder's lease. Torch-free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from kvrelay.connector.protocol import HoldRef
from kvrelay.connector.sidechannel_client import (
    HolderNotAllowedError,
    SideChannelClient,
    SideChannelError,
)
from kvrelay.connector.stats import Counters

log = logging.getLogger(__name__)

_BACKOFF_S = 0.1
_MAX_QUEUED_PER_HOLDER = 10_000


@dataclass(frozen=True)
class Release:
    """One release: the hold to free, and the reader giving up (if any)."""

    hold: HoldRef
    reader_engine_id: str | None = None
    reader_request_id: str | None = None


@dataclass
class _Holder:
    queue: deque[Release] = field(default_factory=deque)
    senders: int = 0


class ReleaseSender:
    """Delivers `Release`s (see module docstring); counts releases_sent / releases_failed."""

    def __init__(
        self,
        client: SideChannelClient,
        counters: Counters,
        attempts: int = 3,
        per_holder: int = 2,
        name: str = "kvrelay-release",
    ) -> None:
        self._client = client
        self._counters = counters
        self._attempts = attempts
        self._per_holder = per_holder
        self._name = name
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._holders: dict[tuple[str, int], _Holder] = {}
        self._closed = False

    def submit(self, item: Release) -> None:
        key = (item.hold.remote_host, item.hold.remote_port)
        with self._lock:
            if self._closed:
                return
            holder = self._holders.setdefault(key, _Holder())
            if len(holder.queue) >= _MAX_QUEUED_PER_HOLDER:
                self._counters.inc("releases_dropped")  # its lease still frees it
                return
            holder.queue.append(item)
            if holder.senders >= self._per_holder:
                return
            holder.senders += 1
        threading.Thread(
            target=self._drain,
            args=(key,),
            name=f"{self._name}-{key[0]}:{key[1]}",
            daemon=True,
        ).start()

    def pending(self) -> int:
        """Releases queued or being sent (for tests and stats)."""
        with self._lock:
            return sum(len(h.queue) + h.senders for h in self._holders.values())

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop taking releases; wait (bounded) for the ones under way."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._closed = True
            for holder in self._holders.values():
                holder.queue.clear()
            while any(h.senders for h in self._holders.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(left)

    def _drain(self, key: tuple[str, int]) -> None:
        while True:
            with self._lock:
                holder = self._holders[key]
                if not holder.queue:
                    holder.senders -= 1
                    if holder.senders == 0:
                        del self._holders[key]
                    self._idle.notify_all()
                    return
                item = holder.queue.popleft()
            self._deliver(item)

    def _deliver(self, item: Release) -> None:
        for attempt in range(self._attempts):
            try:
                hold = item.hold
                self._client.release(
                    hold.remote_host,
                    hold.remote_port,
                    hold.remote_request_id,
                    hold.release_token,
                    reader_engine_id=item.reader_engine_id,
                    reader_request_id=item.reader_request_id,
                )
            except SideChannelError as exc:
                final = exc.status is not None or isinstance(exc, HolderNotAllowedError)
                if final or attempt + 1 == self._attempts or self._closed:
                    # An answer (e.g. 403) or a refused address will not change; network
                    # trouble had its retries.
                    self._counters.inc("releases_failed")
                    log.info("release of %s not delivered: %s", item.hold.remote_request_id, exc)
                    return
                time.sleep(_BACKOFF_S * 2**attempt)  # retry backoff, not synchronisation
                continue
            self._counters.inc("releases_sent")
            return
