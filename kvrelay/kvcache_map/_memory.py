"""`MemoryMap`: the default in-process backend, bounded by entry count (LRU) with TTL expiry.

Every operation runs without awaiting anything, so on one event loop each is atomic: of any
number of concurrent `take`s exactly one finds the entry. A map belongs to one event loop.
Expiry is reported actively: a sweeper task visits due deadline buckets (live keys grouped by
deadline, one bucket per `sweep_interval`), so an entry nobody touches again is still reported
(and its blocks released) soon after its TTL.

Why buckets and not a heap of deadlines: a heap cannot drop a taken entry, so every put+take
pair left a stale item behind, and the periodic rebuild that cleared them (and the collector
walks those items set off) cost more per pair the more entries the map held. A bucket is a set:
`take` removes the key from it, nothing stale is left, and every operation costs the same at
1k or 1M entries (`bench/kvmap.py --scale`).
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import NamedTuple

from kvrelay.kvcache_map._base import (
    CLOSE_DRAIN_TIMEOUT,
    EvictionCallback,
    EvictionReason,
    MapStats,
    MapUpkeep,
    check_ttl,
)
from kvrelay.kvcache_map._entry import ConversationKey, KVEntry, validate_key

DEFAULT_MAX_ENTRIES = 100_000
DEFAULT_SWEEP_INTERVAL = 0.5
# Entries per shard of the slot table (`_Slots`): a map allowed more is split into shards.
SHARD_ENTRIES = 16_384


class _Slot(NamedTuple):
    entry: KVEntry
    deadline: float  # on the map's clock (monotonic by default)
    bucket: int  # the deadline bucket that lists this key (`MemoryMap._bucket_of`)


class _Slots:
    """The live entries in least-recently-put order, split by key hash into shards of at most
    about `SHARD_ENTRIES` once `max_entries` allows more.

    Why shards: a put after a take uses a fresh slot of the table, and when churn has used them
    all CPython rebuilds the whole table at once, with the event loop stopped. With one table of
    1M entries that took about 0.4 s (`bench/kvmap.py --scale`); a shard rebuilds only its own
    entries. Eviction takes the oldest entry of the shard the new key went into, which is exact
    LRU with one shard and, with keys spread evenly over many shards, one of the oldest.
    """

    def __init__(self, max_entries: int) -> None:
        count = -(-max_entries // SHARD_ENTRIES) if max_entries > SHARD_ENTRIES else 1
        self._shards: list[OrderedDict[ConversationKey, _Slot]] = [
            OrderedDict() for _ in range(count)
        ]
        self._len = 0

    def _shard(self, key: ConversationKey) -> OrderedDict[ConversationKey, _Slot]:
        shards = self._shards
        return shards[0] if len(shards) == 1 else shards[hash(key) % len(shards)]

    def __len__(self) -> int:
        return self._len

    def get(self, key: ConversationKey) -> _Slot | None:
        return self._shard(key).get(key)

    def deadline_of(self, key: ConversationKey) -> float:
        """The deadline of a live key."""
        return self._shard(key)[key].deadline

    def touch(self, key: ConversationKey) -> None:
        """Make `key` the most recently used of its shard."""
        self._shard(key).move_to_end(key)

    def pop(self, key: ConversationKey) -> _Slot | None:
        slot = self._shard(key).pop(key, None)
        if slot is not None:
            self._len -= 1
        return slot

    def add(self, key: ConversationKey, slot: _Slot) -> None:
        """Store a key that is not present (callers pop it first)."""
        self._shard(key)[key] = slot
        self._len += 1

    def pop_oldest(self, near: ConversationKey) -> tuple[ConversationKey, _Slot]:
        """Remove the oldest entry of `near`'s shard, or of another when that shard holds only
        `near` itself (just put: never the one evicted)."""
        shard = self._shard(near)
        if len(shard) < 2:
            shard = max(self._shards, key=len)
        self._len -= 1
        return shard.popitem(last=False)

    def items(self) -> Iterator[tuple[ConversationKey, _Slot]]:
        for shard in self._shards:
            yield from shard.items()

    def clear(self) -> None:
        for shard in self._shards:
            shard.clear()
        self._len = 0


class MemoryMap(MapUpkeep):
    """In-process `KVMap`: LRU over at most `max_entries` entries, each with a TTL.

    Leaving entries are reported to `on_evict`: EVICTED (LRU bound), EXPIRED (TTL),
    REPLACED (overwritten by `put`), and DELETED for entries still present when the map is
    closed (nobody else can reach them afterwards). `take`/`delete` are not reported.
    """

    backend = "memory"
    in_process = True  # no operation waits: `put` and `take` never suspend

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
        super().__init__(on_evict, close_timeout)
        self.max_entries = max_entries
        self.sweep_interval = sweep_interval
        self._report_on_close = report_on_close
        self._clock = clock
        self._data = _Slots(max_entries)
        # Every live key is in exactly one bucket; `_due` holds each bucket's number once, so
        # the sweep finds the earliest bucket without scanning. Emptied buckets stay until
        # the sweep passes them: dropping one on `take` and making it again on the next `put`
        # would push its number again each time.
        self._buckets: dict[int, set[ConversationKey]] = {}
        self._due: list[int] = []

    # -- KVMap -------------------------------------------------------------------------------

    async def get(self, key: ConversationKey) -> KVEntry | None:
        self._ready(key)
        slot = self._data.get(key)
        if slot is None:
            self._counters.misses += 1
            return None
        if slot.deadline <= self._clock():
            self._data.pop(key)
            self._unschedule(key, slot)
            self._notifier.notify(key, slot.entry, EvictionReason.EXPIRED)
            self._counters.misses += 1
            return None
        self._data.touch(key)
        self._counters.hits += 1
        return slot.entry

    async def put(self, key: ConversationKey, entry: KVEntry, ttl: float) -> None:
        self._ready(key)
        if not isinstance(entry, KVEntry):
            raise TypeError("entry must be a KVEntry")
        now = self._clock()
        deadline = now + check_ttl(ttl)
        old = self._data.pop(key)
        if old is not None:
            self._unschedule(key, old)
            reason = EvictionReason.EXPIRED if old.deadline <= now else EvictionReason.REPLACED
            self._notifier.notify(key, old.entry, reason)
        bucket = self._bucket_of(deadline)
        self._data.add(key, _Slot(entry, deadline, bucket))
        keys = self._buckets.get(bucket)
        if keys is None:
            keys = self._buckets[bucket] = set()
            heapq.heappush(self._due, bucket)
        keys.add(key)
        self._counters.puts += 1
        while len(self._data) > self.max_entries:
            lru_key, lru = self._data.pop_oldest(near=key)
            self._unschedule(lru_key, lru)
            reason = EvictionReason.EXPIRED if lru.deadline <= now else EvictionReason.EVICTED
            self._notifier.notify(lru_key, lru.entry, reason)

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
        return self._stats(len(self._data), True)

    async def close(self) -> None:
        """Stop the sweeper, report what is left (unless `report_on_close=False`), and wait
        for every pending `on_evict` callback."""
        if not await self._stop_sweeping():
            return
        if self._report_on_close:
            now = self._clock()
            for key, slot in self._data.items():
                reason = EvictionReason.EXPIRED if slot.deadline <= now else EvictionReason.DELETED
                self._notifier.notify(key, slot.entry, reason)
        self._data.clear()
        self._buckets.clear()
        self._due.clear()
        await self._notifier.drain(within=self.close_timeout)

    # -- extras ------------------------------------------------------------------------------

    def sweep_once(self) -> int:
        """Remove and report every entry whose TTL has run out; returns how many."""
        now = self._clock()
        current = self._bucket_of(now)
        reported = 0
        while self._due and self._due[0] <= current:
            bucket = self._due[0]
            keys = self._buckets[bucket]
            if bucket < current:
                # Every deadline in an earlier bucket is before `now`: all of it is due.
                heapq.heappop(self._due)
                del self._buckets[bucket]
                due = list(keys)
            else:
                # The bucket `now` falls in: only the deadlines up to `now`, the rest stay.
                due = [k for k in keys if self._data.deadline_of(k) <= now]
                keys.difference_update(due)
            for key in due:
                slot = self._data.pop(key)
                assert slot is not None  # every key in a bucket is live
                self._notifier.notify(key, slot.entry, EvictionReason.EXPIRED)
            reported += len(due)
            if bucket == current:
                break
        return reported

    def __len__(self) -> int:
        return len(self._data)

    # -- internals ---------------------------------------------------------------------------

    def _ready(self, key: ConversationKey) -> None:
        if self._closed:
            raise RuntimeError("map is closed")
        validate_key(key)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    def _bucket_of(self, deadline: float) -> int:
        # Division by a fixed positive number is monotonic in floating point, so a deadline
        # never lands in a bucket after the one its `now` falls in (see `sweep_once`).
        return math.floor(deadline / self.sweep_interval)

    def _unschedule(self, key: ConversationKey, slot: _Slot) -> None:
        self._buckets[slot.bucket].discard(key)

    def _remove(self, key: ConversationKey) -> KVEntry | None:
        self._ready(key)
        slot = self._data.pop(key)
        if slot is None:
            return None
        self._unschedule(key, slot)
        if slot.deadline <= self._clock():
            self._notifier.notify(key, slot.entry, EvictionReason.EXPIRED)
            return None
        return slot.entry

    async def _sweep_forever(self) -> None:
        while not self._closed:
            # A periodic timer, not synchronisation: expiry is checked on every access too.
            await asyncio.sleep(self.sweep_interval)
            self.sweep_once()
