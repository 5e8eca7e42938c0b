"""Per-tenant limits: requests in flight and requests per second, per API key.

Each tenant (API key hash) gets `tenant_max_inflight` concurrent requests and a token bucket of
`tenant_rps` tokens per second holding at most `tenant_burst`; `tenant_limits` overrides them
per tenant. A request over a limit gets 429 `rate_limit_exceeded` with `Retry-After` and never
reaches an engine.

With the Redis map the counts are shared by every worker and replica: one Lua script checks
and takes both atomically on Redis's clock. An in-flight slot is a member of a sorted set scored
by its expiry; its worker renews its slots every third of `tenant_slot_lease_s`, so the slots of
a worker that crashed expire on their own instead of being held forever. With the memory map
the counts are this process's. If Redis cannot be reached the request is admitted unchecked
(counted), as the proxy serves without reuse then too.

An admission whose answer did not come back in time (Redis stalled, a slow network) may still
run later. Its slot id is chosen before the call, so the worker treats it as a slot it may
hold: it is released by id when the request ends, and a release that finds no such slot
leaves a tombstone (kept one lease) that makes the late admission take nothing. A release
Redis did not confirm is retried (with the tenant's next admission and every second) until it
is, so a stall leaves no slot that no worker owns: the tenant is admitted at once afterwards.

Outcomes are counted in `kvrelay_tenant_limit_total{outcome}`; never labelled by key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvrelay.proxy.base import ProxyError, cancel_and_wait
from kvrelay.proxy.config import Settings, parse_limit
from kvrelay.proxy.telemetry import metrics

log = logging.getLogger(__name__)

ADMITTED = "admitted"
REJECTED_RPS = "rejected_rps"
REJECTED_INFLIGHT = "rejected_inflight"
UNCHECKED = "unchecked"  # Redis unreachable: admitted without a check

# Tenants whose memory-map buckets are remembered at once; the least recently seen go first
# (forgetting one only refills its bucket early).
_MAX_TRACKED = 100_000
# What Retry-After says when the in-flight limit refused: a slot frees when a request ends,
# which the proxy cannot predict.
_INFLIGHT_RETRY_S = 1.0
# Releases Redis did not confirm are sent again this often (and with the tenant's next
# admission); at most this many are remembered per tenant (older ones are left to the lease).
_RELEASE_RETRY_S = 1.0
_MAX_RELEASING = 10_000


@dataclass(frozen=True)
class TenantLimit:
    """The limits of one tenant; 0 means unlimited."""

    max_inflight: int = 0
    rps: float = 0.0
    burst: int = 0

    @property
    def capacity(self) -> int:
        """Tokens the bucket holds: `burst`, or `rps` rounded up (at least 1)."""
        return self.burst or max(1, math.ceil(self.rps))

    @property
    def unlimited(self) -> bool:
        return not self.max_inflight and not self.rps


def limits_from(settings: Settings) -> tuple[TenantLimit, dict[str, TenantLimit]]:
    """The default limit and the per-tenant overrides (unset fields take the default's)."""
    default = TenantLimit(settings.tenant_max_inflight, settings.tenant_rps, settings.tenant_burst)
    overrides: dict[str, TenantLimit] = {}
    for tenant, spec in settings.tenant_limits.items():
        fields = parse_limit(spec, tenant)
        overrides[tenant] = TenantLimit(
            max_inflight=int(fields.get("max_inflight", default.max_inflight)),
            rps=fields.get("rps", default.rps),
            burst=int(fields.get("burst", default.burst)),
        )
    return default, overrides


Release = Callable[[], "asyncio.Task[None] | None"]


class Slot:
    """One admitted request's place; `await release()` on every way out (idempotent)."""

    def __init__(self, on_release: Release | None = None) -> None:
        self._on_release = on_release

    async def release(self) -> None:
        """Free the slot; returns once the shared count has it back (or the attempt ended),
        so an answer sent after this cannot race its sender's next request."""
        on_release, self._on_release = self._on_release, None
        task = on_release() if on_release is not None else None
        if task is not None:
            # Bounded by the task's own timeout; a handler cancelled meanwhile (the client
            # left) still frees the slot: the task is not cancelled with it.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task})


def too_many(outcome: str, retry_after_s: float, limit: TenantLimit) -> ProxyError:
    wait = max(1, math.ceil(retry_after_s))
    if outcome == REJECTED_INFLIGHT:
        what = (
            f"this API key already has {limit.max_inflight} requests in flight, its limit "
            "(setting tenant_max_inflight or tenant_limits); wait for one to finish"
        )
    else:
        what = (
            f"this API key sent more than {limit.rps:g} requests per second (burst "
            f"{limit.capacity}), its limit (setting tenant_rps or tenant_limits)"
        )
    return ProxyError(
        429,
        f"{what}; retry after {wait} s",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(wait)},
    )


