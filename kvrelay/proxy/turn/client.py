"""The client's side of a turn, as the turn sees it: a small interface instead of aiohttp.

A turn reads the client's headers (only for its trace context) and answers in one of two
ways: a JSON body, or an event stream written piece by piece. `AiohttpClient` is that side
for a request of the proxy's server; a unit test drives a turn with a fake of its own.

A client that leaves shows up the way aiohttp shows it: a write raises
`ConnectionResetError`, or the task running the turn is cancelled. Either way the turn frees
what it owes (`kvrelay.proxy.turn.owed`) unless the answer was already complete.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Protocol

import aiohttp
from aiohttp import web

from kvrelay.proxy.base import ProxyError
from kvrelay.proxy.turn.streaming import error_event


class ClientStream(Protocol):
    """An answer streamed to the client."""

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self, data: bytes = b"") -> None:
        """`data` (maybe empty) and the end of the answer, in one write."""


class Client(Protocol):
    """What a turn needs of the client's request."""

    @property
    def headers(self) -> Mapping[str, str]:
        """The request's headers (the turn reads its trace context there)."""

    def send_json(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        """Answer with a JSON body (`application/json`)."""

    async def open_stream(self, status: int, headers: Mapping[str, str]) -> ClientStream:
        """Start a streamed answer; its headers go out with its first write."""


class AiohttpClient:
    """The client of one aiohttp request; `response` is what the handler returns."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self._response: web.StreamResponse | None = None

    @property
    def headers(self) -> Mapping[str, str]:
        return self._request.headers

    @property
    def response(self) -> web.StreamResponse:
        if self._response is None:
            raise RuntimeError("the turn ended without answering")
        return self._response

    def send_json(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        self._response = web.Response(
            body=body, status=status, content_type="application/json", headers=headers
        )

    async def open_stream(self, status: int, headers: Mapping[str, str]) -> ClientStream:
        out = _EventStream(status=status, headers=headers)
        await out.prepare(self._request)
        self._response = out
        return out

    async def end_stream_with(self, error: ProxyError) -> web.StreamResponse | None:
        """When a stream was started and not ended: end it with `error` as an error event and a
        clean close, and return it; None when no stream was started (the caller answers with a
        whole error response then). Once a stream's headers left, any other answer would be a
        second HTTP response written inside the stream's body."""
        out = self._response
        if not isinstance(out, _EventStream):
            return None
        if not out.ended:
            event = error_event(error.message, type=error.type, code=error.code)
            with contextlib.suppress(ConnectionResetError, aiohttp.ClientConnectionResetError):
                await out.write_eof(event)
        return out


class _EventStream(web.StreamResponse):
    """The client's stream; its headers go out with the first event, in one write with it,
    not in a write of their own (aiohttp's `web.Response` buffers them the same way)."""

    _send_headers_immediately = False
    ended = False  # write_eof was called: the answer is complete, or was cut

    async def write_eof(self, data: bytes = b"") -> None:
        self.ended = True
        await super().write_eof(data)
