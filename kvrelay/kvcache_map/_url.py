"""`open_map(url)`: pick and configure a backend from one URL (what `KVRELAY_MAP_URL` holds).

- `memory://?max_entries=N&sweep_interval_ms=M`
- `redis://[[user]:password@]host[:port][/db]?prefix=P&timeout_ms=T&sweep_interval_ms=M
  &shadow_grace_s=G&max_connections=C&sweep_batch=B&sweep=true|false&wait_replicas=N`
  (and `rediss://`).
- `redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]?...`: the master
  the sentinels name for `service` (the password is the data nodes'); same options, and
  `wait_replicas` defaults to 1 (each write confirmed by a replica before it counts).
- `redis+cluster://[[user]:password@]host:port[,host:port...]?...&shards=S`: Redis Cluster,
  keys hash-tagged into `S` index shards (default 16); same options but `wait_replicas`.
  `rediss+sentinel://` and `rediss+cluster://` use TLS.

Keyword options override query options (same names, Python values). Unknown options are an
error, so a typo does not silently fall back to a default. Error messages never echo the URL
(it may carry a password).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from kvrelay.kvcache_map._base import EvictionCallback, KVMap
from kvrelay.kvcache_map._memory import MemoryMap
from kvrelay.kvcache_map._redis import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_PREFIX,
    DEFAULT_TIMEOUT,
    RedisMap,
)
from kvrelay.kvcache_map._redis_topology import (
    DEFAULT_CLUSTER_SHARDS,
    MultiHostURL,
    cluster_client,
    sentinel_client,
    single_client,
)


def _int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer")
    return int(value)


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number")
    return float(value)


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected a boolean")


_MEMORY_OPTS: dict[str, Callable[[Any], Any]] = {
    "max_entries": _int,
    "sweep_interval_ms": _float,
    "report_on_close": _bool,
}
_REDIS_OPTS: dict[str, Callable[[Any], Any]] = {
    "prefix": str,
    "timeout_ms": _float,
    "sweep_interval_ms": _float,
    "shadow_grace_s": _float,
    "max_connections": _int,
    "sweep_batch": _int,
    "sweep": _bool,
    "wait_replicas": _int,
}
_SENTINEL_OPTS = _REDIS_OPTS
_CLUSTER_OPTS: dict[str, Callable[[Any], Any]] = {
    **{k: v for k, v in _REDIS_OPTS.items() if k != "wait_replicas"},
    "shards": _int,
}


def _options(
    query: str, opts: dict[str, Any], known: dict[str, Callable[[Any], Any]], scheme: str
) -> dict[str, Any]:
    merged: dict[str, Any] = dict(parse_qsl(query, keep_blank_values=True))
    merged.update(opts)
    unknown = sorted(set(merged) - set(known))
    if unknown:
        raise ValueError(f"unknown {scheme} map option(s) {unknown}; known: {sorted(known)}")
    parsed: dict[str, Any] = {}
    for name, value in merged.items():
        try:
            parsed[name] = known[name](value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad value for {scheme} map option {name!r}") from exc
    return parsed


def open_map(url: str, on_evict: EvictionCallback | None = None, **opts: Any) -> KVMap:
    """Create the map `url` names. Nothing connects yet: Redis is first used by the first
    operation, so a proxy starts even while Redis is down (and serves without reuse)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "memory":
        o = _options(parts.query, opts, _MEMORY_OPTS, scheme)
        kwargs: dict[str, Any] = {}
        if "max_entries" in o:
            kwargs["max_entries"] = o["max_entries"]
        if "sweep_interval_ms" in o:
            kwargs["sweep_interval"] = o["sweep_interval_ms"] / 1000
        if "report_on_close" in o:
            kwargs["report_on_close"] = o["report_on_close"]
        return MemoryMap(on_evict=on_evict, **kwargs)
    if scheme in ("redis", "rediss"):
        o = _options(parts.query, opts, _REDIS_OPTS, scheme)
        kwargs = _redis_kwargs(o)
        # Our options are consumed here; redis-py gets the URL without its query.
        bare = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        return RedisMap.from_url(bare, on_evict=on_evict, **kwargs)
    if scheme in ("redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster"):
        cluster = scheme.endswith("cluster")
        o = _options(parts.query, opts, _CLUSTER_OPTS if cluster else _SENTINEL_OPTS, scheme)
        kwargs = _redis_kwargs(o)
        timeout = kwargs.get("timeout", DEFAULT_TIMEOUT)
        max_connections = kwargs.pop("max_connections", DEFAULT_MAX_CONNECTIONS)
        try:
            hosts = MultiHostURL.parse(parts.netloc, parts.path)
        except ValueError as exc:
            raise ValueError(f"bad {scheme} map URL: {exc}") from None
        tls = scheme.startswith("rediss")
        if cluster:
            kwargs["shards"] = o.get("shards", DEFAULT_CLUSTER_SHARDS)
            if not 1 <= kwargs["shards"] <= 1024:
                raise ValueError("the cluster map option 'shards' must be 1 to 1024")
            client: Any = cluster_client(
                hosts, timeout=timeout, max_connections=max_connections, tls=tls
            )
        else:
            kwargs.setdefault("wait_replicas", 1)
            client = sentinel_client(
                hosts, timeout=timeout, max_connections=max_connections, tls=tls
            )
        return RedisMap(client, on_evict=on_evict, owns_client=True, **kwargs)
    raise ValueError(
        f"unsupported map URL scheme {parts.scheme!r}: use memory://, redis://, "
        "redis+sentinel:// or redis+cluster://"
    )


def _redis_kwargs(o: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"prefix": o.get("prefix", DEFAULT_PREFIX)}
    if "timeout_ms" in o:
        kwargs["timeout"] = o["timeout_ms"] / 1000
    if "sweep_interval_ms" in o:
        kwargs["sweep_interval"] = o["sweep_interval_ms"] / 1000
    if "shadow_grace_s" in o:
        kwargs["shadow_grace"] = o["shadow_grace_s"]
    for name in ("max_connections", "sweep_batch", "sweep", "wait_replicas"):
        if name in o:
            kwargs[name] = o[name]
    return kwargs


def open_redis_client(url: str, timeout: float = 2.0) -> tuple[Any, str, bool]:
    """A plain client on the Redis a `redis*://` map URL names, for the proxy's other shared
    state (the fleet record): (client, the map's key prefix, whether it is a cluster).
    Raises ValueError for memory:// or a malformed URL."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    prefix = query.get("prefix", DEFAULT_PREFIX)
    if scheme in ("redis", "rediss"):
        bare = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        return single_client(bare, timeout=timeout, max_connections=8), prefix, False
    if scheme in ("redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster"):
        hosts = MultiHostURL.parse(parts.netloc, parts.path)
        tls = scheme.startswith("rediss")
        if scheme.endswith("cluster"):
            client = cluster_client(hosts, timeout=timeout, max_connections=8, tls=tls)
            return client, prefix, True
        return sentinel_client(hosts, timeout=timeout, max_connections=8, tls=tls), prefix, False
    raise ValueError(f"map URL scheme {parts.scheme!r} has no Redis")
