"""Fleet changes that reach every worker and every replica: one versioned fleet record.

The fleet (which engines are in each pool, and whether each is draining) is a record kept
beside the conversation map in Redis, `{prefix}:fleet` (one key: one cluster slot), as JSON:
`{"version": N, "seed": "...", "prefill": {url: {"state", "source"}}, "decode": {...}}`.
Every change (an admin call, a discovery update) is one Lua script that edits the record,
bumps `version` and publishes the new version on `<prefix>:fleet`; every process subscribes
and also polls the version every `fleet_sync_interval_s` (the safety net for a missed message,
and the only path on Redis Cluster), then reconciles its pools with the record: engines the
record lacks leave, new ones join, `state` sets draining. A process that starts reads the
record, so a new replica or a restarted worker gets the current fleet.

`seed` is a digest of the static `prefill`/`decode` settings. A process whose settings differ
from the record's seed (a changed deployment) replaces the static engines in the record;
admin-added and discovered engines stay. Without a shared map (one process, memory map) the
changes apply to that process only (`LocalFleetSync`).

Each engine carries its `source` (`static`, `admin`, `dns`, `kubernetes`), so a discovery
source replaces only its own engines, and an admin removal wins over any source.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
from collections.abc import Iterable
from typing import Any, Literal, Protocol

from kvrelay.kvcache_map import open_redis_client
from kvrelay.proxy.base import cancel_and_wait
from kvrelay.proxy.config import Settings
from kvrelay.proxy.fleet.pools import Backend, Pool

log = logging.getLogger(__name__)

Op = Literal["add", "drain", "remove", "sync"]
ROLES = ("prefill", "decode")

# KEYS: record. ARGV: op JSON, channel, a fresh epoch id. Returns the new record (JSON), ""
# when the op targets an engine the record does not hold (drain/remove), or "missing" when
# there is no record and the op is neither `seed` nor `restore`. A record created anew gets a
# new `epoch`: processes install a record whose epoch differs whatever its version.
_LUA_APPLY = """
local raw = redis.call('GET', KEYS[1])
local op = cjson.decode(ARGV[1])
local r
if raw then
  r = cjson.decode(raw)
elseif op.op == 'seed' then
  r = {version = 0, epoch = ARGV[3], seed = '', prefill = {}, decode = {}}
elseif op.op == 'restore' then
  -- the record was lost (Redis restarted empty): a process puts back the last one it had
  r = op.record
  r.epoch = ARGV[3]
else
  return 'missing'
end
if op.op == 'restore' and raw then return raw end
local pool = {}
if op.role then
  pool = r[op.role]
  if type(pool) ~= 'table' then pool = {}; r[op.role] = pool end
end
if op.op == 'add' then
  -- an admin add takes an engine over from discovery (it then stays until removed)
  local cur = pool[op.url]
  local source = op.source
  if cur and cur.source == 'static' then source = 'static' end
  pool[op.url] = {state = 'active', source = source}
elseif op.op == 'drain' then
  if not pool[op.url] then return '' end
  pool[op.url].state = 'draining'
elseif op.op == 'remove' then
  if not pool[op.url] then return '' end
  pool[op.url] = nil
elseif op.op == 'sync' then
  -- op.urls: every engine this source sees now; others of this source leave. Nothing
  -- changed: no new version (every process runs discovery and sends the same sets).
  local want = {}
  local sides = op.side_channels or {}
  local changed = false
  for _, u in ipairs(op.urls) do want[u] = true end
  for u, e in pairs(pool) do
    if e.source == op.source and not want[u] then pool[u] = nil; changed = true end
  end
  for u, _ in pairs(want) do
    if not pool[u] then
      pool[u] = {state = 'active', source = op.source, side_channel = sides[u]}
      changed = true
    end
  end
  if not changed then return raw end
