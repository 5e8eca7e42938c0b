"""Pass-through routes: engine endpoints the proxy forwards as they are.

Every path in `passthrough_routes` (by default `/v1/embeddings`, `/v1/responses`, `/tokenize`,
`/detokenize`) is forwarded, with any method and its query string, to one engine of
`passthrough_pool` (D by default) that serves the body's model: no P leg, no conversation
map. It gets what the disaggregated routes get: API-key auth, the breaker and per-tenant
limits (`access.admit`), the body limits, the unknown-model 404, the leg timeouts and the
health-aware choice (least work, ejected and draining engines skipped). A request that could
not be sent (connect error) is tried on another engine, up to `retries` more; once it may have
reached an engine it is not repeated, since such routes need not be idempotent. A JSON body
loses any client-supplied `kv_transfer_params`. The answer is relayed as it arrives (SSE and
chunked streams stream); an engine that breaks mid-stream cuts the client's connection, so the
client sees a cut, never a short answer that looks whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from kvrelay.connector.protocol import KV_TRANSFER_PARAMS
from kvrelay.proxy import access, metrics
from kvrelay.proxy.body import HeldBody, parse_json_object, read_body
from kvrelay.proxy.conversation import request_id_from, upstream_request_id
from kvrelay.proxy.errors import ProxyError
from kvrelay.proxy.fleet import Fleet
from kvrelay.proxy.headers import forwarded_headers
from kvrelay.proxy.keys import BODY_BUDGET, FLEET, MODELS
from kvrelay.proxy.pools import Backend, Pool, engines_to_try
from kvrelay.proxy.routing import Router
from kvrelay.proxy.settings import Settings

log = logging.getLogger(__name__)

# Request headers an engine gets; the rest (the client's Authorization above all) stay here.
_FORWARDED_REQUEST = ("Content-Type", "Accept")
# Answer headers a client gets; hop-by-hop and length headers are the proxy's own.
_FORWARDED_ANSWER = ("Content-Type", "Cache-Control")


def add_routes(app: web.Application, routes: list[str]) -> None:
    for route in routes:
        app.router.add_route("*", route, passthrough)


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Forward one request to an engine of the pass-through pool and relay its answer."""
    fleet = request.app[FLEET]
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else ""
    supplied = request.headers.get("X-Request-Id")
    request_id = request_id_from(supplied)
    held = HeldBody(request.app[BODY_BUDGET])
    slot = None
    outcome = "error"
    metrics.INFLIGHT.labels(route).inc()
    try:
        _tenant, slot = await access.admit(request)
        payload, model = await _payload(request, fleet, held)
        upstream_id = upstream_request_id(request_id, supplied == request_id)
        response, outcome = await _forward(
            request, fleet, route, (payload, model), upstream_id, request_id
        )
        return response
    except ProxyError as exc:
        outcome = _outcome_of(exc.status)
        return exc.response({"X-Request-Id": request_id})
    except (ConnectionResetError, aiohttp.ClientConnectionResetError, asyncio.CancelledError):
        outcome = "client_disconnected"
        raise
    finally:
        if slot is not None:
            await slot.release()
        held.release()
        metrics.INFLIGHT.labels(route).dec()
        metrics.PASSTHROUGH.labels(route, outcome).inc()


def _outcome_of(status: int) -> str:
    if status < 400:
        return "ok"
    if status == 503:
        return "unavailable"
    return "client_error" if status < 500 else "upstream_error"


async def _payload(request: web.Request, fleet: Fleet, held: HeldBody) -> tuple[bytes | None, Any]:
    """The body to forward (a JSON object without `kv_transfer_params`, or other bytes as
    sent) and the model it names. A JSON body naming a model nobody serves is refused (404)."""
    if not request.body_exists:
        return None, None
    raw = await read_body(request, fleet.settings, held)
    if request.content_type.startswith("multipart/"):
        return bytes(raw), None  # file uploads (e.g. audio): forwarded as sent
    # Any other body must be a JSON object, whatever its Content-Type says, so that no
    # kv_transfer_params slip through under another label.
    body: dict[str, Any] = parse_json_object(raw, fleet.settings.json_max_depth)
    await request.app[MODELS].check(body.get("model"))
    body.pop(KV_TRANSFER_PARAMS, None)  # the proxy alone speaks to the connector
    return json.dumps(body, separators=(",", ":")).encode(), body.get("model")


