"""`MemoryMap`: the default in-process backend, bounded by entry count (LRU) with TTL expiry.

Every operation runs without awaiting anything, so on one event loop each is atomic: of any
number of concurrent `take`s exactly one finds the entry. A map belongs to one event loop.
Expiry is reported actively: a sweeper task pops due entries from a deadline heap, so an
entry nobody touches again is still reported (and its blocks released) soon after its TTL.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from kvrelay.kvcache_map._base import (
    CLOSE_DRAIN_TIMEOUT,
    Counters,
    EvictionCallback,
    EvictionNotifier,
    EvictionReason,
    MapStats,
    build_stats,
    check_ttl,
    stop_task,
)
from kvrelay.kvcache_map._entry import ConversationKey, KVEntry, validate_key

DEFAULT_MAX_ENTRIES = 100_000
DEFAULT_SWEEP_INTERVAL = 0.5


class _Slot(NamedTuple):
    entry: KVEntry
    deadline: float  # on the map's clock (monotonic by default)
    seq: int  # identifies this put, so stale heap items are recognised


class MemoryMap:
    """In-process `KVMap`: LRU over at most `max_entries` entries, each with a TTL.

    Leaving entries are reported to `on_evict`: EVICTED (LRU bound), EXPIRED (TTL),
    REPLACED (overwritten by `put`), and DELETED for entries still present when the map is
    closed (nobody else can reach them afterwards). `take`/`delete` are not reported.
    """

    backend = "memory"

    def __init__(
        self,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        on_evict: EvictionCallback | None = None,
        sweep_interval: float = DEFAULT_SWEEP_INTERVAL,
        report_on_close: bool = True,
        close_timeout: float = CLOSE_DRAIN_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError("max_entries must be a positive integer")
        if not sweep_interval > 0:
            raise ValueError("sweep_interval must be positive")
        self.max_entries = max_entries
        self.sweep_interval = sweep_interval
        self.close_timeout = close_timeout
        self._report_on_close = report_on_close
        self._clock = clock
        self._data: OrderedDict[ConversationKey, _Slot] = OrderedDict()
        self._heap: list[tuple[float, int, ConversationKey]] = []
        self._seq = itertools.count()
        self._notifier = EvictionNotifier(on_evict)
        self._counters = Counters()
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False

    # -- KVMap -------------------------------------------------------------------------------

    async def get(self, key: ConversationKey) -> KVEntry | None:
        self._ready(key)
        slot = self._data.get(key)
        if slot is None:
            self._counters.misses += 1
            return None
        if slot.deadline <= self._clock():
            del self._data[key]
            self._notifier.notify(key, slot.entry, EvictionReason.EXPIRED)
            self._counters.misses += 1
            return None
        self._data.move_to_end(key)
        self._counters.hits += 1
        return slot.entry

    async def put(self, key: ConversationKey, entry: KVEntry, ttl: float) -> None:
        self._ready(key)
        if not isinstance(entry, KVEntry):
            raise TypeError("entry must be a KVEntry")
        now = self._clock()
        deadline = now + check_ttl(ttl)
        seq = next(self._seq)
        old = self._data.pop(key, None)
        if old is not None:
            reason = EvictionReason.EXPIRED if old.deadline <= now else EvictionReason.REPLACED
            self._notifier.notify(key, old.entry, reason)
        self._data[key] = _Slot(entry, deadline, seq)
        heapq.heappush(self._heap, (deadline, seq, key))
        self._counters.puts += 1
        while len(self._data) > self.max_entries:
            lru_key, lru = self._data.popitem(last=False)
            reason = EvictionReason.EXPIRED if lru.deadline <= now else EvictionReason.EVICTED
            self._notifier.notify(lru_key, lru.entry, reason)
        # Replaced/taken entries leave stale heap items behind; rebuild before they dominate.
        if len(self._heap) > 2 * len(self._data) + 1024:
            self._heap = [(s.deadline, s.seq, k) for k, s in self._data.items()]
            heapq.heapify(self._heap)

    async def take(self, key: ConversationKey) -> KVEntry | None:
        entry = self._remove(key)
        if entry is None:
            self._counters.misses += 1
            return None
        self._counters.hits += 1
        self._counters.takes += 1
        return entry

    async def delete(self, key: ConversationKey) -> KVEntry | None:
        entry = self._remove(key)
        if entry is not None:
            self._counters.deletes += 1
        return entry

    async def stats(self) -> MapStats:
        return build_stats(self.backend, len(self._data), True, self._counters, self._notifier)

    async def close(self) -> None:
        """Stop the sweeper, report what is left (unless `report_on_close=False`), and wait
        for every pending `on_evict` callback."""
        if self._closed:
            return
        self._closed = True
        if self._sweeper is not None:
            await stop_task(self._sweeper)
        if self._report_on_close:
            now = self._clock()
            for key, slot in self._data.items():
                reason = EvictionReason.EXPIRED if slot.deadline <= now else EvictionReason.DELETED
                self._notifier.notify(key, slot.entry, reason)
        self._data.clear()
        self._heap.clear()
        await self._notifier.drain(within=self.close_timeout)

    # -- extras ------------------------------------------------------------------------------

    def sweep_once(self) -> int:
        """Remove and report every entry whose TTL has run out; returns how many."""
        now = self._clock()
        heap, reported = self._heap, 0
        while heap and heap[0][0] <= now:
            _, seq, key = heapq.heappop(heap)
            slot = self._data.get(key)
            if slot is not None and slot.seq == seq:
                del self._data[key]
                self._notifier.notify(key, slot.entry, EvictionReason.EXPIRED)
                reported += 1
        return reported

    async def drain(self) -> None:
        """Wait for the `on_evict` callbacks started so far."""
        await self._notifier.drain()

    def __len__(self) -> int:
        return len(self._data)

    # -- internals ---------------------------------------------------------------------------

    def _ready(self, key: ConversationKey) -> None:
        if self._closed:
            raise RuntimeError("map is closed")
        validate_key(key)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    def _remove(self, key: ConversationKey) -> KVEntry | None:
        self._ready(key)
        slot = self._data.pop(key, None)
        if slot is None:
            return None
        if slot.deadline <= self._clock():
            self._notifier.notify(key, slot.entry, EvictionReason.EXPIRED)
            return None
        return slot.entry

    async def _sweep_forever(self) -> None:
        while not self._closed:
            # A periodic timer, not synchronisation: expiry is checked on every access too.
            await asyncio.sleep(self.sweep_interval)
            self.sweep_once()
