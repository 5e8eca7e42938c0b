"""The engine-facing HTTP/1.1 client: keep-alive pools on asyncio protocols, httptools' parser.

The proxy makes two or three engine calls per turn (P, D, and for streams D's side channel), so
the client's own cost is a large share of the proxy's (bench/RESULTS.md, `## http clients`:
aiohttp's client costs several times more CPU per request than this one). It does only what
engine calls need: one `Origin` per engine address keeps idle connections and reuses them
(LIFO), a request is one `transport.write`, the response is parsed by httptools (llhttp, C)
straight from `data_received`; no cookie jar, redirects, decompression or proxies.

Timeouts cost no object per request: a connection's one timer checks the read deadline
(`read_timeout` without a byte from the engine, while waiting for the headers and between body
bytes) and the whole exchange's deadline (`total_timeout`), rescheduling itself rarely.

A response must be read to its end (`read()`, exhausting `iter_chunks()`) or `close()`d;
`release()` does whichever applies. A fully read response on a keep-alive connection returns
the connection to its pool; closing an unfinished response aborts its connection, which is how
an engine learns the client went away (vLLM aborts the request).

Errors are `UpstreamError`s: `UpstreamConnectError` (no connection: the engine is down),
`UpstreamTimeout` (also a `TimeoutError`) and `UpstreamBroken` (the connection closed or the
exchange was malformed). A reused idle connection that the engine closed before answering is
retried once on a fresh connection (nothing of the response was seen, so the engine never
took the request); any other failure is the caller's to classify.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import AsyncGenerator, Iterable
from typing import cast
from urllib.parse import urlsplit

import httptools

from kvrelay.connector.protocol import HEADER_SIGNATURE

# Above this many unread body bytes the connection stops reading from the socket (flow control).
_HIGH_WATER = 256 * 1024
_NO_BODY_STATUSES = (204, 304)
# The headers that frame a body (anything else: the body ends with the connection).
_FRAMING_HEADERS = frozenset((b"content-length", b"transfer-encoding"))
_FRAMING_LENGTHS = frozenset(map(len, _FRAMING_HEADERS))
_SIGNATURE_HEADER = HEADER_SIGNATURE.lower().encode()
# A GET answer (`Upstream.get`: /health, /metrics, /v1/models, /version) is refused past this.
_GET_MAX_BYTES = 16 * 1024 * 1024


class UpstreamError(ConnectionError):
    """An engine call failed: no connection, no answer in time, or a broken exchange."""


class UpstreamConnectError(UpstreamError):
    """No connection to the engine could be opened (refused, unreachable, connect timeout)."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The engine sent nothing for `read_timeout`, or the exchange ran past `total_timeout`."""


class UpstreamBroken(UpstreamError):
    """The connection closed mid-exchange or the engine broke HTTP/1.1."""


