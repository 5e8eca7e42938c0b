"""What a turn did, counted and reported by one `TurnReport`: metrics, trace spans, log line.

`kvrelay.proxy.turn.relay.Turn` tells the report what happens as it happens (the map
lookup's result, the plan, each attempt, a retry, a fallback, the first byte, where D's params
came from; the legs' accounts are the turn's `TurnAccounts`, which the report counts once the
answer is settled); the report counts it in `/metrics` (`telemetry.metrics`), wraps the turn,
the map take, the legs and the map put in spans (`telemetry.tracing`) and, when the turn ends,
writes its summary line (`telemetry.logs`). Span attributes and log fields are ids, engine
URLs, hashes and numbers: never a prompt, an answer, a key or a token. With tracing off and
text logs each scope is the shared no-op `tracing.OFF`.

The report is written, never read: nothing in the turn decides on what it holds (the turn
keeps its own state; tests/test_structure.py keeps it so). Its methods return nothing but
the scopes and the attempt hook they hand out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kvrelay.kvcache_map import ConversationKey
from kvrelay.proxy.fleet import Backend
from kvrelay.proxy.telemetry import logs, metrics, tracing
from kvrelay.proxy.turn.accounting import UNKNOWN_ACCOUNT, PromptAccount, TurnAccounts
from kvrelay.proxy.turn.context import TurnContext

# Span names, one per step of a turn (docs/DESIGN.md §1).
TURN_SPAN = "kvrelay.turn"
TAKE_SPAN = "kvrelay.map.take"
PUT_SPAN = "kvrelay.map.put"
LEG_SPANS = {"prefill": "kvrelay.prefill", "decode": "kvrelay.decode"}

# HTTP status logged for a turn whose client went away before the answer.
CLIENT_GONE = 499


class LegRecord:
    """What one leg (P or D) of a turn did; times are `time.monotonic()`.

    Two are made on every turn: a plain class whose blanks are class attributes, so only
    what happens is written to it."""

    engine: str | None = None  # URL of the engine tried last
    status: int | None = None  # its HTTP status; None while it has not answered
    attempts: int = 0
    started: float | None = None  # first attempt
    ended: float | None = None  # P: answer read; D: answer relayed
    first_byte: float | None = None  # D: first byte of the answer relayed to the client

    def __init__(self, role: str) -> None:
        self.role = role

    def attempt(self, backend: Backend, attempt: int) -> None:
        """Try `attempt` (0: the first; any other a retry, counted) of this leg begins, on
        `backend`."""
        url = backend.url
        if attempt:
            metrics.RETRIES.labels(self.role).inc()
        if self.started is None:
            self.started = time.monotonic()
        self.attempts += 1
        self.engine = url
        self.status = None
        if tracing.enabled():
            tracing.event("attempt", {"kvrelay.engine.url": url, "kvrelay.attempt": self.attempts})

    @property
    def retries(self) -> int:
        return max(0, self.attempts - 1)

    def attributes(self) -> dict[str, Any]:
        """Span attributes of the leg."""
        out: dict[str, Any] = {"kvrelay.attempts": self.attempts, "kvrelay.retries": self.retries}
        if self.engine is not None:
            out["kvrelay.engine.url"] = self.engine
        if self.status is not None:
            out["http.response.status_code"] = self.status
        ttfb = _seconds(self.started, self.first_byte)
        if ttfb is not None:
            out["kvrelay.time_to_first_byte_s"] = ttfb
        return out

    def summary(self, account: PromptAccount | None) -> dict[str, Any]:
        """The leg in the turn's log line, with what its engine reported of the prompt."""
        out: dict[str, Any] = {
            "engine": self.engine,
            "status": self.status,
            "attempts": self.attempts,
        }
        if account is not None:
            out["prompt"] = account.summary()
        return out


