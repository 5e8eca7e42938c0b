"""Per-API-key breaker: a key whose input keeps making the engines fail is paused.

A request that every engine tried answers with a 5xx is poisonous input or a broken fleet.
Only the first is the key's doing, so a request is a *strike* against its sender only when the
engines that failed it say so (`kvrelay.proxy.fleet.Pool.blames_input`: they are healthy,
serve other keys meanwhile, and fail no other key). `limit` strikes within `cooldown_s` open
the key's breaker: its requests get 429 without reaching an engine until `cooldown_s` after the
last strike. A strike names the engines that failed it and how many failures each had been
charged then; once one of them is charged another (ejected, failing its probe, failing other
keys), the strike is void, and a pause resting on it lifts at once. Other keys are not
affected. State is per worker process and bounded in size.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvrelay.proxy.fleet import Backend

# Keys tracked at once; the least recently struck are forgotten first.
_MAX_TRACKED = 10_000

# The engines that failed a request, each with its `faults` count at the time.
Marks = tuple[tuple["Backend", int], ...]


def _still_fair(marks: Marks) -> bool:
    """No engine of the strike was charged a failure since: the strike still stands."""
    return all(backend.faults == faults for backend, faults in marks)


@dataclass
class TenantBreaker:
    """Strikes per tenant (API key hash) and the keys currently paused."""

    limit: int
    cooldown_s: float
    _strikes: dict[str, deque[tuple[float, Marks]]] = field(default_factory=dict)
    _open_until: dict[str, tuple[float, Marks]] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def retry_after(self, tenant: str) -> float | None:
        """Seconds until the tenant may send again, or None when it may send now."""
        paused = self._open_until.get(tenant)
        if paused is None:
            return None
        until, marks = paused
        left = until - time.monotonic()
        if left <= 0 or not _still_fair(marks):
            del self._open_until[tenant]
            return None
        return left

    def strike(self, tenant: str, engines: Sequence[Backend]) -> bool:
        """Count a request whose input the `engines` that all failed it blame; True when this
        opened the breaker."""
        if not self.enabled:
            return False
        now = time.monotonic()
        strikes = self._strikes.pop(tenant, None) or deque()
        self._strikes[tenant] = strikes  # most recent last
        kept = [(at, m) for at, m in strikes if now - at <= self.cooldown_s and _still_fair(m)]
        strikes.clear()
        strikes.extend(kept)
        strikes.append((now, tuple((backend, backend.faults) for backend in engines)))
        while len(self._strikes) > _MAX_TRACKED:
            del self._strikes[next(iter(self._strikes))]
        if len(strikes) >= self.limit:
            marks = tuple(mark for _, m in strikes for mark in m)
            strikes.clear()
            self._open_until[tenant] = (now + self.cooldown_s, marks)
            while len(self._open_until) > _MAX_TRACKED:
                del self._open_until[next(iter(self._open_until))]
            return True
        return False
