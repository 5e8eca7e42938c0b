"""`FakeRefusingDecode`: a decode engine that refuses every completion with 503, as an
overloaded vLLM does, and answers everything else (health, models, `/tokenize`) by asking a
real engine behind it. A real HTTP server on loopback (`ThreadedApp`); the fake is only in
what it answers.

It has no `/metrics`, so the proxy reads no load from it (it never looks busy), and no side
channel: it takes non-streamed turns only, which is all a refusal needs.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from kvrelay.devtools import ThreadedApp, free_port

_REFUSAL = {"error": {"message": "fake: overloaded", "type": "ServiceUnavailable", "code": 503}}


class FakeRefusingDecode:
    """Refuses completions (counted in `refused`); forwards the rest to `behind`."""

    def __init__(self, behind: str) -> None:
        self.behind = behind.rstrip("/")
        self.refused = 0  # changed only on the server's loop thread
        self._session: aiohttp.ClientSession | None = None
        app = web.Application()
        app.router.add_get("/metrics", self._no_metrics)
        app.router.add_post("/v1/completions", self._refuse)
        app.router.add_post("/v1/chat/completions", self._refuse)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        app.on_cleanup.append(self._close_session)
        self._server = ThreadedApp(app, free_port(), "fake-refusing-decode")

    @property
    def url(self) -> str:
        return self._server.url

    def start(self) -> FakeRefusingDecode:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    async def _no_metrics(self, request: web.Request) -> web.Response:
        return web.json_response({"error": "fake: no metrics"}, status=404)

    async def _refuse(self, request: web.Request) -> web.Response:
        await request.read()
        self.refused += 1
        return web.json_response(_REFUSAL, status=503)

    async def _forward(self, request: web.Request) -> web.Response:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        body = await request.read()
        async with self._session.request(
            request.method, self.behind + request.path_qs, data=body or None,
            headers={"Content-Type": "application/json"} if body else None,
        ) as resp:  # fmt: skip
            return web.Response(
                status=resp.status, body=await resp.read(), content_type=resp.content_type
            )

    async def _close_session(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()
