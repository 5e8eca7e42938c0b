"""Whether a tenant's turns should ask D to hold their blocks: `HoldPayoff`.

A hold pins the turn's blocks in D's pool until the conversation's next turn takes them or the
lease ends, and pinned blocks are blocks neither D's batches nor its prefix cache can use. On
traffic that continues conversations many holds are taken; on traffic of one-off requests (a
shared system prompt and a question, an agent's single calls) none are, and every hold is pool
lost for nothing. So the proxy follows, per tenant, each hold its turns made until it is
*decided*: taken by the conversation's next turn and read by the engine that served it, or not
taken within the tenant's *patience* and so counted unused. A take that comes later still
counts as taken. A next turn that took the hold but read none of it (it went to another D, or
P's own cache had the history, or the holder's blocks were gone) counts as unused too: the
hold pinned D's pool for nothing all the same (`used`, from what the engines reported). A
hold still pending decides nothing. The decided counts decay by `DECAY` per decision (about
the last 64 weigh), and while fewer than `min_use` of them were read the tenant's turns do
not hold, except one in `1 / min_use`: those probe holds are how a change shows.

The patience depends on what the tenant has shown. Until one of its holds has been taken, it
is `patience_s` (`hold_judge_s`, 60 s): a tenant sending only one-off requests is judged within
a minute and `MIN_EVIDENCE` requests of its first, not after a whole conversation TTL. Once a
take has come, it is `ttl_s` (the conversation TTL: no take can come later), because a tenant
whose conversations continue may think for minutes (the Mooncake trace's next turns come 138 s
later at the median, 471 s at the 90th percentile) and judging its holds sooner stops holds
that pay (measured: reuse 0.85 of the LRU bound against 0.96 holding every turn, with a
minute's patience on that trace).

Holds already made do not wait for their lease once they stop paying: while a tenant's holds
do not pay, those counted unused are handed out by `unpaid` (each once) for the proxy to give
back (their map entries deleted, their blocks released), so a tenant's learning period pins D
for about its patience, not for the lease. A conversation whose next turn still comes finds no
history and computes it; that next turn counts as a take all the same (`missed`), so a tenant
judged too early on a patience shorter than its think times waits the TTL from then on and
holds again.

A conversation also decides for itself, turn by turn: where its last turn came back sooner than
the D that served it keeps a block nobody uses (`Router.cache_keeps_s`, read from D's own
histogram), its next turn most likely finds the history in that D's prefix cache unheld, so
this turn does not hold (`worth_holding(sooner_than_cache=True)`, counted `cache_keeps`). The
gap is the age of the hold its turn took (`taken`) or, where its last turn held nothing, the
time since that turn ended (`unheld`, read back by `missed`): a conversation whose turns slow
down past the cache's memory holds again at once, with no tenant-wide evidence to wait for.
The turn weighs this only where the router can find an unheld history in D's cache
(`Router.finds_unheld_history`: KV events followed, decode-only turns by them).

A conversation that answers at once (an agent's loop: the next turn sent as the answer ends)
also has its holds asked *brief* (`brief`): where its last gap, from its last turn's end to this
turn (the age of the hold this turn took, or the time since its last turn ended unheld or with
its hold declined, read back by `missed`), is shorter than `brief_s`, D is asked to keep a hold
over its `hold_max_fraction` as a brief hold (for its `hold_brief_lease_s`) instead of declining
it. Such a history is one a busy D's unheld cache loses within seconds, and its next turn would
compute it all again. A first turn has shown no pace and is not asked: most conversations end
after their first turn. Off by default (`brief_s` 0): on the conversation trace brief holds
bought no reuse and pinned more of D's pool (bench/RESULTS.md, "trace compare (conversation)",
run AL).

Counts are per worker process (each learns from the turns it serves) and per tenant, for at most
`MAX_TENANTS` tenants (least recently seen forgotten first: a forgotten tenant holds again
until it has shown otherwise), each following at most `MAX_PENDING` holds (the oldest dropped
undecided). Decisions are counted in `kvrelay_hold_decisions_total{decision}`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from kvrelay.proxy.telemetry import metrics

DECAY = 1 / 64  # each decided hold ages the counts by this share
MIN_EVIDENCE = 16.0  # decided holds (decayed) before a tenant's share is trusted
MAX_TENANTS = 4096
MAX_PENDING = 4096  # holds followed per tenant


@dataclass(slots=True)
class _Counts:
    taken: float = 0.0  # decided holds a next turn took, decayed
    decided: float = 0.0  # holds taken or past their patience, decayed alike
    # Holds not yet decided: key -> when it was made, oldest first (a key made again moves to
    # the end).
    pending: OrderedDict[Hashable, float] = field(default_factory=OrderedDict)
    # Holds counted unused, still takeable until the TTL: key -> when made.
    judged: OrderedDict[Hashable, float] = field(default_factory=OrderedDict)
    # Holds given back (`unpaid`), until the TTL: key -> when made. A next turn that looks one
    # up finds no entry, but its conversation did continue: that counts as a take.
    given_back: OrderedDict[Hashable, float] = field(default_factory=OrderedDict)
    # Turns that ended without a hold: key -> (when, the D that served it), until the TTL: the
    # conversation's next turn reads its gap back (`missed`).
    unheld: OrderedDict[Hashable, tuple[float, str]] = field(default_factory=OrderedDict)
    seen_take: bool = False  # one of the holds followed here was taken (late ones too)
    since_probe: int = 0  # turns declined since the last probe hold
    # Before this (the clock's time) no hold followed here is due to be decided or forgotten:
    # `_expire` returns at once, as it does on most turns (the oldest hold is seldom due).
    next_due: float = 0.0

    def decide(self, taken: bool) -> None:
        self.decided = self.decided * (1 - DECAY) + 1
        self.taken = self.taken * (1 - DECAY) + (1 if taken else 0)

    def patience(self, floor_s: float, ttl_s: float) -> float:
        """How long a hold waits for its take: `floor_s` until the tenant has shown a take,
        then the TTL (see the module docstring)."""
        return ttl_s if self.seen_take else min(floor_s, ttl_s)


@dataclass
class HoldPayoff:
    """Per tenant, whether holds pay (see the module's docstring)."""

    min_use: float
    patience_s: float  # the least a hold waits for its take before it counts as unused
    ttl_s: float  # the most: no turn can take a hold after the conversation TTL
    brief_s: float = 0.0  # a conversation's last gap under this: its hold asked brief (0: never)
    clock: Callable[[], float] = time.monotonic
    _tenants: OrderedDict[str, _Counts] = field(default_factory=OrderedDict)

    def worth_holding(self, tenant: str, sooner_than_cache: bool = False) -> bool:
        """Should this turn of `tenant` ask D to hold its blocks? `sooner_than_cache`: the
        conversation's last turn came back sooner than its D's cache keeps an unused block
        (see the module's docstring): declined, unless every turn holds (`min_use` 0)."""
        min_use = self.min_use
        if min_use <= 0:
            return True
        counts = self._tenants.get(tenant)
        if counts is not None:
            self._expire(counts)
        if sooner_than_cache:
            metrics.HOLD_DECISIONS.labels("cache_keeps").inc()
            return False
        if counts is None or not self._declining(counts):  # unjudged, or holds that pay
            metrics.HOLD_DECISIONS.labels("kept").inc()
            return True
        counts.since_probe += 1
        if counts.since_probe * min_use >= 1:
            counts.since_probe = 0
            metrics.HOLD_DECISIONS.labels("probe").inc()
            return True
        metrics.HOLD_DECISIONS.labels("declined").inc()
        return False

    def brief(self, gap_s: float | None) -> bool:
        """Whether D is asked to keep this turn's hold over its `hold_max_fraction` as a brief
        hold: its conversation's last gap `gap_s` (None: none known, a first turn) is shorter
        than `brief_s` (see the module's docstring). False: such a hold is declined."""
        return gap_s is not None and gap_s < self.brief_s

    def unpaid(self, tenant: str) -> list[Hashable]:
        """The keys of `tenant`'s holds counted unused, while its holds do not pay: to give
        back now instead of at their lease's end (each key is handed out once)."""
        counts = self._tenants.get(tenant)
        if counts is None or not counts.judged or not self._declining(counts):
            return []
        keys = list(counts.judged)
        counts.given_back.update(counts.judged)
        counts.judged.clear()
        while len(counts.given_back) > MAX_PENDING:
            counts.given_back.popitem(last=False)
        return keys

    def _declining(self, counts: _Counts) -> bool:
        return counts.decided >= MIN_EVIDENCE and counts.taken < self.min_use * counts.decided

    def made(self, tenant: str, key: Hashable) -> None:
        """A turn of `tenant` left a hold on D, stored under `key` for the next turn."""
        counts = self._counts(tenant)
        pending = counts.pending
        pending.pop(key, None)
        made = pending[key] = self.clock()
        # The soonest this hold is due: its patience is at least the floor's.
        counts.next_due = min(counts.next_due, made + min(self.patience_s, self.ttl_s))
        if len(pending) > MAX_PENDING:
            pending.popitem(last=False)

    def taken(self, tenant: str, key: Hashable) -> float | None:
        """A turn of `tenant` took the entry stored under `key`: no longer pending, also when
        it was already counted unused (a late take). A take of a hold followed here sets the
        tenant's patience to the TTL (its conversations continue). Whether the hold paid is
        decided once the turn's engines have said whether they read it (`used`). Returns the
        hold's age (None: this worker did not make it, or no longer follows it)."""
        counts = self._counts(tenant)
        made = counts.pending.pop(key, None)
        if made is None:
            made = counts.judged.pop(key, None)
        if made is None:
            return None
        counts.seen_take = True
        return self.clock() - made

    def used(self, tenant: str, read: bool, cache_kept: bool = False) -> None:
        """The turn of `tenant` that took a hold (`taken`) is served: decided taken when an
        engine `read` the held blocks, unused when none did, and unused too when the take came
        sooner than the holder's prefix cache keeps an unheld block (`cache_kept`: the hold
        pinned D's pool for what the cache would have kept anyway). Counted in
        `kvrelay_hold_decisions_total{decision="read"|"unread"|"cache_kept"}`. Decided also when
        another worker made the hold: with several workers each sees a share of the takes and of
        the holds (the ones it made and another's turn took expire here unused)."""
        paid = read and not cache_kept
        metrics.HOLD_DECISIONS.labels(
            "cache_kept" if read and cache_kept else "read" if read else "unread"
        ).inc()
        self._counts(tenant).decide(taken=paid)

    def unheld(self, tenant: str, key: Hashable, url: str) -> None:
        """A turn of `tenant` that could have held under `key` ended without a hold (not asked,
        or D declined it), served by the D at `url`: its conversation's next turn learns its gap
        from it (`missed`)."""
        if self.min_use <= 0 and self.brief_s <= 0:
            return  # every turn holds and none is brief: no gap is ever asked for
        counts = self._counts(tenant)
        unheld, now = counts.unheld, self.clock()
        unheld.pop(key, None)
        unheld[key] = (now, url)
        counts.next_due = min(counts.next_due, now + self.ttl_s)  # forgotten at the TTL
        if len(unheld) > MAX_PENDING:
            unheld.popitem(last=False)

    def missed(self, tenant: str, key: Hashable) -> tuple[float, str] | None:
        """A turn of `tenant` looked up `key` and found no entry: if it was a hold given back
        (`unpaid`), its conversation continued all the same, so it counts as taken (late), as
        `taken` counts it. Returns, where the conversation's last turn ended unheld
        (`unheld`), the time since and the D that served it; else None."""
        counts = self._tenants.get(tenant)
        if counts is None:
            return None
        if counts.given_back.pop(key, None) is not None:
            counts.seen_take = True
            counts.decide(taken=True)
        last = counts.unheld.pop(key, None)
        return None if last is None else (self.clock() - last[0], last[1])

    def _expire(self, counts: _Counts) -> None:
        """Holds past the tenant's patience were not taken: each is decided unused (and kept
        until the TTL, so that a late take is still known as this tenant's)."""
        now = self.clock()
        if now < counts.next_due:
            return
        pending, judged = counts.pending, counts.judged
        patience = counts.patience(self.patience_s, self.ttl_s)
        due = float("inf")
        while pending:
            key, made = next(iter(pending.items()))
            if now - made < patience:
                due = made + patience
                break
            del pending[key]
            counts.decide(taken=False)
            judged[key] = made
            if len(judged) > MAX_PENDING:
                judged.popitem(last=False)
        for kept in (judged, counts.given_back):
            while kept:
                key, made = next(iter(kept.items()))
                if now - made < self.ttl_s:
                    due = min(due, made + self.ttl_s)
                    break
                del kept[key]
        unheld = counts.unheld
        while unheld:
            key, (ended, _) = next(iter(unheld.items()))
            if now - ended < self.ttl_s:
                due = min(due, ended + self.ttl_s)
                break
            del unheld[key]
        counts.next_due = due

    def _counts(self, tenant: str) -> _Counts:
        tenants = self._tenants
        counts = tenants.get(tenant)
        if counts is None:
            counts = tenants[tenant] = _Counts()
            if len(tenants) > MAX_TENANTS:
                tenants.popitem(last=False)
        else:
            tenants.move_to_end(tenant)
        return counts
