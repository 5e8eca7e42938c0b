"""Clients for a holder's side channel (CONTRACTS §2). Torch-free.

`SideChannelClient` is synchronous on a pooled `httpx.Client` (worker and scheduler threads);
`AsyncSideChannelClient` uses aiohttp (the proxy). Both sign every request and bound the time
and the size of every answer. Network failures raise `SideChannelError`; a "gone" claim or an
unknown release is an answer, not an error.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar
from urllib.parse import quote

import aiohttp
import httpx
from pydantic import BaseModel, ValidationError

from kvrelay.connector.auth import sign_headers
from kvrelay.connector.protocol import (
    PATH_CLAIM,
    PATH_FINISHED_PREFIX,
    PATH_HANDSHAKE,
    PATH_RELEASE,
    ClaimRequest,
    ClaimResponse,
    HandshakeResponse,
    ReleaseRequest,
    ReleaseResponse,
)

MAX_RESPONSE_BYTES = 16 * 1024 * 1024


class SideChannelError(Exception):
    """The holder could not be reached or answered something unexpected."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _base(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _finished_path(client_request_id: str) -> str:
    return PATH_FINISHED_PREFIX + quote(client_request_id, safe="")


_Answer = TypeVar("_Answer", bound=BaseModel)


def _parse_answer(model: type[_Answer], what: str, status: int, body: bytes) -> _Answer:
    """A 200 answer validated as `model`; any other status or a malformed body is an error."""
    if status != 200:
        raise SideChannelError(f"{what} answered {status}: {body[:200]!r}", status)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise SideChannelError(f"malformed {what} answer: {exc}") from exc


def _parse_handshake(status: int, body: bytes) -> HandshakeResponse:
    return _parse_answer(HandshakeResponse, "handshake", status, body)


def _parse_claim(status: int, body: bytes) -> ClaimResponse:
    if status == 410:
        return ClaimResponse(status="gone")
    return _parse_answer(ClaimResponse, "claim", status, body)


def _parse_release(status: int, body: bytes) -> ReleaseResponse:
    return _parse_answer(ReleaseResponse, "release", status, body)


def _parse_finished(status: int, body: bytes) -> dict[str, Any] | None:
    if status == 404:
        return None
    if status != 200:
        raise SideChannelError(f"finished answered {status}: {body[:200]!r}", status)
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise SideChannelError("malformed finished answer") from exc
    if not isinstance(value, dict):
        raise SideChannelError("finished answer is not an object")
    return value


class SideChannelClient:
    """Synchronous, connection-pooled client; safe to share between threads."""

    def __init__(self, secret: bytes, timeout_s: float = 5.0) -> None:
        self._secret = secret
        self._client = httpx.Client(timeout=timeout_s, trust_env=False)

    def _call(self, host: str, port: int, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        headers = sign_headers(self._secret, method, path, body)
        headers["Content-Type"] = "application/json"
        try:
            with self._client.stream(
                method, _base(host, port) + path, content=body or None, headers=headers
            ) as resp:
                data = bytearray()
                for chunk in resp.iter_bytes():
                    data += chunk
                    if len(data) > MAX_RESPONSE_BYTES:
                        raise SideChannelError("side-channel answer too large")
                return resp.status_code, bytes(data)
        except httpx.HTTPError as exc:
            raise SideChannelError(f"side channel {host}:{port} unreachable: {exc}") from exc

    def handshake(self, host: str, port: int) -> HandshakeResponse:
        return _parse_handshake(*self._call(host, port, "GET", PATH_HANDSHAKE, b""))

    def claim(self, host: str, port: int, request_id: str, reader_engine_id: str) -> ClaimResponse:
        body = ClaimRequest(request_id=request_id, reader_engine_id=reader_engine_id)
        return _parse_claim(
            *self._call(host, port, "POST", PATH_CLAIM, body.model_dump_json().encode())
        )

    def release(
        self,
        host: str,
        port: int,
        request_id: str,
        release_token: str,
        reader_engine_id: str | None = None,
    ) -> bool:
        body = ReleaseRequest(
            request_id=request_id, release_token=release_token, reader_engine_id=reader_engine_id
        )
        return _parse_release(
            *self._call(host, port, "POST", PATH_RELEASE, body.model_dump_json().encode())
        ).released

    def finished(self, host: str, port: int, client_request_id: str) -> dict[str, Any] | None:
        path = _finished_path(client_request_id)
        return _parse_finished(*self._call(host, port, "GET", path, b""))

    def close(self) -> None:
        self._client.close()


class AsyncSideChannelClient:
    """aiohttp client for the proxy; pass a shared session or let it own one."""

    def __init__(
        self,
        secret: bytes,
        timeout_s: float = 2.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self._secret = secret
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._owns_session = session is None

    async def _call(
        self, host: str, port: int, method: str, path: str, body: bytes
    ) -> tuple[int, bytes]:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        headers = sign_headers(self._secret, method, path, body)
        headers["Content-Type"] = "application/json"
        try:
            async with self._session.request(
                method,
                _base(host, port) + path,
                data=body or None,
                headers=headers,
                timeout=self._timeout,
            ) as resp:
                data = bytearray()
                async for chunk in resp.content.iter_chunked(65536):
                    data += chunk
                    if len(data) > MAX_RESPONSE_BYTES:
                        raise SideChannelError("side-channel answer too large")
                return resp.status, bytes(data)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise SideChannelError(f"side channel {host}:{port} unreachable: {exc}") from exc

    async def handshake(self, host: str, port: int) -> HandshakeResponse:
        return _parse_handshake(*await self._call(host, port, "GET", PATH_HANDSHAKE, b""))

    async def claim(
        self, host: str, port: int, request_id: str, reader_engine_id: str
    ) -> ClaimResponse:
        body = ClaimRequest(request_id=request_id, reader_engine_id=reader_engine_id)
        raw = body.model_dump_json().encode()
        return _parse_claim(*await self._call(host, port, "POST", PATH_CLAIM, raw))

    async def release(self, host: str, port: int, request_id: str, release_token: str) -> bool:
        body = ReleaseRequest(request_id=request_id, release_token=release_token)
        raw = body.model_dump_json().encode()
        return _parse_release(*await self._call(host, port, "POST", PATH_RELEASE, raw)).released

    async def finished(self, host: str, port: int, client_request_id: str) -> dict[str, Any] | None:
        path = _finished_path(client_request_id)
        return _parse_finished(*await self._call(host, port, "GET", path, b""))

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None
