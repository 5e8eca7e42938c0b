"""Backend pools: health, load and the choice of engine for each leg.

Each engine is a `Backend` with consecutive-failure and -success counters. Failures come from
probes (`GET /health` every `probe_interval_s`) and from real requests (connect errors and
timeouts at once; a 5xx only once it says something about the engine), so a dead engine is
ejected after `eject_after_failures` whichever sees it first — that is the circuit breaker —
and readmitted only by `readmit_after_successes` good probes.

A 5xx can be caused by the request rather than the engine (input every engine fails on), so
one client must not be able to eject the fleet with it. A 5xx counts as a failure when another
engine of the same role then served the same request (`record_failure`); when none did, it is
*disputed* (`record_disputed`) and counts only once a second API key saw a 5xx from that engine
within `engine_5xx_window_s` with no request served by it in between. A timeout is the
request's unless the engine also fails a health probe (`probe`).

Each engine also keeps which keys it served (`KeyLedger`), so that a key whose requests every
engine fails can be told from an engine failing everyone (`Pool.blames_input`, read by the
per-key breaker in `kvrelay.proxy.tenants`); `Backend.faults` counts the failures charged to
the engine, so the breaker can drop strikes those failures explain.

Engines are named to clients and in metrics by `Backend.name` (role and a keyed hash of the
URL, `kvrelay.proxy.fleet.engine_names`), never by their internal URL.
Which engine a leg goes to is `kvrelay.proxy.fleet.routing`'s choice among the usable ones;
draining engines finish what they have but get nothing new.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from kvrelay.proxy.base import cancel_and_wait
from kvrelay.proxy.engines import Upstream, UpstreamError
from kvrelay.proxy.fleet.engine_names import engine_name
from kvrelay.proxy.fleet.freed_tokens import FreedTokens
from kvrelay.proxy.fleet.load_reading import EngineLoad

Role = Literal["prefill", "decode"]
log = logging.getLogger(__name__)


# Keys remembered per engine by the ledger (bounds memory under many API keys).
_MAX_LEDGER_KEYS = 64


@dataclass
class KeyLedger:
    """Which API keys an engine served, in order: enough to answer "did it serve another key
    since this key's last 5xx here?" in O(1) on the request path.

    `served` is called on every answered request; the other key's latest service is the most
    recent one when the last key served differs, else the one before the last key's run."""

    seq: int = 0  # requests served, ever
    last_key: str = ""
    last_seq: int = 0  # `seq` when `last_key` was last served
    before_last_seq: int = 0  # `seq` when a key other than `last_key` was last served
    refused_at: dict[str, int] = field(default_factory=dict)  # key -> `seq` at its last 5xx

    def served(self, key: str) -> None:
        self.seq += 1
        if key != self.last_key:
            self.before_last_seq = self.last_seq
            self.last_key = key
        self.last_seq = self.seq

    def others_served_since_refused(self, key: str) -> bool:
        """Whether another key was served since `key`'s previous 5xx here; records this one.
        Several 5xx with nobody else served between them count as one."""
        other = self.before_last_seq if key == self.last_key else self.last_seq
        since = self.refused_at.pop(key, 0)
        self.refused_at[key] = self.seq
        while len(self.refused_at) > _MAX_LEDGER_KEYS:
            del self.refused_at[next(iter(self.refused_at))]
        return other > since


@dataclass
class Backend:
    """One engine and what the proxy knows about it."""

    url: str
    role: Role
    healthy: bool = True
    draining: bool = False
    failures: int = 0
    successes: int = 0
    inflight: int = 0
    outstanding_work: int = 0
    side_channel: tuple[str, int] | None = None
    last_error: str | None = None
    # The engine's own latest load reading (`kvrelay.proxy.fleet.engine_load`), None until scraped.
    load: EngineLoad | None = None
    # KV this worker's turns freed on the engine, by when: what its last reading still counts.
    freed: FreedTokens = field(default_factory=FreedTokens)
    # API key (tenant hash) -> when it last got a disputed 5xx from this engine, since the
    # engine last served a request (a served request shows it works: the slate is wiped).
    disputed_by: dict[str, float] = field(default_factory=dict)
    probe_ok: bool = True  # the latest health probe's verdict
    faults: int = 0  # failures charged to this engine, ever (never reset)
    keys: KeyLedger = field(default_factory=KeyLedger)

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining

    @property
    def name(self) -> str:
        """How clients and metrics see this engine: role and a stable hash, not the URL."""
        return engine_name(self.role, self.url)

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "url": self.url,
            "role": self.role,
            "healthy": self.healthy,
            "draining": self.draining,
            "inflight": self.inflight,
            "consecutive_failures": self.failures,
            "last_error": self.last_error,
            # This worker's latest reading of the engine's own load (why it may be skipped).
            "load": None
            if self.load is None
            else {
                "running": self.load.running,
                "waiting": self.load.waiting,
                "kv_usage": self.load.kv_usage,
                # Its pool in tokens (vLLM's cache_config_info; None: unknown), and the tokens
                # this worker's turns freed there since the reading (what routing takes off it).
                "pool_tokens": self.load.pool_tokens,
                "freed_tokens": self.freed.since(self.load.at),
                # Mean gap between its output tokens since the reading before (None: none).
                "inter_token_ms": None
                if self.load.inter_token_s is None
                else round(self.load.inter_token_s * 1000, 3),
                "age_s": round(time.monotonic() - self.load.at, 3),
                # How long its prefix cache lately keeps a block nobody uses (None: it
                # serves no residency histogram, or too few evictions to tell).
                "cache_keeps_s": _rounded(self.load.residence.keeps_s())
                if self.load.residence is not None
                else None,
            },
        }


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