class Limiter:
    """Admission by tenant; the base class keeps the counts of this process only."""

    def __init__(self, default: TenantLimit, overrides: dict[str, TenantLimit]) -> None:
        self.default = default
        self.overrides = overrides
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at)
        self._inflight: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return not self.default.unlimited or any(not o.unlimited for o in self.overrides.values())

    def limit_for(self, tenant: str) -> TenantLimit:
        return self.overrides.get(tenant, self.default)

    async def admit(self, tenant: str) -> Slot:
        """A slot for the request, or ProxyError 429 when a limit refuses it."""
        limit = self.limit_for(tenant)
        if limit.unlimited:
            return Slot()
        outcome, retry_after, slot = await self._take(tenant, limit)
        metrics.TENANT_LIMITS.labels(outcome).inc()
        if slot is None:
            raise too_many(outcome, retry_after, limit)
        return slot

    async def _take(self, tenant: str, limit: TenantLimit) -> tuple[str, float, Slot | None]:
        if limit.max_inflight and self._inflight.get(tenant, 0) >= limit.max_inflight:
            return REJECTED_INFLIGHT, _INFLIGHT_RETRY_S, None
        if limit.rps:
            now = time.monotonic()
            tokens, at = self._buckets.pop(tenant, (float(limit.capacity), now))
            tokens = min(float(limit.capacity), tokens + (now - at) * limit.rps)
            if tokens < 1:
                self._buckets[tenant] = (tokens, now)
                return REJECTED_RPS, (1 - tokens) / limit.rps, None
            self._buckets[tenant] = (tokens - 1, now)  # most recent last
            while len(self._buckets) > _MAX_TRACKED:
                del self._buckets[next(iter(self._buckets))]
        if not limit.max_inflight:
            return ADMITTED, 0.0, Slot()
        self._inflight[tenant] = self._inflight.get(tenant, 0) + 1

        def release() -> None:
            left = self._inflight.get(tenant, 1) - 1
            if left > 0:
                self._inflight[tenant] = left
            else:
                self._inflight.pop(tenant, None)

        return ADMITTED, 0.0, Slot(release)

    async def start(self) -> None:
        """Begin background work (slot renewal); nothing for the in-process limiter."""

    async def stop(self) -> None:
        """End background work and finish pending releases."""


# Shared by the admission and release scripts: remove slots ARGV[from..] from KEYS[2]; a slot
# that is not there gets a tombstone in KEYS[3] (scored by its expiry) instead, so that its
# admission, if it is still on its way, takes nothing when it runs.
_LUA_REMOVE = """
local function remove_slots(from, now, lease)
  local tombstoned = false
  for i = from, #ARGV do
    if redis.call('ZREM', KEYS[2], ARGV[i]) == 0 then
      redis.call('ZADD', KEYS[3], now + lease, ARGV[i])
      tombstoned = true
    end
  end
  if tombstoned then redis.call('PEXPIRE', KEYS[3], lease) end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
"""

