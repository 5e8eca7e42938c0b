"""The engine-facing HTTP/1.1 client (`kvrelay.proxy.engines`) against real servers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import pytest
from aiohttp import web

from kvrelay.proxy.engines import (
    H1Response,
    Upstream,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)
from kvrelay.proxy.engines.upstream import Origin, UpstreamBroken
from tests.harness import free_port
from tests.kvcache_map.helpers import eventually

CHUNKS = [f'data: {{"i": {i}}}\n\n'.encode() for i in range(16)]


async def _echo(request: web.Request) -> web.Response:
    body = await request.read()
    peer = request.transport.get_extra_info("peername")[1] if request.transport else 0
    return web.json_response(
        {"body": body.decode(), "id": request.headers.get("X-Request-Id"), "peer": peer}
    )


async def _stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for chunk in CHUNKS:
        await resp.write(chunk)
    await resp.write_eof()
    return resp


async def _close(request: web.Request) -> web.Response:
    return web.Response(body=b"bye", headers={"Connection": "close"})


async def _broken(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    resp.content_length = 1000
    await resp.prepare(request)
    await resp.write(b"x" * 10)
    assert request.transport is not None
    request.transport.abort()
    return resp


async def _page(request: web.Request) -> web.Response:
    return web.Response(body=b"x" * 1000, content_type="text/plain")


def _origin(port: int, max_connections: int = 1024) -> Origin:
    return Origin("http", "127.0.0.1", port, connect_timeout=2.0, max_connections=max_connections)


async def _request(
    pool: Origin,
    method: str,
    path: str,
    body: bytes = b"",
    headers: Iterable[tuple[str, str]] = (),
    read_timeout: float = 5.0,
) -> H1Response:
    return await pool.request(
        method, path, body, headers, read_timeout=read_timeout, total_timeout=10.0
    )


class RawServer:
    """A loopback TCP server whose connections `handle` drives byte by byte."""

    def __init__(
        self, handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
    ) -> None:
        self._handle = handle
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            with contextlib.suppress(ConnectionError):
                await self._handle(reader, writer)
        finally:
            writer.close()

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and its Content-Length body (b"" at EOF)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@pytest.fixture
async def origin() -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_post("/echo", _echo)
    app.router.add_post("/stream", _stream)
    app.router.add_get("/close", _close)
    app.router.add_get("/broken", _broken)
    app.router.add_get("/page", _page)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()


async def test_json_answers_reuse_one_connection(origin: int) -> None:
    pool = _origin(origin)
    peers = set()
    for i in range(3):
        resp = await _request(pool, "POST", "/echo", b'{"n": %d}' % i, [("X-Request-Id", f"r{i}")])
        assert resp.status == 200
        assert resp.header(b"content-type") == b"application/json; charset=utf-8"
        data = await resp.read()
        assert b'"body": "{\\"n\\": %d}"' % i in data
        assert f'"id": "r{i}"'.encode() in data
        peers.add(data.split(b'"peer": ')[1].rstrip(b"}"))
    assert pool.opened == 1
    assert len(peers) == 1
    pool.close()


async def test_chunked_stream_arrives_whole_and_connection_is_reused(origin: int) -> None:
    pool = _origin(origin)
    resp = await _request(pool, "POST", "/stream", b"{}")
    received = b"".join([chunk async for chunk in resp.iter_chunks()])
    assert received == b"".join(CHUNKS)
    again = await _request(pool, "POST", "/echo", b"{}")
    assert again.status == 200
    await again.read()
    assert pool.opened == 1
    pool.close()


async def test_connection_close_is_not_reused(origin: int) -> None:
    pool = _origin(origin)
    for _ in range(2):
        resp = await _request(pool, "GET", "/close")
        assert await resp.read() == b"bye"
    assert pool.opened == 2
    pool.close()


async def test_server_breaking_mid_body_raises(origin: int) -> None:
    pool = _origin(origin)
    resp = await _request(pool, "GET", "/broken")
    with pytest.raises(UpstreamBroken):
        await asyncio.wait_for(resp.read(), 10)
    pool.close()


async def test_response_closed_early_drops_its_connection(origin: int) -> None:
    pool = _origin(origin)
    resp = await _request(pool, "POST", "/stream", b"{}")
    resp.close()
    again = await _request(pool, "POST", "/echo", b"{}")
    await again.read()
    assert pool.opened == 2
    pool.close()


async def test_header_injection_is_refused(origin: int) -> None:
    pool = _origin(origin)
    for evil in (
        [("X-Evil", "a\r\nInjected: 1")],
        [("X-Evil", "a\rb")],
        [("X-Evil", "a\nb")],
        [("X-Fine", "a"), ("X-Evil\n", "b")],
        [("X-Evil\r", "b"), ("X-Fine", "a")],
    ):
        with pytest.raises(ValueError):
            await _request(pool, "POST", "/echo", b"{}", evil)
    assert pool.opened == 0  # refused before anything was sent
    pool.close()


def test_runs_on_uvloop() -> None:
    """The proxy runs on uvloop, whose transports do not subclass asyncio's."""
    import uvloop

    async def exchange() -> bytes:
        app = web.Application()
        app.router.add_post("/echo", _echo)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        pool = _origin(port)
        try:
            resp = await _request(pool, "POST", "/echo", b"hi")
            return await resp.read()
        finally:
            pool.close()
            await runner.cleanup()

    assert b'"body": "hi"' in uvloop.run(exchange())


