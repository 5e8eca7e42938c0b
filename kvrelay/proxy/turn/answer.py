"""Step 5 of a turn: D's answer goes to the client, all but its last bytes (`Answer.relay`),
which leave once the turn is settled (`Answer.finish`).

A JSON answer loses `kv_transfer_params` and keeps every other field; a stream passes through
byte for byte (`kvrelay.proxy.turn.streaming`) with D's `data: [DONE]` held back. Between the
two the turn stores D's params (`kvrelay.proxy.turn.settle`): the client, which sends its next
turn the moment it has the answer, then finds the conversation's entry. A stream that D breaks
after its first byte ends with an error event and frees D's hold and P's blocks.

What the engines reported the turn reused (`kvrelay.proxy.turn.accounting`) goes back with the
answer: as headers on a JSON answer; in a stream, whose headers leave before anything is
known, in its final usage event (`prompt_tokens_details.cached_tokens` and `usage.kvrelay`),
which is kept back with `[DONE]` until the turn is settled.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from kvrelay.connector.protocol import KV_TRANSFER_PARAMS
from kvrelay.proxy.base import ProxyError, jsoncodec
from kvrelay.proxy.engines import UpstreamError
from kvrelay.proxy.turn.accounting import PromptAccount, TurnAccounts
from kvrelay.proxy.turn.client import Client, ClientStream
from kvrelay.proxy.turn.context import TurnContext
from kvrelay.proxy.turn.decode_leg import Served
from kvrelay.proxy.turn.owed import Debt, Owed
from kvrelay.proxy.turn.report import TurnReport
from kvrelay.proxy.turn.streaming import SSEFilter, data_event, error_event

log = logging.getLogger(__name__)


class Relayed:
    """What D's answer leaves for the rest of the turn, filled in as it is relayed.

    A plain class whose defaults are class attributes: one is made on every turn, and only
    what the relay sets is written to it (a dataclass's `__init__` writes all nine fields)."""

    params: Any = None  # D's final params as its answer carried them (maybe not a dict)
    complete: bool = False  # D's answer reached its end: the turn can be stored
    broken: bool = False  # D broke after the first byte: the client was told, nothing to store
    status: int = 200
    body: bytes = b""  # JSON: the answer without its params
    out: ClientStream | None = None  # stream: the client's, open
    usage_event: dict[str, Any] | None = None  # stream: D's final usage event, held back
    done_event: bytes | None = None  # stream: D's `[DONE]`, held back

    def __init__(self, streamed: bool) -> None:
        self.streamed = streamed  # an event stream (else one JSON body)


class Answer:
    """Relaying one turn's D answer to its client."""

    def __init__(
        self,
        ctx: TurnContext,
        report: TurnReport,
        client: Client,
        owed: Owed,
        accounts: TurnAccounts,
    ) -> None:
        self._ctx = ctx
        self._report = report
        self._client = client
        self._owed = owed
        self._accounts = accounts

    async def relay(self, served: Served, relayed: Relayed) -> None:
        """Relay what D (`served`) answered, keeping back its last bytes; `relayed` says what
        came of it, as far as it got (a client that leaves raises out of here)."""
        if relayed.streamed:
            await self._relay_stream(served, relayed)
        else:
            await self._read_json(served, relayed)

    @property
    def _headers(self) -> dict[str, str]:
        ctx = self._ctx
        return {"X-Request-Id": ctx.client_request_id or ctx.request_id}

    async def _read_json(self, served: Served, relayed: Relayed) -> None:
        report = self._report
        try:
            raw = await served.answer.read()
        except UpstreamError as exc:
            report.leg_latency("decode", "error", served.start)
            raise ProxyError(
                502,
                f"the decode engine failed while answering ({type(exc).__name__}); retry",
                code="decode_failed",
            ) from exc
        report.leg_latency("decode", "2xx", served.start)
        try:
            data = jsoncodec.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ProxyError(
                502, "the decode engine answered with invalid JSON", code="decode_failed"
            ) from exc
        if isinstance(data, dict):
            self._accounts.decode_usage(data.get("usage"))
            if KV_TRANSFER_PARAMS in data:
                relayed.params = data.pop(KV_TRANSFER_PARAMS)
                raw = jsoncodec.dumps(data)  # the params stay between the proxy and the engines
        relayed.status, relayed.body, relayed.complete = served.answer.status, raw, True

    async def _relay_stream(self, served: Served, relayed: Relayed) -> None:
        report, resp = self._report, served.answer
        content_type = resp.header(b"content-type")
        out = relayed.out = await self._client.open_stream(
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
                        if served.prefilled is not None:
                            served.prefilled()
                    await out.write(data)
            tail = sse.flush()
            if tail:
                await out.write(tail)
        except UpstreamError as exc:
            # D broke after the first byte: nothing can be retried, the client learns why.
            report.leg_latency("decode", "error", served.start)
            log.warning("decode stream from %s broke: %s", served.backend.url, type(exc).__name__)
            await out.write(
                error_event(
                    "the decode engine stopped in the middle of the answer; retry the request",
                    code="decode_failed",
                )
            )
            await out.write_eof()
            relayed.broken = True
            self._owed.release(Debt.DECODE_HOLD)
            # A D that died may never have confirmed its read of P's blocks.
            self._owed.release(Debt.PREFILL_BLOCKS)
            return
        except BaseException:
            # The client left. Once D finished the answer the turn is complete all the same.
            relayed.params = sse.params
            relayed.complete = sse.saw_finish or sse.saw_done
            raise
        report.leg_latency("decode", "2xx", served.start)
        relayed.params, relayed.complete = sse.params, True
        relayed.usage_event, relayed.done_event = sse.usage_event, sse.done_event

    async def finish(self, relayed: Relayed, routing: str | None) -> None:
        """The answer's last bytes, with the turn's account: the JSON body and its account
        headers, or the stream's usage event, `[DONE]` and its end. `routing`: the turn's
        routing decision, for the stream's `usage.kvrelay`."""
        accounts, report = self._accounts, self._report
        if relayed.usage_event is not None:
            accounts.decode_usage(relayed.usage_event["usage"])
        account = accounts.settle()
        report.count_accounts()
        if relayed.out is None:
            report.first_byte()
            headers = {**self._headers, **account.headers(accounts.prefilled_by)}
            self._client.send_json(relayed.status, relayed.body, headers)
            return
        event = relayed.usage_event
        usage = b"" if event is None else self._usage_event(event, account, routing)
        with contextlib.suppress(ConnectionResetError):
            # The usage event, [DONE] and the end of the chunked body leave in one write.
            await relayed.out.write_eof(usage + (relayed.done_event or b""))

    def _usage_event(
        self, event: dict[str, Any], account: PromptAccount, routing: str | None
    ) -> bytes:
        """D's final usage event with the turn's account: `cached_tokens` is the tokens the
        prefilling engine reported it did not compute, and `usage.kvrelay` the whole account."""
        usage = dict(event["usage"])
        if account.reused is not None:
            details = usage.get("prompt_tokens_details")
            details = dict(details) if isinstance(details, dict) else {}
            details["cached_tokens"] = account.reused
            usage["prompt_tokens_details"] = details
        usage["kvrelay"] = {
            **account.summary(),
            "prefilled_by": self._accounts.prefilled_by,
            "routing": routing,
        }
        return data_event({**event, "usage": usage})