# KEYS: bucket hash, slots sorted set, tombstones sorted set (one hash slot: all carry the
# tenant's hash tag). ARGV: max_inflight, rps, capacity, slot id, lease ms, then slots this
# process is releasing (removed first, so a release still on its way cannot refuse the same
# worker's next request). Returns {0|1|2|3, retry after ms}: 0 admitted, 1 refused by the
# bucket, 2 refused by the in-flight limit, 3 given up by its worker before it ran (nothing
# taken). Time is Redis's, so replicas with skewed clocks share one bucket.
_LUA_ADMIT = (
    _LUA_REMOVE
    + """
local max_inflight = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local cap = tonumber(ARGV[3])
local lease = tonumber(ARGV[5])
remove_slots(6, now, lease)
if redis.call('ZREM', KEYS[3], ARGV[4]) == 1 then
  return {3, 0}
end
if max_inflight > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= max_inflight then
    return {2, 1000}
  end
end
if rate > 0 then
  local b = redis.call('HMGET', KEYS[1], 'tokens', 'at')
  local tokens = tonumber(b[1]) or cap
  local at = tonumber(b[2]) or now
  tokens = math.min(cap, tokens + math.max(0, now - at) * rate / 1000)
  local ttl = math.ceil(cap * 1000 / rate) + 1000
  if tokens < 1 then
    redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', now)
    redis.call('PEXPIRE', KEYS[1], ttl)
    return {1, math.ceil((1 - tokens) * 1000 / rate)}
  end
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'at', now)
  redis.call('PEXPIRE', KEYS[1], ttl)
end
if max_inflight > 0 then
  redis.call('ZADD', KEYS[2], now + lease, ARGV[4])
  redis.call('PEXPIRE', KEYS[2], lease)
end
return {0, 0}
"""
)

# KEYS: as the admission's (the bucket unused). ARGV: lease ms, then the slot ids to release.
_LUA_RELEASE = (
    _LUA_REMOVE
    + """
remove_slots(2, now, tonumber(ARGV[1]))
return 0
"""
)

# KEYS: a tenant's slots. ARGV: lease ms, then the slot ids this worker still runs.
_LUA_RENEW = """
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', until_ms, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
return 0
"""


