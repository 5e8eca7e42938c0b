"""Who may call what: client API keys, the admin key and the metrics key, read one way.

Every key arrives as `Authorization: Bearer <key>` (the admin key may also come as
`X-Admin-Key`) and is read by `presented_key`; `key_matches` compares it with the configured
keys in constant time, against every key, so timing tells nothing about which key was close.
A refusal is an OpenAI-shaped 401 whose `code` names the key that was wanted.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from aiohttp import web
from pydantic import SecretStr

from kvrelay.proxy.base import ProxyError
from kvrelay.proxy.config import Settings
from kvrelay.proxy.http.headers import bearer_token, header_text
from kvrelay.proxy.http.keys import SETTINGS
from kvrelay.proxy.turn import tenant_of


def presented_key(
    request: web.Request, credential_code: str, alt_header: str | None = None
) -> str | None:
    """The key the client sent: the bearer token, else `alt_header`'s value; None for none.

    A header that is not UTF-8 is refused with a 401 carrying `credential_code`.
    """
    token = bearer_token(request, credential_code)
    if token is None and alt_header is not None:
        token = header_text(request, alt_header, credential_code) or None
    return token


def key_matches(given: str | None, keys: Iterable[SecretStr]) -> bool:
    """Whether `given` is one of `keys` (no key given matches nothing)."""
    if given is None:
        return False
    matched = False
    for key in keys:
        # Compare against every key so timing does not reveal which one was close.
        matched |= hmac.compare_digest(given.encode(), key.get_secret_value().encode())
    return matched


def authenticate(request: web.Request, settings: Settings | None = None) -> str:
    """The caller's tenant; 401 when API keys are configured and none matches. `settings`
    spares the lookup through `config_dict` (which a sub-application's handler needs)."""
    if settings is None:
        settings = request.config_dict[SETTINGS]
    token = presented_key(request, "invalid_api_key")
    if not settings.api_keys or key_matches(token, settings.api_keys):
        return tenant_of(token)
    raise ProxyError(
        401,
        "missing or invalid API key: send `Authorization: Bearer <key>` with a key the "
        "proxy was configured with",
        code="invalid_api_key",
    )


def require_admin(request: web.Request) -> None:
    """Pass an admin call; 404 when no admin key is configured, 401 for a wrong key."""
    key = request.config_dict[SETTINGS].admin_key
    if key is None:
        raise ProxyError(
            404, "the admin API is disabled: set admin_key (KVRELAY_ADMIN_KEY) to enable it"
        )
    code = "invalid_admin_key"
    if not key_matches(presented_key(request, code, "X-Admin-Key"), [key]):
        raise ProxyError(401, "admin endpoints need `Authorization: Bearer <admin_key>`", code=code)


def require_metrics_key(request: web.Request) -> None:
    """Pass a `/metrics` scrape when no metrics key is configured or the right one is sent."""
    key = request.config_dict[SETTINGS].metrics_key
    if key is None:
        return
    code = "invalid_metrics_key"
    # A scrape without a key is compared as an empty key, as before keys were read here.
    if not key_matches(presented_key(request, code) or "", [key]):
        raise ProxyError(401, "/metrics needs `Authorization: Bearer <metrics_key>`", code=code)
