"""The D leg of a turn: D decodes with P's params (or prefills alone: decode-only) and, when
the conversation can continue, holds its blocks for the next turn.

D is chosen by the router (`kvrelay.proxy.fleet.Router.pick_decode`: the D that holds the
conversation unless it is overloaded or busy, else the least loaded). A failure before the
first byte (connect error, timeout, 5xx or 429; judged in `kvrelay.proxy.turn.attempts`) makes
the leg try another D with the same P params (none to the engine they name, which serves
them from its own cache); the first D that answers 2xx is `Served`: the
turn relays its answer (`kvrelay.proxy.turn.answer`) and stores its params
(`kvrelay.proxy.turn.store`) while the leg keeps it open. When no D could serve, the client
gets a shaped 502/503, or 504 `decode_timeout` when every attempt timed out on a healthy
engine.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.connector.protocol import KVTransferParams
from kvrelay.proxy.base import ProxyError, jsoncodec, upstream_error_from_body
from kvrelay.proxy.engines import UpstreamError
from kvrelay.proxy.fleet import Backend, Busy, Pool, PromptPrefixes, Router
from kvrelay.proxy.turn.attempts import Attempts, EngineAnswer, LegFailure, Verdict
from kvrelay.proxy.turn.context import TurnContext
from kvrelay.proxy.turn.legs import decode_body

log = logging.getLogger(__name__)


@dataclass(slots=True)  # not frozen: made on every turn (see `PromptShape`), never changed
class Served:
    """The D that answered 2xx, its open answer, and what the turn asked of it."""

    backend: Backend
    answer: EngineAnswer
    hold: bool  # D was asked to hold its blocks for a next turn
    start: float  # when the attempt began (`time.monotonic()`)
    prefilled: Callable[[], None] | None  # call at a stream's first token: D's prompt is done
    busy: Busy  # D's count of this request, entered by the leg, left by `__exit__`
    # D is the engine the params named (a retry on a held history's holder, or on a P that is
    # also a D): it was sent none and served the prompt from its own cache, so no connector
    # read or released those blocks.
    own_blocks: bool = False

    def __enter__(self) -> Served:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """The turn is done with D's answer: a turn that raised closes the connection (not
        pooling it is what tells D to stop), then the answer is released and D's count of the
        request drops."""
        try:
            if exc_type is not None:
                self.answer.close()
            self.answer.release()
        finally:
            self.busy.__exit__(None, None, None)


class DecodeLeg:
    """One turn's D leg: its request, its retries, the error when no D serves."""

    def __init__(
        self,
        attempts: Attempts,
        pool: Pool,
        router: Router,
        side_channel_of: Callable[[Backend], tuple[str, int] | None],
        first_byte_timeout: float,
    ) -> None:
        self._attempts = attempts
        self._pool = pool
        self._router = router
        self._side_channel_of = side_channel_of
        self._first_byte_timeout = first_byte_timeout
        # Every D tried answered 5xx/429 and they blame the input (`Pool.blames_input`):
        # a strike against the key (`kvrelay.proxy.tenants`). Empty otherwise.
        self.suspect_input: tuple[Backend, ...] = ()

    async def serve(
        self,
        ctx: TurnContext,
        p_params: KVTransferParams | None,
        p_url: str | None,
        first: str | None,
        hold: bool,
        decode_tokens: int | None,
        prompt: PromptPrefixes | None = None,
        brief: bool = False,
    ) -> Served:
        """The first D that answers 2xx, its answer open until the turn leaves `with served:`
        (closed when the block raises: that tells D to stop). `p_params`: the blocks D reads
        from the P at `p_url` (P's prefill, or on a spill a prefix pinned there; None: D
        prefills alone); `first`: the D to try first (the conversation's holder, or a spill's
        D); `hold`: ask D to hold for a next turn (`brief`: over its max, briefly);
        `decode_tokens`: D's own prefill work on a turn that skipped P (counted against D's
        budget); `prompt`: the prompt with its token ids when the KV events' index wants them
        (`Router.sent_to`). A plain coroutine and a
        context-manager `Served` rather than an `asynccontextmanager`: it runs on every turn,
        and the generator machinery costs about eight calls per turn (`bench/instructions.py`).
        """
        attempts, pool, report = self._attempts, self._pool, self._attempts.report
        stream, router = ctx.stream, self._router
        reasons: list[str] = []
        refused: list[Backend] = []  # the engines that answered 5xx/429
        slow = 0  # attempts that timed out on an engine that then passed its health probe

        def pick(exclude: set[str]) -> Backend | None:
            return router.pick_decode(first, exclude)

        for backend in attempts.tries("decode", pick):
            if prompt is not None:
                router.sent_to(backend.url, prompt)
            # A stream carries no params on stock engines: only ask D to hold when the proxy
            # can fetch them from D's side channel afterwards (else they would be stranded).
            d_hold = hold and (not stream or self._side_channel_of(backend) is not None)
            # Never params naming D's own blocks: a read from itself is no read.
            own = p_params is not None and backend.url == p_url
            reads = None if own else p_params
            body = decode_body(ctx.body, reads, p_url, d_hold, ctx.tenant, brief)
            payload = jsoncodec.dumps(body)
            start = time.monotonic()
            # D's outstanding work: 1 per request, plus the prompt tokens of a decode-only
            # turn until its first token (what the router weighs against D's prefill budget).
            busy = pool.busy(backend, 1 + (decode_tokens or 0))
            busy.__enter__()
            served: Served | None = None  # set when D's answer is handed to the turn
            try:
                try:
                    resp = await attempts.send(backend, payload)
                    report.leg_answered("decode", resp.status)
                except LegFailure as exc:
                    if not await attempts.failed(pool, backend, exc, start):
                        slow += 1
                    reasons.append(f"{backend.name}: {exc.public}")
                    continue
                try:
                    verdict = attempts.verdict(pool, backend, resp.status)
                    if verdict is Verdict.REFUSED:
                        await _drain(resp)
                        reasons.append(f"{backend.name}: HTTP {resp.status}")
                        refused.append(backend)
                        continue
                    if verdict is Verdict.REJECTED:
                        raise upstream_error_from_body(resp.status, await resp.read(), "decode")
                    report.holding(d_hold)
                    prefilled = busy.prefilled if decode_tokens else None
                    served = Served(backend, resp, d_hold, start, prefilled, busy, own)
                    return served
                except BaseException:
                    resp.close()  # closing (not pooling) the connection tells D to stop
                    raise
                finally:
                    if served is None:
                        resp.release()
            finally:
                if served is None:
                    busy.__exit__(None, None, None)
        if refused and len(refused) == len(reasons) and pool.blames_input(refused, ctx.tenant):
            self.suspect_input = tuple(refused)
        raise self._no_decode(reasons, slow)

    def _no_decode(self, reasons: list[str], slow: int) -> ProxyError:
        detail = "; ".join(reasons) if reasons else "no decode engine is healthy"
        if reasons and slow == len(reasons):
            return ProxyError(
                504,
                f"no decode engine answered within first_byte_timeout "
                f"({self._first_byte_timeout:g} s; {detail}); a long "
                'answer needs "stream": true, or a larger first_byte_timeout',
                code="decode_timeout",
            )
        return ProxyError(
            503 if not reasons else 502,
            f"no decode engine could serve the request ({detail}); retry later or check "
            "the decode engines' health at /ready",
            code="decode_unavailable",
        )


async def _drain(resp: EngineAnswer) -> None:
    with contextlib.suppress(UpstreamError):
        await resp.read()