class RedisLimiter(Limiter):
    """Admission shared by every worker and replica through the map's Redis."""

    def __init__(
        self,
        default: TenantLimit,
        overrides: dict[str, TenantLimit],
        client: Any,
        prefix: str,
        *,
        lease_s: float,
        timeout: float = 2.0,
    ) -> None:
        super().__init__(default, overrides)
        self._r = client
        self._prefix = prefix
        self._lease_ms = int(lease_s * 1000)
        self._timeout = timeout
        self._admit_script = client.register_script(_LUA_ADMIT)
        self._release_script = client.register_script(_LUA_RELEASE)
        self._renew_script = client.register_script(_LUA_RENEW)
        self._live: dict[str, set[str]] = {}  # tenant -> slot ids this process holds
        # tenant -> slot ids released here whose removal Redis has not confirmed yet
        self._releasing: dict[str, set[str]] = {}
        self._pending: set[asyncio.Task[Any]] = set()
        self._renewer: asyncio.Task[None] | None = None
        self._logged_at = 0.0

    def _keys(self, tenant: str) -> list[str]:
        tag = f"{{{self._prefix}:limit:{tenant}}}"  # every key in one cluster hash slot
        return [tag + ":bucket", tag + ":slots", tag + ":gone"]

    async def _take(self, tenant: str, limit: TenantLimit) -> tuple[str, float, Slot | None]:
        slot_id = secrets.token_hex(8)
        releasing = sorted(self._releasing.get(tenant, ()))
        args = [limit.max_inflight, limit.rps, limit.capacity, slot_id, self._lease_ms, *releasing]
        call = asyncio.ensure_future(self._call(self._admit_script, self._keys(tenant), args))
        try:
            # Shielded: a client leaving mid-call must not lose a slot the script took.
            code, wait_ms = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(lambda done: self._undo(done, tenant, slot_id))
            raise
        except Exception as exc:
            self._unavailable(exc)
            if not limit.max_inflight:
                return UNCHECKED, 0.0, Slot()
            # The script may still run once Redis answers again: the slot is this worker's
            # to release (by id) like any other, so it cannot outlive the request.
            self._live.setdefault(tenant, set()).add(slot_id)
            return UNCHECKED, 0.0, Slot(lambda: self._release(tenant, slot_id))
        self._confirmed(tenant, releasing)
        if code == 1:
            return REJECTED_RPS, wait_ms / 1000, None
        if code == 2:
            return REJECTED_INFLIGHT, wait_ms / 1000, None
        if not limit.max_inflight or code == 3:
            return ADMITTED, 0.0, Slot()
        self._live.setdefault(tenant, set()).add(slot_id)
        return ADMITTED, 0.0, Slot(lambda: self._release(tenant, slot_id))

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        async with asyncio.timeout(self._timeout):
            return await script(keys=keys, args=args)

    def _undo(self, done: asyncio.Future[Any], tenant: str, slot_id: str) -> None:
        # Only a definite refusal took nothing; a failed or lost call may have taken the slot.
        if not done.cancelled() and done.exception() is None and done.result()[0] != 0:
            return
        self._release(tenant, slot_id)

    def _release(self, tenant: str, slot_id: str) -> asyncio.Task[None]:
        live = self._live.get(tenant)
        if live is not None:
            live.discard(slot_id)
            if not live:
                del self._live[tenant]
        releasing = self._releasing.setdefault(tenant, set())
        releasing.add(slot_id)
        while len(releasing) > _MAX_RELEASING:  # Redis away for long: the lease frees them
            releasing.pop()
        # A task: a handler being cancelled (the client left) must not stop the release.
        task = asyncio.get_running_loop().create_task(self._remove(tenant, [slot_id]))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def _remove(self, tenant: str, slot_ids: list[str]) -> None:
        try:
            await self._call(self._release_script, self._keys(tenant), [self._lease_ms, *slot_ids])
        except Exception as exc:  # kept in _releasing: retried until Redis confirms it
            self._unavailable(exc)
        else:
            self._confirmed(tenant, slot_ids)

    def _confirmed(self, tenant: str, slot_ids: list[str]) -> None:
        releasing = self._releasing.get(tenant)
        if releasing is not None:
            releasing.difference_update(slot_ids)
            if not releasing:
                del self._releasing[tenant]

    def _unavailable(self, exc: BaseException) -> None:
        metrics.MAP_ERRORS.labels("limit").inc()
        now = time.monotonic()
        if now - self._logged_at > 10.0:  # one line per 10 s, not one per request
            self._logged_at = now
            log.warning("tenant limits unavailable (%s); admitting unchecked", type(exc).__name__)

    async def renew(self) -> None:
        """Push the expiry of every slot this process holds one lease ahead."""
        for tenant, live in list(self._live.items()):
            if live:
                args = [self._lease_ms, *sorted(live)]
                await self._call(self._renew_script, [self._keys(tenant)[1]], args)

    async def retry_releases(self) -> None:
        """Send again every release Redis has not confirmed (a stall or an outage)."""
        for tenant, releasing in list(self._releasing.items()):
            if releasing:
                await self._remove(tenant, sorted(releasing))

    async def _renew_loop(self) -> None:
        renew_every = self._lease_ms / 3000
        renewed_at = time.monotonic()
        while True:
            await asyncio.sleep(min(renew_every, _RELEASE_RETRY_S))
            try:
                await self.retry_releases()
                if time.monotonic() - renewed_at >= renew_every:
                    renewed_at = time.monotonic()
                    await self.renew()
            except Exception as exc:  # Redis away: slots may lapse; admission stays bounded
                self._unavailable(exc)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._renewer = loop.create_task(self._renew_loop(), name="kvrelay-limit-renew")

    async def stop(self) -> None:
        await cancel_and_wait([self._renewer])
        self._renewer = None
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=self._timeout)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._timeout):
                await self._r.aclose()


def open_limiter(settings: Settings) -> Limiter:
    """Shared through the map's Redis when the map is shared, else this process only."""
    default, overrides = limits_from(settings)
    limiter = Limiter(default, overrides)
    if not settings.uses_shared_map or not limiter.enabled:
        return limiter
    from kvrelay.kvcache_map import open_redis_client

    client, prefix, _cluster = open_redis_client(settings.map_url)
    return RedisLimiter(default, overrides, client, prefix, lease_s=settings.tenant_slot_lease_s)
