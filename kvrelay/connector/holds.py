"""The holder's lease table: which finished requests keep blocks for a remote reader.

Shared by the engine's scheduler thread and the side-channel thread, so every method takes the
lock. An entry ends in exactly one way, counted once: read (every expected reader notified),
release (side channel or rejection), expiry (lease over, not pinned by a claim), reclaim (the
engine needs blocks) or budget (holds pin more of the engine's blocks than they may). Deciding
to free only queues the request id; the engine frees blocks when a worker reports it in
`finished_sending` (the scheduler routes the id through the per-step metadata), and `finalize`
then drops the entry.

Holds kept for a later turn are cache, and one client must not be able to take it all: each
carries its owner (the tenant the proxy names in `hold_owner`), and the budget and reclaim free
holds from the owner pinning the most blocks first, its least recently used first (max-min
fairness: a flood of one owner's holds frees that owner's, while another owner under its share
keeps its own). Holds of one owner, or of none, go least recently used first, as before.
Holds for a transfer in progress (P's blocks for this turn's D) are not cache: the budget never
frees them, and reclaim only once one is older than the claim timeout (its reader is late).
"""

from __future__ import annotations

import heapq
import hmac
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvrelay.connector.stats import Counters


class FreeReason(StrEnum):
    READ = "read"
    RELEASE = "release"
    EXPIRY = "expiry"
    RECLAIM = "reclaim"
    BUDGET = "budget"


class ClaimOutcome(StrEnum):
    HELD = "held"
    GONE = "gone"
    CLAIMED = "claimed"  # another reader request owns the claim


# Who claimed a hold: (reader engine id, reader request id). One claim per hold, ever.
Claimant = tuple[str, str]


class ReleaseOutcome(StrEnum):
    RELEASED = "released"
    UNKNOWN = "unknown"
    FORBIDDEN = "forbidden"


@dataclass
class HoldEntry:
    request_id: str
    client_request_id: str | None
    block_ids: list[list[int]]
    num_tokens: int
    expires_at: float  # monotonic
    release_token: str
    created_at: float = field(default_factory=time.monotonic)
    pinned_until: float = 0.0
    claimed_by: Claimant | None = None
    release_requested: bool = False
    freeing: FreeReason | None = None
    # Kept for a later turn (D's `hold_blocks`), not for this turn's P -> D pull: only these
    # are cache the hold budget may free.
    next_turn: bool = False
    # Whose hold it is (the proxy's `hold_owner`: a tenant), for the fair share of the budget.
    owner: str = ""
    # A brief hold (the proxy's `hold_brief`): over the share one hold may pin, bounded by its
    # short lease and a share of its own instead of the budget, which neither counts nor frees
    # it.
    brief: bool = False

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.block_ids)