class _Connection(asyncio.Protocol):
    """One TCP connection; parses the response of the request in flight and times it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        # Body pieces of the current read. httptools calls `on_body` once per piece (a stream
        # sends one per event); bound to the deque's own `append`, that is a call in C, and the
        # response takes all of a read's pieces at once after the parser returns.
        self._body: collections.deque[bytes] = collections.deque()
        self.on_body = self._body.append  # before the parser: it looks its callbacks up once
        self._parser = httptools.HttpResponseParser(self)
        self._response: H1Response | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._read_timeout = 0.0
        self._deadline = 0.0
        self._last_read = 0.0
        self._framed = False  # the response says where its body ends (length or chunked)
        self._head_only = False  # the request was HEAD: the answer has no body, whatever it says

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCP transport implements asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._last_read = self.loop.time()
        response = self._response
        if response is not None:
            response.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamBroken("protocol upgrades are not supported"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBroken(f"malformed HTTP response: {exc}"))
        if self._body:
            if response is not None:
                # After the parser returned: a reader woken by the message's end (in
                # `on_message_complete`) runs only later, and finds every piece in place.
                response._take(self._body)
            self._body.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        response = self._response
        if response is None or response.complete:
            return
        if response.status and not self._framed and response.status not in _NO_BODY_STATUSES:
            response.keep_alive = False  # a body delimited by the end of the connection
            response._finish()
            return
        response._fail(UpstreamBroken(f"connection closed mid-response: {exc or 'EOF'}"))

    # -- httptools callbacks ----------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        response = self._response
        if response is not None:
            response.headers.append((name, value))
            # Lower-cased only when the length could match: most headers are neither.
            if len(name) in _FRAMING_LENGTHS and name.lower() in _FRAMING_HEADERS:
                self._framed = True

    def on_headers_complete(self) -> None:
        response = self._response
        if response is not None:
            response.status = self._parser.get_status_code()
            if self._head_only:
                # httptools cannot be told to skip the body a HEAD answer announces: the
                # answer ends here and its connection is not reused.
                response._finish()
                return
            response._headers_done()

    def on_message_complete(self) -> None:
        response = self._response
        if response is not None:
            response.keep_alive = self._parser.should_keep_alive()
            response._finish()  # the timer stays for the next exchange (see `send`)

    # -- used by the origin and the response ------------------------------------------------------
    def send(
        self,
        request: bytes,
        response: H1Response,
        read_timeout: float,
        total_timeout: float,
        head_only: bool = False,
    ) -> None:
        assert self.transport is not None
        self._response = response
        self._framed = False
        self._head_only = head_only
        now = self.loop.time()
        self._last_read = now
        self._read_timeout = read_timeout
        self._deadline = now + total_timeout
        first_check = min(now + read_timeout, self._deadline)
        timer = self._timer
        # The timer of an earlier exchange on this connection is kept when it fires no later
        # than this one needs (it then checks this exchange and reschedules itself): a busy
        # keep-alive connection makes a timer once per read timeout, not once per request.
        if timer is None or timer.when() > first_check:
            if timer is not None:
                timer.cancel()
            self._timer = self.loop.call_at(first_check, self._on_timer)
        self.transport.write(request)

    def detach(self) -> None:
        self._response = None  # the timer, if any, stays for the next exchange (see `send`)

    def abort(self) -> None:
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.abort()

    def _on_timer(self) -> None:
        self._timer = None
        response = self._response
        if response is None or response.complete:
            return
        now = self.loop.time()
        if now >= self._deadline:
            self._fail(UpstreamTimeout("the engine's answer ran past the total timeout"))
            return
        transport = self.transport
        paused = transport is not None and not transport.is_reading()
        read_by = self._last_read + self._read_timeout
        if now >= read_by and not paused:
            self._fail(UpstreamTimeout("no byte from the engine within the read timeout"))
            return
        # While the reader lags (reading paused), the engine is not the one being slow.
        next_check = now + self._read_timeout if paused else read_by
        self._timer = self.loop.call_at(min(next_check, self._deadline), self._on_timer)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fail(self, exc: Exception) -> None:
        if self._response is not None:
            self._response._fail(exc)
        self.abort()


class H1Response:
    """Status, raw headers and the body as it arrives; read it to the end, or close it."""

    def __init__(self, origin: Origin, conn: _Connection) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False
        self.keep_alive = False
        self.received = False  # any byte of the answer arrived
        self._origin = origin
        self._conn: _Connection | None = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._head: asyncio.Future[None] = conn.loop.create_future()

    def header(self, name: bytes) -> bytes | None:
        """The first header called `name` (lower case; compared case-insensitively), or None."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    async def read(self, limit: int | None = None) -> bytes:
        """The whole (remaining) body; `UpstreamBroken` if it grows past `limit` bytes."""
        if self.complete and len(self._chunks) <= 1:
            data = self._chunks.popleft() if self._chunks else b""
            self._buffered = 0
            self._release_connection()
        else:
            parts: list[bytes] = []
            size = 0
            async for chunk in self.iter_chunks():
                parts.append(chunk)
                size += len(chunk)
                if limit is not None and size > limit:
                    self.close()
                    raise UpstreamBroken(f"the answer is larger than {limit} bytes")
            data = b"".join(parts)
        if limit is not None and len(data) > limit:
            raise UpstreamBroken(f"the answer is larger than {limit} bytes")
        return data

    async def iter_chunks(self) -> AsyncGenerator[bytes, None]:
        """Body bytes as they arrive (transfer-encoding removed); what arrived while the
        reader was busy comes as one piece, so a relay writes it on with one system call."""
        while True:
            if self._chunks:
                if len(self._chunks) == 1:
                    chunk = self._chunks.popleft()
                else:
                    chunk = b"".join(self._chunks)
                    self._chunks.clear()
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
                self._release_connection()
                return
            self._waiter = self._conn.loop.create_future() if self._conn else None
            if self._waiter is None:
                raise UpstreamBroken("the response was closed")
            try:
                await self._waiter
            finally:
                self._waiter = None

    def close(self) -> None:
        """Stop reading: an unfinished response aborts its connection (the engine sees EOF)."""
        if self._conn is None:
            return
        if self.complete and not self._chunks and self._error is None:
            self._release_connection()
            return
        conn, self._conn = self._conn, None
        conn.detach()
        conn.abort()
        self._origin._forget()

    def release(self) -> None:
        """Give the connection back when the body was read to its end, else abort it."""
        self.close()

    async def read_head(self, limit: int) -> bytes:
        """At most the first `limit` bytes of the body (an error page's message); the rest is
        left unread, so `release()` then aborts the connection."""
        parts: list[bytes] = []
        size = 0
        async with contextlib.aclosing(self.iter_chunks()) as chunks:
            async for chunk in chunks:
                parts.append(chunk)
                size += len(chunk)
                if size >= limit:
                    break
        return b"".join(parts)[:limit]

    # -- called by the connection -----------------------------------------------------------------
    def _headers_done(self) -> None:
        if not self._head.done():
            self._head.set_result(None)

    def _take(self, pieces: collections.deque[bytes]) -> None:
        """The body pieces of one read, in order; the caller clears `pieces`."""
        self._buffered += sum(map(len, pieces)) if len(pieces) > 1 else len(pieces[0])
        self._chunks.extend(pieces)
        conn = self._conn
        if self._buffered >= _HIGH_WATER and conn is not None and conn.transport is not None:
            conn.transport.pause_reading()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

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

    def _release_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.detach()
        if self.keep_alive and not conn.closed:
            self._origin._put_back(conn)
        else:
            conn.abort()
            self._origin._forget()


