"""Who may send a request, and whether now: API-key authentication (`kvrelay.proxy.http.auth`),
the per-key breaker (`kvrelay.proxy.tenants.breaker`) and the per-tenant limits
(`kvrelay.proxy.tenants.limits`), the same for every client route."""

from __future__ import annotations

import math

from aiohttp import web

from kvrelay.proxy.base import ProxyError
from kvrelay.proxy.http.auth import authenticate
from kvrelay.proxy.http.body import HeldBody
from kvrelay.proxy.http.keys import LIMITS, SETTINGS, TENANTS
from kvrelay.proxy.telemetry import metrics
from kvrelay.proxy.tenants import Slot


def check_breaker(app: web.Application, tenant: str) -> None:
    """429 `tenant_paused` while the tenant's breaker is open."""
    left = app[TENANTS].retry_after(tenant)
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
    app = request.app  # a property chain in aiohttp: looked up once
    tenant = authenticate(request, app[SETTINGS])
    check_breaker(app, tenant)
    return tenant, await app[LIMITS].admit(tenant)


async def leave(slot: Slot | None, held: HeldBody, route: str) -> None:
    """Give back what a client request held (its tenant slot, its body bytes, its in-flight
    count on `route`): the `finally` of every client route."""
    if slot is not None:
        await slot.release()
    held.release()
    metrics.INFLIGHT.labels(route).dec()