elseif op.op == 'seed' then
  if r.seed == op.seed then return raw end
  for _, role in ipairs({'prefill', 'decode'}) do
    local p = r[role]
    if type(p) ~= 'table' then p = {}; r[role] = p end
    for u, e in pairs(p) do if e.source == 'static' then p[u] = nil end end
    for _, u in ipairs(op[role]) do
      if not p[u] then p[u] = {state = 'active', source = 'static'} end
    end
  end
  r.seed = op.seed
end
r.version = r.version + 1
local out = cjson.encode(r)
redis.call('SET', KEYS[1], out)
redis.call('PUBLISH', ARGV[2], r.version)
return out
"""


class FleetSync(Protocol):
    """What admin handlers and discovery call to change the fleet everywhere."""

    async def apply(self, op: dict[str, Any]) -> bool:
        """Apply one change; False when the target engine is not in the fleet."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def seed_of(prefill: Iterable[str], decode: Iterable[str]) -> str:
    text = json.dumps([sorted(prefill), sorted(decode)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class LocalFleetSync:
    """One process, no shared map: changes apply to this process's pools only."""

    def __init__(self, pools: dict[str, Pool]) -> None:
        self._pools = pools
        # url -> source of the engines discovery added, so a source replaces only its own.
        self._sources: dict[str, str] = {}

    async def apply(self, op: dict[str, Any]) -> bool:
        pool = self._pools[op["role"]]
        kind = op["op"]
        if kind == "add":
            pool.add(op["url"])
            self._sources.pop(op["url"], None)
        elif kind == "drain":
            return pool.drain(op["url"]) is not None
        elif kind == "remove":
            self._sources.pop(op["url"], None)
            return pool.remove(op["url"]) is not None
        elif kind == "sync":
            want = set(op["urls"])
            for url in list(pool.backends):
                if self._sources.get(url) == op["source"] and url not in want:
                    pool.remove(url)
                    del self._sources[url]
                    log.info("%s engine %s left the fleet", pool.role, url)
            for url in sorted(want - set(pool.backends)):
                backend = pool.add(url)
                _set_side_channel(backend, op.get("side_channels", {}).get(url))
                self._sources[url] = op["source"]
                log.info("%s engine %s joined the fleet", pool.role, url)
        return True

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


def reconcile(pools: dict[str, Pool], record: dict[str, Any]) -> None:
    """Make the pools match the record (join, leave, drain, undrain)."""
    for role in ROLES:
        pool = pools[role]
        desired = record.get(role) or {}
        if not isinstance(desired, dict):  # cjson writes an empty table as {} or []
            desired = {}
        for url in list(pool.backends):
            if url not in desired:
                pool.remove(url)
                log.info("%s engine %s left the fleet", role, url)
        for url, info in desired.items():
            backend = pool.get(url)
            info = info if isinstance(info, dict) else {}
            if backend is None:
                backend = pool.add(url)
                log.info("%s engine %s joined the fleet", role, url)
            backend.draining = info.get("state") == "draining"
            _set_side_channel(backend, info.get("side_channel"))


def _set_side_channel(backend: Backend, address: Any) -> None:
    """A discovered side channel (`host:port`) for an engine whose params were not seen yet."""
    if backend.side_channel is not None or not isinstance(address, str):
        return
    host, _, port = address.rpartition(":")
    if host and port.isdigit():
        backend.side_channel = (host, int(port))


class RedisFleetSync:
    """The fleet record in Redis, pub/sub notifications and a polling safety net."""

    def __init__(
        self,
        client: Any,
        prefix: str,
        pools: dict[str, Pool],
        static: dict[str, list[str]],
        *,
        interval: float,
        pubsub: bool,
        timeout: float = 2.0,
    ) -> None:
        self._r = client
        self._key = f"{{{prefix}}}:fleet"
        self._channel = f"{prefix}:fleet"
        self._pools = pools
        self._static = static
        self._interval = interval
        self._use_pubsub = pubsub
        self._timeout = timeout
        self._apply_script = client.register_script(_LUA_APPLY)
        self._version = -1
        self._epoch: Any = None
        self._record: dict[str, Any] | None = None  # the last record installed
        self._wake = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def version(self) -> int:
        return self._version

    async def apply(self, op: dict[str, Any]) -> bool:
        raw = await self._run(op)
        if raw == b"missing":
            await self._restore()
            raw = await self._run(op)
        if not raw or raw == b"missing":
            return False
        self._install(json.loads(raw))
        return True

    async def _run(self, op: dict[str, Any]) -> bytes | None:
        args = [json.dumps(op), self._channel, secrets.token_hex(8)]
        async with asyncio.timeout(self._timeout):
            raw: bytes | None = await self._apply_script(keys=[self._key], args=args)
        return raw

    async def _restore(self) -> None:
        """The record is gone (Redis restarted without persistence): put back the last one
        this process installed, or seed it from the settings if it never had one."""
        if self._record is None:
            await self.apply(self._seed_op())
            return
        log.warning("fleet record missing in Redis; restoring version %s", self._version)
        raw = await self._run({"op": "restore", "record": self._record})
        if raw and raw != b"missing":
            self._install(json.loads(raw))

    def _seed_op(self) -> dict[str, Any]:
        static = self._static
        return {"op": "seed", "seed": seed_of(static["prefill"], static["decode"]), **static}

    async def start(self) -> None:
        """Seed the record from the static settings when they changed, then follow it."""
        try:
            await self.apply(self._seed_op())
        except Exception as exc:  # Redis down at start: the static fleet, then follow later
            log.warning(
                "fleet record unavailable at start (%s); using the settings' fleet",
                type(exc).__name__,
            )
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._poll(), name="kvrelay-fleet-poll"))
        if self._use_pubsub:
            self._tasks.append(loop.create_task(self._listen(), name="kvrelay-fleet-listen"))

    async def stop(self) -> None:
        self._stopping = True  # also ends the loops if a client library swallows the cancel
        # Bounded: a Redis connection stuck mid-close must not hold up the proxy's shutdown.
        await cancel_and_wait(self._tasks, bound_s=self._timeout)
        self._tasks.clear()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._timeout):
                await self._r.aclose()

    async def refresh(self) -> None:
        """Read the record and reconcile if it is newer than what this process applied."""
        async with asyncio.timeout(self._timeout):
            raw = await self._r.get(self._key)
        if raw:
            self._install(json.loads(raw))
        elif self._record is None:
            await self.apply(self._seed_op())  # Redis was down when this process started
        else:
            await self._restore()

    def _install(self, record: dict[str, Any]) -> None:
        version = int(record.get("version", 0))
        epoch = record.get("epoch")
        if self._record is not None and epoch == self._epoch and version <= self._version:
            return
        reconcile(self._pools, record)
        self._record, self._version, self._epoch = record, version, epoch

    async def _poll(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval)
            self._wake.clear()
            try:
                await self.refresh()
            except Exception as exc:  # Redis away: keep the current fleet, try again
                log.debug("fleet refresh failed: %s", type(exc).__name__)

    async def _listen(self) -> None:
        while not self._stopping:
            try:
                pubsub = self._r.pubsub(ignore_subscribe_messages=True)
                try:
                    await pubsub.subscribe(self._channel)
                    self._wake.set()  # catch up with what was missed while unsubscribed
                    while not self._stopping:
                        message = await pubsub.get_message(timeout=self._interval)
                        if message is not None:
                            self._wake.set()
                finally:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # reconnect after a pause; polling covers the gap
                log.debug("fleet subscription lost: %s", type(exc).__name__)
                await asyncio.sleep(self._interval)


def open_fleet_sync(settings: Settings, pools: dict[str, Pool]) -> FleetSync:
    """The record in the map's Redis when the map is shared, else this process only."""
    if not settings.uses_shared_map:
        return LocalFleetSync(pools)
    client, prefix, cluster = open_redis_client(settings.map_url)
    static = {"prefill": list(settings.prefill), "decode": list(settings.decode)}
    return RedisFleetSync(
        client,
        prefix,
        pools,
        static,
        interval=settings.fleet_sync_interval_s,
        pubsub=not cluster,  # redis-py has no asyncio cluster pub/sub: polling only
    )
