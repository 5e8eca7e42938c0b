"""A loopback HTTP relay in front of an engine that records the headers of what it forwards.

The tracing tests put one in front of each enginesim engine (the proxy is given the relay's
URL) to see what the engines received: the W3C `traceparent` of each leg, or none while
tracing is off. It runs on the test's event loop; responses, streamed or not, are passed on
chunk by chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from tests.harness import free_port

# Hop-by-hop and length headers the relay's own HTTP stack sets.
_DROPPED = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass
class Received:
    """One request the engine behind the relay received."""

    method: str
    path: str
    headers: dict[str, str]


@dataclass
class HeaderRecorder:
    """Relay `127.0.0.1:port -> target` recording each request's headers in `received`."""

    target: str
    port: int = field(default_factory=free_port)
    received: list[Received] = field(default_factory=list)
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def traceparents(self, path: str) -> list[str | None]:
        """The `traceparent` of every request to `path`, in order (None: none was sent)."""
        return [r.headers.get("traceparent") for r in self.received if r.path == path]

    async def start(self) -> HeaderRecorder:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
        if request.path != "/health" and request.path != "/metrics":
            self.received.append(Received(request.method, request.path, dict(headers)))
        async with self._session.request(
            request.method, self.target + request.path_qs, headers=headers,
            data=await request.read(), timeout=aiohttp.ClientTimeout(total=60),
        ) as upstream:  # fmt: skip
            out = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED},
            )
            await out.prepare(request)
            async for chunk in upstream.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
