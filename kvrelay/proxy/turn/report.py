"""What a turn did (reuse result, legs, timings), reported as trace spans and one log line.

`kvrelay.proxy.turn.relay.Turn` fills a `LegRecord` per leg and its reuse fields as it goes;
the scopes here wrap the turn, the map take and the legs in spans (`telemetry.tracing`) and,
when the turn ends, write its summary line (`telemetry.logs`). Span attributes and log fields
are ids, engine URLs, hashes and numbers: never a prompt, an answer, a key or a token. With
tracing off and text logs each scope is the shared no-op `tracing.OFF`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from kvrelay.kvcache_map import ConversationKey
from kvrelay.proxy.telemetry import logs, tracing

# Span names, one per step of a turn (docs/DESIGN.md §1).
TURN_SPAN = "kvrelay.turn"
TAKE_SPAN = "kvrelay.map.take"
PUT_SPAN = "kvrelay.map.put"
LEG_SPANS = {"prefill": "kvrelay.prefill", "decode": "kvrelay.decode"}

# HTTP status logged for a turn whose client went away before the answer.
CLIENT_GONE = 499


@dataclass(slots=True)
class LegRecord:
    """What one leg (P or D) of a turn did; times are `time.monotonic()`."""

    role: str
    engine: str | None = None  # URL of the engine tried last
    status: int | None = None  # its HTTP status; None while it has not answered
    attempts: int = 0
    started: float | None = None  # first attempt
    ended: float | None = None  # P: answer read; D: answer relayed
    first_byte: float | None = None  # D: first byte of the answer relayed to the client

    def attempt(self, url: str) -> None:
        """A try of this leg on the engine at `url` begins."""
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

    def summary(self) -> dict[str, Any]:
        """The leg in the turn's log line."""
        return {"engine": self.engine, "status": self.status, "attempts": self.attempts}


class ReportedTurn(Protocol):
    """What the report reads of a turn (`kvrelay.proxy.turn.relay.Turn` is one): the report
    sits below the turn, so it names what it needs instead of importing the turn."""

    request: web.Request
    route: str
    body: dict[str, Any]
    request_id: str
    client_request_id: str
    tenant: str
    started: float
    hold: bool
    reuse: str
    tokens_reused: int
    prefill_leg: LegRecord
    decode_leg: LegRecord

    def conversation_keys(self) -> tuple[ConversationKey | None, ConversationKey | None]: ...


def _seconds(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(end - start, 6)


def _ms(start: float | None, end: float | None) -> float | None:
    seconds = _seconds(start, end)
    return None if seconds is None else round(seconds * 1000, 3)


def conversation_hash(key: ConversationKey | None) -> str | None:
    """A short hash of a conversation's map key: correlates turns without naming the id."""
    return None if key is None else logs.short_hash(key.tenant, key.conversation_id)


# -- scopes --------------------------------------------------------------------------------------


def turn_scope(turn: ReportedTurn) -> contextlib.AbstractContextManager[Any]:
    """The whole turn: its span (continuing the client's `traceparent`) and its log line."""
    traced, logged = tracing.enabled(), logs.turn_log_enabled()
    if not traced and not logged:
        return tracing.OFF
    return _turn_scope(turn, logged)


@contextlib.contextmanager
def _turn_scope(turn: ReportedTurn, logged: bool) -> Iterator[None]:
    error: BaseException | None = None
    try:
        with tracing.span(
            TURN_SPAN, kind="server", parent_headers=turn.request.headers,
            attributes={"kvrelay.route": turn.route, "kvrelay.request_id": turn.request_id},
            finish=lambda: _turn_attributes(turn, error),
        ):  # fmt: skip
            try:
                yield
            except BaseException as exc:
                error = exc
                raise
    finally:
        if logged:
            logs.log_turn("turn", _summary(turn, error))


def take_scope(turn: ReportedTurn) -> contextlib.AbstractContextManager[Any]:
    """Taking the conversation's entry from the map."""
    if not tracing.enabled():
        return tracing.OFF
    return tracing.span(
        TAKE_SPAN,
        finish=lambda: {"kvrelay.reuse": turn.reuse, "kvrelay.tokens_reused": turn.tokens_reused},
    )


def put_scope(tokens: int, ttl_s: float) -> contextlib.AbstractContextManager[Any]:
    """Storing D's params as the conversation's new entry."""
    if not tracing.enabled():
        return tracing.OFF
    return tracing.span(PUT_SPAN, attributes={"kvrelay.tokens": tokens, "kvrelay.map.ttl_s": ttl_s})


def leg_scope(leg: LegRecord) -> contextlib.AbstractContextManager[Any]:
    """One leg, all its attempts (each an `attempt` event naming the engine)."""
    if not tracing.enabled():
        return tracing.OFF
    return tracing.span(LEG_SPANS[leg.role], kind="client", finish=leg.attributes)


# -- what is reported ----------------------------------------------------------------------------


def _status(turn: ReportedTurn, error: BaseException | None) -> int:
    if error is None:
        return turn.decode_leg.status or 200
    status = getattr(error, "status", None)  # ProxyError
    if isinstance(status, int):
        return status
    if isinstance(error, asyncio.CancelledError | ConnectionResetError):
        return CLIENT_GONE
    return 500


def _turn_attributes(turn: ReportedTurn, error: BaseException | None) -> dict[str, Any]:
    p, d = turn.prefill_leg, turn.decode_leg
    lookup, _ = turn.conversation_keys()
    out: dict[str, Any] = {
        "kvrelay.tenant": turn.tenant,
        "kvrelay.reuse": turn.reuse,
        "kvrelay.tokens_reused": turn.tokens_reused,
        "kvrelay.retries": p.retries + d.retries,
        "kvrelay.stream": turn.body.get("stream") is True,
        "http.response.status_code": _status(turn, error),
    }
    conversation = conversation_hash(lookup)
    if conversation is not None:
        out["kvrelay.conversation"] = conversation
    if p.engine is not None:
        out["kvrelay.prefill.url"] = p.engine
    if d.engine is not None:
        out["kvrelay.decode.url"] = d.engine
    return out


def _summary(turn: ReportedTurn, error: BaseException | None) -> dict[str, Any]:
    p, d = turn.prefill_leg, turn.decode_leg
    lookup, store = turn.conversation_keys()
    return {
        "request_id": turn.client_request_id or turn.request_id,
        "upstream_request_id": turn.request_id,
        "route": turn.route,
        "tenant": turn.tenant,
        "conversation": conversation_hash(lookup),
        "stored_as": conversation_hash(store) if turn.hold else None,
        "reuse": turn.reuse,
        "tokens_reused": turn.tokens_reused,
        "stream": turn.body.get("stream") is True,
        "status": _status(turn, error),
        "error": type(error).__name__ if error is not None else None,
        "prefill": p.summary(),
        "decode": d.summary(),
        "retries": p.retries + d.retries,
        "duration_ms": {
            "total": _ms(turn.started, time.monotonic()),
            "prefill": _ms(p.started, p.ended),
            "decode_ttfb": _ms(d.started, d.first_byte),
            "decode": _ms(d.started, d.ended),
        },
    }