# Tenants remembered per engine for disputed 5xx (bounds memory under many API keys).
_MAX_DISPUTING_TENANTS = 64

HealthListener = Callable[[Backend], None]


async def probe_health(client: Upstream, url: str, timeout_s: float) -> tuple[bool, str]:
    """One `GET /health` of the engine at `url`: (passed, why not)."""
    try:
        status, _ = await client.get(url, "/health", timeout_s=timeout_s)
    except (UpstreamError, TimeoutError, OSError) as exc:
        return False, f"health probe failed: {type(exc).__name__}"
    return status == 200, f"health probe answered {status}"


@dataclass
class Pool:
    """The engines of one role."""

    role: Role
    eject_after: int
    readmit_after: int
    backends: dict[str, Backend] = field(default_factory=dict)
    on_health_change: HealthListener | None = None
    on_leave: HealthListener | None = None  # an engine left the pool (removed)
    dispute_window_s: float = 60.0

    def add(self, url: str) -> Backend:
        if url in self.backends:
            backend = self.backends[url]
            backend.draining = False
            return backend
        backend = Backend(url=url, role=self.role)
        self.backends[url] = backend
        self._notify(backend)
        return backend

    def remove(self, url: str) -> Backend | None:
        backend = self.backends.pop(url, None)
        if backend is not None and self.on_leave is not None:
            self.on_leave(backend)
        return backend

    def drain(self, url: str) -> Backend | None:
        backend = self.backends.get(url)
        if backend is not None:
            backend.draining = True
        return backend

    def get(self, url: str) -> Backend | None:
        return self.backends.get(url)

    def usable(self) -> list[Backend]:
        return [b for b in self.backends.values() if b.usable]

    def record_failure(self, backend: Backend, reason: str) -> None:
        backend.successes = 0
        backend.failures += 1
        backend.faults += 1
        backend.last_error = reason
        if backend.healthy and backend.failures >= self.eject_after:
            backend.healthy = False
            log.warning(
                "ejected %s engine %s after %d failures (%s)",
                self.role,
                backend.url,
                backend.failures,
                reason,
            )
            self._notify(backend)

    def record_disputed(self, backend: Backend, tenant: str, reason: str) -> None:
        """A 5xx no other engine contradicted: the request may be at fault, not the engine.

        It becomes a failure only when another API key also got one from this engine within
        the window and since it last served a request, so a single client's poisonous input
        never ejects an engine, nor do two clients' poisonous inputs that others' requests
        served in between show to be input."""
        now = time.monotonic()
        seen = backend.disputed_by
        for other, at in list(seen.items()):
            if now - at > self.dispute_window_s:
                del seen[other]
        seen.pop(tenant, None)
        seen[tenant] = now
        while len(seen) > _MAX_DISPUTING_TENANTS:
            del seen[next(iter(seen))]
        if len(seen) >= 2:
            self.record_failure(backend, f"{reason} (for {len(seen)} API keys)")

    def record_served(self, backend: Backend, tenant: str) -> None:
        """A request of `tenant` answered (not 5xx): the engine works, for that key."""
        backend.keys.served(tenant)
        if backend.disputed_by:
            backend.disputed_by.clear()
        self.record_success(backend, probe=False)

    def blames_input(self, engines: list[Backend], tenant: str) -> bool:
        """Whether the 5xx these engines answered to a request of `tenant` that none of them
        served point at the request's input rather than at the engines: every one is in its
        pool, passed its latest probe and failed no other key since it last served a request,
        and one of them served another key since `tenant`'s previous 5xx there (several 5xx
        with nobody else served between them are one piece of evidence). Records these 5xx."""
        now = time.monotonic()
        others_served = False
        for backend in engines:
            # Every engine records this 5xx, whatever the verdict.
            others_served |= backend.keys.others_served_since_refused(tenant)
        for backend in engines:
            if not (backend.healthy and backend.probe_ok):
                return False
            for key, at in backend.disputed_by.items():
                if key != tenant and now - at <= self.dispute_window_s:
                    return False  # another key fails here too: the engine's trouble
        return others_served

    def record_success(self, backend: Backend, *, probe: bool) -> None:
        backend.failures = 0
        if backend.healthy:
            return
        # A request success cannot readmit (ejected engines get no requests); probes do.
        if probe:
            backend.successes += 1
            if backend.successes >= self.readmit_after:
                backend.healthy = True
                backend.successes = 0
                backend.last_error = None
                log.warning("readmitted %s engine %s", self.role, backend.url)
                self._notify(backend)

    def _notify(self, backend: Backend) -> None:
        if self.on_health_change is not None:
            self.on_health_change(backend)

    def busy(self, backend: Backend, work: int) -> Busy:
        """Count a request against the backend while it runs (a `with` block)."""
        return Busy(backend, work)


