"""Per-API-key breaker: a key whose requests keep making every engine fail is paused.

A request that every engine tried answers with a 5xx is more likely poisonous input than a broken
fleet (engines are judged separately, see `kvrelay.proxy.fleet.pools`). Such a request is a *strike*
against its sender's key. `limit` strikes within `cooldown_s` open the key's breaker: its requests
get 429 without reaching an engine until `cooldown_s` after the last strike. Other keys are not
affected. State is per worker process and bounded in size.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

# Keys tracked at once; the least recently struck are forgotten first.
_MAX_TRACKED = 10_000


@dataclass
class TenantBreaker:
    """Strikes per tenant (API key hash) and the keys currently paused."""

    limit: int
    cooldown_s: float
    _strikes: dict[str, deque[float]] = field(default_factory=dict)
    _open_until: dict[str, float] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def retry_after(self, tenant: str) -> float | None:
        """Seconds until the tenant may send again, or None when it may send now."""
        until = self._open_until.get(tenant)
        if until is None:
            return None
        left = until - time.monotonic()
        if left <= 0:
            del self._open_until[tenant]
            return None
        return left

    def strike(self, tenant: str) -> bool:
        """Count a request that every engine failed; True when this opened the breaker."""
        if not self.enabled:
            return False
        now = time.monotonic()
        strikes = self._strikes.pop(tenant, None) or deque()
        self._strikes[tenant] = strikes  # most recent last
        while strikes and now - strikes[0] > self.cooldown_s:
            strikes.popleft()
        strikes.append(now)
        while len(self._strikes) > _MAX_TRACKED:
            del self._strikes[next(iter(self._strikes))]
        if len(strikes) >= self.limit:
            strikes.clear()
            self._open_until[tenant] = now + self.cooldown_s
            while len(self._open_until) > _MAX_TRACKED:
                del self._open_until[next(iter(self._open_until))]
            return True
        return False
