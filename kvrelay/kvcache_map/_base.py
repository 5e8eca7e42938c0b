"""The interface every backend implements (`KVMap`), its statistics, and the eviction
reporting both backends share.

Reporting rule: an entry that leaves the map without the caller getting it back is reported
to `on_evict` once, because it describes KV blocks someone must release. `take` and `delete`
hand the entry to the caller, so they are never reported.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from kvrelay.kvcache_map._entry import ConversationKey, KVEntry

log = logging.getLogger(__name__)

# How long `close()` waits for pending `on_evict` callbacks before cancelling them.
CLOSE_DRAIN_TIMEOUT = 30.0


class EvictionReason(StrEnum):
    """Why an entry left the map without being taken."""

    EVICTED = "evicted"  # pushed out by the entry-count bound (memory LRU)
    EXPIRED = "expired"  # its TTL ran out
    REPLACED = "replaced"  # a `put` for the same key overwrote it
    DELETED = "deleted"  # dropped with the map itself (`MemoryMap.close`), not by `delete`


EvictionCallback = Callable[[ConversationKey, KVEntry, EvictionReason], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class MapStats:
    """Counters of one map instance (`entries` is the store's, shared across replicas)."""

    backend: str
    entries: int | None  # None when the store cannot be asked (Redis down)
    available: bool
    hits: int
    misses: int
    puts: int
    takes: int
    deletes: int
    evicted: int
    expired: int
    replaced: int
    deleted: int
    corrupt: int
    unavailable_errors: int
    callback_errors: int

    def as_dict(self) -> dict[str, int | str | bool | None]:
        return asdict(self)


@runtime_checkable
class KVMap(Protocol):
    """Conversation → reusable KV entry. All methods may raise `MapUnavailableError` (Redis),
    and key-taking ones `KeyTooLongError`/`InvalidKeyError` for keys no backend accepts."""

    # True when every operation completes without waiting (the in-process map): a caller may
    # then run `put` inline, where a cancellation cannot reach it, instead of in a task.
    in_process: bool

    async def get(self, key: ConversationKey) -> KVEntry | None: ...

    async def put(self, key: ConversationKey, entry: KVEntry, ttl: float) -> None:
        """Store for `ttl` seconds; an entry already under `key` is reported REPLACED.

        `UnconfirmedPutError` (a `MapUnavailableError`) when the put may have been stored all
        the same (timed out after it went out): its `settle()` says which, before the caller
        frees the entry's blocks."""

    async def take(self, key: ConversationKey) -> KVEntry | None:
        """Atomic get-and-delete: of concurrent takers exactly one gets the entry."""

    async def delete(self, key: ConversationKey) -> KVEntry | None:
        """Remove and return the entry (not reported: the caller releases it)."""

    async def stats(self) -> MapStats: ...

    async def close(self) -> None: ...


@dataclass
class MapCounters:
    """Plain per-instance operation counters a backend increments."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    takes: int = 0
    deletes: int = 0
    corrupt: int = 0
    unavailable_errors: int = 0


def check_ttl(ttl: float) -> float:
    """A TTL must be a positive finite number of seconds."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < float("inf"):
        raise ValueError("ttl must be a positive finite number of seconds")
    return float(ttl)


class EvictionNotifier:
    """Runs `on_evict` for each reported entry in its own task and counts reasons.

    Callbacks release blocks over HTTP; running them in tasks keeps `put` fast and a slow or
    failing callback away from the map's callers. Failures are logged and counted, never
    raised. `drain()` waits for the callbacks started so far (used by `close()` and tests).
    """

    def __init__(self, callback: EvictionCallback | None, concurrency: int = 64) -> None:
        self._callback = callback
        self._tasks: set[asyncio.Task[None]] = set()
        self._limit = asyncio.Semaphore(concurrency)
        self.counts: dict[EvictionReason, int] = dict.fromkeys(EvictionReason, 0)
        self.errors = 0

    def notify(self, key: ConversationKey, entry: KVEntry, reason: EvictionReason) -> None:
        self.counts[reason] += 1
        if self._callback is None:
            return
        task = asyncio.get_running_loop().create_task(self._run(key, entry, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, key: ConversationKey, entry: KVEntry, reason: EvictionReason) -> None:
        assert self._callback is not None
        async with self._limit:
            try:
                await self._callback(key, entry, reason)
            except Exception:
                self.errors += 1
                # The key and entry are not logged: conversation ids and release tokens are
                # the client's and the holder's business.
                log.exception("on_evict callback failed (reason=%s)", reason.value)

    @property
    def pending(self) -> int:
        return len(self._tasks)

    async def drain(self, within: float | None = None) -> None:
        """Wait until every callback started so far has finished.

        With `within`, callbacks still running after that many seconds are cancelled (and
        counted as errors): a map's `close()` must not hang on a release that never returns.
        """
        deadline = None if within is None else asyncio.get_running_loop().time() + within
        while self._tasks:
            left = None if deadline is None else deadline - asyncio.get_running_loop().time()
            if left is not None and left <= 0:
                stuck = list(self._tasks)
                self.errors += len(stuck)
                log.error("cancelling %d on_evict callbacks still running at close", len(stuck))
                for task in stuck:
                    task.cancel()
                await asyncio.wait(stuck)
                return
            await asyncio.wait(set(self._tasks), timeout=left)


async def stop_task(task: asyncio.Task[None]) -> None:
    """Cancel `task` and wait until it has finished.

    Re-cancels until done: a cancellation that lands while a library converts it (an
    `asyncio.timeout` expiring in the same loop iteration, a client's own clean-up) must not
    leave a background loop running and `close()` waiting forever.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.cancelled() and task.exception() is not None:
        log.error("background task failed: %r", task.exception())


class MapUpkeep:
    """What every backend keeps beside its entries: eviction reporting, operation counters,
    the sweeper task and the closed flag, and the statistics and closing built from them.

    A backend sets `backend`, starts `_sweeper` on first use and ends `close()` its own way
    once `_stop_sweeping()` has said the map was still open.
    """

    backend: str

    def __init__(self, on_evict: EvictionCallback | None, close_timeout: float) -> None:
        self.close_timeout = close_timeout
        self._notifier = EvictionNotifier(on_evict)
        self._counters = MapCounters()
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False

    async def drain(self) -> None:
        """Wait for the `on_evict` callbacks started so far."""
        await self._notifier.drain()

    def _stats(self, entries: int | None, available: bool) -> MapStats:
        return build_stats(self.backend, entries, available, self._counters, self._notifier)

    async def _stop_sweeping(self) -> bool:
        """Mark the map closed and stop its sweeper; False when it was closed already."""
        if self._closed:
            return False
        self._closed = True
        if self._sweeper is not None:
            await stop_task(self._sweeper)
        return True


def build_stats(
    backend: str,
    entries: int | None,
    available: bool,
    counters: MapCounters,
    notifier: EvictionNotifier,
) -> MapStats:
    """One `MapStats` from a backend's operation counters and its eviction notifier."""
    return MapStats(
        backend=backend,
        entries=entries,
        available=available,
        hits=counters.hits,
        misses=counters.misses,
        puts=counters.puts,
        takes=counters.takes,
        deletes=counters.deletes,
        evicted=notifier.counts[EvictionReason.EVICTED],
        expired=notifier.counts[EvictionReason.EXPIRED],
        replaced=notifier.counts[EvictionReason.REPLACED],
        deleted=notifier.counts[EvictionReason.DELETED],
        corrupt=counters.corrupt,
        unavailable_errors=counters.unavailable_errors,
        callback_errors=notifier.errors,
    )
