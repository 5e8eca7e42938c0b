"""Whether a tenant's turns should ask D to hold their blocks: `HoldPayoff`.

A hold pins the turn's blocks in D's pool until the conversation's next turn takes them or the
lease ends, and pinned blocks are blocks neither D's batches nor its prefix cache can use. On
traffic that continues conversations most holds are taken; on traffic of one-off requests
(a shared system prompt and a question, an agent's single calls) none are, and every hold is
pool lost for nothing. So the proxy counts, per tenant, the holds its turns made and the
entries a next turn took, each count decaying by `DECAY` per hold made (about the last 64
holds weigh), and while fewer than `min_use` of them were taken the tenant's turns do not
hold, except one in `1 / min_use`: those probe holds are how a change shows (a tenant whose
conversations start continuing again takes them, and its share climbs back).

Counts are per worker process (each learns from its own turns) and per tenant, kept for at
most `MAX_TENANTS` tenants, least recently seen forgotten first (a forgotten tenant holds
again until it has shown otherwise). Decisions are counted in
`kvrelay_hold_decisions_total{decision}`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvrelay.proxy.telemetry import metrics

DECAY = 1 / 64  # each hold made ages the counts by this share
MIN_EVIDENCE = 16.0  # decayed holds made before a tenant's share is trusted
MAX_TENANTS = 65536


@dataclass(slots=True)
class _Counts:
    made: float = 0.0  # holds made, decayed
    taken: float = 0.0  # of those, taken by a next turn, decayed alike
    since_probe: int = 0  # turns declined since the last probe hold


@dataclass
class HoldPayoff:
    """Per tenant, whether holds pay (see the module's docstring)."""

    min_use: float
    _tenants: OrderedDict[str, _Counts] = field(default_factory=OrderedDict)

    def worth_holding(self, tenant: str) -> bool:
        """Should this turn of `tenant` ask D to hold its blocks?"""
        min_use = self.min_use
        if min_use <= 0:
            return True
        counts = self._tenants.get(tenant)
        if counts is None or counts.made < MIN_EVIDENCE or counts.taken >= min_use * counts.made:
            metrics.HOLD_DECISIONS.labels("kept").inc()
            return True
        counts.since_probe += 1
        if counts.since_probe * min_use >= 1:
            counts.since_probe = 0
            metrics.HOLD_DECISIONS.labels("probe").inc()
            return True
        metrics.HOLD_DECISIONS.labels("declined").inc()
        return False

    def made(self, tenant: str) -> None:
        """A turn of `tenant` left a hold on D (its entry is stored)."""
        counts = self._counts(tenant)
        counts.made = counts.made * (1 - DECAY) + 1
        counts.taken *= 1 - DECAY

    def taken(self, tenant: str) -> None:
        """A turn of `tenant` took the entry a previous turn's hold left."""
        counts = self._counts(tenant)
        counts.taken = min(counts.taken + 1, counts.made)

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
