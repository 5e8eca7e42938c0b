"""One client turn through the fleet: reuse lookup, the P leg, the D leg, storing D's params.

Order of a turn (DESIGN §1): take the conversation's entry (atomic, single use) and check it
(history, expiry, verifiability) → P prefills, pulling the old turn's KV when there is a
usable entry → D decodes with P's params and, when the conversation may continue, holds its
blocks → D's final params become the conversation's new entry. Every way out of a turn frees
what the turn made someone hold: the taken entry once P is done with it, P's blocks when no D
took them, D's blocks when they cannot be stored (`Cleanup`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvrelay.connector.protocol import (
    RELEASE_TOKEN,
    REMOTE_BLOCK_HASHES,
    REMOTE_BLOCKS_EXPIRY_TIME,
    REMOTE_HOST,
    REMOTE_NUM_TOKENS,
    REMOTE_PORT,
)
from kvrelay.kvcache_map import (
    ConversationKey,
    KVEntry,
    KVMap,
    MapUnavailableError,
)
from kvrelay.kvcache_map._errors import InvalidKeyError
from kvrelay.proxy import metrics
from kvrelay.proxy.conversation import PromptShape, chat_store_key_id
from kvrelay.proxy.errors import ProxyError, upstream_error_from_body
from kvrelay.proxy.legs import KV_PARAMS, capped_num_tokens, decode_body, prefill_body
from kvrelay.proxy.pools import Backend, Pool
from kvrelay.proxy.release import Releaser
from kvrelay.proxy.settings import Settings
from kvrelay.proxy.streaming import SSEFilter, error_event

log = logging.getLogger(__name__)

# A D that streamed without params publishes them on its side channel when it finishes;
# a cancelled one may take a moment to finish. Bounded retries, then the lease frees them.
_FINISHED_RETRY_DELAYS = (0.0, 0.2, 0.5, 1.0)


class LegFailure(Exception):
    """An engine could not be used for a leg (connect, timeout, 5xx); another may be tried."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass
class Fleet:
    """What every turn shares: settings, pools, the map, the engine session, the releaser."""

    settings: Settings
    prefill: Pool
    decode: Pool
    kvmap: KVMap
    session: aiohttp.ClientSession
    releaser: Releaser
    map_errors_logged_at: float = 0.0

    def leg_timeout(self) -> aiohttp.ClientTimeout:
        s = self.settings
        return aiohttp.ClientTimeout(
            total=s.total_timeout,
            connect=s.connect_timeout,
            sock_connect=s.connect_timeout,
            sock_read=s.first_byte_timeout,
        )

    def map_unavailable(self, op: str, exc: Exception) -> None:
        metrics.MAP_ERRORS.labels(op).inc()
        now = time.monotonic()
        if now - self.map_errors_logged_at > 10.0:  # one line per 10 s, not one per request
            self.map_errors_logged_at = now
            log.warning("conversation map unavailable (%s: %s); serving without reuse", op, exc)

    def side_channel_of(self, backend: Backend) -> tuple[str, int] | None:
        configured = self.settings.side_channels.get(backend.url)
        if configured is not None:
            host, _, port = configured.rpartition(":")
            return host, int(port)
        return backend.side_channel


