"""Where `RedisMap` keeps its keys, and the clients for single Redis, Sentinel and Cluster.

Every Lua script of the map touches one entry's value key, its shadow key and an index. In
Redis Cluster all keys of one script must live in one hash slot, so a cluster map splits the
index into `shards` sorted sets and puts each entry's three keys under its shard's hash tag:

- single Redis / Sentinel (`shards=0`): `prefix:v:<member>`, `prefix:s:<member>`, `prefix:idx`
  (the layout of earlier releases, unchanged);
- Cluster: `{prefix:<n>}:v:<member>`, `{prefix:<n>}:s:<member>`, `{prefix:<n>}:idx` with
  `n = crc32(member) % shards`; the sweep visits every shard.

Client builders bound every wait by `timeout` and never retry on their own (the map turns any
failure into `MapUnavailableError` at once).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

DEFAULT_CLUSTER_SHARDS = 16


@dataclass(frozen=True)
class KeyLayout:
    """Key names of one map (see the module docstring)."""

    prefix: str
    shards: int = 0  # 0: one untagged index (single Redis, Sentinel)

    @property
    def shard_count(self) -> int:
        return max(1, self.shards)

    def shard_of(self, member: str) -> int:
        if not self.shards:
            return 0
        return zlib.crc32(member.encode("ascii")) % self.shards

    def base(self, shard: int) -> str:
        return f"{{{self.prefix}:{shard}}}" if self.shards else self.prefix

    def keys(self, member: str) -> list[str]:
        """[value, shadow, index] of one entry: the KEYS of the put and take scripts."""
        base = self.base(self.shard_of(member))
        return [f"{base}:v:{member}", f"{base}:s:{member}", f"{base}:idx"]

    def fate(self, member: str, write_id: str) -> str:
        """The key recording whether one put was stored or undone (same slot as the entry)."""
        return f"{self.base(self.shard_of(member))}:w:{write_id}"

    def value(self, member: str) -> str:
        return self.keys(member)[0]

    def index(self, shard: int) -> str:
        return f"{self.base(shard)}:idx"

    def sweep_prefixes(self, shard: int) -> tuple[str, str]:
        base = self.base(shard)
        return f"{base}:v:", f"{base}:s:"

    @property
    def lock(self) -> str:
        return f"{self.prefix}:sweep-lock"


def _common(timeout: float) -> dict[str, Any]:
    return {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
    }


def single_client(url: str, *, timeout: float, max_connections: int) -> aioredis.Redis:
    """`redis://` / `rediss://`: one server (password, user, db from the URL)."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout,  # waiting for a free pooled connection
        **_common(timeout),
    )
    return aioredis.Redis(connection_pool=pool)


@dataclass(frozen=True)
class MultiHostURL:
    """`scheme://[user[:password]@]host:port[,host:port...][/path]` split into parts."""

    hosts: list[tuple[str, int]]
    username: str | None
    password: str | None
    path: list[str]

    @classmethod
    def parse(cls, netloc: str, path: str) -> MultiHostURL:
        auth, at, hostlist = netloc.rpartition("@")
        username = password = None
        if at:
            user, colon, pw = auth.partition(":")
            username = unquote(user) or None
            password = unquote(pw) if colon else None
        hosts: list[tuple[str, int]] = []
        for item in hostlist.split(","):
            host, colon, port = item.strip().rpartition(":")
            if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError("each host must be host:port")
            hosts.append((host.strip("[]"), int(port)))
        return cls(hosts, username, password, [p for p in path.split("/") if p])


def cluster_client(
    url: MultiHostURL, *, timeout: float, max_connections: int, tls: bool
) -> RedisCluster:
    """`redis+cluster://host:port[,host:port]`: any reachable nodes; the rest is discovered."""
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in url.hosts],
        username=url.username,
        password=url.password,
        max_connections=max_connections,
        ssl=tls,
        **_common(timeout),
    )


def sentinel_client(
    url: MultiHostURL, *, timeout: float, max_connections: int, tls: bool
) -> aioredis.Redis:
    """`redis+sentinel://host:port[,host:port]/service[/db]`: the service's current master,
    asked of the sentinels on every new connection (so a failover is followed)."""
    if not url.path:
        raise ValueError("a sentinel URL needs the service name as its path: /mymaster")
    service = url.path[0]
    db = int(url.path[1]) if len(url.path) > 1 else 0
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis 8.2
        url.hosts,
        sentinel_kwargs={"socket_timeout": timeout, "socket_connect_timeout": timeout},
        username=url.username,
        password=url.password,
        db=db,
        max_connections=max_connections,
        ssl=tls,
        **_common(timeout),
    )
    client: aioredis.Redis = sentinel.master_for(service)
    return client
