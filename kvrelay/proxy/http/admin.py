"""Admin API: list, add, drain and remove engines at run time, and ask where a prompt is
cached (`POST /admin/prefix-cache`), behind the admin key.

A sub-application mounted at `/admin` (`admin_app`). `Authorization: Bearer <admin_key>` (or
`X-Admin-Key`, read by `kvrelay.proxy.http.auth`). Without a configured admin key the routes answer
404, so an unconfigured proxy exposes no control surface. Changes go through
the fleet sync (`kvrelay.proxy.fleet`): with the Redis map they reach every worker and replica;
with the memory map (one process) they apply to this process.

Changes of one engine are linearizable: each takes effect at one point (the record's Lua
script, or this process's pools), and its answer describes the engine as that change left it,
not as a later change (on this worker or another) may already have left this worker's pool.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from kvrelay.proxy.base import ProxyError, bad_request, json_response
from kvrelay.proxy.config import normalize_backend_url
from kvrelay.proxy.fleet import Backend, Pool
from kvrelay.proxy.http.auth import require_admin
from kvrelay.proxy.http.body import HeldBody, read_json_object
from kvrelay.proxy.http.keys import (
    BODY_BUDGET,
    CACHE_SCOPES,
    FLEET,
    FLEET_SYNC,
    KV_EVENTS_FEED,
    SETTINGS,
    TURN_CREW,
)
from kvrelay.proxy.turn import chat_shape, completion_shape

log = logging.getLogger(__name__)


def _pools(request: web.Request) -> dict[str, Pool]:
    fleet = request.config_dict[FLEET]
    return {"prefill": fleet.prefill, "decode": fleet.decode}


async def _target(request: web.Request) -> tuple[Pool, str]:
    if request.method == "DELETE" and not request.can_read_body:
        data: Any = dict(request.query)
    else:
        held = HeldBody(request.config_dict[BODY_BUDGET])
        try:
            # The same size, time and depth limits as the client routes.
            data = await read_json_object(request, request.config_dict[SETTINGS], held)
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
    require_admin(request)
    blocks = request.config_dict[FLEET].router.blocks
    feed = request.config_dict.get(KV_EVENTS_FEED)

    def view(b: Backend) -> dict[str, object]:
        described = b.describe()
        if blocks is not None:
            # What the engine's KV events say it caches (the exact index: a P's for prefix
            # routing, a D's for pulls); 0 for an engine whose events are not followed or heard.
            described["kv_events_blocks"] = blocks.blocks_of(b.url)
        if feed is not None:
            # This worker's subscription reached the engine: what it publishes now arrives.
            described["kv_events_connected"] = feed.connected(b.url)
        return described

    return json_response(
        {role: [view(b) for b in pool.backends.values()] for role, pool in _pools(request).items()}
    )


async def _change(request: web.Request, op: str) -> tuple[Pool, str, bool, Backend]:
    """Apply `op` to the engine the request names: (pool, url, whether the engine was in the
    fleet, the engine as this worker knew it, or a new view of it when it knew none)."""
    require_admin(request)
    pool, url = await _target(request)
    known = pool.get(url) or Backend(url=url, role=pool.role)
    sync = request.config_dict[FLEET_SYNC]
    try:
        found = await sync.apply({"op": op, "role": pool.role, "url": url, "source": "admin"})
    except Exception as exc:  # the shared record is unreachable: change nothing anywhere
        log.warning(
            "fleet change %s %s refused: fleet record unavailable (%s)", op, url, type(exc).__name__
        )
        raise ProxyError(
            503,
            "the shared fleet record is unavailable (Redis); nothing was changed, retry",
            code="fleet_unavailable",
        ) from None
    # The change is made; a later one (a remove racing this add) may already have been
    # installed here too, so the answer comes from this change, not from the pool now.
    return pool, url, found, pool.get(url) or known


async def add_backend(request: web.Request) -> web.StreamResponse:
    _, _, _, backend = await _change(request, "add")
    return json_response({**backend.describe(), "draining": False}, 201)


async def drain_backend(request: web.Request) -> web.StreamResponse:
    pool, url, found, backend = await _change(request, "drain")
    if not found:
        raise ProxyError(404, f"no {pool.role} engine {url}")
    return json_response({**backend.describe(), "draining": True})


async def remove_backend(request: web.Request) -> web.StreamResponse:
    pool, url, found, backend = await _change(request, "remove")
    if not found:
        raise ProxyError(404, f"no {pool.role} engine {url}")
    return json_response({"removed": backend.describe()})


async def prefix_cache(request: web.Request) -> web.StreamResponse:
    """Where the prompt of a chat or completions request body is cached, as this worker's
    prefix routing sees it: per P and per D, the prefix the routing-fed index expects
    (characters) and, with KV events, the prefix the engine's own events reported (tokens).
    An operator's answer to "why did this request go there". `?tenant=` names whose request
    it is (a tenant id, `kvrelay tenant-id`; default the keyless "anonymous"): its cache scope
    applies as to the tenant's own requests."""
    require_admin(request)
    crew = request.config_dict[TURN_CREW]
    router = crew.router
    if router.prefixes is None:
        raise ProxyError(409, "prefix_routing is off", code="prefix_routing_off")
    held = HeldBody(request.config_dict[BODY_BUDGET])
    try:
        body = await read_json_object(request, request.config_dict[SETTINGS], held)
    finally:
        held.release()
    request.config_dict[CACHE_SCOPES].apply(body, request.query.get("tenant", "anonymous"))
    messages, salt = body.get("messages"), body.get("cache_salt")
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        route, shape = "chat", chat_shape(body)
    elif isinstance(body.get("prompt"), str):
        route, shape = "completions", completion_shape(body)
    else:
        raise bad_request("send a chat (`messages`) or completions (`prompt`) request body")
    salt = salt if isinstance(salt, str) else None
    prompt = shape.prefixes(salt or "", body)
    if prompt is None:
        raise bad_request("the prompt is too short to have a prefix the index names")
    if router.blocks is not None:
        prompt = await crew.with_tokens(prompt, route, body)
    expected = router.prefixes.cached_chars(prompt)
    reported = (
        router.blocks.cached_tokens(prompt.tokens, salt)
        if router.blocks is not None and prompt.tokens
        else {}
    )

    def engines(pool: Pool) -> list[dict[str, Any]]:
        return [
            {
                "name": b.name,
                "url": b.url,
                "expected_chars": expected.get(b.url, 0),
                "events_tokens": reported.get(b.url, 0) if router.blocks is not None else None,
            }
            for b in pool.backends.values()
        ]

    return json_response(
        {
            "prompt_chars": prompt.total,
            "prompt_tokens": len(prompt.tokens) if prompt.tokens else None,
            "prefill": engines(crew.prefill),
            "decode": engines(crew.decode),
        }
    )


def admin_app() -> web.Application:
    """The admin routes as a sub-application; `create_app` mounts it at `/admin`.

    Its handlers read the proxy's shared state through `request.config_dict` (the parent
    application's keys), and the parent's middlewares (error shaping) wrap them too.
    """
    sub = web.Application()
    sub.router.add_get("/backends", list_backends)
    sub.router.add_post("/backends", add_backend)
    sub.router.add_post("/backends/drain", drain_backend)
    sub.router.add_delete("/backends", remove_backend)
    sub.router.add_post("/prefix-cache", prefix_cache)
    return sub