class Origin:
    """Keep-alive connections to one engine address (scheme, host, port), opened on demand.

    At most `max_connections` are open at once (idle ones included); a request beyond that
    waits, at most the connect timeout, for one to come back or close."""

    def __init__(
        self,
        scheme: str,
        host: str,
        port: int,
        *,
        connect_timeout: float,
        max_connections: int = 1024,
    ) -> None:
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        self.opened = 0  # connections opened so far (reuse shows as opened << requests)
        self._ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if scheme == "https" else None
        )
        self._idle: list[_Connection] = []
        self._open = 0  # idle + in use
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._host_header = f"Host: {netloc}\r\n".encode()
        self._closed = False

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: Iterable[tuple[str, str]] = (),
        *,
        read_timeout: float,
        total_timeout: float,
    ) -> H1Response:
        """Send one request; returns once the response's status and headers have arrived."""
        lines = [f"{name}: {value}\r\n" for name, value in headers]
        head = "".join(lines)
        # A clean header line has exactly one CR and one LF: two counts over the whole head
        # instead of four tests a header (this runs for every request to an engine).
        if head.count("\r") != len(lines) or head.count("\n") != len(lines):
            raise ValueError("header names and values must not contain CR or LF")
        if body or method not in ("GET", "HEAD", "DELETE"):
            head = f"Content-Length: {len(body)}\r\n{head}"
        start = f"{method} {path} HTTP/1.1\r\n".encode()
        wire = b"".join((start, self._host_header, f"{head}\r\n".encode(), body))
        while True:
            conn = await self._connection()
            response = H1Response(self, conn)
            conn.send(wire, response, read_timeout, total_timeout, method == "HEAD")
            try:
                await response._head
            except UpstreamBroken:
                response.close()
                if conn.reused and not response.received:
                    # The engine closed this idle connection as the request went out: it never
                    # took it. Once more on a fresh connection.
                    continue
                raise
            except BaseException:
                response.close()  # cancelled: the engine sees the connection close
                raise
            return response

    async def _connection(self) -> _Connection:
        waited = False
        while True:
            while self._idle:
                conn = self._idle.pop()
                if not conn.closed:
                    conn.reused = True
                    return conn
                self._open -= 1
            if self._open < self.max_connections:
                break
            if waited:
                raise UpstreamConnectError(
                    f"all {self.max_connections} connections to {self.host}:{self.port} stayed busy"
                )
            waited = await self._wait_for_slot()
        self._open += 1
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), self.host, self.port, ssl=self._ssl
                )
        except TimeoutError as exc:
            self._forget()
            raise UpstreamConnectError(
                f"cannot connect to {self.host}:{self.port} within {self.connect_timeout} s"
            ) from exc
        except OSError as exc:
            self._forget()
            raise UpstreamConnectError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        except BaseException:
            self._forget()
            raise
        self.opened += 1
        return conn

    async def _wait_for_slot(self) -> bool:
        """Wait (at most the connect timeout) until a connection comes back or closes.

        Returns False when woken (look again), True when the time ran out."""
        waiter = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(waiter)
        try:
            async with asyncio.timeout(self.connect_timeout):
                await waiter
        except TimeoutError:
            return True
        finally:
            if not waiter.done():
                waiter.cancel()
        return False

    def _put_back(self, conn: _Connection) -> None:
        if self._closed:
            conn.abort()
            self._forget()
            return
        self._idle.append(conn)
        self._wake_slot_waiter()

    def _forget(self) -> None:
        """One connection is gone: its slot is free."""
        self._open -= 1
        self._wake_slot_waiter()

    def _wake_slot_waiter(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        """Close the idle connections; responses being read keep theirs until done."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.abort()
            self._open -= 1


class Upstream:
    """The proxy's engine connections: one `Origin` per engine address, made on first use."""

    def __init__(self, *, connect_timeout: float, max_connections: int = 1024) -> None:
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        self._origins: dict[tuple[str, str, int], Origin] = {}
        self._by_url: dict[str, Origin] = {}

    def origin(self, scheme: str, host: str, port: int) -> Origin:
        key = (scheme, host, port)
        origin = self._origins.get(key)
        if origin is None:
            origin = Origin(
                scheme,
                host,
                port,
                connect_timeout=self.connect_timeout,
                max_connections=self.max_connections,
            )
            self._origins[key] = origin
        return origin

    def for_url(self, base_url: str) -> Origin:
        """The origin of an engine base URL (`http://host:port`, `https://…`)."""
        origin = self._by_url.get(base_url)
        if origin is None:
            parts = urlsplit(base_url)
            scheme = parts.scheme or "http"
            port = parts.port or (443 if scheme == "https" else 80)
            origin = self.origin(scheme, parts.hostname or "", port)
            self._by_url[base_url] = origin
        return origin

    async def get(
        self, base_url: str, path: str, *, timeout_s: float, max_bytes: int = _GET_MAX_BYTES
    ) -> tuple[int, bytes]:
        """`GET path` of the engine at `base_url`, read whole within `timeout_s` (connecting
        included): status and body. The health probes, load scrapes, `/v1/models` and
        `/version` calls; `UpstreamError` or `TimeoutError` when it fails."""
        return await self._whole("GET", base_url, path, b"", (), timeout_s, max_bytes)

    async def post_json(
        self,
        base_url: str,
        path: str,
        body: bytes,
        *,
        timeout_s: float,
        max_bytes: int = _GET_MAX_BYTES,
    ) -> tuple[int, bytes]:
        """`POST path` with a JSON body, read whole within `timeout_s`, as `get` (the prompt
        token counts, `/tokenize`)."""
        headers = (("Content-Type", "application/json"),)
        return await self._whole("POST", base_url, path, body, headers, timeout_s, max_bytes)

    async def _whole(
        self,
        method: str,
        base_url: str,
        path: str,
        body: bytes,
        headers: tuple[tuple[str, str], ...],
        timeout_s: float,
        max_bytes: int,
    ) -> tuple[int, bytes]:
        async with asyncio.timeout(timeout_s):
            resp = await self.for_url(base_url).request(
                method, path, body, headers, read_timeout=timeout_s, total_timeout=timeout_s
            )
            try:
                return resp.status, await resp.read(max_bytes)
            finally:
                resp.release()

    async def side_channel_call(
        self,
        host: str,
        port: int,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
        timeout_s: float,
        max_bytes: int,
    ) -> tuple[int, bytes, str | None]:
        """One side-channel exchange (`kvrelay.connector.sidechannel_client.SideChannelCall`):
        status, body (at most `max_bytes`) and the signature header."""
        resp = await self.origin("http", host, port).request(
            method, path, body, headers.items(), read_timeout=timeout_s, total_timeout=timeout_s
        )
        try:
            data = await resp.read(max_bytes)
        finally:
            resp.release()
        signature = resp.header(_SIGNATURE_HEADER)
        return resp.status, data, signature.decode("latin-1") if signature is not None else None

    def close(self) -> None:
        for origin in self._origins.values():
            origin.close()
        self._origins.clear()
        self._by_url.clear()
