"""Who may send a request, and whether now: API-key authentication, the per-key breaker
(`kvrelay.proxy.tenants`) and the per-tenant limits (`kvrelay.proxy.limits`), the same for
every client route."""

from __future__ import annotations

import hmac
import math

from aiohttp import web

from kvrelay.proxy.conversation import tenant_of
from kvrelay.proxy.errors import ProxyError
from kvrelay.proxy.headers import bearer_token
from kvrelay.proxy.keys import LIMITS, SETTINGS, TENANTS
from kvrelay.proxy.limits import Slot


def authenticate(request: web.Request) -> str:
    """The caller's tenant; 401 when keys are configured and none matches."""
    settings = request.app[SETTINGS]
    token = bearer_token(request)
    if not settings.api_keys:
        return tenant_of(token)
    if token is not None:
        matched = False
        for key in settings.api_keys:
            # Compare against every key so timing does not reveal which one was close.
            matched |= hmac.compare_digest(token.encode(), key.get_secret_value().encode())
        if matched:
            return tenant_of(token)
    raise ProxyError(
        401,
        "missing or invalid API key: send `Authorization: Bearer <key>` with a key the "
        "proxy was configured with",
        code="invalid_api_key",
    )


def check_breaker(request: web.Request, tenant: str) -> None:
    """429 `tenant_paused` while the tenant's breaker is open."""
    left = request.app[TENANTS].retry_after(tenant)
    if left is not None:
        wait = max(1, math.ceil(left))
        raise ProxyError(
            429,
            "this API key's recent requests made every engine fail, so its requests are paused "
            f"for {wait} s (settings tenant_failure_limit, tenant_cooldown_s); check the input "
            "those requests sent",
            code="tenant_paused",
            headers={"Retry-After": str(wait)},
        )


async def admit(request: web.Request) -> tuple[str, Slot]:
    """Authenticate, check the breaker and take a slot under the tenant's limits (429 when
    over them). The caller releases the slot on every way out."""
    tenant = authenticate(request)
    check_breaker(request, tenant)
    return tenant, await request.app[LIMITS].admit(tenant)
