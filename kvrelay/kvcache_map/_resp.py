"""`RespConnection`: the Redis map's scripts on one connection that every caller shares, on
asyncio protocols.

redis-py's asyncio client makes some two hundred Python calls per command (a connection taken
from the pool and given back, timeouts, its stream reader), so a put+take pair cost the proxy
about as much CPU as a whole turn. Here a call is one write of the packed command onto the
shared connection; Redis answers in the order the commands came (RESP), so callers wait in a
FIFO, and the protocol's `data_received` parses each reply and resolves its caller directly:
a reply reaches its caller on the next loop iteration, as with redis-py, and commands written
in the same iteration leave together.

Scope: a plain-TCP single server (`redis://`, its user, password and db from the URL) without
`wait_replicas`. TLS, Sentinel, Cluster and `WAIT`, and the map's calls off the request path
(`get`, the sweep's lock, `stats`), stay on redis-py.

Failures raise redis-py's exception classes, so the map treats them as before:
- a refused connect or a connection reset or closed fails every call waiting on it with
  `ConnectionError` (`NotConnectedError` when no connection could be made: nothing was
  sent); the next call connects again;
- an error reply reaches its caller only (`ResponseError`, `NoScriptError`);
- a caller that stops waiting (its timeout) keeps its place in the FIFO; its reply is dropped
  when it comes. The command may still run, as with redis-py;
- a connection that has owed a reply for `stale_after` seconds (Redis paused, a silent
  network path) is dropped at the next call, which connects again.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

Arg = bytes | str | int


class NotConnectedError(RedisConnectionError):
    """No connection could be made: the command never went out (it cannot have run)."""


class _Incomplete:
    """The buffer ends inside a reply."""


_INCOMPLETE = _Incomplete()


def pack(args: tuple[Arg, ...]) -> bytes:
    """A command as a RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        raw = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(parts)


