"""`RedisMap`: the shared backend for several proxy replicas (`redis.asyncio`, pooled).

Layout under `prefix` (member = `encode_key(key)`, only `[A-Za-z0-9_.-]`):
- `prefix:v:<member>`  the entry, with the entry's TTL kept by Redis (what `get` reads);
- `prefix:s:<member>`  a shadow copy living `shadow_grace` seconds longer, so the entry can
  still be reported after Redis has dropped the main key;
- `prefix:idx`         sorted set member → expiry (ms, Redis server clock).
On Redis Cluster the index is split into shards and each entry's keys carry its shard's hash
tag, so every script stays within one slot (`_redis_topology.KeyLayout`).

Every write is one Lua script, so each is atomic across replicas: `take`/`delete` remove the
value, the shadow and the index member together (a taken entry is never reported); `put`
reports what it overwrote (REPLACED, or EXPIRED when only the shadow was left); the sweep pops
due index members with their shadow values and deletes the main key too, so an entry is
either taken or reported as expired, never both. Each replica sweeps every `sweep_interval`
under a short `SET NX PX` lock so usually one replica does the work; correctness does not
depend on the lock (the pop is atomic), only the wasted effort does. Delivery is exactly once
while the sweeping replica stays up; a replica that dies between the pop and its callback
loses those reports (the holder's lease then frees the blocks).

With `wait_replicas=N` (Sentinel deployments) every write is followed, on the same connection,
by `WAIT N`: a take or put that N replicas did not confirm raises `MapUnavailableError`, so the
proxy never uses an entry whose removal a failover could undo (it may instead be left to the
holder's lease). The sweep's pops are confirmed the same way before they are reported.

Connectivity problems of any kind raise `MapUnavailableError` within `timeout` seconds (no
client-side retries); the pool reconnects on its own when Redis is back and scripts are
reloaded on demand (NOSCRIPT), so callers never rebuild the map. A put that may have run all
the same raises `UnconfirmedPutError`; each put writes its own fate key (`prefix:w:<id>`), on
which its `settle()` learns whether the put ran or makes sure it never will.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import secrets
from collections.abc import Awaitable
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvrelay.kvcache_map._base import (
    CLOSE_DRAIN_TIMEOUT,
    EvictionCallback,
    EvictionReason,
    MapStats,
    MapUpkeep,
    check_ttl,
)
from kvrelay.kvcache_map._entry import ConversationKey, KVEntry, decode_key, encode_key
from kvrelay.kvcache_map._errors import (
    EntryDecodeError,
    InvalidKeyError,
    MapUnavailableError,
    UnconfirmedPutError,
)
from kvrelay.kvcache_map._redis_topology import KeyLayout, single_client
from kvrelay.kvcache_map._resp import NotConnectedError, RespConnection

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PREFIX = "kvrelay"
# The per-operation bound: 100 ms. Measured with `python -m bench.kvmap --backends redis
# --clients 1 16 64` on a 2-CPU machine at load average 6 (three times oversubscribed): put
# p99 3.2 / 6.7 / 15.5 ms. 50 ms timed out 3 of 15 turns next to real vLLM engines, whose CPU
# use stalls the proxy's event loop (the bound counts that too). 100 ms is over 6x the worst
# p99 seen; a stalled Redis costs a turn at most two bounds (take, put).
DEFAULT_TIMEOUT = 0.1
DEFAULT_SWEEP_INTERVAL = 0.5
DEFAULT_SHADOW_GRACE = 300.0
DEFAULT_SWEEP_BATCH = 256
DEFAULT_MAX_CONNECTIONS = 128
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")

# Returns the string at KEYS-style key `k`, false when absent; a value of another type is
# deleted and returned as "" so the caller counts it as corrupt instead of failing.
_LUA_GETSTR = """
local function getstr(k)
  local t = redis.call('TYPE', k)['ok']
  if t == 'string' then return redis.call('GET', k) end
  if t ~= 'none' then redis.call('DEL', k); return '' end
  return false
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: value, shadow, index, fate. ARGV: entry, ttl_ms, grace_ms, member. The fate key is this
# write's own: "stored" once it ran (for the entry's TTL: afterwards the entry is gone anyway),
# "undone" once a settle got there first (the put then stores nothing), so a put whose reply
# was lost is settled one way, once, on Redis.
_LUA_PUT = (
    _LUA_GETSTR
    + """
local ttl = tonumber(ARGV[2])
if not redis.call('SET', KEYS[4], 'stored', 'NX', 'PX', ttl) then
  return {'undone'}
end
local old = getstr(KEYS[1])
local kind = 'replaced'
if not old and redis.call('ZSCORE', KEYS[3], ARGV[4]) then
  -- the live copy is gone but the sweeper has not reported it yet: report it from here
  old = getstr(KEYS[2])
  kind = 'expired'
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('SET', KEYS[2], ARGV[1], 'PX', ttl + tonumber(ARGV[3]))
redis.call('ZADD', KEYS[3], now_ms() + ttl, ARGV[4])
if old then return {kind, old} end
return false
"""
)

