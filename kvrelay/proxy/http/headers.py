"""Reading request headers that may hold any bytes.

aiohttp keeps header bytes that are not UTF-8 as lone surrogates; encoding such a value (to
compare a key, to build a map key) would fail deep inside a handler. Every header the proxy
interprets goes through `header_text`, which refuses such a value with an OpenAI-shaped error
instead: 401 for credentials, 400 for anything else. `forwarded_headers` picks the client
headers the `forward_headers` setting passes on to the engines.
"""

from __future__ import annotations

from aiohttp import web

from kvrelay.proxy.base import ProxyError

_CREDENTIALS = frozenset({"authorization", "x-admin-key"})


def header_text(
    request: web.Request, name: str, credential_code: str = "invalid_api_key"
) -> str | None:
    """The header's value, or None when absent; a value that is not UTF-8 is refused."""
    value = request.headers.get(name)
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        if name.lower() in _CREDENTIALS:
            raise ProxyError(
                401,
                f"the {name} header is not valid UTF-8; send the key as plain text",
                code=credential_code,
            ) from None
        raise ProxyError(
            400, f"the {name} header is not valid UTF-8", param=name, code="invalid_header"
        ) from None
    return value


def bearer_token(request: web.Request, credential_code: str = "invalid_api_key") -> str | None:
    """The token of `Authorization: Bearer <token>`, or None."""
    header = header_text(request, "Authorization", credential_code) or ""
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


def forwarded_headers(request: web.Request, names: list[str]) -> tuple[tuple[str, str], ...]:
    """The headers among `names` that the request carries, as (name, value) for the engines."""
    out = []
    for name in names:
        value = header_text(request, name)
        if value is not None:
            out.append((name, value))
    return tuple(out)
