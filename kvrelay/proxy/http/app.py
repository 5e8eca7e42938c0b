"""The aiohttp application: routes, error handling, start-up and shutdown of shared state.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`,
`GET /ready`, `GET /metrics`, `GET /version` (`kvrelay.proxy.fleet.versions`),
`DELETE /v1/conversations/{id}`, `GET /openapi.json`, the admin sub-application under `/admin`
(`kvrelay.proxy.http.admin`) and the pass-through routes (`kvrelay.proxy.http.passthrough`).
Who may call what: `kvrelay.proxy.http.auth`; whether now: `kvrelay.proxy.http.access`.
`create_app(settings)` builds it; `kvrelay.proxy.http.server` runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from kvrelay.kvcache_map import (
    ConversationKey,
    InvalidKeyError,
    KVMap,
    MapUnavailableError,
    open_map,
)
from kvrelay.proxy.base import ProxyError, json_response, strip_connector_fields
from kvrelay.proxy.config import Settings
from kvrelay.proxy.engines import Releaser, Upstream
from kvrelay.proxy.fleet import (
    Backend,
    EngineVersions,
    Fleet,
    HealthChecker,
    KVEventsFeed,
    LoadPoller,
    ModelCatalog,
    Pool,
    events_endpoint,
    name_key,
    open_fleet_sync,
    start_discovery,
    start_kube_discovery,
    use_name_key,
)
from kvrelay.proxy.http.access import admit, leave
from kvrelay.proxy.http.admin import admin_app
from kvrelay.proxy.http.auth import authenticate, require_metrics_key
from kvrelay.proxy.http.body import BodyBudget, HeldBody, read_json_object
from kvrelay.proxy.http.headers import forwarded_headers, header_text
from kvrelay.proxy.http.keys import (
    BODY_BUDGET,
    CACHE_SCOPES,
    FLEET,
    FLEET_SYNC,
    HEALTH,
    KV_EVENTS_FEED,
    LIMITS,
    MODELS,
    SETTINGS,
    TENANTS,
    TURN_CREW,
    VERSIONS,
)
from kvrelay.proxy.http.openapi import openapi_document
from kvrelay.proxy.http.passthrough import add_routes as add_passthrough_routes
from kvrelay.proxy.http.validation import validate_chat, validate_completion
from kvrelay.proxy.telemetry import metrics
from kvrelay.proxy.tenants import CacheScopes, Slot, TenantBreaker, open_limiter
from kvrelay.proxy.turn import (
    CONVERSATION_HEADER,
    SESSION_HEADER,
    AiohttpClient,
    Turn,
    TurnContext,
    TurnCrew,
    chat_shape,
    completion_shape,
    conversation_id_from,
    request_id_from,
    upstream_request_id,
)

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
INTERNAL_ERROR = ProxyError(
    500,
    "the proxy failed on this request; retry, or report it with its X-Request-Id",
    code="internal_error",
)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI-shaped body, an unexpected one as a shaped 500."""
    try:
        return await handler(request)
    except ProxyError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {
            404: f"no route {request.method} {request.path}; see /openapi.json",
            405: f"method {request.method} is not allowed on {request.path}",
        }.get(exc.status, exc.reason)
        return ProxyError(exc.status, message).response()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        raise  # the client is gone: nobody to answer
    except Exception:
        log.exception("unexpected error on %s %r", request.method, request.path)
        return INTERNAL_ERROR.response()


async def _completion(request: web.Request, route: str) -> web.StreamResponse:
    app = request.app  # a property chain in aiohttp: looked up once
    fleet = app[FLEET]
    metrics.INFLIGHT.labels(route).inc()
    outcome = "error"
    supplied = request.headers.get("X-Request-Id")
    request_id = request_id_from(supplied)
    held = HeldBody(app[BODY_BUDGET])
    turn: Turn | None = None
    client: AiohttpClient | None = None
    tenant = ""
    slot: Slot | None = None
    try:
        tenant, slot = await admit(request)
        body = await read_json_object(request, fleet.settings, held)
        if route == "chat":
            validate_chat(body)
        else:
            validate_completion(body)
        strip_connector_fields(body)
        app[CACHE_SCOPES].apply(body, tenant)  # the engines cache per tenant
        await app[MODELS].check(body.get("model"))
        conversation_id = conversation_id_from(
            header_text(request, CONVERSATION_HEADER), body, header_text(request, SESSION_HEADER)
        )
        shape = chat_shape(body) if route == "chat" else completion_shape(body)
        client = AiohttpClient(request)
        settings = fleet.settings
        ctx = TurnContext.of(
            route=route,
            body=body,
            request_id=upstream_request_id(request_id, supplied == request_id),
            tenant=tenant,
            shape=shape,
            conversation_id=conversation_id,
            client_request_id=request_id,
            forwarded=forwarded_headers(request, settings.forward_headers),
            fingerprint_conversations=settings.fingerprint_conversations,
        )
        turn = Turn(app[TURN_CREW], client, ctx)
        await turn.run()
        outcome = "ok"
        return client.response
    except ProxyError as exc:
        outcome = "client_error" if exc.status < 500 else "upstream_error"
        suspect = turn.suspect_input if turn is not None else ()
        if suspect and app[TENANTS].strike(tenant, suspect):
            log.warning("paused an API key (tenant %s) whose requests every engine failed", tenant)
        started = await _end_started_stream(client, exc)
        return started or exc.response({"X-Request-Id": request_id})
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        outcome = "client_disconnected"
        raise
    except asyncio.CancelledError:
        outcome = "client_disconnected"
        raise
    except Exception:
        started = await _end_started_stream(client, INTERNAL_ERROR)
        if started is None:
            raise  # the errors middleware answers with a shaped 500
        log.exception(
            "unexpected error on %s %r after its stream started", request.method, request.path
        )
        return started
    finally:
        await leave(slot, held, route)
        metrics.REQUESTS.labels(route, outcome).inc()