# KEYS: the put's fate key. ARGV: its lifetime ms. Returns 1 when the put ran (its entry is the
# map's like any other), 0 when it did not and now never will (the fate says "undone").
_LUA_SETTLE_PUT = """
if redis.call('SET', KEYS[1], 'undone', 'NX', 'PX', tonumber(ARGV[1])) then return 0 end
if redis.call('GET', KEYS[1]) == 'undone' then return 0 end
return 1
"""

# KEYS: value, shadow, index. ARGV: member. Used by take and delete.
_LUA_TAKE = (
    _LUA_GETSTR
    + """
local v = getstr(KEYS[1])
if not v then return false end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
return v
"""
)

# KEYS: index. ARGV: value key prefix, shadow key prefix, batch size.
# Returns {number of due members, member1, value1, member2, value2, ...}.
_LUA_SWEEP = (
    _LUA_GETSTR
    + """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms(), 'LIMIT', 0, tonumber(ARGV[3]))
local out = {#due}
for _, m in ipairs(due) do
  local s = ARGV[2] .. m
  local v = getstr(s)
  redis.call('DEL', ARGV[1] .. m, s)
  redis.call('ZREM', KEYS[1], m)
  if v then
    out[#out + 1] = m
    out[#out + 1] = v
  end
end
return out
"""
)