@dataclass
class Turn:
    """State of one client request while it crosses P and D."""

    fleet: Fleet
    request: web.Request
    route: str  # "chat" | "completions"
    body: dict[str, Any]
    request_id: str  # upstream id, on both legs
    tenant: str
    conversation_id: str | None
    shape: PromptShape
    client_request_id: str = ""  # what the client sees in X-Request-Id
    started: float = field(default_factory=time.monotonic)
    entry: KVEntry | None = None
    p_backend: Backend | None = None
    p_params: dict[str, Any] | None = None
    p_prompt_tokens: int | None = None
    p_answered: bool = False  # P returned 2xx (its connector dealt with any reuse params)
    d_backend: Backend | None = None
    d_accepted: bool = False
    d_params_handled: bool = False
    hold: bool = False

    # -- keys ----------------------------------------------------------------------------------

    def _lookup_key(self) -> ConversationKey | None:
        if self.conversation_id is not None:
            return ConversationKey(self.tenant, self.conversation_id)
        fingerprinting = self.route == "chat" and self.fleet.settings.fingerprint_conversations
        if fingerprinting and self.shape.lookup_key_id is not None:
            return ConversationKey(self.tenant, self.shape.lookup_key_id)
        return None

    def _store_key(self) -> ConversationKey | None:
        if self.shape.store_fingerprint is None:
            return None
        if self.conversation_id is not None:
            return ConversationKey(self.tenant, self.conversation_id)
        if self.route == "chat" and self.fleet.settings.fingerprint_conversations:
            key_id = chat_store_key_id(self.shape)
            return ConversationKey(self.tenant, key_id) if key_id else None
        return None

    # -- the turn ------------------------------------------------------------------------------

    async def run(self) -> web.StreamResponse:
        try:
            response = await self._run()
        except BaseException:
            self._cleanup_after_failure()
            raise
        # On success P's blocks need no call from here: D's connector either read them (the
        # read frees them) or released them itself (skipped, mismatched or failed load).
        return response

    async def _run(self) -> web.StreamResponse:
        store_key = self._store_key()
        self.hold = store_key is not None
        try:
            await self._take_entry()
            await self._prefill()
        finally:
            # The old turn's blocks are superseded. When P answered, its connector read them
            # (freeing them) or released them; otherwise nobody will, so the proxy does.
            if self.entry is not None and not self.p_answered:
                self.fleet.releaser.release_soon_entry(self.entry)
        return await self._decode(store_key)

    async def _take_entry(self) -> None:
        key = self._lookup_key()
        if key is None:
            if self.route == "chat" or self.conversation_id is not None:
                metrics.REUSE.labels("miss").inc()
            return
        try:
            entry = await self.fleet.kvmap.take(key)
        except MapUnavailableError as exc:
            self.fleet.map_unavailable("take", exc)
            metrics.REUSE.labels("map_unavailable").inc()
            self.hold = False  # nowhere to store D's params: do not make D hold
            return
        except InvalidKeyError as exc:
            raise ProxyError(
                400, f"conversation id not accepted: {exc}", param="conversation_id"
            ) from None
        if entry is None:
            metrics.REUSE.labels("miss").inc()
            return
        settings = self.fleet.settings
        if not self.shape.extends(entry.fingerprint):
            # Edited or different history: the blocks describe another prompt.
            metrics.REUSE.labels("refused").inc()
            self.fleet.releaser.release_soon_entry(entry)
            return
        if entry.expires_at - time.time() < settings.entry_safety_margin_s:
            metrics.REUSE.labels("expired").inc()
            self.fleet.releaser.release_soon_entry(entry)
            return
        if entry.block_hashes is None and not settings.stock_vllm_reuse:
            metrics.REUSE.labels("unverifiable").inc()
            self.fleet.releaser.release_soon_entry(entry)
            return
        holder = self.fleet.decode.get(entry.url)
        if holder is None or not holder.healthy:
            # P's pull would only wait for a handshake timeout; a draining holder still serves.
            metrics.REUSE.labels("holder_unavailable").inc()
            self.fleet.releaser.release_soon_entry(entry)
            return
        metrics.REUSE.labels("hit").inc()
        metrics.TOKENS_REUSED.inc(entry.num_tokens)
        self.entry = entry

    def _work_estimate(self) -> int:
        # Prompt size in bytes is a cheap stand-in for prefill work (no tokenizer here).
        if self.route == "chat":
            return sum(len(str(m.get("content") or "")) for m in self.body["messages"]) + 1
        return len(str(self.body.get("prompt"))) + 1

    async def _prefill(self) -> None:
        fleet = self.fleet
        reuse = self.entry.to_kv_transfer_params() if self.entry is not None else None
        payload = json.dumps(prefill_body(self.body, reuse), separators=(",", ":")).encode()
        exclude: set[str] = set()
        work = self._work_estimate()
        for attempt in range(1 + fleet.settings.retries):
            backend = fleet.prefill.pick_least_work(exclude)
            if backend is None:
                break
            exclude.add(backend.url)
            if attempt:
                metrics.RETRIES.labels("prefill").inc()
            start = time.monotonic()
            try:
                with fleet.prefill.busy(backend, work):
                    status, raw = await self._post_read(backend, payload)
            except LegFailure as exc:
                fleet.prefill.record_failure(backend, exc.reason)
                metrics.LEG_LATENCY.labels("prefill", "error").observe(time.monotonic() - start)
                log.warning("prefill on %s failed: %s", backend.url, exc.reason)
                continue
            metrics.LEG_LATENCY.labels("prefill", str(status // 100) + "xx").observe(
                time.monotonic() - start
            )
            if status >= 500 or status == 429:
                fleet.prefill.record_failure(backend, f"HTTP {status}")
                log.warning("prefill on %s answered %d", backend.url, status)
                continue
            if status >= 400:
                # The prompt itself is bad: D would refuse it too.
                fleet.prefill.record_success(backend, probe=False)
                raise upstream_error_from_body(status, raw, "prefill")
            fleet.prefill.record_success(backend, probe=False)
            self.p_backend = backend
            self.p_answered = True
            self._read_prefill_answer(raw)
            return
        metrics.FALLBACKS.labels("decode_only").inc()
        log.warning("no prefill engine answered; decode engine prefills (request %s)",
                    self.request_id)  # fmt: skip

    def _read_prefill_answer(self, raw: bytes) -> None:
        try:
            data = json.loads(raw)
        except ValueError:
            return
        if not isinstance(data, dict):
            return
        params = data.get(KV_PARAMS)
        self.p_params = params if isinstance(params, dict) else None
        usage = data.get("usage")
        if isinstance(usage, dict):
            prompt_tokens = usage.get("prompt_tokens")
            if isinstance(prompt_tokens, int):
                self.p_prompt_tokens = prompt_tokens
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                metrics.TOKENS_PULLED.inc(details["cached_tokens"])

    async def _post_read(self, backend: Backend, payload: bytes) -> tuple[int, bytes]:
        resp = await self._open(backend, payload)
        try:
            return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise LegFailure(f"reading the answer failed: {type(exc).__name__}") from exc
        finally:
            resp.release()

    async def _open(self, backend: Backend, payload: bytes) -> aiohttp.ClientResponse:
        path = "/v1/chat/completions" if self.route == "chat" else "/v1/completions"
        headers = {"Content-Type": "application/json", "X-Request-Id": self.request_id}
        try:
            return await self.fleet.session.post(
                backend.url + path,
                data=payload,
                headers=headers,
                timeout=self.fleet.leg_timeout(),
            )
        except aiohttp.ClientConnectorError as exc:
            raise LegFailure(f"cannot connect ({exc.os_error})") from exc
        except (aiohttp.ServerTimeoutError, TimeoutError) as exc:
            raise LegFailure("no answer within the first-byte timeout") from exc
        except aiohttp.ClientError as exc:
            raise LegFailure(f"{type(exc).__name__}: {exc}") from exc

    # -- D ---------------------------------------------------------------------------------------

    async def _decode(self, store_key: ConversationKey | None) -> web.StreamResponse:
        fleet = self.fleet
        stream = self.body.get("stream") is True
        preferred = self.entry.url if self.entry is not None else None
        exclude: set[str] = set()
        reasons: list[str] = []
        for attempt in range(1 + fleet.settings.retries):
            backend = fleet.decode.pick_with_affinity(
                preferred, exclude, fleet.settings.decode_overload_inflight
            )
            if backend is None:
                break
            exclude.add(backend.url)
            if attempt:
                metrics.RETRIES.labels("decode").inc()
            # A stream carries no params on stock engines: only ask D to hold when the proxy
            # can fetch them from D's side channel afterwards (else they would be stranded).
            hold = self.hold and (not stream or fleet.side_channel_of(backend) is not None)
            payload = json.dumps(
                decode_body(
                    self.body,
                    self.p_params,
                    self.p_backend.url if self.p_backend else None,
                    hold,
                ),
                separators=(",", ":"),
            ).encode()
            start = time.monotonic()
            self.d_backend = backend
            with fleet.decode.busy(backend, 1):
                try:
                    resp = await self._open(backend, payload)
                except LegFailure as exc:
                    fleet.decode.record_failure(backend, exc.reason)
                    metrics.LEG_LATENCY.labels("decode", "error").observe(time.monotonic() - start)
                    reasons.append(f"{backend.url}: {exc.reason}")
                    log.warning("decode on %s failed: %s", backend.url, exc.reason)
                    continue
                try:
                    if resp.status >= 500 or resp.status == 429:
                        await _drain(resp)
                        fleet.decode.record_failure(backend, f"HTTP {resp.status}")
                        reasons.append(f"{backend.url}: HTTP {resp.status}")
                        continue
                    if resp.status >= 400:
                        raw = await resp.read()
                        fleet.decode.record_success(backend, probe=False)
                        raise upstream_error_from_body(resp.status, raw, "decode")
                    fleet.decode.record_success(backend, probe=False)
                    self.d_accepted = True
                    self.hold = hold
                    if stream:
                        return await self._relay_stream(resp, backend, store_key, start)
                    return await self._relay_json(resp, backend, store_key, start)
                except BaseException:
                    # Closing (not pooling) the connection is what tells D to stop.
                    resp.close()
                    raise
                finally:
                    resp.release()
        detail = "; ".join(reasons) if reasons else "no decode engine is healthy"
        raise ProxyError(
            503 if not reasons else 502,
            f"no decode engine could serve the request ({detail}); retry later or check "
            "the decode engines' health at /ready",
            code="decode_unavailable",
        )

    async def _relay_json(
        self,
        resp: aiohttp.ClientResponse,
        backend: Backend,
        store_key: ConversationKey | None,
        start: float,
    ) -> web.StreamResponse:
        try:
            raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            metrics.LEG_LATENCY.labels("decode", "error").observe(time.monotonic() - start)
            raise ProxyError(
                502,
                f"the decode engine failed while answering ({type(exc).__name__}); retry",
                code="decode_failed",
            ) from exc
        metrics.LEG_LATENCY.labels("decode", "2xx").observe(time.monotonic() - start)
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ProxyError(
                502, "the decode engine answered with invalid JSON", code="decode_failed"
            ) from exc
        params = data.pop(KV_PARAMS, None) if isinstance(data, dict) else None
        if isinstance(params, dict):
            metrics.FINISHED_PARAMS.labels("response").inc()
            await self._store(params, backend, store_key)
        elif self.hold:
            self._no_params()
        else:
            self.d_params_handled = True
        metrics.TTFT.labels(self.route).observe(time.monotonic() - self.started)
        return web.Response(
            body=json.dumps(data, separators=(",", ":")).encode(),
            status=resp.status,
            content_type="application/json",
            headers={"X-Request-Id": self.client_request_id or self.request_id},
        )

    async def _relay_stream(
        self,
        resp: aiohttp.ClientResponse,
        backend: Backend,
        store_key: ConversationKey | None,
        start: float,
    ) -> web.StreamResponse:
        out = web.StreamResponse(
            status=resp.status,
            headers={
                "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
                "X-Request-Id": self.client_request_id or self.request_id,
            },
        )
        await out.prepare(self.request)
        sse = SSEFilter()
        first = True
        try:
            async for chunk in resp.content.iter_any():
                data = sse.feed(chunk)
                if data:
                    if first:
                        metrics.TTFT.labels(self.route).observe(time.monotonic() - self.started)
                        first = False
                    await out.write(data)
            tail = sse.flush()
            if tail:
                await out.write(tail)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, TimeoutError) as exc:
            # D broke after the first byte: nothing can be retried, the client learns why.
            metrics.LEG_LATENCY.labels("decode", "error").observe(time.monotonic() - start)
            log.warning("decode stream from %s broke: %s", backend.url, type(exc).__name__)
            await out.write(
                error_event(
                    "the decode engine stopped in the middle of the answer; retry the request",
                    code="decode_failed",
                )
            )
            await out.write_eof()
            self._release_decode_later(backend)
            self.d_params_handled = True
            # A D that died may never have confirmed its read of P's blocks.
            self.fleet.releaser.release_soon_params("prefill", self.p_params)
            return out
        metrics.LEG_LATENCY.labels("decode", "2xx").observe(time.monotonic() - start)
        if sse.params is not None:
            metrics.FINISHED_PARAMS.labels("stream").inc()
            await self._store(sse.params, backend, store_key)
        elif self.hold:
            params = await self._fetch_finished(backend)
            if params is not None:
                metrics.FINISHED_PARAMS.labels("side_channel").inc()
                await self._store(params, backend, store_key)
            else:
                self._no_params()
        else:
            self.d_params_handled = True
        await out.write_eof()
        return out

    def _no_params(self) -> None:
        self.d_params_handled = True
        metrics.FINISHED_PARAMS.labels("missing").inc()

    async def _fetch_finished(self, backend: Backend) -> dict[str, Any] | None:
        address = self.fleet.side_channel_of(backend)
        if address is None:
            return None
        return await self.fleet.releaser.finished_params(address[0], address[1], self.request_id)

    # -- storing D's params ---------------------------------------------------------------------

    async def _store(
        self, params: dict[str, Any], backend: Backend, store_key: ConversationKey | None
    ) -> None:
        """Make D's params the conversation's entry, or release D's blocks if they cannot be."""
        self.d_params_handled = True
        fleet = self.fleet
        host, port = params.get(REMOTE_HOST), params.get(REMOTE_PORT)
        if isinstance(host, str) and isinstance(port, int) and not isinstance(port, bool):
            backend.side_channel = (host, port)  # learnt for later streams
        stock = not params.get(RELEASE_TOKEN) and not params.get(REMOTE_BLOCK_HASHES)
        if store_key is None or not self.hold:
            # Not asked to hold: kvrelay's D freed them already; a stock D holds until its lease.
            if stock and params.get(REMOTE_NUM_TOKENS):
                metrics.RELEASES.labels("decode", "unsupported").inc()
            return
        if stock and not fleet.settings.stock_vllm_reuse:
            metrics.RELEASES.labels("decode", "unsupported").inc()
            return
        expiry = params.get(REMOTE_BLOCKS_EXPIRY_TIME)
        ttl = fleet.settings.conversation_ttl_s
        if isinstance(expiry, int | float):
            ttl = min(ttl, float(expiry) - time.time() - fleet.settings.entry_safety_margin_s)
        if ttl <= 0:
            fleet.releaser.release_soon_params("decode", params)
            return
        to_store = dict(params)
        if stock:
            # Stock engines cannot verify tokens: trust only the previous prompt's part.
            to_store[REMOTE_NUM_TOKENS] = capped_num_tokens(params, self.p_prompt_tokens)
        try:
            assert self.shape.store_fingerprint is not None
            entry = KVEntry.from_kv_transfer_params(
                to_store, url=backend.url, fingerprint=self.shape.store_fingerprint
            )
        except ValueError as exc:
            log.warning("decode engine %s returned unusable params: %s", backend.url, exc)
            fleet.releaser.release_soon_params("decode", params)
            return
        try:
            await fleet.kvmap.put(store_key, entry, ttl)
        except MapUnavailableError as exc:
            fleet.map_unavailable("put", exc)
            fleet.releaser.release_soon_params("decode", params)

    # -- failure paths ---------------------------------------------------------------------------

    def _cleanup_after_failure(self) -> None:
        """Free what this turn made engines hold (runs on errors and client disconnects)."""
        releaser = self.fleet.releaser
        if self.p_params is not None:
            # D took them only if it read them; a release after the read is a no-op.
            releaser.release_soon_params("prefill", self.p_params)
            self.p_params = None
        if self.d_accepted and self.hold and not self.d_params_handled and self.d_backend:
            self._release_decode_later(self.d_backend)
            self.d_params_handled = True

    def _release_decode_later(self, backend: Backend) -> None:
        """D may have finished (and held) before the turn was abandoned: free that hold."""
        if not self.hold:
            return
        address = self.fleet.side_channel_of(backend)
        if address is None:
            return
        releaser = self.fleet.releaser
        request_id = self.request_id

        async def fetch_and_release() -> None:
            for delay in _FINISHED_RETRY_DELAYS:
                if delay:
                    await asyncio.sleep(delay)
                params = await releaser.finished_params(address[0], address[1], request_id)
                if params is not None:
                    await releaser.release(
                        "decode",
                        params.get(REMOTE_HOST),
                        params.get(REMOTE_PORT),
                        params.get("remote_request_id"),
                        params.get(RELEASE_TOKEN),
                    )
                    return

        releaser.spawn(fetch_and_release())


async def _drain(resp: aiohttp.ClientResponse) -> None:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        await resp.read()
