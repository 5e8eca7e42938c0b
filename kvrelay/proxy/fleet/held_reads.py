"""Whether a D's holds are still there when another engine reads them: `HeldReads`.

A map entry names blocks its D held when the turn ended. D may end that hold before the next
turn comes: its hold budget frees the least recently made holds, block pressure reclaims them,
the lease ends them. The proxy is not told; the entry still names the blocks, and the next turn
is planned as if the history could be read. A spill priced that way sends a long history to a
D chosen for a short prefill, which then computes all of it (bench/RESULTS.md, conversation
trace, run Y: 8 of 12 such reads in one round found the hold gone, and later turns' TTFT p90
doubled against holds off).

What the engines report says how it went: the engine sent a holder's blocks loaded some of
them, or refused them because the read failed (the holder no longer had them). `HeldReads`
keeps, per holder D, a decayed share of the reads that found their blocks, and the spill's
planning weighs a held history by it (`Router._held_source`): a holder whose holds are
usually gone by the next turn is not counted on for a read. A read that refused nothing for a
failure (the reader's own cache had the history) says nothing and is not counted.

A holder not yet read four times (`MIN_READS`, decayed) takes the share of every holder's reads
together: what ends holds (D's budget against the conversations' think times, block pressure)
is much the same on every D of a pool, and each D alone sees few reads (a spilled turn's D or P
reads a held history on a few later turns in ten). Until four reads in all, holds count as
there (the connector keeps a hold until one of the ends above). No probe is
needed to see a holder's holds last again: every turn through P whose conversation has an entry
still has P read it, whatever the share, and counts here. Per worker process, at most
`MAX_HOLDERS` holders (least recently read forgotten first: a forgotten holder counts as there
again).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

DECAY = 1 / 16  # each read ages a holder's counts by this share: about the last 16 weigh
MIN_READS = 3.0  # decayed reads before a holder's share is trusted: its fourth read
MAX_HOLDERS = 4096


@dataclass(slots=True)
class _Reads:
    found: float = 0.0  # reads that loaded some of the held blocks, decayed
    reads: float = 0.0  # reads that loaded some or found the hold gone, decayed alike

    def add(self, found: bool) -> None:
        self.reads = self.reads * (1 - DECAY) + 1
        self.found = self.found * (1 - DECAY) + (1 if found else 0)

    def share(self) -> float | None:
        """The share that found their blocks; None before `MIN_READS`."""
        return None if self.reads < MIN_READS else self.found / self.reads


@dataclass
class HeldReads:
    """Per holder D, the share of reads of its held blocks that found them (see the module)."""

    limit: int = MAX_HOLDERS
    _holders: OrderedDict[str, _Reads] = field(default_factory=OrderedDict)
    _all: _Reads = field(default_factory=_Reads)  # every holder's reads together

    def read(self, url: str, found: bool) -> None:
        """An engine was sent the blocks the D at `url` held for a turn: it loaded some
        (`found`), or its read failed because D no longer had them."""
        holders = self._holders
        counts = holders.get(url)
        if counts is None:
            counts = holders[url] = _Reads()
            if len(holders) > self.limit:
                holders.popitem(last=False)
        else:
            holders.move_to_end(url)
        counts.add(found)
        self._all.add(found)

    def share(self, url: str) -> float:
        """The share of a held history of the D at `url` a planned read is expected to load:
        that holder's found share once it has shown four reads, else every holder's, else 1.0."""
        counts = self._holders.get(url)
        share = counts.share() if counts is not None else None
        if share is None:
            share = self._all.share()
        return 1.0 if share is None else share