class TurnReport:
    """The logbook of one turn: what it did, counted as it happens and reported at its end.

    Made on every turn: a plain class whose blanks are class attributes (see `LegRecord`)."""

    hold: bool = False  # D is asked to hold its blocks for a next turn
    reuse: str = "none"  # the map lookup's result (REUSE); "none": nothing to look up
    tokens_offered: int = 0  # on a lookup hit: the entry's tokens (an offer, not a reuse)
    routing: str | None = None  # the ROUTING decision
    counted: bool = False  # the accounts are counted in /metrics

    def __init__(
        self, ctx: TurnContext, parent_headers: Mapping[str, str], accounts: TurnAccounts
    ) -> None:
        self.ctx = ctx  # the request: route, ids, tenant, stream, the keys looked up and stored
        self.parent_headers = parent_headers  # the client's headers: its trace context
        self.accounts = accounts  # the turn's record of the legs' accounts, counted at the end
        self.started = time.monotonic()
        # Whether spans are recorded, asked once: every scope and attempt of the turn reads it.
        self.traced = tracing.enabled()
        self.prefill_leg = LegRecord("prefill")
        self.decode_leg = LegRecord("decode")

    # -- counted as it happens -----------------------------------------------------------------

    def holding(self, hold: bool) -> None:
        """Whether D is asked to hold its blocks for a next turn (the log line's `stored_as`)."""
        self.hold = hold

    def reuse_result(self, result: str, tokens: int = 0) -> None:
        """What the map lookup gave (`kvrelay_reuse_total`); on a hit, the tokens offered."""
        self.reuse = result
        metrics.REUSE.labels(result).inc()
        if tokens:
            self.tokens_offered = tokens
            metrics.TOKENS_OFFERED.inc(tokens)

    # `role` is "prefill" or "decode"; each reads its record inline (no helper): these run
    # on every leg of every turn.

    def on_attempt(self, role: str) -> Callable[[Backend, int], None]:
        """The hook a leg calls as each attempt begins (`LegRecord.attempt`)."""
        return (self.prefill_leg if role == "prefill" else self.decode_leg).attempt

    def leg_answered(self, role: str, status: int) -> None:
        """The leg's engine answered with this HTTP status."""
        (self.prefill_leg if role == "prefill" else self.decode_leg).status = status

    def leg_ended(self, role: str) -> None:
        """P's answer is read; D's answer is relayed."""
        (self.prefill_leg if role == "prefill" else self.decode_leg).ended = time.monotonic()

    def leg_latency(self, role: str, outcome: str, start: float) -> None:
        """One attempt of a leg ended: `outcome` is "error" or the status class ("2xx")."""
        metrics.LEG_LATENCY.labels(role, outcome).observe(time.monotonic() - start)

    def routed(self, decision: str) -> None:
        """decode_only | spilled | prefill_affinity | prefill_chosen
        (`kvrelay_routing_decisions_total`)."""
        self.routing = decision
        metrics.ROUTING.labels(decision).inc()

    def spilled(self, *, first: bool) -> None:
        """The router sent the turn to a D off a backed-up P (`kvrelay_prefill_spilled_total`)."""
        metrics.PREFILL_SPILLED.labels("first" if first else "later").inc()

    def decode_only_checked(self, result: str) -> None:
        """A decode-only turn the estimate allowed was checked on D's count of the prompt:
        `kvrelay_decode_only_checks_total{result=fits|too_long|uncounted}`."""
        metrics.DECODE_ONLY_CHECKS.labels(result).inc()

    def fell_back(self, kind: str) -> None:
        metrics.FALLBACKS.labels(kind).inc()

    # -- realized reuse (docs/ACCOUNTING.md §3) ------------------------------------------------

    def count_accounts(self) -> None:
        """Count the legs' accounts and the turn's (once): the account of the leg that
        prefilled the prompt, `unknown` where its engine gave no figure."""
        if self.counted:
            return
        self.counted = True
        accounts = self.accounts
        turn = accounts.settle()
        if accounts.prefill is not None:
            _count("prefill", accounts.prefill)
        _count("decode", accounts.decode or UNKNOWN_ACCOUNT)
        if turn.reused is not None:
            leg = accounts.prefilled_by
            metrics.TOKENS_REUSED.labels(leg).inc(turn.reused)
            if turn.prompt_tokens is not None:
                metrics.TURN_PROMPT_TOKENS.labels(leg).inc(turn.prompt_tokens)

    def first_byte(self) -> None:
        """The first byte of D's answer goes to the client."""
        now = time.monotonic()
        self.decode_leg.first_byte = now
        metrics.TTFT.labels(self.ctx.route).observe(now - self.started)

    def finished_params(self, source: str) -> None:
        """Where D's final params came from: response | stream | side_channel | missing."""
        metrics.FINISHED_PARAMS.labels(source).inc()

    def hold_declined(self) -> None:
        """D did not keep the hold it was asked for: the turn alone is over its share."""
        metrics.HOLD_DECISIONS.labels("over_budget").inc()

    def hold_unsupported(self) -> None:
        """D holds blocks the proxy cannot release (a stock engine): its lease frees them."""
        metrics.RELEASES.labels("decode", "unsupported").inc()

    # -- scopes --------------------------------------------------------------------------------

    def turn_scope(self) -> contextlib.AbstractContextManager[Any]:
        """The whole turn: its span (continuing the client's `traceparent`) and its log line."""
        traced, logged = self.traced, logs.turn_log_enabled()
        if not traced and not logged:
            return tracing.OFF
        return self._turn_scope(logged)

    @contextlib.contextmanager
    def _turn_scope(self, logged: bool) -> Iterator[None]:
        error: BaseException | None = None
        try:
            with tracing.span(
                TURN_SPAN,
                kind="server",
                parent_headers=self.parent_headers,
                attributes={
                    "kvrelay.route": self.ctx.route,
                    "kvrelay.request_id": self.ctx.request_id,
                },
                finish=lambda: self._turn_attributes(error),
            ):
                try:
                    yield
                except BaseException as exc:
                    error = exc
                    raise
        finally:
            if logged:
                logs.log_turn("turn", self._summary(error))

    def take_scope(self) -> contextlib.AbstractContextManager[Any]:
        """Taking the conversation's entry from the map."""
        if not self.traced:
            return tracing.OFF
        return tracing.span(TAKE_SPAN, finish=self._take_attributes)

    def _take_attributes(self) -> dict[str, Any]:
        return {"kvrelay.reuse": self.reuse, "kvrelay.tokens_offered": self.tokens_offered}

    def put_scope(self, tokens: int, ttl_s: float) -> contextlib.AbstractContextManager[Any]:
        """Storing D's params as the conversation's new entry."""
        if not self.traced:
            return tracing.OFF
        attributes = {"kvrelay.tokens": tokens, "kvrelay.map.ttl_s": ttl_s}
        return tracing.span(PUT_SPAN, attributes=attributes)

    def leg_scope(self, role: str) -> contextlib.AbstractContextManager[Any]:
        """One leg, all its attempts (each an `attempt` event naming the engine)."""
        if not self.traced:
            return tracing.OFF
        return tracing.span(
            LEG_SPANS[role],
            kind="client",
            finish=(self.prefill_leg if role == "prefill" else self.decode_leg).attributes,
        )

    # -- what is reported ----------------------------------------------------------------------

    def _status(self, error: BaseException | None) -> int:
        if error is None:
            return self.decode_leg.status or 200
        status = getattr(error, "status", None)  # ProxyError
        if isinstance(status, int):
            return status
        if isinstance(error, asyncio.CancelledError | ConnectionResetError):
            return CLIENT_GONE
        return 500

    def _turn_attributes(self, error: BaseException | None) -> dict[str, Any]:
        p, d, ctx = self.prefill_leg, self.decode_leg, self.ctx
        out: dict[str, Any] = {
            "kvrelay.tenant": ctx.tenant,
            "kvrelay.reuse": self.reuse,
            "kvrelay.tokens_offered": self.tokens_offered,
            "kvrelay.retries": p.retries + d.retries,
            "kvrelay.stream": ctx.stream,
            "http.response.status_code": self._status(error),
        }
        conversation = conversation_hash(ctx.lookup_key)
        if conversation is not None:
            out["kvrelay.conversation"] = conversation
        account = self.accounts.settled
        if account is not None and account.reused is not None:
            out["kvrelay.tokens_reused"] = account.reused
        if p.engine is not None:
            out["kvrelay.prefill.url"] = p.engine
        if d.engine is not None:
            out["kvrelay.decode.url"] = d.engine
        return out

    def _summary(self, error: BaseException | None) -> dict[str, Any]:
        p, d, accounts, ctx = self.prefill_leg, self.decode_leg, self.accounts, self.ctx
        return {
            "request_id": ctx.client_request_id or ctx.request_id,
            "upstream_request_id": ctx.request_id,
            "route": ctx.route,
            "tenant": ctx.tenant,
            "conversation": conversation_hash(ctx.lookup_key),
            "stored_as": conversation_hash(ctx.store_key) if self.hold else None,
            "lookup": self.reuse,
            "routing": self.routing,
            "tokens_offered": self.tokens_offered,
            "tokens_reused": accounts.settled.reused if accounts.settled is not None else None,
            "prefilled_by": accounts.prefilled_by,
            "stream": ctx.stream,
            "status": self._status(error),
            "error": type(error).__name__ if error is not None else None,
            "prefill": p.summary(accounts.prefill),
            "decode": d.summary(accounts.decode),
            "retries": p.retries + d.retries,
            "duration_ms": {
                "total": _ms(self.started, time.monotonic()),
                "prefill": _ms(p.started, p.ended),
                "decode_ttfb": _ms(d.started, d.first_byte),
                "decode": _ms(d.started, d.ended),
            },
        }


