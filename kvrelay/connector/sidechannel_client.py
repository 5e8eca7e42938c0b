"""Clients for a holder's side channel (CONTRACTS §2). Torch-free.

`SideChannelClient` is synchronous on a pooled `httpx.Client` (worker and scheduler threads);
`AsyncSideChannelClient` (the proxy) uses the proxy's own engine connections passed in as a
`SideChannelCall`, or else aiohttp. The two share everything but the transport: each call is an
`_Exchange` (what to send, how to read the answer) signed and checked by one `_Signer`. Both
sign every request for the address
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
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
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
    secret: bytes,
    allowlist: HolderAllowlist | None,
    host: str,
    port: int,
    method: str,
    path: str,
    body: bytes,
) -> dict[str, str]:
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


_Result = TypeVar("_Result")


@dataclass(frozen=True)
class _Exchange(Generic[_Result]):
    """One side-channel call, whatever carries it: what to send and how to read the answer."""

    method: str
    path: str
    body: bytes
    parse: Callable[[int, bytes], _Result]


def _handshake() -> _Exchange[HandshakeResponse]:
    return _Exchange("GET", PATH_HANDSHAKE, b"", _parse_handshake)


def _claim(
    request_id: str, reader_engine_id: str, reader_request_id: str
) -> _Exchange[ClaimResponse]:
    body = ClaimRequest(
        request_id=request_id,
        reader_engine_id=reader_engine_id,
        reader_request_id=reader_request_id,
    )
    return _Exchange("POST", PATH_CLAIM, body.model_dump_json().encode(), _parse_claim)


def _release(
    request_id: str,
    release_token: str,
    reader_engine_id: str | None = None,
    reader_request_id: str | None = None,
) -> _Exchange[bool]:
    body = ReleaseRequest(
        request_id=request_id,
        release_token=release_token,
        reader_engine_id=reader_engine_id,
        reader_request_id=reader_request_id,
    )
    return _Exchange(
        "POST",
        PATH_RELEASE,
        body.model_dump_json().encode(),
        lambda status, data: _parse_release(status, data).released,
    )


def _finished(client_request_id: str) -> _Exchange[dict[str, Any] | None]:
    return _Exchange("GET", _finished_path(client_request_id), b"", _parse_finished)


def _finished_batch(client_request_ids: list[str]) -> _Exchange[dict[str, dict[str, Any]]]:
    raw = FinishedBatchRequest(request_ids=client_request_ids).model_dump_json().encode()
    return _Exchange(
        "POST",
        PATH_FINISHED_BATCH,
        raw,
        lambda status, body: (
            _parse_answer(FinishedBatchResponse, "finished batch", status, body).finished
        ),
    )


class _Signer:
    """Signing and checking shared by both clients; only the transport differs."""

    def __init__(self, secret: bytes, allowlist: HolderAllowlist | None) -> None:
        self._secret = secret
        self._allowlist = allowlist

    def headers(self, host: str, port: int, exchange: _Exchange[Any]) -> dict[str, str]:
        return _signed_request(
            self._secret,
            self._allowlist,
            host,
            port,
            exchange.method,
            exchange.path,
            exchange.body,
        )

    def answer(
        self,
        exchange: _Exchange[_Result],
        headers: dict[str, str],
        status: int,
        data: bytes,
        signature: str | None,
    ) -> _Result:
        return exchange.parse(*_authentic(self._secret, headers, status, data, signature))


def _unreachable(host: str, port: int, exc: Exception) -> SideChannelError:
    return SideChannelError(f"side channel {host}:{port} unreachable: {exc}")


class SideChannelClient:
    """Synchronous, connection-pooled client; safe to share between threads."""

    def __init__(
        self, secret: bytes, timeout_s: float = 5.0, allowlist: HolderAllowlist | None = None
    ) -> None:
        self._signer = _Signer(secret, allowlist)
        self._client = httpx.Client(timeout=timeout_s, trust_env=False)

    def _call(self, host: str, port: int, exchange: _Exchange[_Result]) -> _Result:
        headers = self._signer.headers(host, port, exchange)
        try:
            with self._client.stream(
                exchange.method,
                _base(host, port) + exchange.path,
                content=exchange.body or None,
                headers=headers,
            ) as resp:
                data = bytearray()
                for chunk in resp.iter_bytes():
                    data += chunk
                    if len(data) > MAX_RESPONSE_BYTES:
                        raise SideChannelError("side-channel answer too large")
                signature = resp.headers.get(HEADER_SIGNATURE)
                status = resp.status_code
        except httpx.HTTPError as exc:
            raise _unreachable(host, port, exc) from exc
        return self._signer.answer(exchange, headers, status, bytes(data), signature)

    def handshake(self, host: str, port: int) -> HandshakeResponse:
        return self._call(host, port, _handshake())

    def claim(
        self, host: str, port: int, request_id: str, reader_engine_id: str, reader_request_id: str
    ) -> ClaimResponse:
        return self._call(host, port, _claim(request_id, reader_engine_id, reader_request_id))

    def release(
        self,
        host: str,
        port: int,
        request_id: str,
        release_token: str,
        reader_engine_id: str | None = None,
        reader_request_id: str | None = None,
    ) -> bool:
        exchange = _release(request_id, release_token, reader_engine_id, reader_request_id)
        return self._call(host, port, exchange)

    def finished(self, host: str, port: int, client_request_id: str) -> dict[str, Any] | None:
        return self._call(host, port, _finished(client_request_id))

    def close(self) -> None:
        self._client.close()


# (host, port, method, path, headers, body, timeout_s, max_bytes) -> (status, body, signature);
# raises ConnectionError or TimeoutError when the exchange fails.
SideChannelCall = Callable[
    [str, int, str, str, dict[str, str], bytes, float, int],
    Awaitable[tuple[int, bytes, str | None]],
]


class _AiohttpCall:
    """A `SideChannelCall` over an aiohttp session (a shared one, or one it owns): the
    transport of an `AsyncSideChannelClient` not given the proxy's engine connections."""

    def __init__(self, session: aiohttp.ClientSession | None) -> None:
        self._session = session
        self._owns_session = session is None

    async def __call__(
        self,
        host: str,
        port: int,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
        timeout_s: float,
        max_bytes: int,
    ) -> tuple[int, bytes, str | None]:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.request(
                method,
                _base(host, port) + path,
                data=body or None,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                data = bytearray()
                async for chunk in resp.content.iter_chunked(65536):
                    data += chunk
                    if len(data) > max_bytes:
                        raise SideChannelError("side-channel answer too large")
                return resp.status, bytes(data), resp.headers.get(HEADER_SIGNATURE)
        except aiohttp.ClientError as exc:
            raise ConnectionError(str(exc)) from exc

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None


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
        self._signer = _Signer(secret, None)
        self._timeout_s = timeout_s
        self._own: _AiohttpCall | None = None
        if transport is None:
            transport = self._own = _AiohttpCall(session)
        self._transport = transport

    async def _call(self, host: str, port: int, exchange: _Exchange[_Result]) -> _Result:
        headers = self._signer.headers(host, port, exchange)
        try:
            status, data, signature = await self._transport(
                host,
                port,
                exchange.method,
                exchange.path,
                headers,
                exchange.body,
                self._timeout_s,
                MAX_RESPONSE_BYTES,
            )
        except (ConnectionError, TimeoutError) as exc:
            raise _unreachable(host, port, exc) from exc
        return self._signer.answer(exchange, headers, status, data, signature)

    async def handshake(self, host: str, port: int) -> HandshakeResponse:
        return await self._call(host, port, _handshake())

    async def claim(
        self, host: str, port: int, request_id: str, reader_engine_id: str, reader_request_id: str
    ) -> ClaimResponse:
        return await self._call(host, port, _claim(request_id, reader_engine_id, reader_request_id))

    async def release(self, host: str, port: int, request_id: str, release_token: str) -> bool:
        return await self._call(host, port, _release(request_id, release_token))

    async def finished(self, host: str, port: int, client_request_id: str) -> dict[str, Any] | None:
        return await self._call(host, port, _finished(client_request_id))

    async def finished_batch(
        self, host: str, port: int, client_request_ids: list[str]
    ) -> dict[str, dict[str, Any]]:
        """Params of the ids the holder has published, by id; it waits for none of them.

        A holder without the batch endpoint answers 404 or 405 (a `SideChannelError` with that
        status): ask it one id at a time (`finished`)."""
        return await self._call(host, port, _finished_batch(client_request_ids))

    async def close(self) -> None:
        if self._own is not None:
            await self._own.close()
