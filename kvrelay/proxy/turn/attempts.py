"""How a turn's legs try engines and judge their answers: written once, used by P and D alike.

A leg asks `Attempts.tries` for the engines to try (the router picks each one, at most
1 + `retries`), sends its request with `Attempts.send`, and hands what came back to
`Attempts.failed` (nothing usable: connect error, timeout, a broken answer) or
`Attempts.verdict` (an HTTP status). The verdicts, for both legs:

- 2xx: served; the 5xx answers seen so far are judged (`judge_5xx`).
- 5xx or 429: refused; another engine is tried. The answer is not yet held against the engine:
  if another engine of the same role serves the request it was the engine's fault, if none does
  it is disputed (maybe the input's fault, `Pool.record_disputed`).
- other 4xx: the input is bad (any engine would refuse it); the client gets the engine's error.

A timeout is what a slow answer looks like too, so it is charged to the engine only when the
engine also fails a health probe asked at once (`Attempts.failed` returns False otherwise).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Protocol

from kvrelay.proxy.engines import Upstream, UpstreamConnectError, UpstreamError, UpstreamTimeout
from kvrelay.proxy.fleet import Backend, Pool, engines_to_try, probe_health
from kvrelay.proxy.telemetry import tracing
from kvrelay.proxy.turn.context import TurnContext
from kvrelay.proxy.turn.report import TurnReport

log = logging.getLogger(__name__)


class LegFailure(Exception):
    """An engine could not be used for a leg (connect, timeout, 5xx); another may be tried.

    `reason` is for operators (logs, /admin); `public` is what a client may read: it names no
    address. `timeout`: the engine said nothing in time, which a slow answer does too."""

    def __init__(self, reason: str, public: str | None = None, *, timeout: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.public = public or reason
        self.timeout = timeout


class EngineAnswer(Protocol):
    """An engine's answer as a leg reads it (`kvrelay.proxy.engines.H1Response` is one)."""

    @property
    def status(self) -> int: ...

    def header(self, name: bytes) -> bytes | None: ...

    async def read(self) -> bytes: ...

    def iter_chunks(self) -> AsyncIterator[bytes]: ...

    def close(self) -> None:
        """Drop the connection (what tells the engine to stop)."""

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if it can."""


class Engines(Protocol):
    """Where the legs send their requests: `UpstreamEngines` in the proxy, a fake in unit tests.
    Raises `UpstreamConnectError`, `UpstreamTimeout` (no first byte in time) or `UpstreamError`."""

    def post(
        self, url: str, path: str, payload: bytes, headers: tuple[tuple[str, str], ...]
    ) -> Awaitable[EngineAnswer]: ...

    async def probe(self, url: str) -> tuple[bool, str]:
        """One health probe of the engine at `url`: (passed, why not)."""
        ...


class UpstreamEngines:
    """The legs' requests on the worker's engine client, with the turn's timeouts."""

    def __init__(
        self,
        upstream: Upstream,
        first_byte_timeout: float,
        total_timeout: float,
        probe_timeout: float,
    ):
        self._upstream = upstream
        self._first_byte_timeout = first_byte_timeout
        self._total_timeout = total_timeout
        self._probe_timeout = probe_timeout

    def post(
        self, url: str, path: str, payload: bytes, headers: tuple[tuple[str, str], ...]
    ) -> Awaitable[EngineAnswer]:
        # The engine client's own coroutine, not one wrapping it: a frame less on every leg.
        return self._upstream.for_url(url).request(
            "POST",
            path,
            payload,
            headers,
            read_timeout=self._first_byte_timeout,
            total_timeout=self._total_timeout,
        )

    async def probe(self, url: str) -> tuple[bool, str]:
        return await probe_health(self._upstream, url, self._probe_timeout)


class Verdict(enum.Enum):
    """What an engine's status says about the attempt (see the module's docstring)."""

    SERVED = "served"
    REFUSED = "refused"  # 5xx or 429: try another engine
    REJECTED = "rejected"  # 4xx: the input is bad


