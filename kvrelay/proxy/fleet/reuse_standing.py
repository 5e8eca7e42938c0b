"""Which engines' reuse pays: routing that learns from what the engines report.

A decode-only turn pays only when D serves the history from its own prefix cache; an affinity
turn only when P's prefix cache still has the previous prompt. A D started without prefix
caching (or whose blocks were evicted) answers a decode-only turn with no cached tokens: it
recomputed the whole history, the very work P exists to take off D. `ReuseStanding` keeps, for
one kind of turn, the engines whose last such turn showed no reuse: they are *withdrawn* from
it (the turn goes through P, or to P by load) until they show reuse again: on another kind of
turn (D's local hit on a turn through P, P's local hit on any turn), or on one probe turn let
through after `reuse_probe_interval_s`.

What an engine's cache holds for one tenant says nothing about another's (the engines cache per
tenant, `kvrelay.proxy.tenants.cache_scope`), and a tenant must not be able to take a route away
from the others with turns that reuse nothing on purpose: the standing is kept per engine *and
tenant*. Each change is counted (`kvrelay_reuse_standing_changes_total`) and logged at INFO (a
tenant's standing is not an operator's alarm; the counter is). At most `MAX_WITHDRAWN` pairs are
remembered per kind of turn (the oldest forgotten first: forgetting one restores it), so many
API keys cannot grow a worker's memory. The state is per worker process: each learns from its
own turns.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.proxy.telemetry import metrics

log = logging.getLogger(__name__)

MAX_WITHDRAWN = 65536  # (engine, tenant) pairs remembered per kind of turn


@dataclass
class ReuseStanding:
    """Engines of one role withdrawn, for one tenant, from one kind of turn (`turn`:
    decode_only | affinity) because that turn showed that tenant no reuse there."""

    role: str
    turn: str
    probe_interval_s: float
    clock: Callable[[], float] = time.monotonic
    limit: int = MAX_WITHDRAWN
    # Withdrawn (engine url, tenant) -> when its next probe turn may go, oldest first.
    _next_probe: OrderedDict[tuple[str, str], float] = field(default_factory=OrderedDict)

    def admits(self, url: str, tenant: str) -> bool:
        """May the engine get this kind of turn of `tenant` now? Withdrawn, it gets one probe
        turn every `probe_interval_s` (a probe lost to a failure is followed by the next one)."""
        key = (url, tenant)
        next_probe = self._next_probe.get(key)
        if next_probe is None:
            return True
        now = self.clock()
        if now < next_probe:
            return False
        self._next_probe[key] = now + self.probe_interval_s
        return True

    def withdrawn(self, url: str, tenant: str) -> bool:
        return (url, tenant) in self._next_probe

    def paid(self, url: str, tenant: str) -> None:
        """The engine showed `tenant` reuse: it gets this kind of turn again."""
        if self._next_probe.pop((url, tenant), None) is not None:
            self._changed(url, tenant, "restored")

    def unpaid(self, url: str, tenant: str) -> None:
        """This kind of turn showed `tenant` no reuse on the engine: withdraw it (a probe that
        showed none leaves it withdrawn until the next probe)."""
        key = (url, tenant)
        if key not in self._next_probe:
            self._next_probe[key] = self.clock() + self.probe_interval_s
            while len(self._next_probe) > self.limit:
                self._next_probe.popitem(last=False)
            self._changed(url, tenant, "withdrawn")

    def _changed(self, url: str, tenant: str, change: str) -> None:
        metrics.REUSE_STANDING.labels(self.role, self.turn, change).inc()
        if change == "withdrawn":
            log.info(
                "%s turns of tenant %s on %s showed no cached tokens: withdrawn (a probe turn "
                "every %gs or a %s local hit on another turn restores them)",
                self.turn,
                tenant,
                url,
                self.probe_interval_s,
                self.role,
            )
        else:
            log.info(
                "%s turns of tenant %s on %s show cached tokens again: restored",
                self.turn,
                tenant,
                url,
            )
