"""`open_map(url)`: pick and configure a backend from one URL (what `KVRELAY_MAP_URL` holds).

- `memory://?max_entries=N&sweep_interval_ms=M`
- `redis://[[user]:password@]host[:port][/db]?prefix=P&timeout_ms=T&sweep_interval_ms=M
  &shadow_grace_s=G&max_connections=C&sweep_batch=B&sweep=true|false` (and `rediss://`).

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
from kvrelay.kvcache_map._redis import DEFAULT_PREFIX, RedisMap


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
        kwargs = {"prefix": o.get("prefix", DEFAULT_PREFIX)}
        if "timeout_ms" in o:
            kwargs["timeout"] = o["timeout_ms"] / 1000
        if "sweep_interval_ms" in o:
            kwargs["sweep_interval"] = o["sweep_interval_ms"] / 1000
        if "shadow_grace_s" in o:
            kwargs["shadow_grace"] = o["shadow_grace_s"]
        for name in ("max_connections", "sweep_batch", "sweep"):
            if name in o:
                kwargs[name] = o[name]
        # Our options are consumed here; redis-py gets the URL without its query.
        bare = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        return RedisMap.from_url(bare, on_evict=on_evict, **kwargs)
    raise ValueError(f"unsupported map URL scheme {parts.scheme!r}: use memory:// or redis://")
