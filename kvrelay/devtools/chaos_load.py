"""The chaos fleet and its load: multi-turn conversations through the proxy while faults fly.

Shared by the chaos test (`tests/chaos/test_chaos.py`, bounded) and the soak script
(`bench.soak`, long). Pieces:

- `ChaosFleet`: Redis, 2 P and 2 D enginesim (short leases), a `FaultProxy` in front of every
  engine (the proxy only knows the relays' URLs) and a proxy with two workers on the Redis map.
- `LoadRunner`: client threads running seeded multi-turn chats (streamed or not, explicit
  conversation id or history fingerprint), some abandoned mid-stream; every turn is recorded
  with what the client saw, so the reference check can run after the load.
- `Chaos`: one thread injecting seeded faults: kill/restart an engine, restart Redis, delay,
  reset or refuse connections at a relay, make an engine fail requests.
- `Sampler`: proxy RSS (whole process tree) and latency over time.

Nothing here sleeps to synchronise: threads wait on a stop `Event` with a timeout (pacing),
and start-ups are bounded readiness waits.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvrelay.devtools import sse
from kvrelay.devtools.engines import EngineFactory, EngineSim
from kvrelay.devtools.faultproxy import FaultProxy
from kvrelay.devtools.process import wait_until
from kvrelay.devtools.proxy_server import ProxyFactory, ProxyServer
from kvrelay.devtools.redis import RedisServer

MODEL = "kvrelay-sim"
SYSTEM = "You are a patient assistant who answers in a few words. " * 4
TOPICS = ["rivers", "caches", "bridges", "comets", "gardens", "compilers", "tides", "owls"]
FOLLOW_UPS = [
    "Why?",
    "And then?",
    "Give an example.",
    "Shorter, please.",
    "What else?",
    "Is that always true?",
    "How so?",
    "Explain like I am five.",
]


# Reports of finished chaos runs, shown in pytest's terminal summary (tests/chaos/conftest.py).
SUMMARIES: list[tuple[str, str]] = []


# -- process memory -----------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                text = Path(f"/proc/{pid}/task/{task}/children").read_text()
                out += [int(p) for p in text.split()]
    return out


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and all its descendants (the proxy's workers), in bytes."""
    total, todo, seen = 0, [pid], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        todo += _children(current)
    return total


# -- the fleet ----------------------------------------------------------------------------------


