"""One client turn through the fleet: reuse lookup, the P leg, the D leg, storing D's params.

Order of a turn (docs/DESIGN.md §1): take the conversation's entry (atomic, single use) and
check it (history, expiry, verifiability) → P prefills, pulling the old turn's KV when there is a
usable entry → D decodes with P's params and, when the conversation may continue, holds its
blocks → D's final params become the conversation's new entry. Every way out of a turn frees
what the turn made someone hold: the taken entry once P is done with it, P's blocks when no D
took them, D's blocks when they cannot be stored (`Owed`, in `kvrelay.proxy.turn.owed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvrelay.connector.protocol import (
    KV_TRANSFER_PARAMS,
    RELEASE_TOKEN,
    REMOTE_BLOCK_HASHES,
    REMOTE_BLOCKS_EXPIRY_TIME,
    REMOTE_HOST,
    REMOTE_NUM_TOKENS,
    REMOTE_PORT,
    HoldRef,
)
from kvrelay.kvcache_map import (
    ConversationKey,
    InvalidKeyError,
    KVEntry,
    MapUnavailableError,
    UnconfirmedPutError,
)
from kvrelay.proxy.base import ProxyError, jsoncodec, upstream_error_from_body
from kvrelay.proxy.engines import H1Response, UpstreamConnectError, UpstreamError, UpstreamTimeout
from kvrelay.proxy.fleet import Backend, Fleet, Pool, engines_to_try, probe
from kvrelay.proxy.telemetry import tracing
from kvrelay.proxy.turn.conversation import PromptShape, chat_store_key_id, prompt_chars
from kvrelay.proxy.turn.legs import capped_num_tokens, decode_body, prefill_body
from kvrelay.proxy.turn.owed import Debt, Owed
from kvrelay.proxy.turn.report import TurnReport
from kvrelay.proxy.turn.streaming import SSEFilter, error_event

log = logging.getLogger(__name__)

# A D that streamed without params publishes them on its side channel when it finishes;
# a cancelled one may take a moment to finish. Bounded retries, then the lease frees them.
_FINISHED_RETRY_DELAYS = (0.0, 0.2, 0.5, 1.0)


class LegFailure(Exception):
    """An engine could not be used for a leg (connect, timeout, 5xx); another may be tried.

    `reason` is for operators (logs, /admin); `public` is what a client may read: it names no
    address. `timeout`: the engine said nothing in time, which a slow answer does too."""

    def __init__(self, reason: str, public: str | None = None, *, timeout: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.public = public or reason
        self.timeout = timeout


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
    forwarded: tuple[tuple[str, str], ...] = ()  # client headers for the engines (forward_headers)
    entry: KVEntry | None = None
    p_backend: Backend | None = None
    p_params: dict[str, Any] | None = None
    p_prompt_tokens: int | None = None
    # Conditional routing sent the turn straight to the holding D, which prefills this many
    # (estimated) tokens itself; None: the turn goes through P.
    decode_only_tokens: int | None = None
    owed: Owed = field(default_factory=Owed)  # holds nobody else will free (see `owed`)
    report: TurnReport = field(init=False)  # what happened: metrics, spans, the log line
    # 5xx answers not yet judged: the engine's fault if another engine serves the request,
    # disputed (maybe the request's fault) if none does.
    pending_5xx: list[tuple[Pool, Backend, str]] = field(default_factory=list)
    # Every D tried answered 5xx/429 and they blame the input (`Pool.blames_input`):
    # a strike against the key (`kvrelay.proxy.tenants`). Empty otherwise.
    suspect_input: tuple[Backend, ...] = ()
    _work: int | None = None  # `_work_estimate`, once computed

    def __post_init__(self) -> None:
        self.report = TurnReport(
            route=self.route,
            request_id=self.request_id,
            client_request_id=self.client_request_id,
            tenant=self.tenant,
            stream=self.body.get("stream") is True,
            parent_headers=self.request.headers,
            lookup_key=self._lookup_key(),
            store_key=self._store_key(),
        )

    # -- engines -------------------------------------------------------------------------------

    def _engines_to_try(
        self, role: str, pick: Callable[[set[str]], Backend | None]
    ) -> Iterator[Backend]:
        """The engines a leg tries, in order: `pick` chooses among those not tried yet, at most
        1 + `retries` of them; every try after the first counts as a retry."""
        leg = self.report.leg(role)
        retried = functools.partial(self.report.retried, role)
        for backend in engines_to_try(pick, 1 + self.fleet.settings.retries, retried):
            leg.attempt(backend.url)
            yield backend

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
        with self.report.turn_scope():
            try:
                response = await self._run()
            except BaseException:
                self._judge_5xx(served=None)
                self.owed.release_all()
                raise
            # D's answer is complete, so P's blocks need no call from here: D's connector
            # either read them (the read frees them) or released them itself (skipped or
            # failed load).
            self.owed.settle(Debt.PREFILL_BLOCKS)
            return response

    async def _run(self) -> web.StreamResponse:
        store_key = self.report.store_key
        self.report.hold = store_key is not None
        try:
            with self.report.take_scope():
                await self._take_entry()
            self.decode_only_tokens = self.fleet.router.decode_only_tokens(
                self.entry, self._work_estimate()
            )
            if self.decode_only_tokens is None:
                with self.report.leg_scope("prefill"):
                    await self._prefill()
                self.report.prefill_leg.ended = time.monotonic()
        finally:
            # The old turn's blocks are superseded. When P answered, its connector read them
            # (freeing them) or released them; otherwise nobody will, so the proxy does.
            if self.decode_only_tokens is None:
                self.owed.release(Debt.PREVIOUS_HOLD)
        if self.decode_only_tokens is None:
            return await self._decode_leg(store_key)
        # Straight to the holder: D serves the history from the held blocks (its prefix-cache
        # hit), so the old hold is given back only once D is done with this turn.
        self.report.routed("decode_only")
        try:
            return await self._decode_leg(store_key)
        finally:
            self.owed.release(Debt.PREVIOUS_HOLD)

    async def _decode_leg(self, store_key: ConversationKey | None) -> web.StreamResponse:
        with self.report.leg_scope("decode"):
            response = await self._decode(store_key)
        self.report.decode_leg.ended = time.monotonic()
        return response

    async def _take_entry(self) -> None:
        key = self.report.lookup_key
        if key is None:
            if self.route == "chat" or self.conversation_id is not None:
                self.report.reuse_result("miss")
            return
        try:
            entry = await self.fleet.kvmap.take(key)
        except MapUnavailableError as exc:
            self.fleet.map_unavailable("take", exc)
            self.report.reuse_result("map_unavailable")
            self.report.hold = False  # nowhere to store D's params: do not make D hold
            return
        except InvalidKeyError as exc:
            raise ProxyError(
                400, f"conversation id not accepted: {exc}", param="conversation_id"
            ) from None
        if entry is None:
            self.report.reuse_result("miss")
            return
        settings = self.fleet.settings
        if not self.shape.extends(entry.fingerprint):
            # Edited or different history: the blocks describe another prompt.
            self.report.reuse_result("refused")
            self.fleet.releaser.release_soon("decode", entry.hold_ref)
            return
        if entry.expires_at - time.time() < settings.entry_safety_margin_s:
            self.report.reuse_result("expired")
            self.fleet.releaser.release_soon("decode", entry.hold_ref)
            return
        if entry.block_hashes is None and not settings.stock_vllm_reuse:
            self.report.reuse_result("unverifiable")
            self.fleet.releaser.release_soon("decode", entry.hold_ref)
            return
        holder = self.fleet.decode.get(entry.url)
        if holder is None or not holder.healthy:
            # P's pull would only wait for a handshake timeout; a draining holder still serves.
            self.report.reuse_result("holder_unavailable")
            self.fleet.releaser.release_soon("decode", entry.hold_ref)
            return
        self.report.reuse_result("hit", entry.num_tokens)
        self.entry = entry
        releaser = self.fleet.releaser
        self.owed.owe(Debt.PREVIOUS_HOLD, lambda: releaser.release_soon("decode", entry.hold_ref))

    def _work_estimate(self) -> int:
        # Prompt size in characters is a cheap stand-in for prefill work (no tokenizer here).
        # Computed once: a long chat's history makes it a pass over every message.
        if self._work is None:
            self._work = prompt_chars(self.route, self.body) + 1
        return self._work

    async def _prefill(self) -> None:
        fleet = self.fleet
        reuse = self.entry.to_kv_transfer_params() if self.entry is not None else None
        payload = jsoncodec.dumps(prefill_body(self.body, reuse))
        work = self._work_estimate()
        affine: set[str] = set()

        def pick_prefill(exclude: set[str]) -> Backend | None:
            backend, by_affinity = fleet.router.pick_prefill(self.entry, exclude)
            if backend is not None and by_affinity:
                affine.add(backend.url)
            return backend

        for backend in self._engines_to_try("prefill", pick_prefill):
            start = time.monotonic()
            try:
                with fleet.prefill.busy(backend, work):
                    status, raw = await self._post_read(backend, payload)
                self.report.prefill_leg.status = status
            except LegFailure as exc:
                await self._charge(fleet.prefill, backend, exc)
                self.report.leg_latency("prefill", "error", start)
                log.warning("prefill on %s failed: %s", backend.url, exc.reason)
                continue
            self.report.leg_latency("prefill", str(status // 100) + "xx", start)
            if status >= 500 or status == 429:
                self.pending_5xx.append((fleet.prefill, backend, f"HTTP {status}"))
                log.warning("prefill on %s answered %d", backend.url, status)
                continue
            if status >= 400:
                # The prompt itself is bad: D would refuse it too.
                fleet.prefill.record_served(backend, self.tenant)
                raise upstream_error_from_body(status, raw, "prefill")
            fleet.prefill.record_served(backend, self.tenant)
            self._judge_5xx(served=fleet.prefill)
            self.p_backend = backend
            decision = "prefill_affinity" if backend.url in affine else "prefill_chosen"
            self.report.routed(decision)
            self.owed.settle(Debt.PREVIOUS_HOLD)  # P's connector read or released it
            self._read_prefill_answer(raw)
            if self.p_params is not None:
                release = functools.partial(
                    fleet.releaser.release_soon_params, "prefill", self.p_params
                )
                self.owed.owe(Debt.PREFILL_BLOCKS, release)
            return
        self.report.fell_back("decode_only")
        log.warning("no prefill engine answered; decode engine prefills (request %s)",
                    self.request_id)  # fmt: skip

    def _read_prefill_answer(self, raw: bytes) -> None:
        try:
            data = jsoncodec.loads(raw)
        except (ValueError, RecursionError):
            return
        if not isinstance(data, dict):
            return
        params = data.get(KV_TRANSFER_PARAMS)
        self.p_params = params if isinstance(params, dict) else None
        usage = data.get("usage")
        if isinstance(usage, dict):
            prompt_tokens = usage.get("prompt_tokens")
            if isinstance(prompt_tokens, int):
                self.p_prompt_tokens = prompt_tokens
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.report.tokens_pulled(details["cached_tokens"])

    async def _post_read(self, backend: Backend, payload: bytes) -> tuple[int, bytes]:
        resp = await self._open(backend, payload)
        try:
            return resp.status, await resp.read()
        except UpstreamError as exc:
            raise LegFailure(f"reading the answer failed: {type(exc).__name__}") from exc
        finally:
            resp.release()

    async def _open(self, backend: Backend, payload: bytes) -> H1Response:
        path = "/v1/chat/completions" if self.route == "chat" else "/v1/completions"
        settings = self.fleet.settings
        headers: tuple[tuple[str, str], ...] = (
            ("Content-Type", "application/json"),
            ("X-Request-Id", self.request_id),
            *self.forwarded,
        )
        if tracing.enabled():
            carrier: dict[str, str] = {}
            tracing.inject(carrier)  # the leg's span continues on the engine (W3C traceparent)
            headers += tuple(carrier.items())
        try:
            return await self.fleet.upstream.for_url(backend.url).request(
                "POST",
                path,
                payload,
                headers,
                read_timeout=settings.first_byte_timeout,
                total_timeout=settings.total_timeout,
            )
        except UpstreamConnectError as exc:
            raise LegFailure(f"cannot connect ({exc})", "cannot connect") from exc
        except UpstreamTimeout as exc:
            raise LegFailure("no answer within the first-byte timeout", timeout=True) from exc
        except UpstreamError as exc:
            raise LegFailure(f"{type(exc).__name__}: {exc}", type(exc).__name__) from exc

    # -- D ---------------------------------------------------------------------------------------

    async def _decode(self, store_key: ConversationKey | None) -> web.StreamResponse:
        fleet = self.fleet
        stream = self.body.get("stream") is True
        preferred = self.entry.url if self.entry is not None else None
        reasons: list[str] = []
        refused: list[Backend] = []  # the engines that answered 5xx/429
        slow = 0  # attempts that timed out on an engine that then passed its health probe

        def pick_decode(exclude: set[str]) -> Backend | None:
            return fleet.router.pick_decode(preferred, exclude)

        for backend in self._engines_to_try("decode", pick_decode):
            # A stream carries no params on stock engines: only ask D to hold when the proxy
            # can fetch them from D's side channel afterwards (else they would be stranded).
            hold = self.report.hold and (not stream or fleet.side_channel_of(backend) is not None)
            payload = jsoncodec.dumps(
                decode_body(
                    self.body, self.p_params, self.p_backend.url if self.p_backend else None, hold
                )
            )
            start = time.monotonic()
            # D's outstanding work: 1 per request, plus the prompt tokens of a decode-only
            # turn (what the router weighs against D's prefill budget).
            with fleet.decode.busy(backend, 1 + (self.decode_only_tokens or 0)):
                try:
                    resp = await self._open(backend, payload)
                    self.report.decode_leg.status = resp.status
                except LegFailure as exc:
                    if not await self._charge(fleet.decode, backend, exc):
                        slow += 1
                    self.report.leg_latency("decode", "error", start)
                    reasons.append(f"{backend.name}: {exc.public}")
                    log.warning("decode on %s failed: %s", backend.url, exc.reason)
                    continue
                try:
                    if resp.status >= 500 or resp.status == 429:
                        await _drain(resp)
                        self.pending_5xx.append((fleet.decode, backend, f"HTTP {resp.status}"))
                        reasons.append(f"{backend.name}: HTTP {resp.status}")
                        refused.append(backend)
                        continue
                    if resp.status >= 400:
                        raw = await resp.read()
                        fleet.decode.record_served(backend, self.tenant)
                        raise upstream_error_from_body(resp.status, raw, "decode")
                    fleet.decode.record_served(backend, self.tenant)
                    self._judge_5xx(served=fleet.decode)
                    self.report.hold = hold
                    if hold:
                        self.owed.owe(
                            Debt.DECODE_HOLD,
                            functools.partial(self._release_decode_later, backend),
                        )
                    if stream:
                        return await self._relay_stream(resp, backend, store_key, start)
                    return await self._relay_json(resp, backend, store_key, start)
                except BaseException:
                    # Closing (not pooling) the connection is what tells D to stop.
                    resp.close()
                    raise
                finally:
                    resp.release()
        if (
            refused
            and len(refused) == len(reasons)
            and fleet.decode.blames_input(refused, self.tenant)
        ):
            self.suspect_input = tuple(refused)
        detail = "; ".join(reasons) if reasons else "no decode engine is healthy"
        if reasons and slow == len(reasons):
            raise ProxyError(
                504,
                f"no decode engine answered within first_byte_timeout "
                f"({fleet.settings.first_byte_timeout:g} s; {detail}); a long answer needs "
                '"stream": true, or a larger first_byte_timeout',
                code="decode_timeout",
            )
        raise ProxyError(
            503 if not reasons else 502,
            f"no decode engine could serve the request ({detail}); retry later or check "
            "the decode engines' health at /ready",
            code="decode_unavailable",
        )

    async def _relay_json(
        self,
        resp: H1Response,
        backend: Backend,
        store_key: ConversationKey | None,
        start: float,
    ) -> web.StreamResponse:
        try:
            raw = await resp.read()
        except UpstreamError as exc:
            self.report.leg_latency("decode", "error", start)
            raise ProxyError(
                502,
                f"the decode engine failed while answering ({type(exc).__name__}); retry",
                code="decode_failed",
            ) from exc
        self.report.leg_latency("decode", "2xx", start)
        try:
            data = jsoncodec.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ProxyError(
                502, "the decode engine answered with invalid JSON", code="decode_failed"
            ) from exc
        params = None
        if isinstance(data, dict) and KV_TRANSFER_PARAMS in data:
            params = data.pop(KV_TRANSFER_PARAMS)
            raw = jsoncodec.dumps(data)  # the params stay between the proxy and the engines
        if isinstance(params, dict):
            self.report.finished_params("response")
            if self.fleet.kvmap.in_process:
                # Nothing here waits, so nothing can interrupt it: a cancellation (the client
                # leaving) is delivered only at a wait. No task, and no wait for one.
                await self._store(params, backend, store_key)
            else:
                await self._settle(self._store(params, backend, store_key))
        elif self.report.hold:
            self._no_params()
        self.report.first_byte()
        return web.Response(
            body=raw,
            status=resp.status,
            content_type="application/json",
            headers={"X-Request-Id": self.client_request_id or self.request_id},
        )

    async def _relay_stream(
        self,
        resp: H1Response,
        backend: Backend,
        store_key: ConversationKey | None,
        start: float,
    ) -> web.StreamResponse:
        content_type = resp.header(b"content-type")
        out = _EventStream(
            status=resp.status,
            headers={
                "Content-Type": content_type.decode("latin-1")
                if content_type
                else "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": self.client_request_id or self.request_id,
            },
        )
        await out.prepare(self.request)
        # `[DONE]` is held back: clients (the openai SDK) hang up and send the next turn the
        # moment they see it, so it goes out only once this turn's entry is settled.
        sse = SSEFilter(hold_done=True)
        first = True
        try:
            async for chunk in resp.iter_chunks():
                data = sse.feed(chunk)
                if data:
                    if first:
                        self.report.first_byte()
                        first = False
                    await out.write(data)
            tail = sse.flush()
            if tail:
                await out.write(tail)
        except UpstreamError as exc:
            # D broke after the first byte: nothing can be retried, the client learns why.
            self.report.leg_latency("decode", "error", start)
            log.warning("decode stream from %s broke: %s", backend.url, type(exc).__name__)
            await out.write(
                error_event(
                    "the decode engine stopped in the middle of the answer; retry the request",
                    code="decode_failed",
                )
            )
            await out.write_eof()
            self.owed.release(Debt.DECODE_HOLD)
            # A D that died may never have confirmed its read of P's blocks.
            self.owed.release(Debt.PREFILL_BLOCKS)
            return out
        except BaseException:
            # The client left. Once D finished the answer the turn is complete: it is stored
            # as usual (in the background); only a turn cut short gives D's hold back.
            if sse.saw_finish or sse.saw_done:
                self._settle_in_background(self._after_stream(sse.params, backend, store_key))
            raise
        self.report.leg_latency("decode", "2xx", start)
        await self._settle(self._after_stream(sse.params, backend, store_key))
        with contextlib.suppress(ConnectionResetError, aiohttp.ClientConnectionResetError):
            # [DONE] and the end of the chunked body leave in one write.
            await out.write_eof(sse.done_event or b"")
        return out

    async def _after_stream(
        self,
        params: dict[str, Any] | None,
        backend: Backend,
        store_key: ConversationKey | None,
    ) -> None:
        """Store D's params of a finished stream: from the stream or from D's side channel."""
        if params is not None:
            self.report.finished_params("stream")
            await self._store(params, backend, store_key)
        elif self.report.hold:
            fetched = await self._fetch_finished(backend)
            if fetched is not None:
                self.report.finished_params("side_channel")
                await self._store(fetched, backend, store_key)
            else:
                self._no_params()

    def _settle_in_background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[Any]:
        """Run the storing of D's params as a tracked task that a client leaving cannot cancel.

        From here on the task owns D's hold: the failure path must not release it too.
        """
        self.owed.settle(Debt.DECODE_HOLD)
        return self.fleet.releaser.spawn(work)

    async def _settle(self, work: Coroutine[Any, Any, None]) -> None:
        """Wait for the entry to be stored, at most the side-channel timeout; a client that
        leaves meanwhile cancels only this wait, never the storing."""
        task = self._settle_in_background(work)
        if task.done():
            return
        # One future and one timer rather than `asyncio.wait` (sets, a waiter per call): this
        # runs on every turn that stores params.
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def wake(_: object = None) -> None:
            if not waiter.done():
                waiter.set_result(None)

        task.add_done_callback(wake)
        timer = loop.call_later(self.fleet.settings.side_channel_timeout, wake)
        try:
            await waiter
        finally:
            timer.cancel()
            task.remove_done_callback(wake)

    def _no_params(self) -> None:
        self.owed.settle(Debt.DECODE_HOLD)  # nothing to store; a stock D's lease frees it
        self.report.finished_params("missing")

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
        self.owed.settle(Debt.DECODE_HOLD)  # from here on this method frees or stores them
        fleet = self.fleet
        host, port = params.get(REMOTE_HOST), params.get(REMOTE_PORT)
        if isinstance(host, str) and isinstance(port, int) and not isinstance(port, bool):
            backend.side_channel = (host, port)  # learnt for later streams
        stock = not params.get(RELEASE_TOKEN) and not params.get(REMOTE_BLOCK_HASHES)
        if store_key is None or not self.report.hold:
            # Not asked to hold: kvrelay's D freed them already; a stock D holds until its lease.
            if stock and params.get(REMOTE_NUM_TOKENS):
                self.report.hold_unsupported()
            return
        if stock and not fleet.settings.stock_vllm_reuse:
            self.report.hold_unsupported()
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
                to_store,
                url=backend.url,
                fingerprint=self.shape.store_fingerprint,
                **self._routing_hints(),
            )
        except ValueError as exc:
            log.warning("decode engine %s returned unusable params: %s", backend.url, exc)
            fleet.releaser.release_soon_params("decode", params)
            return
        with self.report.put_scope(entry.num_tokens, ttl):
            try:
                await fleet.kvmap.put(store_key, entry, ttl)
            except UnconfirmedPutError as exc:
                fleet.map_unavailable("put", exc)
                # The entry may be stored all the same: D's blocks stay held until the map
                # says it is not (else a next turn could find an entry pointing at nothing).
                fleet.releaser.spawn(
                    fleet.releaser.release_unless_stored("decode", exc.settle, params)
                )
            except MapUnavailableError as exc:
                fleet.map_unavailable("put", exc)
                fleet.releaser.release_soon_params("decode", params)

    def _routing_hints(self) -> dict[str, Any]:
        """What the next turn's routing needs (kvrelay.proxy.fleet.routing): this turn's P and its
        prompt's characters per token; a turn without P keeps the previous turn's."""
        previous = self.entry
        prefill_url = self.p_backend.url if self.p_backend is not None else None
        chars_per_token = None
        if self.p_prompt_tokens:
            # Floored so that an odd prompt (no text content) cannot make the entry invalid.
            chars_per_token = round(max(self._work_estimate() / self.p_prompt_tokens, 1e-3), 4)
        if previous is not None:
            prefill_url = prefill_url or previous.prefill_url
            chars_per_token = chars_per_token or previous.chars_per_token
        return {"prefill_url": prefill_url, "chars_per_token": chars_per_token}

    # -- failure paths ---------------------------------------------------------------------------

    def _judge_5xx(self, *, served: Pool | None) -> None:
        """Settle the 5xx answers seen so far: failures of their engines when another engine
        of the same role (`served`) did this request's job, disputed (see
        `Pool.record_disputed`) when none did. D serving a request that every P failed says
        nothing about P: D does another job (it prefills without P's parameters)."""
        pending, self.pending_5xx = self.pending_5xx, []
        for pool, backend, reason in pending:
            if pool.get(backend.url) is not backend:
                continue  # removed meanwhile
            if pool is served:
                pool.record_failure(backend, reason)
            else:
                pool.record_disputed(backend, self.tenant, reason)

    async def _charge(self, pool: Pool, backend: Backend, exc: LegFailure) -> bool:
        """Count a failed attempt against its engine; False when it is not the engine's.

        A timeout is what a slow answer (a long non-streamed generation) looks like too, so it
        is the engine's only when the engine also fails a health probe, asked now."""
        if not exc.timeout:
            pool.record_failure(backend, exc.reason)
            return True
        limit = aiohttp.ClientTimeout(total=self.fleet.settings.probe_timeout_s)
        ok, why = await probe(self.fleet.session, backend.url, limit)
        if pool.get(backend.url) is not backend:
            return True  # removed meanwhile: nothing to judge
        backend.probe_ok = ok
        if ok:
            return False
        pool.record_failure(backend, f"{exc.reason}; {why}")
        return True

    def _release_decode_later(self, backend: Backend) -> None:
        """D may have finished (and held) before the turn was abandoned: free that hold."""
        if not self.report.hold:
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
                    await releaser.release("decode", HoldRef.from_params(params))
                    return

        releaser.spawn(fetch_and_release())


class _EventStream(web.StreamResponse):
    """The client's stream; its headers go out with the first event, in one write with it,
    not in a write of their own (aiohttp's `web.Response` buffers them the same way)."""

    _send_headers_immediately = False


async def _drain(resp: H1Response) -> None:
    with contextlib.suppress(UpstreamError):
        await resp.read()
