"""The keep-alive HTTP/1.1 client candidate (`bench/h1client.py`) against a real aiohttp server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from bench.h1client import H1Error, H1Pool
from tests.harness import free_port

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


@pytest.fixture
async def origin() -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_post("/echo", _echo)
    app.router.add_post("/stream", _stream)
    app.router.add_get("/close", _close)
    app.router.add_get("/broken", _broken)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()


async def test_json_answers_reuse_one_connection(origin: int) -> None:
    pool = H1Pool("127.0.0.1", origin)
    peers = set()
    for i in range(3):
        resp = await pool.request("POST", "/echo", b'{"n": %d}' % i, [("X-Request-Id", f"r{i}")])
        assert resp.status == 200
        assert resp.header(b"content-type") == b"application/json; charset=utf-8"
        data = await resp.read()
        assert b'"body": "{\\"n\\": %d}"' % i in data
        assert f'"id": "r{i}"'.encode() in data
        peers.add(data.split(b'"peer": ')[1].rstrip(b"}"))
    assert pool.opened == 1
    assert len(peers) == 1
    await pool.close()


async def test_chunked_stream_arrives_whole_and_connection_is_reused(origin: int) -> None:
    pool = H1Pool("127.0.0.1", origin)
    resp = await pool.request("POST", "/stream", b"{}")
    received = b"".join([chunk async for chunk in resp.iter_chunks()])
    assert received == b"".join(CHUNKS)
    again = await pool.request("POST", "/echo", b"{}")
    assert again.status == 200
    await again.read()
    assert pool.opened == 1
    await pool.close()


async def test_connection_close_is_not_reused(origin: int) -> None:
    pool = H1Pool("127.0.0.1", origin)
    for _ in range(2):
        resp = await pool.request("GET", "/close")
        assert await resp.read() == b"bye"
    assert pool.opened == 2
    await pool.close()


async def test_server_breaking_mid_body_raises(origin: int) -> None:
    pool = H1Pool("127.0.0.1", origin)
    resp = await pool.request("GET", "/broken")
    with pytest.raises(H1Error):
        await asyncio.wait_for(resp.read(), 10)
    await pool.close()


async def test_response_closed_early_drops_its_connection(origin: int) -> None:
    pool = H1Pool("127.0.0.1", origin)
    resp = await pool.request("POST", "/stream", b"{}")
    resp.close()
    again = await pool.request("POST", "/echo", b"{}")
    await again.read()
    assert pool.opened == 2
    await pool.close()


async def test_header_injection_is_refused(origin: int) -> None:
    pool = H1Pool("127.0.0.1", origin)
    with pytest.raises(ValueError):
        await pool.request("POST", "/echo", b"{}", [("X-Evil", "a\r\nInjected: 1")])
    await pool.close()


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
        pool = H1Pool("127.0.0.1", port)
        try:
            resp = await pool.request("POST", "/echo", b"hi")
            return await resp.read()
        finally:
            await pool.close()
            await runner.cleanup()

    assert b'"body": "hi"' in uvloop.run(exchange())
