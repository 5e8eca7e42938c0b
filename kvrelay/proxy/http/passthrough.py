"""Pass-through routes: engine endpoints the proxy forwards as they are.

Every path in `passthrough_routes` (by default `/v1/embeddings`, `/v1/responses`, `/tokenize`,
`/detokenize`) is forwarded, with any method and its query string, to one engine of
`passthrough_pool` (D by default) that serves the body's model: no P leg, no conversation
map. It gets what the disaggregated routes get: API-key auth, the breaker and per-tenant
limits (`access.admit`), the body limits, the unknown-model 404, the leg timeouts and the
health-aware choice (least work, ejected and draining engines skipped). A request that could
not be sent (connect error) is tried on another engine, up to `retries` more; once it may have
reached an engine it is not repeated, since such routes need not be idempotent. A JSON body
loses any client-supplied `kv_transfer_params`, whatever Content-Type it came under (only a real
multipart form is forwarded as sent, `kvrelay.proxy.http.forms`). The answer is relayed as it
arrives (SSE and chunked streams stream); an engine that breaks mid-stream cuts the client's
connection, so the client sees a cut, never a short answer that looks whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.helpers import parse_mimetype

from kvrelay.connector.protocol import KV_TRANSFER_PARAMS
from kvrelay.proxy.base import ProxyError, bad_request, strip_connector_fields
from kvrelay.proxy.engines import H1Response, UpstreamConnectError, UpstreamError, UpstreamTimeout
from kvrelay.proxy.fleet import Backend, Fleet, Pool, Router, engines_to_try
from kvrelay.proxy.http.access import admit, leave
from kvrelay.proxy.http.body import HeldBody, parse_json_body, read_body
from kvrelay.proxy.http.forms import field_text as form_field_text
from kvrelay.proxy.http.forms import parts as form_parts
from kvrelay.proxy.http.forms import without as form_without
from kvrelay.proxy.http.headers import forwarded_headers
from kvrelay.proxy.http.keys import BODY_BUDGET, CACHE_SCOPES, FLEET, MODELS
from kvrelay.proxy.telemetry import metrics
from kvrelay.proxy.tenants import CACHE_SALT, check_client_salt
from kvrelay.proxy.turn import request_id_from, upstream_request_id

log = logging.getLogger(__name__)

# Request headers an engine gets; the rest (the client's Authorization above all) stay here.
_FORWARDED_REQUEST = ("Content-Type", "Accept")
# Answer headers a client gets; hop-by-hop and length headers are the proxy's own.
_FORWARDED_ANSWER = ("Content-Type", "Cache-Control")
JSON_TYPE = "application/json"


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
        tenant, slot = await admit(request)
        body = await _payload(request, fleet, held, tenant, route)
        upstream_id = upstream_request_id(request_id, supplied == request_id)
        response, outcome = await _forward(request, fleet, route, body, upstream_id, request_id)
        return response
    except ProxyError as exc:
        outcome = _outcome_of(exc.status)
        return exc.response({"X-Request-Id": request_id})
    except (ConnectionResetError, aiohttp.ClientConnectionResetError, asyncio.CancelledError):
        outcome = "client_disconnected"
        raise
    finally:
        await leave(slot, held, route)
        metrics.PASSTHROUGH.labels(route, outcome).inc()


def _outcome_of(status: int) -> str:
    if status < 400:
        return "ok"
    if status == 503:
        return "unavailable"
    return "client_error" if status < 500 else "upstream_error"


# Routes that compute no KV (vLLM's request models for them have no `cache_salt`): every other
# JSON route gets the tenant's salt, since a prompt it prefills is cached (and its usage can
# report cached tokens, the oracle `kvrelay.proxy.tenants.cache_scope` closes).
_NO_KV_ROUTES = frozenset({"/tokenize", "/detokenize"})

# A JSON text's first byte past any whitespace; a multipart body starts with its boundary.
_LOOKS_LIKE_JSON = re.compile(rb"[ \t\r\n]*[\[{]")


async def _payload(
    request: web.Request, fleet: Fleet, held: HeldBody, tenant: str, route: str
) -> tuple[bytes | None, Any, str | None]:
    """The body to forward, the model it names and its Content-Type. Bodies are checked by
    what they are, not by the Content-Type the client claims: anything that is not a real
    multipart form must be a JSON object and gets the JSON checks (budget, depth, model,
    `kv_transfer_params` dropped, the tenant's `cache_salt` set where the route computes KV);
    a form gets its `model` field checked and its `kv_transfer_params` field dropped. A model
    nobody serves is refused (404)."""
    if not request.body_exists:
        return None, None, None
    raw = await read_body(request, fleet.settings, held)
    content_type = request.headers.get("Content-Type", "")
    mime = parse_mimetype(content_type)
    if mime.type == "multipart" and not _LOOKS_LIKE_JSON.match(raw):
        boundary = mime.parameters.get("boundary")
        if not boundary:
            raise bad_request(
                "a multipart body needs the boundary parameter of its Content-Type",
                code="invalid_multipart",
            )
        return *(await _form_payload(request, raw, boundary, held)), content_type
    body: dict[str, Any] = parse_json_body(raw, fleet.settings, held)
    await request.app[MODELS].check(body.get("model"))
    strip_connector_fields(body)  # the proxy alone speaks to the connector
    if route not in _NO_KV_ROUTES:
        problem = check_client_salt(body.get(CACHE_SALT))
        if problem is not None:
            raise bad_request(problem, param=CACHE_SALT)
        request.app[CACHE_SCOPES].apply(body, tenant)
    return json.dumps(body, separators=(",", ":")).encode(), body.get("model"), JSON_TYPE


async def _form_payload(
    request: web.Request, raw: bytes | bytearray, boundary: str, held: HeldBody
) -> tuple[bytes, Any]:
    found = form_parts(raw, boundary)
    model: str | None = None
    for part in found:
        if part.name == "model":
            model = form_field_text(raw, part)
            await request.app[MODELS].check(model)
    if any(part.name == KV_TRANSFER_PARAMS for part in found):
        held.grow_to(2 * len(raw))  # the rebuilt form beside the body it came from
        return form_without(raw, boundary, found, {KV_TRANSFER_PARAMS}), model
    return bytes(raw), model


async def _forward(
    request: web.Request,
    fleet: Fleet,
    route: str,
    body: tuple[bytes | None, Any, str | None],
    upstream_id: str,
    client_id: str,
) -> tuple[web.StreamResponse, str]:
    """The relayed answer and its outcome label."""
    settings = fleet.settings
    payload, model, content_type = body
    pool = fleet.decode if settings.passthrough_pool == "decode" else fleet.prefill
    pick = _picker(fleet.router, pool, request.app[MODELS].servers_of(model))
    headers = {h: request.headers[h] for h in _FORWARDED_REQUEST if h in request.headers}
    if content_type is not None:
        headers["Content-Type"] = content_type
    headers.update(forwarded_headers(request, settings.forward_headers))
    headers["X-Request-Id"] = upstream_id
    reasons: list[str] = []

    def on_try(backend: Backend, attempt: int) -> None:
        if attempt:
            metrics.RETRIES.labels("passthrough").inc()

    origin_path = route
    if request.rel_url.raw_query_string:
        origin_path += "?" + request.rel_url.raw_query_string
    wire_headers = tuple(headers.items())
    for backend in engines_to_try(pick, 1 + settings.retries, on_try):
        with pool.busy(backend, 1):
            try:
                resp = await fleet.upstream.for_url(backend.url).request(
                    request.method,
                    origin_path,
                    payload or b"",
                    wire_headers,
                    read_timeout=settings.first_byte_timeout,
                    total_timeout=settings.total_timeout,
                )
            except UpstreamConnectError as exc:
                # Nothing reached the engine: another one may serve it.
                pool.record_failure(backend, f"cannot connect ({exc})")
                reasons.append(f"{backend.name}: cannot connect")
                log.warning("pass-through %s to %s: cannot connect", route, backend.url)
                continue
            except UpstreamTimeout:
                pool.record_failure(backend, "no answer within the first-byte timeout")
                raise ProxyError(
                    504,
                    f"the {pool.role} engine {backend.name} did not answer {route} within "
                    f"{settings.first_byte_timeout:g} s (setting first_byte_timeout)",
                    code="upstream_timeout",
                ) from None
            except UpstreamError as exc:
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
            finally:
                # Read to its end: the connection goes back to its pool; else it is aborted,
                # so an engine mid-answer learns the client left.
                resp.release()
    detail = "; ".join(reasons) if reasons else f"no {pool.role} engine is healthy"
    raise ProxyError(
        503,
        f"no {pool.role} engine could take {route} ({detail}); retry later or check /ready",
        code="backends_unavailable",
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


# An engine's 5xx answer is read whole only up to this; its error message is in the first bytes.
_ERROR_READ_MAX = 64 * 1024


def _answer_headers(resp: H1Response, client_id: str) -> dict[str, str]:
    headers = {}
    for name in _FORWARDED_ANSWER:
        value = resp.header(name.lower().encode())
        if value is not None:
            headers[name] = value.decode("latin-1")
    headers["X-Request-Id"] = client_id
    return headers


async def _engine_failure(
    resp: H1Response, backend: Backend, route: str, headers: dict[str, str]
) -> web.Response:
    """An engine's 5xx, OpenAI-shaped: its own JSON error as it is, anything else (a text or
    HTML page, JSON without an error) as a shaped 502 quoting its first bytes."""
    try:
        raw = await resp.read_head(_ERROR_READ_MAX)
    except (UpstreamError, TimeoutError):
        raw = b""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return web.Response(body=raw, status=resp.status, headers=headers)
    text = " ".join(raw[:300].decode("utf-8", "replace").split())
    log.warning(
        "pass-through %s: %s answered HTTP %d without an error object",
        route,
        backend.url,
        resp.status,
    )
    return ProxyError(
        502,
        f"the engine {backend.name} failed on {route} (HTTP {resp.status}"
        + (f": {text}" if text else "")
        + ")",
        code="upstream_failed",
    ).response({"X-Request-Id": headers["X-Request-Id"]})


async def _relay(
    request: web.Request,
    resp: H1Response,
    backend: Backend,
    route: str,
    client_id: str,
) -> tuple[web.StreamResponse, str]:
    """Send the engine's answer on: a stream (SSE, or a body of unknown length) as it
    arrives, an answer of announced length once whole (so the handler frees its limit slot
    before the client has the answer, and a next request cannot find it still taken)."""
    headers = _answer_headers(resp, client_id)
    if resp.status >= 500:
        return await _engine_failure(resp, backend, route, headers), _outcome_of(resp.status)
    mime = parse_mimetype(headers.get("Content-Type", ""))
    is_sse = (mime.type, mime.subtype) == ("text", "event-stream")
    if resp.header(b"content-length") is not None and not is_sse:
        try:
            raw = await resp.read()
        except (UpstreamError, TimeoutError) as exc:
            log.warning("pass-through %s from %s broke: %s", route, backend.url, type(exc).__name__)
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
        async for chunk in resp.iter_chunks():
            await out.write(chunk)
    except (UpstreamError, TimeoutError) as exc:
        log.warning(
            "pass-through %s from %s broke after %.1f s: %s",
            route,
            backend.url,
            time.monotonic() - started,
            type(exc).__name__,
        )
        # Headers are out: closing the connection is the only way to tell the client.
        if request.transport is not None:
            request.transport.close()
        return out, "upstream_cut"
    await out.write_eof()
    return out, _outcome_of(resp.status)
