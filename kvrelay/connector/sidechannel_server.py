"""The holder's side channel: an aiohttp server on its own thread and event loop.

Every request is size-bounded, read whole, and authenticated (HMAC over its timestamp, nonce,
destination, method, path and body; `kvrelay.connector.auth`) before anything looks at it: it
must be addressed to one of this engine's own addresses and its nonce must be new. Refusals are
counted per reason and never acted on. Every answer to an authenticated request is signed over
that request's nonce, so readers can tell the holder's answers from anyone else's. Endpoints:
CONTRACTS §2. `GET /v1/finished/{id}` for a request not yet published waits (bounded) for its
publication: the proxy asks as soon as the stream's last token reached it, which can be a moment
before the engine's scheduler published the params. `POST /v1/finished` answers for several ids
at once and waits for none (the proxy asks for a missing one alone): one call instead of one per
streamed turn, on a thread that shares the engine's interpreter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from kvrelay.connector.auth import AuthFailure, NonceCache, destination, response_signature, verify
from kvrelay.connector.holds import ClaimOutcome, HoldTable, ReleaseOutcome
from kvrelay.connector.protocol import (
    HEADER_NONCE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    MAX_BODY_BYTES,
    PATH_CLAIM,
    PATH_FINISHED_BATCH,
    PATH_FINISHED_PREFIX,
    PATH_HANDSHAKE,
    PATH_RELEASE,
    ClaimRequest,
    ClaimResponse,
    FinishedBatchRequest,
    FinishedBatchResponse,
    ReleaseRequest,
)
from kvrelay.connector.stats import Counters

log = logging.getLogger(__name__)

_BODY = web.RequestKey("body", bytes)

# How long `GET /v1/finished/{id}` waits for params not yet published. Below the proxy's
# side-channel timeout (2 s by default), so a waiting answer still reaches it.
FINISHED_WAIT_S = 0.5


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
        finished_wait_s: float = FINISHED_WAIT_S,
        aliases: Collection[str] = (),
    ) -> None:
        self._host = host
        # Host names clients address this side channel by (the bind host is always one).
        self._hosts = {host, *aliases}
        self._destinations: frozenset[str] = frozenset()
        self._nonces = NonceCache()
        self._port = port
        self._secret = secret
        self._holds = holds
        self._counters = counters
        self._handshake = handshake
        self._finished_wait_s = finished_wait_s
        # Finished-params requests waiting for a publication, by client request id (loop only).
        self._finished_waiters: dict[str, list[asyncio.Event]] = {}
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
        app.router.add_post(PATH_FINISHED_BATCH, self._on_finished_batch)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
        await site.start()
        server = site._server
        assert server is not None
        sockets = getattr(server, "sockets", None) or []
        self.port = int(sockets[0].getsockname()[1]) if sockets else self._port
        self._destinations = frozenset(destination(h, self.port) for h in self._hosts)

    async def _cleanup(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)
        self._thread = None

    # --- request guard: size, whole body, auth, replay; then the signed answer ------------
    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            return self._too_large()
        body = await self._read_body(request)
        if body is None:
            return self._too_large()
        failure = verify(
            self._secret,
            request.headers,
            request.method,
            request.raw_path,
            body,
            destinations=self._destinations,
        )
        nonce = request.headers.get(HEADER_NONCE, "")
        if failure is None and not self._nonces.first_use(
            nonce, float(request.headers[HEADER_TIMESTAMP])
        ):
            failure = AuthFailure.REPLAY
        if failure is not None:
            self._counters.inc("auth_rejected")
            self._counters.inc(f"auth_rejected_{failure.value}")
            return _error(401, "unauthenticated")
        request[_BODY] = body
        response: web.StreamResponse = await handler(request)
        if isinstance(response, web.Response):
            raw = response.body if isinstance(response.body, bytes) else b""
            response.headers[HEADER_SIGNATURE] = response_signature(
                self._secret, nonce, response.status, raw
            )
        return response

    @staticmethod
    async def _read_body(request: web.Request) -> bytes | None:
        """The whole body (a request may arrive in many TCP segments), None past the limit."""
        body = bytearray()
        while True:
            chunk = await request.content.read(MAX_BODY_BYTES + 1 - len(body))
            if not chunk:
                return bytes(body)
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                return None

    def _too_large(self) -> web.Response:
        self._counters.inc("rejected_too_large")
        return _error(413, "body too large")

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
        outcome, entry = self._holds.claim(
            msg.request_id, (msg.reader_engine_id, msg.reader_request_id)
        )
        if outcome is ClaimOutcome.CLAIMED:
            taken = ClaimResponse(status="claimed", instance_id=self.instance_id)
            return web.json_response(taken.model_dump(), status=409)
        if entry is None:
            gone = ClaimResponse(status="gone", instance_id=self.instance_id)
            return web.json_response(gone.model_dump(), status=410)
        held = ClaimResponse(
            status="held",
            block_ids=entry.block_ids,
            num_tokens=entry.num_tokens,
            instance_id=self.instance_id,
            # What is left of the pin (a re-claim by the same reader does not extend it).
            pinned_for_s=max(0.001, entry.pinned_until - time.monotonic()),
        )
        return web.json_response(held.model_dump())

    async def _on_release(self, request: web.Request) -> web.Response:
        try:
            msg = ReleaseRequest.model_validate_json(request[_BODY])
        except ValidationError:
            return self._malformed("release")
        reader = (
            (msg.reader_engine_id, msg.reader_request_id)
            if msg.reader_engine_id and msg.reader_request_id
            else None
        )
        outcome = self._holds.release(msg.request_id, msg.release_token, reader)
        if outcome is ReleaseOutcome.FORBIDDEN:
            return _error(403, "wrong release token")
        released = outcome is ReleaseOutcome.RELEASED
        if released:
            self._counters.inc("releases_received")
        return web.json_response({"released": released})

    async def _on_finished(self, request: web.Request) -> web.Response:
        key = request.match_info["client_request_id"]
        params = self._holds.finished(key)
        if params is None and self._finished_wait_s > 0:
            params = await self._wait_finished(key)
        if params is None:
            return _error(404, "unknown request id")
        return web.Response(text=json.dumps(params), content_type="application/json")

    async def _on_finished_batch(self, request: web.Request) -> web.Response:
        try:
            msg = FinishedBatchRequest.model_validate_json(request[_BODY])
        except ValidationError:
            return self._malformed("finished batch")
        found: dict[str, dict[str, Any]] = {}
        for key in msg.request_ids:
            params = self._holds.finished(key)
            if params is not None:
                found[key] = params
        body = FinishedBatchResponse(finished=found).model_dump_json()
        return web.Response(text=body, content_type="application/json")

    async def _wait_finished(self, key: str) -> dict[str, Any] | None:
        published = asyncio.Event()
        waiters = self._finished_waiters.setdefault(key, [])
        waiters.append(published)
        try:
            # Published between the first look and the registration: the second look sees it.
            params = self._holds.finished(key)
            if params is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(published.wait(), self._finished_wait_s)
                params = self._holds.finished(key)
            return params
        finally:
            waiters.remove(published)
            if not waiters:
                del self._finished_waiters[key]

    def notify_finished(self, client_request_id: str) -> None:
        """The scheduler published params for `client_request_id` (any thread): wake waiters."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
            loop.call_soon_threadsafe(self._wake_finished, client_request_id)

    def _wake_finished(self, key: str) -> None:
        for published in self._finished_waiters.get(key, ()):
            published.set()
