"""FakeUpstream: a stand-in engine for the proxy's pass-through routes, with a gate.

Named fake on purpose: enginesim answers the pass-through routes in vLLM's shapes, but a
test of *streaming* needs an engine that sends part of an answer and then waits until the
test says so (to show the proxy relays what has arrived rather than buffering), or breaks off
in the middle. It records every request it got (path, headers, body) for the tests to check
what the proxy forwarded.

- `POST /v1/responses` (any other path too) with `"stream": true`: one SSE event at once, the
  rest once `gate` is set; with `"cut": true` in the body the connection is dropped after the
  first event instead. Without stream: a JSON echo of the body.
- `POST /v1/embeddings`: a JSON echo (status `status` when set, e.g. 500, with `error_text` as
  a text/plain answer when that is set). A body that is not JSON (a multipart form) is recorded
  and answered like an empty one.
- `GET /v1/models`: the `models` it was given. `GET /health`: ok. `GET /metrics`: empty
  (not recorded: the proxy scrapes it for load signals).
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass

from aiohttp import web

from kvrelay.devtools import ThreadedApp
from tests.harness import free_port


@dataclass
class Seen:
    """One request the fake got."""

    method: str
    path: str
    query: str
    headers: dict[str, str]  # names in lower case
    body: bytes


class FakeUpstream:
    """An aiohttp server on a background thread (`ThreadedApp`)."""

    def __init__(self, models: tuple[str, ...] = ("kvrelay-sim",)) -> None:
        self.port = free_port()
        self.models = models
        self.seen: list[Seen] = []
        self.status = 200
        self.error_text: str | None = None
        self.gate = threading.Event()
        self.first_event_sent = threading.Event()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._any)
        self._server = ThreadedApp(app, self.port, "fake-upstream")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        # The proxy scrapes engines' load gauges; this fake has none to report.
        return web.Response(text="", content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "owned_by": "fake"} for m in self.models]
        return web.json_response({"object": "list", "data": data})

    async def _any(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.seen.append(
            Seen(
                request.method,
                request.path,
                request.query_string,
                {k.lower(): v for k, v in request.headers.items()},
                raw,
            )
        )
        body = json.loads(raw) if raw and request.content_type == "application/json" else {}
        if self.status != 200 and self.error_text is not None:
            return web.Response(text=self.error_text, status=self.status)
        if self.status != 200:
            return web.json_response({"error": {"message": "fake failure"}}, status=self.status)
        if not body.get("stream"):
            return web.json_response({"echo": body, "path": request.path})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b'event: first\ndata: {"n":1}\n\n')
        self.first_event_sent.set()
        if body.get("cut"):
            assert request.transport is not None
            request.transport.close()  # a dying engine: no end of the chunked body
            return out
        await asyncio.get_running_loop().run_in_executor(None, self.gate.wait, 30)
        await out.write(b'event: second\ndata: {"n":2}\n\n')
        await out.write_eof()
        return out

    def start(self) -> FakeUpstream:
        self._server.start()
        return self

    def stop(self) -> None:
        self.gate.set()  # a handler still waiting ends now
        self._server.stop()