async def _end_started_stream(
    client: AiohttpClient | None, error: ProxyError
) -> web.StreamResponse | None:
    """A turn whose stream had started ends it with `error` as its last event (never a second
    response inside the stream's body); None when no stream had started."""
    return None if client is None else await client.end_stream_with(error)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "completions")


async def models(request: web.Request) -> web.StreamResponse:
    authenticate(request)
    return json_response(await request.app[MODELS].listing())


async def health(request: web.Request) -> web.StreamResponse:
    return json_response({"status": "ok"})


async def ready(request: web.Request) -> web.StreamResponse:
    fleet = request.app[FLEET]
    p, d = len(fleet.prefill.usable()), len(fleet.decode.usable())
    body = {"ready": bool(p and d), "prefill_healthy": p, "decode_healthy": d}
    return json_response(body, 200 if p and d else 503)


async def metrics_page(request: web.Request) -> web.StreamResponse:
    require_metrics_key(request)
    payload, content_type = metrics.render()
    return web.Response(body=payload, headers={"Content-Type": content_type})


async def delete_conversation(request: web.Request) -> web.StreamResponse:
    tenant = authenticate(request)
    fleet = request.app[FLEET]
    conversation_id = request.match_info["conversation_id"]
    try:
        entry = await fleet.kvmap.delete(ConversationKey(tenant, conversation_id))
    except MapUnavailableError as exc:
        fleet.map_unavailable("delete", exc)
        raise ProxyError(
            503, "the conversation map is unavailable; retry later", code="map_unavailable"
        ) from None
    except InvalidKeyError as exc:
        raise ProxyError(400, f"conversation id not accepted: {exc}") from None
    if entry is None:
        raise ProxyError(
            404,
            f"no conversation {conversation_id!r} holds KV for this API key (already ended, "
            "expired, or never stored)",
            code="conversation_not_found",
        )
    fleet.releaser.release_soon("decode", entry.hold_ref)
    return json_response({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


async def version(request: web.Request) -> web.StreamResponse:
    """vLLM's answer (the proxy's version) to anyone, as vLLM gives it; the engines' list
    only to a caller with an API key (when keys are configured)."""
    versions = request.app[VERSIONS]
    try:
        authenticate(request)
    except ProxyError:
        return json_response(versions.own())
    return json_response(await versions.document())


async def openapi(request: web.Request) -> web.StreamResponse:
    return json_response(openapi_document())


def _health_gauge(with_urls: bool) -> tuple[Callable[[Backend], None], Callable[[Backend], None]]:
    """What keeps `kvrelay_backend_healthy` current: on a health change, on leaving."""

    def label(backend: Backend) -> str:
        return backend.url if with_urls else backend.name

    def update(backend: Backend) -> None:
        metrics.backend_health(backend.role, label(backend), backend.healthy)

    def gone(backend: Backend) -> None:
        metrics.backend_gone(backend.role, label(backend))

    return update, gone


def create_app(settings: Settings, kvmap: KVMap | None = None) -> web.Application:
    """The proxy application; state is created on start-up and closed on cleanup."""
    app = web.Application(
        middlewares=[errors_middleware], client_max_size=settings.body_limit_bytes
    )
    app[SETTINGS] = settings
    use_name_key(name_key(settings))  # how /metrics and client errors name engines
    app[BODY_BUDGET] = BodyBudget(settings.inflight_body_bytes)
    app[TENANTS] = TenantBreaker(settings.tenant_failure_limit, settings.tenant_cooldown_s)
    isolate = settings.cache_isolation == "tenant"
    app[CACHE_SCOPES] = CacheScopes(isolate, settings.cache_share_groups)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_page)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/version", version)
    app.router.add_delete("/v1/conversations/{conversation_id}", delete_conversation)
    app.add_subapp("/admin", admin_app())
    add_passthrough_routes(app, settings.passthrough_routes)
    app.cleanup_ctx.append(_make_state(settings, kvmap))
    return app


def _make_state(
    settings: Settings, injected_map: KVMap | None
) -> Callable[[web.Application], AsyncIterator[None]]:
    """The app's shared state as one aiohttp cleanup context, each resource stopped by the
    same stack that started it: a start that fails halfway stops what had started, and at
    shutdown every stop runs, last started first, whatever an earlier one raised (each error
    is logged with the resource's name)."""

    async def state(app: web.Application) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            await _start_state(app, settings, injected_map, stack)
            yield

    return state


def _stopping(
    name: str, stop: Callable[[], Awaitable[None] | None]
) -> Callable[[], Awaitable[None]]:
    """`stop` as an exit callback that logs its failure instead of skipping the stops after."""

    async def run() -> None:
        try:
            result = stop()
            if result is not None:
                await result
        except Exception:
            log.exception("stopping %s failed", name)

    return run


async def _start_state(
    app: web.Application,
    settings: Settings,
    injected_map: KVMap | None,
    stack: contextlib.AsyncExitStack,
) -> None:
    """Start every shared resource; each one's stop goes on `stack` once it has started."""
    secret = settings.connector_secret.get_secret_value() if settings.connector_secret else None
    upstream = Upstream(connect_timeout=settings.connect_timeout)
    stack.push_async_callback(_stopping("the engine client", upstream.close))
    releaser = Releaser(secret, upstream, settings.side_channel_timeout)
    if not releaser.enabled:
        log.warning(
            "connector_secret is unset: the proxy cannot release held blocks or fetch "
            "streamed requests' params (KVRELAY_CONNECTOR_SECRET)"
        )
    # Drained after the map closes: the map's last evictions release holds too.
    stack.push_async_callback(_stopping("the releaser", releaser.drain))
    kvmap = injected_map or open_map(settings.map_url, on_evict=releaser.on_evict)
    if injected_map is None:
        stack.push_async_callback(_stopping("the conversation map", kvmap.close))
    gauge, gone = _health_gauge(settings.metrics_backend_urls)
    pools = {
        role: Pool(
            role,
            settings.eject_after_failures,
            settings.readmit_after_successes,
            on_health_change=gauge,
            on_leave=gone,
            dispute_window_s=settings.engine_5xx_window_s,
        )
        for role in ("prefill", "decode")
    }
    prefill, decode = pools["prefill"], pools["decode"]
    for url in settings.prefill:
        prefill.add(url)
    for url in settings.decode:
        decode.add(url)
    fleet = Fleet(settings, prefill, decode, kvmap, upstream, releaser)
    app[FLEET] = fleet
    app[TURN_CREW] = TurnCrew.of(fleet)
    app[MODELS] = ModelCatalog(fleet)
    app[VERSIONS] = EngineVersions(fleet)
    started = time.monotonic()
    limiter = open_limiter(settings)
    app[LIMITS] = limiter
    await limiter.start()
    stack.push_async_callback(_stopping("the tenant limiter", limiter.stop))
    sync = open_fleet_sync(settings, pools)
    app[FLEET_SYNC] = sync
    await sync.start()
    stack.push_async_callback(_stopping("the fleet sync", sync.stop))
    discovery = await start_discovery(settings, sync)
    if discovery is not None:
        stack.push_async_callback(_stopping("DNS discovery", discovery.stop))
    kube = await start_kube_discovery(settings, sync)
    if kube is not None:
        stack.push_async_callback(_stopping("Kubernetes discovery", kube.stop))
    checker = HealthChecker(
        [prefill, decode], upstream, settings.probe_interval_s, settings.probe_timeout_s
    )
    app[HEALTH] = checker
    checker.start()
    stack.push_async_callback(_stopping("the health checker", checker.stop))
    # Engine load signals for routing (kvrelay.proxy.fleet.engine_load); off with interval 0.
    poller = LoadPoller(
        [prefill, decode], upstream, settings.load_poll_interval_s, settings.probe_timeout_s
    )
    poller.start()
    stack.push_async_callback(_stopping("the load poller", poller.stop))
    blocks = fleet.router.blocks
    if blocks is not None:  # prefix routing from the engines' own KV events
        feed = KVEventsFeed(
            (prefill, decode),
            blocks,
            functools.partial(
                events_endpoint,
                endpoints=settings.kv_events_endpoints,
                port=settings.kv_events_port,
            ),
            settings.probe_interval_s,
            functools.partial(
                events_endpoint,
                endpoints=settings.kv_events_replay_endpoints,
                port=settings.kv_events_replay_port,
            ),
        )
        feed.start()
        app[KV_EVENTS_FEED] = feed
        stack.push_async_callback(_stopping("the KV events feed", feed.stop))
    log.info("kvrelay proxy ready in %.2fs", time.monotonic() - started)
