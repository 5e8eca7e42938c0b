"""Steps 5 and 6 of a turn: D's answer goes to the client, and D's final params get stored.

A JSON answer loses `kv_transfer_params` and keeps every other field; a stream passes through
byte for byte (`kvrelay.proxy.turn.streaming`) with D's `data: [DONE]` held back. Either way
the turn is over for the client only once D's params are stored (`kvrelay.proxy.turn.store`)
or the decision not to store them is made: the answer, or `[DONE]`, goes out after that,
waited for at most `side_channel_timeout` (past it the store finishes in the background).
Params a stream did not carry come from D's side channel. A stream cut short (D broke, or the
client left before the answer was complete) frees D's hold and P's blocks.

What the engines reported the turn reused (`kvrelay.proxy.turn.accounting`) goes back with the
answer: as headers on a JSON answer; in a stream, whose headers leave before anything is
known, in its final usage event (`prompt_tokens_details.cached_tokens` and `usage.kvrelay`),
which is kept back with `[DONE]` until the turn is settled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from kvrelay.connector.protocol import KV_TRANSFER_PARAMS, HoldRef
from kvrelay.proxy.base import ProxyError, jsoncodec
from kvrelay.proxy.engines import UpstreamError
from kvrelay.proxy.fleet import Backend, Fleet
from kvrelay.proxy.turn.accounting import PromptAccount
from kvrelay.proxy.turn.attempts import EngineAnswer
from kvrelay.proxy.turn.client import Client
from kvrelay.proxy.turn.owed import Debt, Owed
from kvrelay.proxy.turn.report import TurnReport
from kvrelay.proxy.turn.store import Store
from kvrelay.proxy.turn.streaming import SSEFilter, data_event, error_event

log = logging.getLogger(__name__)

# A D that streamed without params publishes them on its side channel when it finishes;
# a cancelled one may take a moment to finish. Bounded retries, then the lease frees them.
_FINISHED_RETRY_DELAYS = (0.0, 0.2, 0.5, 1.0)


class Answer:
    """Relaying one turn's D answer to its client, and settling what D holds."""

    def __init__(
        self, fleet: Fleet, report: TurnReport, client: Client, owed: Owed, store: Store
    ) -> None:
        self._fleet = fleet
        self._report = report
        self._client = client
        self._owed = owed
        self._store = store

    async def relay(
        self,
        resp: EngineAnswer,
        backend: Backend,
        hold: bool,
        start: float,
        prefilled: Callable[[], None] | None = None,
    ) -> None:
        """D (`backend`) answered 2xx: relay it; `hold`: D was asked to hold its blocks;
        `prefilled`: called at a stream's first token (D is done with the prompt)."""
        if hold:
            release = functools.partial(self._release_hold_later, backend)
            self._owed.owe(Debt.DECODE_HOLD, release)
        if self._report.stream:
            await self._relay_stream(resp, backend, hold, start, prefilled)
        else:
            await self._relay_json(resp, backend, hold, start)

    @property
    def _headers(self) -> dict[str, str]:
        report = self._report
        return {"X-Request-Id": report.client_request_id or report.request_id}

    async def _relay_json(
        self, resp: EngineAnswer, backend: Backend, hold: bool, start: float
    ) -> None:
        report = self._report
        try:
            raw = await resp.read()
        except UpstreamError as exc:
            report.leg_latency("decode", "error", start)
            raise ProxyError(
                502,
                f"the decode engine failed while answering ({type(exc).__name__}); retry",
                code="decode_failed",
            ) from exc
        report.leg_latency("decode", "2xx", start)
        try:
            data = jsoncodec.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ProxyError(
                502, "the decode engine answered with invalid JSON", code="decode_failed"
            ) from exc
        params = None
        if isinstance(data, dict):
            report.decode_usage(data.get("usage"))
        if isinstance(data, dict) and KV_TRANSFER_PARAMS in data:
            params = data.pop(KV_TRANSFER_PARAMS)
            raw = jsoncodec.dumps(data)  # the params stay between the proxy and the engines
        if isinstance(params, dict):
            report.finished_params("response")
            if self._fleet.kvmap.in_process:
                # Nothing here waits, so nothing can interrupt it: a cancellation (the client
                # leaving) is delivered only at a wait. No task, and no wait for one.
                await self._put(params, backend, hold)
            else:
                await self._settle(self._put(params, backend, hold))
        elif hold:
            self._no_params()
        account = report.settle_accounts()
        report.first_byte()
        headers = {**self._headers, **account.headers(report.prefilled_by)}
        self._client.send_json(resp.status, raw, headers)

    async def _relay_stream(
        self,
        resp: EngineAnswer,
        backend: Backend,
        hold: bool,
        start: float,
        prefilled: Callable[[], None] | None,
    ) -> None:
        report = self._report
        content_type = resp.header(b"content-type")
        out = await self._client.open_stream(
            resp.status,
            {
                "Content-Type": content_type.decode("latin-1")
                if content_type
                else "text/event-stream",
                "Cache-Control": "no-cache",
                **self._headers,
            },
        )
        # `[DONE]` is held back: clients (the openai SDK) hang up and send the next turn the
        # moment they see it, so it goes out only once this turn's entry is settled.
        # So is the final usage event: it gets the turn's account once the turn is settled.
        sse = SSEFilter(hold_done=True, hold_usage=True)
        first = True
        try:
            async for chunk in resp.iter_chunks():
                data = sse.feed(chunk)
                if data:
                    if first:
                        report.first_byte()
                        first = False
                        if prefilled is not None:
                            prefilled()
                    await out.write(data)
            tail = sse.flush()
            if tail:
                await out.write(tail)
        except UpstreamError as exc:
            # D broke after the first byte: nothing can be retried, the client learns why.
            report.leg_latency("decode", "error", start)
            log.warning("decode stream from %s broke: %s", backend.url, type(exc).__name__)
            await out.write(
                error_event(
                    "the decode engine stopped in the middle of the answer; retry the request",
                    code="decode_failed",
                )
            )
            await out.write_eof()
            self._owed.release(Debt.DECODE_HOLD)
            # A D that died may never have confirmed its read of P's blocks.
            self._owed.release(Debt.PREFILL_BLOCKS)
            return
        except BaseException:
            # The client left. Once D finished the answer the turn is complete: it is stored
            # as usual (in the background); only a turn cut short gives D's hold back.
            if sse.saw_finish or sse.saw_done:
                self._in_background(self._after_stream(sse.params, backend, hold))
            raise
        report.leg_latency("decode", "2xx", start)
        await self._settle(self._after_stream(sse.params, backend, hold))
        if sse.usage_event is not None:
            report.decode_usage(sse.usage_event["usage"])
        account = report.settle_accounts()
        usage = b"" if sse.usage_event is None else self._usage_event(sse.usage_event, account)
        with contextlib.suppress(ConnectionResetError):
            # The usage event, [DONE] and the end of the chunked body leave in one write.
            await out.write_eof(usage + (sse.done_event or b""))

    def _usage_event(self, event: dict[str, Any], account: PromptAccount) -> bytes:
        """D's final usage event with the turn's account: `cached_tokens` is the tokens the
        prefilling engine reported it did not compute, and `usage.kvrelay` the whole account."""
        usage = dict(event["usage"])
        if account.reused is not None:
            details = usage.get("prompt_tokens_details")
            details = dict(details) if isinstance(details, dict) else {}
            details["cached_tokens"] = account.reused
            usage["prompt_tokens_details"] = details
        report = self._report
        usage["kvrelay"] = {
            **account.summary(),
            "prefilled_by": report.prefilled_by,
            "routing": report.routing,
        }
        return data_event({**event, "usage": usage})

    async def _after_stream(
        self, params: dict[str, Any] | None, backend: Backend, hold: bool
    ) -> None:
        """Store D's params of a finished stream: from the stream or from D's side channel."""
        if params is not None:
            self._report.finished_params("stream")
            await self._put(params, backend, hold)
        elif hold:
            fetched = await self._fetch_finished(backend)
            if fetched is not None:
                self._report.finished_params("side_channel")
                await self._put(fetched, backend, hold)
            else:
                self._no_params()

    async def _put(self, params: dict[str, Any], backend: Backend, hold: bool) -> None:
        self._owed.settle(Debt.DECODE_HOLD)  # from here on the store frees or stores them
        await self._store.put(params, backend, hold)

    def _in_background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[Any]:
        """Run the storing of D's params as a tracked task that a client leaving cannot cancel.

        From here on the task owns D's hold: the failure path must not release it too.
        """
        self._owed.settle(Debt.DECODE_HOLD)
        return self._fleet.releaser.spawn(work)

    async def _settle(self, work: Coroutine[Any, Any, None]) -> None:
        """Wait for the entry to be stored, at most the side-channel timeout; a client that
        leaves meanwhile cancels only this wait, never the storing."""
        task = self._in_background(work)
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
        timer = loop.call_later(self._fleet.settings.side_channel_timeout, wake)
        try:
            await waiter
        finally:
            timer.cancel()
            task.remove_done_callback(wake)

    def _no_params(self) -> None:
        self._owed.settle(Debt.DECODE_HOLD)  # nothing to store; a stock D's lease frees it
        self._report.finished_params("missing")

    async def _fetch_finished(self, backend: Backend) -> dict[str, Any] | None:
        address = self._fleet.side_channel_of(backend)
        if address is None:
            return None
        releaser = self._fleet.releaser
        return await releaser.finished_params(address[0], address[1], self._report.request_id)

    def _release_hold_later(self, backend: Backend) -> None:
        """D may have finished (and held) before the turn was abandoned: free that hold."""
        address = self._fleet.side_channel_of(backend)
        if address is None:
            return
        releaser = self._fleet.releaser
        request_id = self._report.request_id

        async def fetch_and_release() -> None:
            for delay in _FINISHED_RETRY_DELAYS:
                if delay:
                    await asyncio.sleep(delay)
                params = await releaser.finished_params(address[0], address[1], request_id)
                if params is not None:
                    await releaser.release("decode", HoldRef.from_params(params))
                    return

        releaser.spawn(fetch_and_release())