class Attempts:
    """The engine attempts of one turn, P's and D's: sending, judging, charging engines."""

    def __init__(
        self, ctx: TurnContext, engines: Engines, report: TurnReport, retries: int
    ) -> None:
        self.report = report  # written (attempts, latencies), never read
        self._engines = engines
        self._tenant = ctx.tenant
        self._tries = 1 + retries
        self._traced = tracing.enabled()
        self._path = "/v1/chat/completions" if ctx.route == "chat" else "/v1/completions"
        self._headers: tuple[tuple[str, str], ...] = (
            ("Content-Type", "application/json"),
            ("X-Request-Id", ctx.request_id),
            *ctx.forwarded,
        )
        # 5xx answers not yet judged: the engine's fault if another engine serves the request,
        # disputed (maybe the request's fault) if none does.
        self._pending_5xx: list[tuple[Pool, Backend, str]] = []

    def tries(self, role: str, pick: Callable[[set[str]], Backend | None]) -> Iterator[Backend]:
        """The engines a leg tries, in order: `pick` chooses among those not tried yet, at most
        1 + `retries` of them; every try after the first counts as a retry."""
        # The generator itself, not a loop over it: one frame less on every leg.
        return engines_to_try(pick, self._tries, self.report.on_attempt(role))

    async def send(self, backend: Backend, payload: bytes) -> EngineAnswer:
        """POST a leg's payload to `backend`; `LegFailure` when there is no answer to judge."""
        headers = self._headers
        if self._traced:
            carrier: dict[str, str] = {}
            tracing.inject(carrier)  # the leg's span continues on the engine (W3C traceparent)
            headers += tuple(carrier.items())
        try:
            return await self._engines.post(backend.url, self._path, payload, headers)
        except UpstreamConnectError as exc:
            raise LegFailure(f"cannot connect ({exc})", "cannot connect") from exc
        except UpstreamTimeout as exc:
            raise LegFailure("no answer within the first-byte timeout", timeout=True) from exc
        except UpstreamError as exc:
            raise LegFailure(f"{type(exc).__name__}: {exc}", type(exc).__name__) from exc

    async def failed(self, pool: Pool, backend: Backend, exc: LegFailure, start: float) -> bool:
        """An attempt got no answer: count it (latency, log) and charge the engine; False when
        it is not the engine's fault (a timeout on an engine that passes its probe)."""
        charged = await self._charge(pool, backend, exc)
        self.report.leg_latency(pool.role, "error", start)
        log.warning("%s on %s failed: %s", pool.role, backend.url, exc.reason)
        return charged

    def verdict(self, pool: Pool, backend: Backend, status: int) -> Verdict:
        """Judge an engine's status (see the module's docstring)."""
        if status >= 500 or status == 429:
            self._pending_5xx.append((pool, backend, f"HTTP {status}"))
            return Verdict.REFUSED
        pool.record_served(backend, self._tenant)
        if status >= 400:
            return Verdict.REJECTED
        if self._pending_5xx:
            self.judge_5xx(served=pool)
        return Verdict.SERVED

    def judge_5xx(self, *, served: Pool | None) -> None:
        """Settle the 5xx answers seen so far: failures of their engines when another engine
        of the same role (`served`) did this request's job, disputed (see
        `Pool.record_disputed`) when none did. D serving a request that every P failed says
        nothing about P: D does another job (it prefills without P's parameters)."""
        pending, self._pending_5xx = self._pending_5xx, []
        for pool, backend, reason in pending:
            if pool.get(backend.url) is not backend:
                continue  # removed meanwhile
            if pool is served:
                pool.record_failure(backend, reason)
            else:
                pool.record_disputed(backend, self._tenant, reason)

    async def _charge(self, pool: Pool, backend: Backend, exc: LegFailure) -> bool:
        if not exc.timeout:
            pool.record_failure(backend, exc.reason)
            return True
        ok, why = await self._engines.probe(backend.url)
        if pool.get(backend.url) is not backend:
            return True  # removed meanwhile: nothing to judge
        backend.probe_ok = ok
        if ok:
            return False
        pool.record_failure(backend, f"{exc.reason}; {why}")
        return True