_LUA_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def make_client(
    url: str,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> aioredis.Redis:
    """A pooled client for `redis://` / `rediss://` URLs (password, user, db from the URL)
    whose every wait is bounded by `timeout` and that never retries on its own."""
    return single_client(url, timeout=timeout, max_connections=max_connections)


class RedisMap(MapUpkeep):
    """`KVMap` on Redis, shared by any number of proxy replicas using the same `prefix`.

    Reports REPLACED (overwritten by `put`) and EXPIRED (TTL ran out, found by the sweep or by
    a `put` over it); there is no count bound (configure Redis `maxmemory` with
    `noeviction`). `take`/`delete` are not reported.
    """

    backend = "redis"
    in_process = False

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        *,
        prefix: str = DEFAULT_PREFIX,
        shards: int = 0,
        wait_replicas: int = 0,
        on_evict: EvictionCallback | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        sweep_interval: float = DEFAULT_SWEEP_INTERVAL,
        shadow_grace: float = DEFAULT_SHADOW_GRACE,
        sweep_batch: int = DEFAULT_SWEEP_BATCH,
        sweep: bool = True,
        owns_client: bool = True,
        close_timeout: float = CLOSE_DRAIN_TIMEOUT,
    ) -> None:
        if not _PREFIX_RE.fullmatch(prefix):
            raise ValueError("prefix must be 1-64 characters of [A-Za-z0-9_.:-]")
        if not 0 < timeout < math.inf:
            raise ValueError("timeout must be positive")
        if not 0 < sweep_interval < math.inf:
            raise ValueError("sweep_interval must be positive")
        if not 0 <= shadow_grace < math.inf:
            raise ValueError("shadow_grace must be non-negative")
        if sweep_batch < 1:
            raise ValueError("sweep_batch must be positive")
        if not 0 <= shards <= 1024:
            raise ValueError("shards must be 0 (one index) to 1024")
        if wait_replicas < 0:
            raise ValueError("wait_replicas must be non-negative")
        if wait_replicas and isinstance(client, RedisCluster):
            raise ValueError("wait_replicas is for single Redis and Sentinel maps")
        super().__init__(on_evict, close_timeout)
        self.prefix = prefix
        self.timeout = timeout
        self.sweep_interval = sweep_interval
        self._r = client
        self._owns_client = owns_client
        self._grace_ms = math.ceil(shadow_grace * 1000)
        self._batch = sweep_batch
        self._sweep_enabled = sweep
        self._layout = KeyLayout(prefix, shards)
        self._lock = self._layout.lock
        self._wait_replicas = wait_replicas
        # WAIT's own timeout leaves room within the operation's timeout for the script.
        self._wait_ms = max(1, math.floor(timeout * 500))
        # The lock only saves work (see module docstring); it outlives a slow sweep briefly.
        self._lock_ms = max(1000, math.ceil(sweep_interval * 4000))
        self._put = client.register_script(_LUA_PUT)
        self._settle_put = client.register_script(_LUA_SETTLE_PUT)
        self._take = client.register_script(_LUA_TAKE)
        self._sweep = client.register_script(_LUA_SWEEP)
        self._unlock = client.register_script(_LUA_UNLOCK)
        # The write scripts on a leaner client where it can serve (plain TCP, no WAIT).
        self._resp = (
            RespConnection.for_client(client, stale_after=max(1.0, 20 * timeout))
            if not wait_replicas and not isinstance(client, RedisCluster)
            else None
        )
        self._available = True

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        **kwargs: Any,
    ) -> RedisMap:
        client = make_client(url, timeout=timeout, max_connections=max_connections)
        return cls(client, timeout=timeout, owns_client=True, **kwargs)

    # -- KVMap -------------------------------------------------------------------------------

    async def get(self, key: ConversationKey) -> KVEntry | None:
        member = self._member(key)
        raw: bytes | None
        try:
            # Plain GET: Redis's own TTL decides liveness, no script needed.
            raw = cast("bytes | None", await self._op(self._r.get(self._layout.value(member))))
        except _WrongType:
            raw = b""
        return self._found(raw)

    async def put(self, key: ConversationKey, entry: KVEntry, ttl: float) -> None:
        """See `KVMap.put`; raises `UnconfirmedPutError` when the put may have been stored
        without this replica knowing (its `settle` finds out, or makes sure it never is)."""
        member = self._member(key)
        if not isinstance(entry, KVEntry):
            raise TypeError("entry must be a KVEntry")
        ttl_ms = max(1, math.ceil(check_ttl(ttl) * 1000))
        keys = [*self._layout.keys(member), self._layout.fate(member, secrets.token_hex(8))]
        try:
            result, confirmed = await self._write(
                self._put, keys, [entry.to_bytes(), ttl_ms, self._grace_ms, member]
            )
        except MapUnavailableError as exc:
            if isinstance(exc.__cause__, ResponseError | NotConnectedError):
                raise  # refused by Redis, or never sent: nothing was stored
            raise self._unconfirmed(f"put outcome unknown ({exc})", keys, ttl_ms) from exc
        if not confirmed:
            # A failover may undo this put and bring back the entry it overwrote, so that
            # entry is not reported now (reported later once, or left to its lease). The
            # master has it meanwhile: the caller settles it before freeing its blocks.
            raise self._unconfirmed("put not confirmed by enough replicas", keys, ttl_ms)
        if result and len(result) != 2:  # a settle got there first: nothing stored
            return
        self._counters.puts += 1
        if result:
            kind, old_raw = result
            old = self._decode(old_raw)
            if old is not None:
                reason = EvictionReason.EXPIRED if kind == b"expired" else EvictionReason.REPLACED
                self._notifier.notify(key, old, reason)

    def _unconfirmed(self, why: str, keys: list[str], ttl_ms: int) -> UnconfirmedPutError:
        # "undone" outlives any late arrival of the put (as long as the entry's shadow).
        fate, args = [keys[3]], [ttl_ms + self._grace_ms]

        async def settle() -> bool:
            result, confirmed = await self._write(self._settle_put, fate, args)
            if not confirmed:
                raise MapUnavailableError("settling a put not confirmed by enough replicas")
            return bool(result)

        return UnconfirmedPutError(why, settle)

    async def take(self, key: ConversationKey) -> KVEntry | None:
        entry = self._found(await self._remove(key))
        if entry is not None:
            self._counters.takes += 1
        return entry

    async def delete(self, key: ConversationKey) -> KVEntry | None:
        raw = await self._remove(key)
        entry = None if raw is None else self._decode(raw)
        if entry is not None:
            self._counters.deletes += 1
        return entry

    async def stats(self) -> MapStats:
        """Never raises: `entries` is None and `available` False while Redis is down."""
        entries: int | None
        try:
            entries = 0
            for shard in range(self._layout.shard_count):
                entries += int(await self._op(self._r.zcard(self._layout.index(shard))))
        except MapUnavailableError:
            entries = None
        return self._stats(entries, self._available)

    async def close(self) -> None:
        """Stop sweeping, wait for pending callbacks, close the client if this map made it.
        Entries stay in Redis for the other replicas."""
        if not await self._stop_sweeping():
            return
        await self._notifier.drain(within=self.close_timeout)
        if self._resp is not None:
            self._resp.close()
        if self._owns_client:
            await self._r.aclose()

    # -- extras ------------------------------------------------------------------------------

    async def sweep_once(self) -> int:
        """Report every due entry (if this replica gets the sweep lock); returns how many."""
        token = secrets.token_hex(8)
        locked = await self._op(self._r.set(self._lock, token, nx=True, px=self._lock_ms))
        if not locked:
            return 0
        reported = 0
        try:
            for shard in range(self._layout.shard_count):
                reported += await self._sweep_shard(shard)
            return reported
        finally:
            with contextlib.suppress(MapUnavailableError):
                await self._op(self._unlock(keys=[self._lock], args=[token]))

    async def _sweep_shard(self, shard: int) -> int:
        reported = 0
        index = self._layout.index(shard)
        vprefix, sprefix = self._layout.sweep_prefixes(shard)
        while True:
            result, confirmed = await self._write(
                self._sweep, [index], [vprefix, sprefix, self._batch]
            )
            due, pairs = int(result[0]), result[1:]
            if not confirmed:
                # A failover could put these back in the index, to be reported again by the
                # new master: report none now (each is then reported once, or left to the
                # holder's lease if the removal did survive).
                log.warning("dropping %d unconfirmed expiry reports", len(pairs) // 2)
                return reported
            for i in range(0, len(pairs), 2):
                reported += self._report_expired(pairs[i], pairs[i + 1])
            if due < self._batch:
                return reported

    @property
    def available(self) -> bool:
        """False after a failed operation, true again after the next successful one."""
        return self._available

    # -- internals ---------------------------------------------------------------------------

    def _member(self, key: ConversationKey) -> str:
        if self._closed:
            raise RuntimeError("map is closed")
        member = encode_key(key)
        if self._sweeper is None and self._sweep_enabled:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())
        return member

    async def _remove(self, key: ConversationKey) -> bytes | None:
        member = self._member(key)
        raw, confirmed = await self._write(self._take, self._layout.keys(member), [member])
        if not confirmed:
            # Removed on the master, but a failover could bring it back: using it now could
            # make it used twice. Left unused (a later take after such a failover may use it).
            raise MapUnavailableError("take not confirmed by enough replicas")
        return cast("bytes | None", raw)

    async def _write(self, script: Any, keys: list[str], args: list[Any]) -> tuple[Any, bool]:
        """Run a write script; with `wait_replicas`, WAIT on the same connection afterwards.
        Returns (script result, whether enough replicas confirmed it)."""
        if not self._wait_replicas:
            if self._resp is not None:
                return await self._op(self._resp.evalsha(script, keys, args)), True
            return await self._op(script(keys=keys, args=args)), True

        async def run() -> list[Any]:
            async with self._r.pipeline(transaction=False) as pipe:
                await script(keys=keys, args=args, client=pipe)
                pipe.execute_command("WAIT", self._wait_replicas, self._wait_ms)
                return await pipe.execute()

        result, acked = await self._op(run())
        if int(acked) < self._wait_replicas:
            self._counters.unavailable_errors += 1
            log.warning(
                "redis map write confirmed by %d of %d replicas", int(acked), self._wait_replicas
            )
            return result, False
        return result, True

    async def _op(self, awaitable: Awaitable[T]) -> T:
        """Await one Redis call within `timeout`; every failure becomes MapUnavailableError."""
        try:
            async with asyncio.timeout(self.timeout):
                result = await awaitable
        except ResponseError as exc:
            if str(exc).startswith("WRONGTYPE"):
                raise _WrongType from exc
            self._failed(exc)
            raise MapUnavailableError(f"redis refused the operation: {_first_word(exc)}") from exc
        except (RedisError, RedisClusterException, OSError, TimeoutError) as exc:
            self._failed(exc)
            raise MapUnavailableError(f"redis unavailable: {type(exc).__name__}") from exc
        if not self._available:
            self._available = True
            log.warning("redis map is available again")
        return result

    def _failed(self, exc: BaseException) -> None:
        self._counters.unavailable_errors += 1
        if self._available:
            self._available = False
            # Connectivity errors are expected and logged once per outage; anything else
            # (a script error) is a bug and logged in full.
            if isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError | TimeoutError):
                log.warning("redis map unavailable: %s", type(exc).__name__)
            else:
                log.error("redis map operation failed: %r", exc)

    def _decode(self, raw: bytes) -> KVEntry | None:
        try:
            return KVEntry.from_bytes(raw)
        except EntryDecodeError:
            self._counters.corrupt += 1
            return None

    def _found(self, raw: bytes | None) -> KVEntry | None:
        entry = None if raw is None else self._decode(raw)
        if entry is None:
            self._counters.misses += 1
        else:
            self._counters.hits += 1
        return entry

    def _report_expired(self, member: bytes, raw: bytes) -> int:
        try:
            key = decode_key(member.decode("ascii"))
        except (UnicodeDecodeError, InvalidKeyError):
            self._counters.corrupt += 1
            return 0
        entry = self._decode(raw)
        if entry is None:
            return 0
        self._notifier.notify(key, entry, EvictionReason.EXPIRED)
        return 1

    async def _sweep_forever(self) -> None:
        # Stagger replicas so they do not all try the lock at the same instant.
        await asyncio.sleep(self.sweep_interval * (0.5 + secrets.randbelow(1000) / 1000))
        while not self._closed:
            try:
                await self.sweep_once()
            except MapUnavailableError:
                pass  # counted and logged by _op; try again next interval
            except Exception:
                log.exception("redis map sweep failed")
            await asyncio.sleep(self.sweep_interval)


class _WrongType(Exception):
    """A key holds a non-string value (someone else wrote it): treated as a corrupt miss."""


def _first_word(exc: BaseException) -> str:
    text = str(exc)
    return text.split(" ", 1)[0][:32] if text else type(exc).__name__