@dataclass
class ChaosFleet:
    """Redis + 2 P + 2 D (each behind a fault relay) + a two-worker proxy on the Redis map."""

    lease_seconds: float = 6.0
    workers: int = 2
    blocks_per_engine: int = 512
    # Extra proxy settings (KVRELAY_* without the prefix), e.g. the routing policy; the test
    # fleets pin `always_p` unless this overrides it.
    proxy_settings: dict[str, str] = field(default_factory=dict)
    redis: RedisServer = field(default_factory=RedisServer)
    engines: EngineFactory = field(default_factory=EngineFactory)
    proxies: ProxyFactory = field(default_factory=ProxyFactory)
    relays: dict[str, FaultProxy] = field(default_factory=dict)
    proxy: ProxyServer | None = None

    def start(self) -> ChaosFleet:
        self.redis.start()
        lease = str(self.lease_seconds)
        for name, role in (
            ("P0", "prefill"),
            ("P1", "prefill"),
            ("D0", "decode"),
            ("D1", "decode"),
        ):
            engine = self.engines(
                name,
                "--role",
                role,
                "--lease-seconds",
                lease,
                "--num-blocks",
                str(self.blocks_per_engine),
            )
            self.relays[name] = FaultProxy("127.0.0.1", engine.port).start()
        side = ",".join(
            f"{self.relays[e.name].url}=127.0.0.1:{e.side_channel_port}"
            for e in self.engines.engines
        )
        settings = dict(
            map_url=self.redis.url + "?timeout_ms=200",
            workers=str(self.workers),
            side_channels=side,
            entry_safety_margin_s="1.5",
            conversation_ttl_s="60",
            connect_timeout="1",
            first_byte_timeout="8",
            total_timeout="30",
            retries="1",
            eject_after_failures="2",
            readmit_after_successes="1",
        )
        settings.update(self.proxy_settings)
        self.proxy = self.proxies(
            [self.relays["P0"].url, self.relays["P1"].url],
            [self.relays["D0"].url, self.relays["D1"].url],
            "/ready",
            None,
            **settings,
        )
        return self

    def engine(self, name: str) -> EngineSim:
        return next(e for e in self.engines.engines if e.name == name)

    @property
    def engine_names(self) -> list[str]:
        return [e.name for e in self.engines.engines]

    def proxy_rss(self) -> int:
        assert self.proxy is not None and self.proxy.process is not None
        assert self.proxy.process.proc is not None
        return tree_rss_bytes(self.proxy.process.proc.pid)

    def heal(self) -> None:
        """Remove every standing fault; restart anything that is down."""
        for relay in self.relays.values():
            relay.heal()
        for engine in self.engines.engines:
            if engine.process is None or not engine.process.alive:
                engine.start()
            else:
                with contextlib.suppress(OSError, ValueError):
                    engine.request("/admin/faults", {"fail_next_n": 0, "delay_ms": 0})
        if self.redis.process is None or not self.redis.process.alive:
            self.redis.start()

    def held_blocks(self) -> dict[str, float]:
        return {e.name: e.metric("enginesim_blocks_held_for_remote") for e in self.engines.engines}

    def held_blocks_now(self) -> float:
        """Blocks held for a next turn or a pull, summed over the engines that answer (a
        killed engine holds nothing: its pool went with it)."""
        total = 0.0
        for engine in self.engines.engines:
            with contextlib.suppress(OSError, ValueError, KeyError):
                total += engine.metric("enginesim_blocks_held_for_remote")
        return total

    def stranded_blocks(self, within_s: float) -> dict[str, float]:
        """Blocks still held by each engine when its pool is not idle within `within_s`
        (wait for the leases and the proxy's releases); empty when every pool went idle."""
        try:
            wait_until(
                lambda: all(e.pool_idle() for e in self.engines.engines),
                within_s,
                interval=0.25,
                what="every pool idle",
            )
        except TimeoutError:
            return self.held_blocks()
        return {}

    def wait_ready(self, timeout: float = 60.0) -> None:
        assert self.proxy is not None
        url = self.proxy.url + "/ready"

        def ready() -> bool:
            # Every worker must see both pools healthy: ask several times (SO_REUSEPORT spreads).
            try:
                return all(httpx.get(url, timeout=2).status_code == 200 for _ in range(4))
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout, interval=0.2, what="the proxy's pools to be healthy")

    def close(self) -> None:
        self.proxies.close()
        for relay in self.relays.values():
            relay.stop()
        self.engines.close()
        self.redis.stop()

    def __enter__(self) -> ChaosFleet:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- one turn as the client saw it --------------------------------------------------------------


@dataclass
class TurnRecord:
    """A turn's request and outcome. `outcome`: ok | error | disconnected."""

    messages: list[dict[str, Any]]
    max_tokens: int
    stream: bool
    outcome: str
    answer: str | None = None
    error_kind: str | None = None
    latency_s: float = 0.0
    at: float = 0.0


def is_openai_error(payload: Any) -> bool:
    """`{"error": {"message": str, "type": str, "param": ..., "code": ...}}`."""
    if not isinstance(payload, dict) or set(payload) != {"error"}:
        return False
    err = payload["error"]
    return (
        isinstance(err, dict)
        and {"message", "type", "param", "code"} <= set(err)
        and isinstance(err["message"], str)
        and bool(err["message"])
        and isinstance(err["type"], str)
    )


def _error_kind(status: int, payload: Any) -> str:
    if not is_openai_error(payload):
        return f"unshaped_{status}"
    return f"{status}:{payload['error'].get('code') or payload['error']['type']}"