def parse(buf: bytes | bytearray, pos: int) -> tuple[Any, int] | _Incomplete:
    """One RESP2 reply at `pos`: (value, end), or `_INCOMPLETE`. Error replies come back as
    exception instances (the caller raises them); nil as None; bulk strings as bytes."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return _INCOMPLETE
    kind = buf[pos]
    line = bytes(buf[pos + 1 : end])
    pos = end + 2
    if kind == 0x24:  # $ bulk string
        size = int(line)
        if size < 0:
            return None, pos
        stop = pos + size
        if len(buf) < stop + 2:
            return _INCOMPLETE
        return bytes(buf[pos:stop]), stop + 2
    if kind == 0x3A:  # : integer
        return int(line), pos
    if kind == 0x2A:  # * array
        count = int(line)
        if count < 0:
            return None, pos
        items = []
        for _ in range(count):
            got = parse(buf, pos)
            if isinstance(got, _Incomplete):
                return got
            item, pos = got
            items.append(item)
        return items, pos
    if kind == 0x2B:  # + simple string
        return line, pos
    if kind == 0x2D:  # - error
        text = line.decode("utf-8", "replace")
        return (NoScriptError if text.startswith("NOSCRIPT") else ResponseError)(text), pos
    raise ValueError(f"not a RESP reply (type byte {kind!r})")


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.owed_since = 0.0  # when the oldest unanswered command's wait began, or the last reply
        self.lost = False
        self._buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        waiting = self.waiting
        try:
            while pos < len(buf):
                got = parse(buf, pos)
                if isinstance(got, _Incomplete):
                    break
                reply, pos = got
                future = waiting.popleft()  # IndexError: a reply nobody asked for
                if future.done():
                    continue  # its caller stopped waiting
                if isinstance(reply, ResponseError):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except (ValueError, IndexError) as exc:
            self.fail(f"redis broke the protocol: {exc}")
            return
        del buf[:pos]
        self.owed_since = time.monotonic()

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail("connection to redis lost")

    def fail(self, why: str) -> None:
        """Close the connection and fail every call still waiting on it (an exception each:
        one instance raised in many tasks would gather all their tracebacks)."""
        self.lost = True
        if self.transport is not None:
            self.transport.abort()
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(RedisConnectionError(why))

    def send(self, args: tuple[Arg, ...]) -> asyncio.Future[Any]:
        assert self.transport is not None
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if not self.waiting:
            self.owed_since = time.monotonic()
        self.waiting.append(future)
        self.transport.write(pack(args))
        return future


@dataclass(frozen=True)
class RedisAddress:
    """Where a `RespConnection` connects, and as whom."""

    host: str
    port: int
    username: str | None = None
    password: str | None = None
    db: int = 0
    connect_timeout: float = 5.0


class RespConnection:
    """One shared connection to a plain-TCP Redis server; see the module docstring."""

    def __init__(self, address: RedisAddress, *, stale_after: float) -> None:
        self._address = address
        self._stale_after = stale_after
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Task[_Protocol] | None = None

    @classmethod
    def for_client(cls, client: aioredis.Redis, *, stale_after: float) -> RespConnection | None:
        """The same server as `client`'s pool, when it is a plain TCP one (else None)."""
        # redis-py's undocumented pool attributes: the only record of the URL's address and
        # credentials once parsed (pinned by tests/test_private_apis.py).
        pool = client.connection_pool
        if pool.connection_class is not Connection:  # TLS, Unix socket, Sentinel
            return None
        kw = pool.connection_kwargs
        timeout = kw.get("socket_connect_timeout") or kw.get("socket_timeout") or 5.0
        address = RedisAddress(
            str(kw.get("host", "localhost")),
            int(kw.get("port", 6379)),
            username=kw.get("username"),
            password=kw.get("password"),
            db=int(kw.get("db") or 0),
            connect_timeout=float(timeout),
        )
        return cls(address, stale_after=stale_after)

    async def call(self, *args: Arg) -> Any:
        """Send one command and wait for its reply (an error reply is raised)."""
        proto = self._proto
        if proto is None or not self._usable(proto):
            proto = await self._connected()
        return await proto.send(args)

    async def evalsha(self, script: AsyncScript, keys: list[str], args: list[Any]) -> Any:
        """Run a registered script; load it first if Redis does not know it (NOSCRIPT runs
        nothing, so the retry cannot run it twice)."""
        try:
            # AsyncScript's sha and text: the map's scripts are registered with redis-py, which
            # keeps them there (pinned by tests/test_private_apis.py).
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            body = script.script
            await self.call(
                "SCRIPT", "LOAD", body if isinstance(body, bytes | str) else bytes(body)
            )
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)

    def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        if self._proto is not None:
            self._proto.fail("redis map closed")
            self._proto = None

    def _usable(self, proto: _Protocol) -> bool:
        if proto.lost:
            return False
        return not proto.waiting or time.monotonic() - proto.owed_since <= self._stale_after

    async def _connected(self) -> _Protocol:
        if self._connecting is None:
            proto = self._proto
            if proto is not None:
                if self._usable(proto):
                    return proto  # another caller's connect finished meanwhile
                proto.fail("redis stopped answering")
                self._proto = None
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
        # Shielded: one caller's timeout does not abort the connect the others wait for.
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> _Protocol:
        try:
            loop = asyncio.get_running_loop()
            where = self._address
            async with asyncio.timeout(where.connect_timeout):
                _, proto = await loop.create_connection(_Protocol, where.host, where.port)
                try:
                    if where.password is not None:
                        user = (where.username,) if where.username else ()
                        await proto.send(("AUTH", *user, where.password))
                    if where.db:
                        await proto.send(("SELECT", where.db))
                except BaseException:
                    proto.fail("redis connection setup failed")
                    raise
            self._proto = proto
            return proto
        except (OSError, TimeoutError) as exc:
            raise NotConnectedError(f"cannot connect to redis: {type(exc).__name__}") from exc
        finally:
            self._connecting = None