async def _forward(
    request: web.Request,
    fleet: Fleet,
    route: str,
    body: tuple[bytes | None, Any],
    upstream_id: str,
    client_id: str,
) -> tuple[web.StreamResponse, str]:
    """The relayed answer and its outcome label."""
    settings = fleet.settings
    payload, model = body
    pool = fleet.decode if settings.passthrough_pool == "decode" else fleet.prefill
    pick = _picker(fleet.router, pool, request.app[MODELS].servers_of(model))
    headers = {h: request.headers[h] for h in _FORWARDED_REQUEST if h in request.headers}
    if payload is not None and not request.content_type.startswith("multipart/"):
        headers["Content-Type"] = "application/json"
    headers.update(forwarded_headers(request, settings.forward_headers))
    headers["X-Request-Id"] = upstream_id
    reasons: list[str] = []

    def on_retry() -> None:
        metrics.RETRIES.labels("passthrough").inc()

    for backend in engines_to_try(pick, 1 + settings.retries, on_retry):
        with pool.busy(backend, 1):
            try:
                resp = await fleet.session.request(
                    request.method,
                    backend.url + route,
                    params=request.rel_url.query,
                    data=payload,
                    headers=headers,
                    timeout=_timeout(settings),
                )
            except aiohttp.ClientConnectorError as exc:
                # Nothing reached the engine: another one may serve it.
                pool.record_failure(backend, f"cannot connect ({exc.os_error})")
                reasons.append(f"{backend.name}: cannot connect")
                log.warning("pass-through %s to %s: cannot connect", route, backend.url)
                continue
            except (aiohttp.ServerTimeoutError, TimeoutError):
                pool.record_failure(backend, "no answer within the first-byte timeout")
                raise ProxyError(
                    504,
                    f"the {pool.role} engine {backend.name} did not answer {route} within "
                    f"{settings.first_byte_timeout:g} s (setting first_byte_timeout)",
                    code="upstream_timeout",
                ) from None
            except aiohttp.ClientError as exc:
                # The request may have reached the engine: not repeated elsewhere.
                pool.record_failure(backend, f"{type(exc).__name__}")
                raise ProxyError(
                    502,
                    f"the {pool.role} engine {backend.name} failed on {route} "
                    f"({type(exc).__name__}); retry",
                    code="upstream_failed",
                ) from None
            try:
                if resp.status < 500:
                    pool.record_success(backend, probe=False)
                return await _relay(request, resp, backend, route, client_id)
            except BaseException:
                resp.close()  # not pooled: an engine mid-answer learns the client left
                raise
            finally:
                resp.release()
    detail = "; ".join(reasons) if reasons else f"no {pool.role} engine is healthy"
    raise ProxyError(
        503,
        f"no {pool.role} engine could take {route} ({detail}); retry later or check /ready",
        code="backends_unavailable",
    )


def _timeout(settings: Settings) -> aiohttp.ClientTimeout:
    """The legs' timeouts for a pass-through request (on the fleet's aiohttp session: these routes
    stream arbitrary bodies and methods, so they do not use the turns' engine client)."""
    return aiohttp.ClientTimeout(
        total=settings.total_timeout,
        connect=settings.connect_timeout,
        sock_connect=settings.connect_timeout,
        sock_read=settings.first_byte_timeout,
    )


def _picker(
    router: Router, pool: Pool, serving: frozenset[str] | None
) -> Callable[[set[str]], Backend | None]:
    """The least loaded among the engines that serve the request's model (all when none is known
    to: a model listed only by the other pool, or a fleet that did not answer /v1/models)."""

    def pick(tried: set[str]) -> Backend | None:
        if serving is None or not any(b.url in serving for b in pool.usable()):
            return router.least_loaded(pool, tried)
        others = {b.url for b in pool.usable() if b.url not in serving}
        return router.least_loaded(pool, tried | others)

    return pick


async def _relay(
    request: web.Request,
    resp: aiohttp.ClientResponse,
    backend: Backend,
    route: str,
    client_id: str,
) -> tuple[web.StreamResponse, str]:
    """Send the engine's answer on: a stream (SSE, or a body of unknown length) as it
    arrives, an answer of announced length once whole (so the handler frees its limit slot
    before the client has the answer, and a next request cannot find it still taken)."""
    headers = {h: resp.headers[h] for h in _FORWARDED_ANSWER if h in resp.headers}
    headers["X-Request-Id"] = client_id
    if resp.content_length is not None and resp.content_type != "text/event-stream":
        try:
            raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("pass-through %s from %s broke: %s", route, backend.url,
                        type(exc).__name__)  # fmt: skip
            raise ProxyError(
                502,
                f"the engine {backend.name} failed while answering {route} "
                f"({type(exc).__name__}); retry",
                code="upstream_failed",
            ) from None
        return web.Response(body=raw, status=resp.status, headers=headers), _outcome_of(resp.status)
    out = web.StreamResponse(status=resp.status, headers=headers)
    await out.prepare(request)
    started = time.monotonic()
    try:
        async for chunk in resp.content.iter_any():
            await out.write(chunk)
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, TimeoutError) as exc:
        log.warning("pass-through %s from %s broke after %.1f s: %s", route, backend.url,
                    time.monotonic() - started, type(exc).__name__)  # fmt: skip
        # Headers are out: closing the connection is the only way to tell the client.
        if request.transport is not None:
            request.transport.close()
        return out, "upstream_cut"
    await out.write_eof()
    return out, _outcome_of(resp.status)
