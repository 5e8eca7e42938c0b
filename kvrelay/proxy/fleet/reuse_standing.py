"""Which engines' reuse pays: routing that learns from what the engines report.

A decode-only turn pays only when D serves the history from its own prefix cache; an affinity
turn only when P's prefix cache still has the previous prompt. A D started without prefix
caching (or whose blocks were evicted) answers a decode-only turn with no cached tokens: it
recomputed the whole history, the very work P exists to take off D. `ReuseStanding` keeps, for
one kind of turn, the engines whose last such turn showed no reuse: they are *withdrawn* from
it (the turn goes through P, or to P by load) until they show reuse again: on another kind of
turn (D's local hit on a turn through P, P's local hit on any turn), or on one probe turn let
through after `reuse_probe_interval_s`. Each change is logged once and counted
(`kvrelay_reuse_standing_changes_total`). The state is per worker process: each learns from
its own turns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.proxy.telemetry import metrics

log = logging.getLogger(__name__)


@dataclass
class ReuseStanding:
    """Engines of one role withdrawn from one kind of turn (`turn`: decode_only | affinity)
    because that turn showed no reuse there."""

    role: str
    turn: str
    probe_interval_s: float
    clock: Callable[[], float] = time.monotonic
    _next_probe: dict[str, float] = field(default_factory=dict)  # withdrawn: url -> when

    def admits(self, url: str) -> bool:
        """May the engine get this kind of turn now? A withdrawn engine gets one probe turn
        every `probe_interval_s` (a probe lost to a failure is followed by the next one)."""
        next_probe = self._next_probe.get(url)
        if next_probe is None:
            return True
        now = self.clock()
        if now < next_probe:
            return False
        self._next_probe[url] = now + self.probe_interval_s
        return True

    def withdrawn(self, url: str) -> bool:
        return url in self._next_probe

    def paid(self, url: str) -> None:
        """The engine showed reuse: it gets this kind of turn again."""
        if self._next_probe.pop(url, None) is not None:
            self._changed(url, "restored")

    def unpaid(self, url: str) -> None:
        """This kind of turn showed no reuse on the engine: withdraw it (a probe that showed
        none leaves it withdrawn until the next probe)."""
        if url not in self._next_probe:
            self._next_probe[url] = self.clock() + self.probe_interval_s
            self._changed(url, "withdrawn")

    def _changed(self, url: str, change: str) -> None:
        metrics.REUSE_STANDING.labels(self.role, self.turn, change).inc()
        if change == "withdrawn":
            log.warning(
                "%s turns on %s showed no cached tokens: withdrawn (a probe turn every %gs "
                "or a %s local hit on another turn restores them)",
                self.turn, url, self.probe_interval_s, self.role,
            )  # fmt: skip
        else:
            log.warning("%s turns on %s show cached tokens again: restored", self.turn, url)
