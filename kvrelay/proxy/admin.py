"""Admin API: list, add, drain and remove engines at run time, behind the admin key.

`Authorization: Bearer <admin_key>` (or `X-Admin-Key`). Without a configured admin key the
routes answer 404, so an unconfigured proxy exposes no control surface. Changes apply to the
worker process that receives them (with `--workers N`, configure the fleet by settings).
"""

from __future__ import annotations

import hmac
from typing import Any

from aiohttp import web

from kvrelay.proxy.body import HeldBody, read_json_object
from kvrelay.proxy.errors import ProxyError, bad_request, json_response
from kvrelay.proxy.headers import bearer_token, header_text
from kvrelay.proxy.keys import BODY_BUDGET, FLEET, SETTINGS
from kvrelay.proxy.pools import Pool
from kvrelay.proxy.settings import normalize_backend_url


def _check_admin(request: web.Request) -> None:
    key = request.app[SETTINGS].admin_key
    if key is None:
        raise ProxyError(
            404, "the admin API is disabled: set admin_key (KVRELAY_ADMIN_KEY) to enable it"
        )
    code = "invalid_admin_key"
    given = bearer_token(request, code) or header_text(request, "X-Admin-Key", code) or ""
    if not given or not hmac.compare_digest(given.encode(), key.get_secret_value().encode()):
        raise ProxyError(
            401,
            "admin endpoints need `Authorization: Bearer <admin_key>`",
            code="invalid_admin_key",
        )


def _pools(request: web.Request) -> dict[str, Pool]:
    fleet = request.app[FLEET]
    return {"prefill": fleet.prefill, "decode": fleet.decode}


async def _target(request: web.Request) -> tuple[Pool, str]:
    if request.method == "DELETE" and not request.can_read_body:
        data: Any = dict(request.query)
    else:
        held = HeldBody(request.app[BODY_BUDGET])
        try:
            # The same size, time and depth limits as the client routes.
            data = await read_json_object(request, request.app[SETTINGS], held)
        except ProxyError as exc:
            if exc.code not in ("invalid_json", "empty_body"):
                raise
            raise bad_request('send a JSON object {"role": ..., "url": ...}') from None
        finally:
            held.release()
    role, url = data.get("role"), data.get("url")
    pools = _pools(request)
    if role not in pools:
        raise bad_request('`role` must be "prefill" or "decode"', param="role")
    if not isinstance(url, str):
        raise bad_request("`url` must be an engine base URL string", param="url")
    try:
        return pools[role], normalize_backend_url(url)
    except ValueError as exc:
        raise bad_request(str(exc), param="url") from None


async def list_backends(request: web.Request) -> web.StreamResponse:
    _check_admin(request)
    return json_response(
        {
            role: [b.describe() for b in pool.backends.values()]
            for role, pool in _pools(request).items()
        }
    )


async def add_backend(request: web.Request) -> web.StreamResponse:
    _check_admin(request)
    pool, url = await _target(request)
    return json_response(pool.add(url).describe(), 201)


async def drain_backend(request: web.Request) -> web.StreamResponse:
    _check_admin(request)
    pool, url = await _target(request)
    backend = pool.drain(url)
    if backend is None:
        raise ProxyError(404, f"no {pool.role} engine {url}")
    return json_response(backend.describe())


async def remove_backend(request: web.Request) -> web.StreamResponse:
    _check_admin(request)
    pool, url = await _target(request)
    backend = pool.remove(url)
    if backend is None:
        raise ProxyError(404, f"no {pool.role} engine {url}")
    return json_response({"removed": backend.describe()})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/backends", list_backends)
    app.router.add_post("/admin/backends", add_backend)
    app.router.add_post("/admin/backends/drain", drain_backend)
    app.router.add_delete("/admin/backends", remove_backend)