async def test_connect_refused_is_a_connect_error() -> None:
    pool = _origin(free_port())
    with pytest.raises(UpstreamConnectError):
        await _request(pool, "GET", "/")
    pool.close()


async def test_silent_engine_times_out_on_read() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await reader.read()  # never answers; returns when the client hangs up

    async with RawServer(silent) as server:
        pool = _origin(server.port)
        with pytest.raises(UpstreamTimeout):
            await _request(pool, "POST", "/v1/completions", b"{}", read_timeout=0.2)
        pool.close()


async def test_a_reused_connection_times_out_on_its_new_shorter_deadline() -> None:
    # The first exchange leaves a timer for its long read timeout on the connection; the
    # second, on the same connection, must not inherit that later deadline.
    async def answers_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(_OK)
        await writer.drain()
        await _read_request(reader)
        await reader.read()  # the second request is never answered

    async with RawServer(answers_once) as server:
        pool = _origin(server.port)
        first = await _request(pool, "POST", "/v1/completions", b"{}", read_timeout=60.0)
        assert await first.read() == b"ok"
        async with asyncio.timeout(5):  # a plain TimeoutError here: the deadline was missed
            with pytest.raises(UpstreamTimeout):
                await _request(pool, "POST", "/v1/completions", b"{}", read_timeout=0.2)
        assert pool.opened == 1
        pool.close()


async def test_back_to_back_exchanges_share_one_timer(origin: int) -> None:
    pool = _origin(origin)
    timers = []
    for _ in range(3):
        resp = await _request(pool, "POST", "/echo", b"x")
        await resp.read()
        (conn,) = pool._idle
        timers.append(conn._timer)
    assert timers[0] is not None and all(t is timers[0] for t in timers)
    pool.close()


async def test_chunks_of_one_read_come_as_one_piece_in_order() -> None:
    """Sixteen chunks sent in one write reach the reader joined, in order, and the connection
    goes back to the pool for the next exchange."""
    framed = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in CHUNKS) + b"0\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def burst(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(head + framed)
        await _read_request(reader)
        writer.write(_OK)
        await writer.drain()
        await reader.read()

    async with RawServer(burst) as server:
        pool = _origin(server.port)
        resp = await _request(pool, "GET", "/")
        await eventually(lambda: resp.complete, within=5, what="the whole answer")
        pieces = [chunk async for chunk in resp.iter_chunks()]
        assert pieces == [b"".join(CHUNKS)]
        again = await _request(pool, "GET", "/")
        assert await again.read() == b"ok"
        assert pool.opened == 1
        pool.close()


async def test_unread_body_past_the_high_water_mark_pauses_reading() -> None:
    """A reader that lags stops the socket reads; reading on resumes them and loses nothing."""
    size = 1024 * 1024
    body = bytes(range(256)) * (size // 256)

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + body)
        await writer.drain()
        await reader.read()

    async with RawServer(big) as server:
        pool = _origin(server.port)
        resp = await _request(pool, "GET", "/")
        conn = resp._conn
        assert conn is not None and conn.transport is not None
        transport = conn.transport
        await eventually(lambda: not transport.is_reading(), within=5, what="reading paused")
        assert not resp.complete
        assert await resp.read() == body
        assert pool.opened == 1
        pool.close()