class _LegSeries:
    """One leg's account series, looked up once per process: `_count` runs for both legs of
    every turn, and a label lookup per series was most of its cost."""

    __slots__ = ("cached", "computed", "engine", "loaded", "local_hit", "unknown", "unknown_tokens")

    def __init__(self, leg: str) -> None:
        tokens = metrics.PROMPT_TOKENS
        self.engine = metrics.LEG_ACCOUNTS.labels(leg, "engine")
        self.unknown = metrics.LEG_ACCOUNTS.labels(leg, "unknown")
        self.unknown_tokens = tokens.labels(leg, "unknown")
        self.local_hit = tokens.labels(leg, "local_hit")
        self.loaded = tokens.labels(leg, "loaded")
        self.cached = tokens.labels(leg, "cached")
        self.computed = tokens.labels(leg, "computed")


_LEG_SERIES: dict[str, _LegSeries] = {}


def _count(leg: str, account: PromptAccount) -> None:
    """One leg's account in `/metrics`: its prompt tokens by source, its refused blocks."""
    series = _LEG_SERIES.get(leg)
    if series is None:
        series = _LEG_SERIES[leg] = _LegSeries(leg)
    reused = account.reused
    if reused is None:
        series.unknown.inc()
        if account.prompt_tokens:
            series.unknown_tokens.inc(account.prompt_tokens)
        return
    series.engine.inc()
    if account.local_hit is not None and account.loaded is not None:
        series.local_hit.inc(account.local_hit)
        series.loaded.inc(account.loaded)
    else:
        series.cached.inc(reused)
    computed = account.computed
    if computed is not None:
        series.computed.inc(computed)
    for reason, blocks in account.refused:
        metrics.REFUSED_BLOCKS.labels(leg, reason).inc(blocks)


def _seconds(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(end - start, 6)


def _ms(start: float | None, end: float | None) -> float | None:
    seconds = _seconds(start, end)
    return None if seconds is None else round(seconds * 1000, 3)


def conversation_hash(key: ConversationKey | None) -> str | None:
    """A short hash of a conversation's map key: correlates turns without naming the id."""
    return None if key is None else logs.short_hash(key.tenant, key.conversation_id)
