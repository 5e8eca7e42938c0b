"""Clients for a holder's side channel (CONTRACTS §2). Torch-free.

`SideChannelClient` is synchronous on a pooled `httpx.Client` (worker and scheduler threads);
`AsyncSideChannelClient` (the proxy) uses aiohttp, or the proxy's own engine connections passed
in as a `SideChannelCall`. Both sign every request for the address
they send it to, bound the time and the size of every answer, and believe an answer only when
the holder signed it for that very request. With an allowlist (readers: `allowed_holders`) a
holder outside it is never contacted. Network failures, unsigned or forged answers and refused
addresses raise `SideChannelError`; a "gone"/"claimed" claim or an unknown release is an
answer, not an error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import quote

import aiohttp
import httpx
from pydantic import BaseModel, ValidationError

from kvrelay.connector.allowlist import HolderAllowlist
from kvrelay.connector.auth import destination, sign_headers, verify_response
from kvrelay.connector.errors import ConnectorError, ConnectorErrorKind
from kvrelay.connector.protocol import (
    HEADER_NONCE,
    HEADER_SIGNATURE,
    PATH_CLAIM,
    PATH_FINISHED_BATCH,
    PATH_FINISHED_PREFIX,
    PATH_HANDSHAKE,
    PATH_RELEASE,
    ClaimRequest,
    ClaimResponse,
    FinishedBatchRequest,
    FinishedBatchResponse,
    HandshakeResponse,
    ReleaseRequest,
    ReleaseResponse,
)

MAX_RESPONSE_BYTES = 16 * 1024 * 1024


class SideChannelError(ConnectorError):
    """The holder could not be reached or answered something unexpected."""

    kind = ConnectorErrorKind.SIDE_CHANNEL

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class HolderNotAllowedError(SideChannelError):
    """The holder's address is outside the allowlist: it was not contacted (final)."""

    kind = ConnectorErrorKind.HOLDER_NOT_ALLOWED