async def test_body_ended_by_connection_close() -> None:
    async def unframed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello ")
        writer.write(b"world")
        await writer.drain()
        writer.close()

    async with RawServer(unframed) as server:
        pool = _origin(server.port)
        resp = await _request(pool, "GET", "/")
        assert await resp.read() == b"hello world"
        pool.close()


async def test_idle_connection_closed_by_the_engine_is_retried_on_a_fresh_one() -> None:
    async def one_per_connection(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await _read_request(reader)
        writer.write(_OK)  # keep-alive answer ...
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError):
            await _read_request(reader)  # ... then the next request on it is dropped unanswered
        writer.close()

    async with RawServer(one_per_connection) as server:
        pool = _origin(server.port)
        for _ in range(2):
            resp = await _request(pool, "POST", "/", b"{}")
            assert await resp.read() == b"ok"
        assert pool.opened == 2
        pool.close()


async def test_engine_dropping_a_fresh_connection_is_not_retried() -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.close()

    async with RawServer(drop) as server:
        pool = _origin(server.port)
        with pytest.raises(UpstreamBroken):
            await _request(pool, "POST", "/", b"{}")
        assert pool.opened == 1
        pool.close()


async def test_cancelled_request_closes_its_connection() -> None:
    engine_saw_eof = asyncio.Event()
    got_request = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        got_request.set()
        await reader.read()  # b"" once the client closes
        engine_saw_eof.set()

    async with RawServer(slow) as server:
        pool = _origin(server.port)
        task = asyncio.create_task(_request(pool, "POST", "/", b"{}"))
        await asyncio.wait_for(got_request.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(engine_saw_eof.wait(), 5)
        pool.close()


async def test_connections_are_bounded_and_a_waiting_request_reuses_one() -> None:
    release = asyncio.Event()

    async def gated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError):
            while True:
                await _read_request(reader)
                await release.wait()
                writer.write(_OK)
                await writer.drain()

    async with RawServer(gated) as server:
        pool = _origin(server.port, max_connections=1)
        first = asyncio.create_task(_request(pool, "POST", "/", b"{}"))
        second = asyncio.create_task(_request(pool, "POST", "/", b"{}"))
        done, _ = await asyncio.wait({first, second}, timeout=0.3)
        assert not done  # one on the wire, one waiting for the only connection
        release.set()
        resp = await asyncio.wait_for(first, 5)
        assert await resp.read() == b"ok"
        resp = await asyncio.wait_for(second, 5)
        assert await resp.read() == b"ok"
        assert pool.opened == 1
        pool.close()


def test_errors_are_connection_errors() -> None:
    """Callers classify by these bases: every failure is an UpstreamError, timeouts too."""
    assert issubclass(UpstreamTimeout, TimeoutError)
    assert issubclass(UpstreamTimeout, UpstreamError)
    assert issubclass(UpstreamConnectError, UpstreamError)


async def test_get_reads_the_whole_answer_and_bounds_its_size(origin: int) -> None:
    client = Upstream(connect_timeout=2.0)
    try:
        assert await client.get(f"http://127.0.0.1:{origin}", "/page", timeout_s=5.0) == (
            200,
            b"x" * 1000,
        )
        with pytest.raises(UpstreamBroken):
            await client.get(f"http://127.0.0.1:{origin}", "/page", timeout_s=5.0, max_bytes=999)
    finally:
        client.close()


async def test_get_timeout_bounds_the_whole_exchange() -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n")
        for _ in range(4):  # one byte a read timeout's fifth: each read is in time, not the whole
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.1)  # the engine's pace, not synchronisation

    async with RawServer(slow) as server:
        client = Upstream(connect_timeout=2.0)
        with pytest.raises(TimeoutError):
            await client.get(f"http://127.0.0.1:{server.port}", "/", timeout_s=0.25)
        client.close()


async def test_head_answer_ends_at_its_headers() -> None:
    async def head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        # A HEAD answer announces the length a GET would have, and sends no body.
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with RawServer(head) as server:
        pool = _origin(server.port)
        resp = await _request(pool, "HEAD", "/", read_timeout=5.0)
        assert resp.status == 200
        assert await asyncio.wait_for(resp.read(), timeout=2.0) == b""
        resp.release()
        pool.close()


async def test_read_head_takes_only_the_first_bytes(origin: int) -> None:
    pool = _origin(origin)
    resp = await _request(pool, "GET", "/page")
    assert await resp.read_head(10) == b"x" * 10
    resp.release()
    pool.close()