def _parse_sse(raw: bytes) -> tuple[str, Any | None, bool]:
    """(text, first error event or None, saw [DONE]) of a chat completion stream."""
    stream = sse.parse(raw)
    errors = [e for e in stream.events if isinstance(e, dict) and "error" in e]
    answer = [e for e in stream.events if not (isinstance(e, dict) and "error" in e)]
    return sse.text_of(answer, chat=True), (errors[0] if errors else None), stream.done


def one_turn(
    client: httpx.Client,
    base: str,
    messages: list[dict[str, Any]],
    max_tokens: int,
    stream: bool,
    headers: dict[str, str],
    disconnect: bool = False,
) -> TurnRecord:
    """Send one chat turn; classify what came back (never raises for server behaviour)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": stream}
    record = TurnRecord([dict(m) for m in messages], max_tokens, stream, "error", at=time.time())
    start = time.monotonic()
    try:
        if not stream:
            resp = client.post(base + "/v1/chat/completions", json=body, headers=headers)
            payload = resp.json()
            if resp.status_code == 200 and "choices" in payload:
                record.outcome, record.answer = "ok", payload["choices"][0]["message"]["content"]
            else:
                record.error_kind = _error_kind(resp.status_code, payload)
        else:
            with client.stream(
                "POST", base + "/v1/chat/completions", json=body, headers=headers
            ) as resp:
                if disconnect and resp.status_code == 200:
                    # Read the first bytes, then walk away: the proxy must cancel and release.
                    for _ in resp.iter_raw(1):
                        break
                    record.outcome = "disconnected"
                    return record
                raw = resp.read()
            if resp.status_code != 200:
                record.error_kind = _error_kind(resp.status_code, json.loads(raw))
            else:
                text, error, done = _parse_sse(raw)
                if error is not None:
                    record.error_kind = "stream:" + _error_kind(200, error)
                elif not done:
                    record.error_kind = "stream_truncated"
                else:
                    record.outcome, record.answer = "ok", text
    except (httpx.TransportError, ValueError) as exc:
        # The proxy itself went away or sent garbage: never acceptable.
        record.error_kind = f"client_saw_{type(exc).__name__}"
    finally:
        record.latency_s = time.monotonic() - start
    return record


# -- the load -----------------------------------------------------------------------------------


@dataclass
class LoadRunner:
    """`clients` threads, each running conversations of up to `turns` turns until stopped."""

    base_url: str
    seed: int
    clients: int = 4
    turns: int = 5
    disconnect_rate: float = 0.08
    think_s: tuple[float, float] = (0.2, 0.7)  # a person reading the answer between turns
    records: list[TurnRecord] = field(default_factory=list)
    conversations: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> LoadRunner:
        for i in range(self.clients):
            thread = threading.Thread(target=self._client, args=(i,), name=f"load-{i}", daemon=True)
            self._threads.append(thread)
            thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.1, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            raise TimeoutError(f"load threads did not finish within {timeout}s: {stuck}")

    def run_for(self, seconds: float) -> None:
        """Let the load run for `seconds` (returns early if it was stopped)."""
        self._stop.wait(seconds)

    def _client(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        timeout = httpx.Timeout(45.0, connect=5.0)
        with httpx.Client(timeout=timeout) as client:
            while not self._stop.is_set():
                with self._lock:
                    self.conversations += 1
                    number = self.conversations
                self._conversation(client, rng, f"c{self.seed}-{index}-{number}")

    def _conversation(self, client: httpx.Client, rng: random.Random, conv_id: str) -> None:
        topic = rng.choice(TOPICS)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM + f" Topic: {topic}. Conversation {conv_id}."},
            {"role": "user", "content": f"Tell me about {topic}."},
        ]
        # Half use an explicit id, half rely on the history fingerprint (stock OpenAI clients).
        headers = {"X-Conversation-Id": conv_id} if rng.random() < 0.5 else {}
        for _ in range(self.turns):
            if self._stop.is_set():
                return
            stream = rng.random() < 0.5
            max_tokens = rng.randint(4, 14)
            record = None
            for _attempt in range(3):
                disconnect = stream and rng.random() < self.disconnect_rate
                record = one_turn(
                    client, self.base_url, messages, max_tokens, stream, headers, disconnect
                )
                with self._lock:
                    self.records.append(record)
                if record.outcome == "ok" or self._stop.is_set():
                    break
            if record is None or record.outcome != "ok":
                return  # give the conversation up after three failed attempts
            assert record.answer is not None
            if self._stop.wait(rng.uniform(*self.think_s)):
                return
            messages.append({"role": "assistant", "content": record.answer})
            messages.append({"role": "user", "content": rng.choice(FOLLOW_UPS)})

    def snapshot(self) -> list[TurnRecord]:
        with self._lock:
            return list(self.records)


# -- faults -------------------------------------------------------------------------------------


@dataclass
class Chaos:
    """Injects a seeded fault every `period_s` (±50%) until stopped; counts by kind."""

    fleet: ChaosFleet
    seed: int
    period_s: float = 4.0
    injected: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time, action)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    # An engine restart (a minute under load) runs beside the other faults, one at a time.
    _restart: threading.Thread | None = None

    def start(self) -> Chaos:
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 90.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError("the chaos thread did not stop")
        if self._restart is not None:
            self._restart.join(timeout)
            if self._restart.is_alive():
                raise TimeoutError("an engine restart did not finish")

    def _run(self) -> None:
        rng = random.Random(self.seed)
        actions = [
            (self._kill_restart_engine, 2),
            (self._restart_redis, 1),
            (self._delay, 2),
            (self._drop, 3),
            (self._refuse, 2),
            (self._engine_fails, 2),
            (self._decode_outage, 2),
        ]
        population = [a for a, weight in actions for _ in range(weight)]
        while not self._stop.wait(self.period_s * rng.uniform(0.5, 1.5)):
            action = rng.choice(population)
            self.events.append((time.monotonic(), action.__name__.lstrip("_")))
            try:
                action(rng)
            except Exception as exc:  # a fault that could not be injected is reported, not fatal
                self.errors.append(f"{action.__name__}: {type(exc).__name__}: {exc}")

    def _kill_restart_engine(self, rng: random.Random) -> None:
        if self._restart is not None and self._restart.is_alive():
            self._drop(rng)  # one engine down at a time; do something else meanwhile
            return
        engine = self.fleet.engine(rng.choice(self.fleet.engine_names))
        engine.kill()
        self.injected["engine_killed"] += 1
        down_for = rng.uniform(0.5, 2.0)

        def restart() -> None:
            # Down for a moment so in-flight legs and probes see it gone, then back.
            self._stop.wait(down_for)
            try:
                engine.start()
                self.injected["engine_restarted"] += 1
            except Exception as exc:
                self.errors.append(f"restart {engine.name}: {type(exc).__name__}: {exc}")

        self._restart = threading.Thread(target=restart, name="chaos-restart", daemon=True)
        self._restart.start()

    def _restart_redis(self, rng: random.Random) -> None:
        self.fleet.redis.kill()
        self.injected["redis_killed"] += 1
        self._stop.wait(rng.uniform(0.2, 1.5))
        self.fleet.redis.start()
        self.injected["redis_restarted"] += 1

    def _relay(self, rng: random.Random) -> FaultProxy:
        return self.fleet.relays[rng.choice(sorted(self.fleet.relays))]

    def _delay(self, rng: random.Random) -> None:
        relay = self._relay(rng)
        relay.set_delay(rng.uniform(0.05, 0.4))
        self.injected["relay_delay"] += 1
        self._stop.wait(rng.uniform(1.0, 3.0))
        relay.set_delay(0.0)

    def _drop(self, rng: random.Random) -> None:
        self.injected["relay_dropped_connections"] += self._relay(rng).drop_all()
        self.injected["relay_drop_events"] += 1

    def _refuse(self, rng: random.Random) -> None:
        n = rng.randint(1, 4)
        self._relay(rng).refuse_next(n)
        self.injected["relay_refusals_armed"] += n

    def _engine_fails(self, rng: random.Random) -> None:
        engine = self.fleet.engine(rng.choice(self.fleet.engine_names))
        status = rng.choice([500, 503])
        code, _ = engine.request(
            "/admin/faults", {"fail_next_n": rng.randint(1, 3), "fail_status": status}
        )
        if code == 200:
            self.injected["engine_fail_next"] += 1

    def _decode_outage(self, rng: random.Random) -> None:
        """Every decode engine fails its next requests: clients must get a clear error."""
        for name in self.fleet.engine_names:
            if name.startswith("D"):
                with contextlib.suppress(OSError):
                    self.fleet.engine(name).request(
                        "/admin/faults", {"fail_next_n": 2, "fail_status": 503}
                    )
        self.injected["decode_outage"] += 1


# -- sampling memory and latency ----------------------------------------------------------------


@dataclass
class Sample:
    """One reading of the `Sampler`, `t` seconds into the run."""

    t: float
    rss_bytes: int
    held_blocks: float
    requests: int
    p50_latency_s: float | None
    p95_latency_s: float | None


@dataclass
class Sampler:
    """Every `period_s`: proxy RSS, the blocks the engines hold and the latency of the turns
    completed since the last one."""

    fleet: ChaosFleet
    load: LoadRunner
    period_s: float = 2.0
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    t0: float = field(default_factory=time.monotonic)

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        seen = 0
        while True:
            records = self.load.snapshot()
            fresh = [r.latency_s for r in records[seen:] if r.outcome == "ok"]
            seen = len(records)
            p50 = statistics.median(fresh) if fresh else None
            p95 = sorted(fresh)[int(0.95 * (len(fresh) - 1))] if fresh else None
            with contextlib.suppress(OSError, AssertionError):
                self.samples.append(
                    Sample(
                        time.monotonic() - self.t0,
                        self.fleet.proxy_rss(),
                        self.fleet.held_blocks_now(),
                        len(records),
                        p50,
                        p95,
                    )
                )
            if self._stop.wait(self.period_s):
                return


# -- the report ---------------------------------------------------------------------------------


def _by_label(proxy: ProxyServer, metric: str, label: str) -> dict[str, float]:
    """`metric` by the value of `label`, summed over the proxy's workers."""
    out: dict[str, float] = {}
    for series, value in proxy.metrics().items():
        if series.startswith(metric + "{"):
            key = series.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[key] = out.get(key, 0.0) + value
    return out


def proxy_reuse(proxy: ProxyServer) -> dict[str, float]:
    """`kvrelay_reuse_total` by result, summed over the proxy's workers."""
    return _by_label(proxy, "kvrelay_reuse_total", "result")


def routing_decisions(proxy: ProxyServer) -> dict[str, float]:
    """`kvrelay_routing_decisions_total` by decision, summed over the proxy's workers."""
    return _by_label(proxy, "kvrelay_routing_decisions_total", "decision")


def summarize(records: list[TurnRecord]) -> dict[str, Any]:
    outcomes = Counter(r.outcome for r in records)
    errors = Counter(r.error_kind for r in records if r.outcome == "error")
    return {"turns": len(records), "outcomes": dict(outcomes), "errors": dict(errors)}


def iter_mismatches(records: list[TurnRecord]) -> Iterator[tuple[TurnRecord, str]]:
    """Completed turns whose answer differs from the non-disaggregated reference."""
    from kvrelay.enginesim.reference import reference_chat

    for record in records:
        if record.outcome != "ok":
            continue
        expected = reference_chat(record.messages, record.max_tokens)
        if record.answer != expected:
            yield record, expected