def _base(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


# Characters `quote(..., safe="")` leaves alone: ids made only of them need no quoting (the
# proxy's own ids are; `quote` is a measurable share of a streamed turn's cost).
_UNRESERVED = re.compile(r"[A-Za-z0-9_.~-]+")


def _finished_path(client_request_id: str) -> str:
    if _UNRESERVED.fullmatch(client_request_id):
        return PATH_FINISHED_PREFIX + client_request_id
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
    if status == 409:
        return ClaimResponse(status="claimed")
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


def _signed_request(
    secret: bytes, allowlist: HolderAllowlist | None, host: str, port: int, method: str,
    path: str, body: bytes,
) -> dict[str, str]:  # fmt: skip
    """Headers for one request, after checking the holder may be contacted at all."""
    if allowlist is not None and not allowlist.allows(host):
        raise HolderNotAllowedError(f"holder address {host!r} is not in allowed_holders")
    headers = sign_headers(secret, method, path, body, dest=destination(host, port))
    headers["Content-Type"] = "application/json"
    return headers


def _authentic(
    secret: bytes, headers: dict[str, str], status: int, data: bytes, signature: str | None
) -> tuple[int, bytes]:
    """The answer, if the holder signed it for this request; anything else is an error."""
    if not verify_response(secret, headers[HEADER_NONCE], status, data, signature):
        raise SideChannelError(f"unauthenticated side-channel answer (status {status})", status)
    return status, data


class SideChannelClient:
    """Synchronous, connection-pooled client; safe to share between threads."""

    def __init__(
        self, secret: bytes, timeout_s: float = 5.0, allowlist: HolderAllowlist | None = None
    ) -> None:
        self._secret = secret
        self._allowlist = allowlist
        self._client = httpx.Client(timeout=timeout_s, trust_env=False)

    def _call(self, host: str, port: int, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        headers = _signed_request(self._secret, self._allowlist, host, port, method, path, body)
        try:
            with self._client.stream(
                method, _base(host, port) + path, content=body or None, headers=headers
            ) as resp:
                data = bytearray()
                for chunk in resp.iter_bytes():
                    data += chunk
                    if len(data) > MAX_RESPONSE_BYTES:
                        raise SideChannelError("side-channel answer too large")
                signature = resp.headers.get(HEADER_SIGNATURE)
                return _authentic(self._secret, headers, resp.status_code, bytes(data), signature)
        except httpx.HTTPError as exc:
            raise SideChannelError(f"side channel {host}:{port} unreachable: {exc}") from exc

    def handshake(self, host: str, port: int) -> HandshakeResponse:
        return _parse_handshake(*self._call(host, port, "GET", PATH_HANDSHAKE, b""))

    def claim(
        self, host: str, port: int, request_id: str, reader_engine_id: str, reader_request_id: str
    ) -> ClaimResponse:
        body = ClaimRequest(
            request_id=request_id,
            reader_engine_id=reader_engine_id,
            reader_request_id=reader_request_id,
        )
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
        reader_request_id: str | None = None,
    ) -> bool:
        body = ReleaseRequest(
            request_id=request_id,
            release_token=release_token,
            reader_engine_id=reader_engine_id,
            reader_request_id=reader_request_id,
        )
        return _parse_release(
            *self._call(host, port, "POST", PATH_RELEASE, body.model_dump_json().encode())
        ).released

    def finished(self, host: str, port: int, client_request_id: str) -> dict[str, Any] | None:
        path = _finished_path(client_request_id)
        return _parse_finished(*self._call(host, port, "GET", path, b""))

    def close(self) -> None:
        self._client.close()


# (host, port, method, path, headers, body, timeout_s, max_bytes) -> (status, body, signature);
# raises ConnectionError or TimeoutError when the exchange fails.
SideChannelCall = Callable[
    [str, int, str, str, dict[str, str], bytes, float, int],
    Awaitable[tuple[int, bytes, str | None]],
]


class AsyncSideChannelClient:
    """Async client for the proxy: over `transport` when given, else over an aiohttp session
    (a shared one, or one it owns)."""

    def __init__(
        self,
        secret: bytes,
        timeout_s: float = 2.0,
        session: aiohttp.ClientSession | None = None,
        transport: SideChannelCall | None = None,
    ) -> None:
        self._secret = secret
        self._timeout_s = timeout_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._owns_session = session is None
        self._transport = transport

    async def _call(
        self, host: str, port: int, method: str, path: str, body: bytes
    ) -> tuple[int, bytes]:
        headers = _signed_request(self._secret, None, host, port, method, path, body)
        if self._transport is not None:
            try:
                status, answer, signature = await self._transport(
                    host, port, method, path, headers, body, self._timeout_s, MAX_RESPONSE_BYTES
                )
            except (ConnectionError, TimeoutError) as exc:
                raise SideChannelError(f"side channel {host}:{port} unreachable: {exc}") from exc
            return _authentic(self._secret, headers, status, answer, signature)
        if self._session is None:
            self._session = aiohttp.ClientSession()
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
                signature = resp.headers.get(HEADER_SIGNATURE)
                return _authentic(self._secret, headers, resp.status, bytes(data), signature)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise SideChannelError(f"side channel {host}:{port} unreachable: {exc}") from exc

    async def handshake(self, host: str, port: int) -> HandshakeResponse:
        return _parse_handshake(*await self._call(host, port, "GET", PATH_HANDSHAKE, b""))

    async def claim(
        self, host: str, port: int, request_id: str, reader_engine_id: str, reader_request_id: str
    ) -> ClaimResponse:
        body = ClaimRequest(
            request_id=request_id,
            reader_engine_id=reader_engine_id,
            reader_request_id=reader_request_id,
        )
        raw = body.model_dump_json().encode()
        return _parse_claim(*await self._call(host, port, "POST", PATH_CLAIM, raw))

    async def release(self, host: str, port: int, request_id: str, release_token: str) -> bool:
        body = ReleaseRequest(request_id=request_id, release_token=release_token)
        raw = body.model_dump_json().encode()
        return _parse_release(*await self._call(host, port, "POST", PATH_RELEASE, raw)).released

    async def finished(self, host: str, port: int, client_request_id: str) -> dict[str, Any] | None:
        path = _finished_path(client_request_id)
        return _parse_finished(*await self._call(host, port, "GET", path, b""))

    async def finished_batch(
        self, host: str, port: int, client_request_ids: list[str]
    ) -> dict[str, dict[str, Any]]:
        """Params of the ids the holder has published, by id; it waits for none of them.

        A holder without the batch endpoint answers 404 or 405 (a `SideChannelError` with that
        status): ask it one id at a time (`finished`)."""
        raw = FinishedBatchRequest(request_ids=client_request_ids).model_dump_json().encode()
        status, body = await self._call(host, port, "POST", PATH_FINISHED_BATCH, raw)
        return _parse_answer(FinishedBatchResponse, "finished batch", status, body).finished

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None
