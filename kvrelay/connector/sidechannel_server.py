"""The holder's side channel: an aiohttp server on its own thread and event loop.

Every request is authenticated (HMAC, `kvrelay.connector.auth`) and size-bounded before anything
looks at it; refusals are counted per reason and never acted on. Endpoints: CONTRACTS §2.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from kvrelay.connector.auth import verify
from kvrelay.connector.holds import HoldTable, ReleaseOutcome
from kvrelay.connector.protocol import (
    MAX_BODY_BYTES,
    PATH_CLAIM,
    PATH_FINISHED_PREFIX,
    PATH_HANDSHAKE,
    PATH_RELEASE,
    ClaimRequest,
    ClaimResponse,
    ReleaseRequest,
)
from kvrelay.connector.stats import Counters

log = logging.getLogger(__name__)

_BODY = web.RequestKey("body", bytes)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class SideChannelServer:
    """Serves handshake metadata, claims, releases and finished params for one engine."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        holds: HoldTable,
        counters: Counters,
        handshake: Callable[[], dict[str, Any] | None],
    ) -> None:
        self._host = host
        self._port = port
        self._secret = secret
        self._holds = holds
        self._counters = counters
        self._handshake = handshake
        self.instance_id = uuid.uuid4().hex
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.port = 0

    # --- lifecycle -------------------------------------------------------------------------
    def start(self, timeout_s: float = 10.0) -> int:
        self._thread = threading.Thread(target=self._run, name="kvrelay-sidechannel", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"side channel did not start within {timeout_s}s")
        if self._start_error is not None:
            raise RuntimeError(f"side channel failed to start: {self._start_error}")
        return self.port

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to start(); the thread must not die silently
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._cleanup())
        loop.close()

    async def _serve(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._guard])
        app.router.add_get(PATH_HANDSHAKE, self._on_handshake)
        app.router.add_post(PATH_CLAIM, self._on_claim)
        app.router.add_post(PATH_RELEASE, self._on_release)
        app.router.add_get(PATH_FINISHED_PREFIX + "{client_request_id}", self._on_finished)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
        await site.start()
        server = site._server
        assert server is not None
        sockets = getattr(server, "sockets", None) or []
        self.port = int(sockets[0].getsockname()[1]) if sockets else self._port

    async def _cleanup(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)
        self._thread = None

    # --- request guard: size, then auth, before any handler -------------------------------
    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            self._counters.inc("rejected_too_large")
            return _error(413, "body too large")
        body = await request.content.read(MAX_BODY_BYTES + 1)
        if len(body) > MAX_BODY_BYTES:
            self._counters.inc("rejected_too_large")
            return _error(413, "body too large")
        failure = verify(self._secret, request.headers, request.method, request.raw_path, body)
        if failure is not None:
            self._counters.inc("auth_rejected")
            self._counters.inc(f"auth_rejected_{failure.value}")
            return _error(401, "unauthenticated")
        request[_BODY] = body
        response: web.StreamResponse = await handler(request)
        return response

    def _malformed(self, what: str) -> web.Response:
        self._counters.inc("rejected_malformed")
        return _error(400, f"malformed {what}")

    # --- handlers ---------------------------------------------------------------------------
    async def _on_handshake(self, request: web.Request) -> web.Response:
        payload = self._handshake()
        if payload is None:
            return _error(503, "workers have not registered their caches yet")
        self._counters.inc("handshakes_served")
        return web.json_response({**payload, "instance_id": self.instance_id})

    async def _on_claim(self, request: web.Request) -> web.Response:
        try:
            msg = ClaimRequest.model_validate_json(request[_BODY])
        except ValidationError:
            return self._malformed("claim")
        entry = self._holds.claim(msg.request_id, msg.reader_engine_id)
        if entry is None:
            gone = ClaimResponse(status="gone", instance_id=self.instance_id)
            return web.json_response(gone.model_dump(), status=410)
        held = ClaimResponse(
            status="held",
            block_ids=entry.block_ids,
            num_tokens=entry.num_tokens,
            instance_id=self.instance_id,
            pinned_for_s=self._holds.claim_timeout_s,
        )
        return web.json_response(held.model_dump())

    async def _on_release(self, request: web.Request) -> web.Response:
        try:
            msg = ReleaseRequest.model_validate_json(request[_BODY])
        except ValidationError:
            return self._malformed("release")
        outcome = self._holds.release(msg.request_id, msg.release_token, msg.reader_engine_id)
        if outcome is ReleaseOutcome.FORBIDDEN:
            return _error(403, "wrong release token")
        released = outcome is ReleaseOutcome.RELEASED
        if released:
            self._counters.inc("releases_received")
        return web.json_response({"released": released})

    async def _on_finished(self, request: web.Request) -> web.Response:
        key = request.match_info["client_request_id"]
        params = self._holds.finished(key)
        if params is None:
            return _error(404, "unknown request id")
        return web.Response(text=json.dumps(params), content_type="application/json")