class HoldTable:
    """Lease-bounded holds plus the bounded store of finished params for streams."""

    def __init__(
        self,
        counters: Counters,
        claim_timeout_s: float,
        finished_ttl_s: float = 600.0,
        finished_max: int = 10_000,
    ) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, HoldEntry] = {}
        self._to_free: list[str] = []
        self._counters = counters
        self._claim_timeout_s = claim_timeout_s
        self._finished: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()
        self._finished_ttl_s = finished_ttl_s
        self._finished_max = finished_max
        # Until then a reader's cancelled READ of a freed, claimed hold may still be in flight:
        # the engine must keep stepping so NIXL progresses it to its end (see `draining`).
        self._drain_until = 0.0

    # --- holds -----------------------------------------------------------------------------
    def add(self, entry: HoldEntry) -> None:
        with self._lock:
            self._entries[entry.request_id] = entry
            self._counters.inc("holds_started")
            self._update_gauges()

    def claim(
        self, request_id: str, reader: Claimant, now: float | None = None
    ) -> tuple[ClaimOutcome, HoldEntry | None]:
        """Pin a live hold for ONE reader request; `(HELD, copy)` or why not.

        A hold is read once: the first reader request to claim it owns it for good, and the
        same (engine, request) asking again — a retried call, another TP rank — gets the same
        claim back. Any other reader is refused, so no second read can run on blocks the first
        reader's notification is about to free.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.freeing is not None or entry.release_requested:
                self._counters.inc("claims_gone")
                return ClaimOutcome.GONE, None
            if entry.claimed_by is not None and entry.claimed_by != reader:
                self._counters.inc("claims_refused")
                return ClaimOutcome.CLAIMED, None
            if entry.claimed_by is None:
                if entry.expires_at <= now:
                    self._mark(entry, FreeReason.EXPIRY)
                    self._counters.inc("claims_gone")
                    return ClaimOutcome.GONE, None
                entry.pinned_until = now + self._claim_timeout_s
                entry.claimed_by = reader
            elif entry.pinned_until <= now:
                # The owner's pin ran out: its read is over one way or another (no extension).
                self._counters.inc("claims_gone")
                return ClaimOutcome.GONE, None
            self._counters.inc("claims_held")
            return ClaimOutcome.HELD, HoldEntry(**entry.__dict__)

    def release(
        self,
        request_id: str,
        token: str | None,
        reader: Claimant | None = None,
        now: float | None = None,
    ) -> ReleaseOutcome:
        """Free a hold now; with `token=None` the caller is trusted (engine-internal).

        `reader` = the reader request that claimed it and now gives up: its pin ends with the
        release. Any other caller's release waits for the pin.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None:
                return ReleaseOutcome.UNKNOWN
            if token is not None and not hmac.compare_digest(entry.release_token, token):
                self._counters.inc("release_forbidden")
                return ReleaseOutcome.FORBIDDEN
            if entry.freeing is not None:
                return ReleaseOutcome.UNKNOWN
            if reader is not None and entry.claimed_by == reader:
                entry.pinned_until = 0.0
            if entry.pinned_until > now:
                # A claimed read may be copying these blocks right now: free when it ends
                # (its notification) or when the claim times out, never under it.
                if entry.release_requested:
                    return ReleaseOutcome.UNKNOWN
                entry.release_requested = True
            else:
                self._mark(entry, FreeReason.RELEASE)
            return ReleaseOutcome.RELEASED

    def reap(self, now: float | None = None) -> list[str]:
        """Queue EVERY expired, unpinned hold (and released-while-pinned ones whose pin ended)."""
        now = time.monotonic() if now is None else now
        marked: list[str] = []
        with self._lock:
            for entry in self._entries.values():
                if entry.freeing is not None or entry.pinned_until > now:
                    continue
                if entry.release_requested:
                    self._mark(entry, FreeReason.RELEASE)
                    marked.append(entry.request_id)
                elif entry.expires_at <= now:
                    self._mark(entry, FreeReason.EXPIRY)
                    marked.append(entry.request_id)
        return marked

    def reclaim(
        self,
        num_blocks: int,
        now: float | None = None,
        freeable: Callable[[HoldEntry], int] | None = None,
    ) -> int:
        """Free unpinned holds until `num_blocks` blocks are queued; returns blocks.

        Next-turn holds go first, in the fair order of `trim`; then holds for a transfer in
        progress older than the claim timeout (a reader that has not claimed by then is late),
        oldest first. A younger transfer hold is this turn's KV on its way to D: freeing it
        would make D recompute the prompt, so the engine waits for it instead.
        `freeable(entry)`: how many of its blocks the engine gets back by freeing it (blocks
        another request also uses, e.g. a running turn's prefix hit on them, stay in use);
        default all. A hold that frees none is kept: dropping it gains no block.
        """
        now = time.monotonic() if now is None else now
        freed = 0
        with self._lock:
            live = [e for e in self._entries.values() if e.freeing is None]
            cache = [e for e in live if e.next_turn]
            late = now - self._claim_timeout_s
            transfers = sorted(
                (e for e in live if not e.next_turn and e.created_at <= late),
                key=lambda e: e.created_at,
            )
            for entry in (*_fair_order(cache, lambda e: e.pinned_until <= now), *transfers):
                if freed >= num_blocks:
                    break
                if entry.pinned_until > now:
                    continue
                gain = entry.num_blocks if freeable is None else freeable(entry)
                if gain <= 0:
                    continue
                self._mark(entry, FreeReason.RECLAIM)
                freed += gain
        return freed

    def trim(
        self,
        max_blocks: int,
        keep: str | None = None,
        now: float | None = None,
        brief: bool = False,
    ) -> int:
        """Free unpinned next-turn holds until the live ones pin `max_blocks` blocks at most;
        returns the blocks queued. The budget's holds, or with `brief` the brief ones (their
        own bound: `hold_brief_max_fraction`).

        From the owner that pins the most blocks first (see the module docstring), and each
        owner's least recently used first: a hold is used last when its turn finishes, and a
        conversation's next turn is less likely to come the longer it has not (think times
        fall off with age). `keep` (the hold just made) is never freed: the latest turn is the
        likeliest to be continued, so the budget may be exceeded by it alone. Claimed holds
        stay (a reader may be copying them) and count against the budget and their owner's
        share. Holds for a P -> D pull of the same turn are transfers in progress, neither
        counted nor freed.
        """
        now = time.monotonic() if now is None else now
        freed = 0
        with self._lock:
            live = [
                e
                for e in self._entries.values()
                if e.freeing is None and e.next_turn and e.brief == brief
            ]
            excess = sum(e.num_blocks for e in live) - max_blocks
            if excess <= 0:
                return 0

            def can_free(entry: HoldEntry) -> bool:
                return entry.request_id != keep and entry.pinned_until <= now

            for entry in _fair_order(live, can_free):
                if freed >= excess:
                    break
                self._mark(entry, FreeReason.BUDGET)
                freed += entry.num_blocks
        return freed

    @property
    def claim_timeout_s(self) -> float:
        return self._claim_timeout_s

    def take_frees(self) -> list[str]:
        """Holds the engine must free now (each handed out once)."""
        with self._lock:
            out, self._to_free = self._to_free, []
            return out

    def finalize(self, request_id: str) -> FreeReason | None:
        """The engine freed the blocks: count why, drop the entry. None if not ours."""
        with self._lock:
            entry = self._entries.pop(request_id, None)
            if entry is None:
                return None
            if entry.freeing is not None and request_id in self._to_free:
                # Freed by its readers while a release/expiry/reclaim decided since the last
                # step was still queued: the engine must not be told to free it again.
                self._to_free.remove(request_id)
            reason = entry.freeing or FreeReason.READ
            if entry.claimed_by is not None and reason is not FreeReason.READ:
                self._drain_until = max(self._drain_until, time.monotonic() + self._claim_timeout_s)
            self._counters.inc(f"freed_by_{reason.value}")
            self._update_gauges()
            return reason

    def draining(self, now: float | None = None) -> bool:
        """A claimed hold was freed unread recently: its reader's READ may still need us."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return now < self._drain_until

    def is_held(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._entries

    def held_count(self) -> int:
        with self._lock:
            return len(self._entries)

    def held_blocks(self) -> int:
        with self._lock:
            return sum(e.num_blocks for e in self._entries.values())

    def _mark(self, entry: HoldEntry, reason: FreeReason) -> None:
        entry.freeing = reason
        self._to_free.append(entry.request_id)

    def _update_gauges(self) -> None:
        self._counters.set("held", len(self._entries))
        self._counters.set("held_blocks", sum(e.num_blocks for e in self._entries.values()))

    # --- finished params, keyed by client request id (for streams) -------------------------
    def publish_finished(self, client_request_id: str, params: dict[str, Any]) -> None:
        now = time.monotonic()
        with self._lock:
            self._finished.pop(client_request_id, None)
            self._finished[client_request_id] = (now + self._finished_ttl_s, params)
            while len(self._finished) > self._finished_max:
                self._finished.popitem(last=False)
            self._counters.inc("finished_published")

    def finished(self, client_request_id: str) -> dict[str, Any] | None:
        now = time.monotonic()
        with self._lock:
            # Entries are in publish order with one TTL, so expired ones sit at the front.
            while self._finished:
                key, (deadline, _) = next(iter(self._finished.items()))
                if deadline > now:
                    break
                del self._finished[key]
            item = self._finished.get(client_request_id)
            return None if item is None else item[1]


def _fair_order(
    entries: Iterable[HoldEntry], can_free: Callable[[HoldEntry], bool]
) -> Iterator[HoldEntry]:
    """The holds `can_free` allows, in the order to free them: always one of the owner that
    now pins the most blocks (every hold of its counts, freeable or not; ties: the owner whose
    next candidate is older), oldest first within an owner. The caller stops when it has
    freed enough; each hold taken counts as freed from its owner's share."""
    pinned: dict[str, int] = {}
    queues: dict[str, deque[HoldEntry]] = {}
    for entry in sorted(entries, key=lambda e: e.created_at):
        pinned[entry.owner] = pinned.get(entry.owner, 0) + entry.num_blocks
        if can_free(entry):
            queues.setdefault(entry.owner, deque()).append(entry)
    heap = [(-pinned[owner], queue[0].created_at, owner) for owner, queue in queues.items()]
    heapq.heapify(heap)
    while heap:
        _, _, owner = heapq.heappop(heap)
        queue = queues[owner]
        entry = queue.popleft()
        yield entry
        pinned[owner] -= entry.num_blocks
        if queue:
            heapq.heappush(heap, (-pinned[owner], queue[0].created_at, owner))