class Busy:
    """A request counted against its backend from `__enter__` to `__exit__`.

    A class rather than a generator-based context manager: it runs on every leg."""

    __slots__ = ("_backend", "_work")

    def __init__(self, backend: Backend, work: int) -> None:
        self._backend = backend
        self._work = work

    def __enter__(self) -> None:
        self._backend.inflight += 1
        self._backend.outstanding_work += self._work

    def __exit__(self, *exc_info: object) -> None:
        self._backend.inflight -= 1
        self._backend.outstanding_work -= self._work

    def prefilled(self) -> None:
        """The engine is past the prompt (its first token is out): from now on the request
        counts 1, as a decode does, so prompt work measures prefill still to do."""
        self._backend.outstanding_work -= self._work - 1
        self._work = 1


def engines_to_try(
    pick: Callable[[set[str]], Backend | None],
    attempts: int,
    on_try: Callable[[Backend, int], object],
) -> Iterator[Backend]:
    """The engines a request tries, in order: `pick` chooses among those not tried yet, at
    most `attempts` of them; `on_try(backend, attempt)` is called before each try (attempt 0
    is the first, any other a retry)."""
    tried: set[str] = set()
    for attempt in range(attempts):
        backend = pick(tried)
        if backend is None:
            return
        tried.add(backend.url)
        on_try(backend, attempt)
        yield backend


class EngineRounds:
    """A background loop that visits every engine of the given pools once per `interval`
    seconds until stopped (`_visit`, all engines concurrently); a bug in one round is logged
    and the next round still runs. The health probes and the load scrapes are two of these."""

    task_name = "kvrelay-rounds"

    def __init__(
        self,
        pools: list[Pool],
        client: Upstream,
        interval: float,
        timeout: float,
    ) -> None:
        self._pools = pools
        self._client = client
        self._interval = interval
        self._timeout = timeout
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the loop (an interval of 0 or less: never)."""
        if self._interval > 0:
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None

    async def visit_all(self) -> None:
        """One round: every engine of every pool, concurrently."""
        visits = [
            self._visit(pool, backend)
            for pool in self._pools
            for backend in list(pool.backends.values())
        ]
        await asyncio.gather(*visits)

    async def _visit(self, pool: Pool, backend: Backend) -> None:
        raise NotImplementedError

    async def _run(self) -> None:
        while True:
            try:
                await self.visit_all()
            except Exception:  # a bug in one round must not end the loop
                log.exception("%s round failed", self.task_name)
            await asyncio.sleep(self._interval)


class HealthChecker(EngineRounds):
    """Probes every engine's `/health` on an interval until stopped."""

    task_name = "kvrelay-health"

    async def probe_all(self) -> None:
        await self.visit_all()

    async def _visit(self, pool: Pool, backend: Backend) -> None:
        ok, reason = await probe_health(self._client, backend.url, self._timeout)
        if pool.get(backend.url) is not backend:
            return  # removed while probing
        backend.probe_ok = ok
        if ok:
            pool.record_success(backend, probe=True)
        else:
            pool.record_failure(backend, reason)
