"""A small keep-alive HTTP/1.1 client on asyncio protocols with httptools' response parser.

A candidate for the proxy's engine-facing client (it lives in `bench/` until the proxy's hot
path is reworked): one `H1Pool` per engine origin keeps idle connections and reuses them; a
request is one `transport.write`; the response is parsed by httptools (llhttp, C) straight from
`data_received`, with no per-request timeout objects, no cookie jar, no redirects, no
decompression and no DNS: engines are addressed by IP and port, and bodies are passed through.

Use:

    pool = H1Pool("127.0.0.1", 8000)
    resp = await pool.request("POST", "/v1/completions", body, headers)
    data = await resp.read()            # or: async for chunk in resp.iter_chunks(): ...
    await pool.close()

A response must be read to its end (`read()` or exhausting `iter_chunks()`) or `close()`d; a
fully read response on a keep-alive connection returns the connection to the pool. Closing a
response early closes its connection, which is how a server learns the client went away.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Iterable
from typing import cast

import httptools

# Above this many unread body bytes the connection stops reading from the socket (flow control).
_HIGH_WATER = 256 * 1024


class H1Error(ConnectionError):
    """The connection failed or the server broke the HTTP/1.1 exchange."""


class _Connection(asyncio.Protocol):
    """One TCP connection; parses the response of the request in flight."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)
        self._response: H1Response | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCP transport implements asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(H1Error("protocol upgrades are not supported"))
        except httptools.HttpParserError as exc:
            self._fail(H1Error(f"malformed HTTP response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._response is not None and not self._response.complete:
            self._response._fail(H1Error(f"connection closed mid-response: {exc or 'EOF'}"))

    def pause_writing(self) -> None:  # request bodies are small: nothing to throttle
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks -------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if self._response is not None:
            self._response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._response is not None:
            self._response.status = self._parser.get_status_code()
            self._response._headers_done()

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        response = self._response
        if response is not None:
            response.keep_alive = self._parser.should_keep_alive()
            response._finish()

    # -- used by the pool --------------------------------------------------------------------------
    def send(self, request: bytes, response: H1Response) -> None:
        assert self.transport is not None
        self._response = response
        self.transport.write(request)

    def detach(self) -> None:
        self._response = None

    def _fail(self, exc: Exception) -> None:
        if self._response is not None:
            self._response._fail(exc)
        self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class H1Response:
    """Status, raw headers and the body as it arrives; read it to the end or close it."""

    def __init__(self, pool: H1Pool, conn: _Connection) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False
        self.keep_alive = False
        self._pool = pool
        self._conn: _Connection | None = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._head: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def header(self, name: bytes) -> bytes | None:
        """The first header named `name` (case-insensitive), else None."""
        lname = name.lower()
        for key, value in self.headers:
            if key.lower() == lname:
                return value
        return None

    async def read(self) -> bytes:
        """The whole (remaining) body."""
        parts = [chunk async for chunk in self.iter_chunks()]
        return b"".join(parts)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (transfer-encoding removed)."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._buffered < _HIGH_WATER and self._conn is not None:
                    transport = self._conn.transport
                    if transport is not None and not transport.is_reading():
                        transport.resume_reading()
                yield chunk
                continue
            if self._error is not None:
                raise self._error
            if self.complete:
                self._release()
                return
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def close(self) -> None:
        """Stop reading: an unfinished response closes its connection."""
        if self._conn is None:
            return
        if self.complete and not self._chunks:
            self._release()
            return
        conn, self._conn = self._conn, None
        conn.detach()
        conn.abort()

    # -- called by the connection ---------------------------------------------------------------
    def _headers_done(self) -> None:
        if not self._head.done():
            self._head.set_result(None)

    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered >= _HIGH_WATER and self._conn is not None and self._conn.transport:
            self._conn.transport.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        self._headers_done()
        self._wake()

    def _fail(self, exc: Exception) -> None:
        if self._error is None:
            self._error = exc
        if not self._head.done():
            self._head.set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.detach()
        if self.keep_alive and not conn.closed:
            self._pool._put_back(conn)
        else:
            conn.abort()


class H1Pool:
    """Keep-alive connections to one HTTP/1.1 origin, opened on demand, reused LIFO."""

    def __init__(self, host: str, port: int, max_idle: int = 1024) -> None:
        self.host = host
        self.port = port
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._host_header = f"Host: {host}:{port}\r\n".encode()
        self.opened = 0  # connections opened so far (reuse shows as opened << requests)

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: Iterable[tuple[str, str]] = (),
    ) -> H1Response:
        """Send one request; returns once the response's status and headers have arrived."""
        head = [f"{method} {path} HTTP/1.1\r\n".encode(), self._host_header]
        head.append(f"Content-Length: {len(body)}\r\n".encode())
        for name, value in headers:
            if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
                raise ValueError("header names and values must not contain CR or LF")
            head.append(f"{name}: {value}\r\n".encode())
        head.append(b"\r\n")
        conn = await self._connection()
        response = H1Response(self, conn)
        conn.send(b"".join(head) + body, response)
        try:
            await response._head
        except BaseException:
            response.close()
            raise
        return response

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(_Connection, self.host, self.port)
        except OSError as exc:
            raise H1Error(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        self.opened += 1
        return conn

    def _put_back(self, conn: _Connection) -> None:
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.abort()

    async def close(self) -> None:
        """Close every idle connection (responses still being read keep theirs)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.abort()
