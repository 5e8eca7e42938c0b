"""OpenTelemetry traces of turns (kvrelay.proxy.telemetry.tracing): the span tree of a two-turn
conversation, the `traceparent` the engines receive, nothing secret in any attribute, export over
OTLP/HTTP to a collector on loopback, and nothing at all while tracing is off.

The in-memory tests run the proxy in this process (the SDK's in-memory exporter lives here) in
front of real enginesim P and D, each behind a `HeaderRecorder` that shows what the engine got.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kvrelay.devtools import CONNECTOR_SECRET, EngineFactory, EngineSim, ProxyFactory
from kvrelay.proxy.config import TracingMode, load_settings
from kvrelay.proxy.http.app import create_app
from kvrelay.proxy.telemetry import tracing
from tests.harness import REPO_ROOT, free_port, wait_until
from tests.proxy.client import MODEL
from tests.proxy.header_recorder import HeaderRecorder

CHAT = "/v1/chat/completions"
# Several full blocks, so the second turn has something to pull from D.
LONG_SYSTEM = "You are a careful assistant. Answer briefly. " * 6
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[EngineSim, EngineSim]]:
    factory = EngineFactory()
    try:
        p, d = factory.many(("TP", ["--role", "prefill"]), ("TD", ["--role", "decode"]))
        yield p, d
    finally:
        factory.close()


@pytest.fixture
def memory_spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, every span kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        yield exporter
    finally:
        tracing.shutdown()


@contextlib.asynccontextmanager
async def recorded_fleet(
    p: EngineSim, d: EngineSim, api_key: str, **more_settings: Any
) -> AsyncIterator[tuple[str, HeaderRecorder, HeaderRecorder]]:
    """The proxy in this process in front of P and D, each behind a header recorder; yields
    (proxy URL, P's recorder, D's recorder). Everything is stopped (and the proxy's background
    releases drained) on exit. `more_settings` are further proxy settings."""
    rp, rd = HeaderRecorder(p.url), HeaderRecorder(d.url)
    await rp.start()
    await rd.start()
    settings = load_settings(
        {
            "prefill": [rp.url],
            "decode": [rd.url],
            "side_channels": {
                rp.url: f"127.0.0.1:{p.side_channel_port}",
                rd.url: f"127.0.0.1:{d.side_channel_port}",
            },
            "connector_secret": CONNECTOR_SECRET,
            "api_keys": [api_key],
            "probe_interval_s": 0.2,
            # Both turns take the P and D legs, so each has every span (under the default
            # policy the second turn would skip P).
            "routing_policy": "always_p",
            **more_settings,
        },
        env_file=None,
    )
    runner = web.AppRunner(create_app(settings), access_log=None)
    port = free_port()
    try:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield f"http://127.0.0.1:{port}", rp, rd
    finally:
        await runner.cleanup()
        await rp.stop()
        await rd.stop()


async def two_turns(
    url: str, headers: dict[str, str], canary: str
) -> tuple[list[str], list[dict[str, Any]]]:
    """Turn 1 plain JSON, turn 2 streamed, then the conversation is ended; returns the answers
    and the request bodies."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": f"First question {canary}"},
    ]
    bodies = []
    async with aiohttp.ClientSession(headers=headers) as client:
        body = {"model": MODEL, "messages": messages, "max_tokens": 8}
        bodies.append(body)
        async with client.post(url + CHAT, json=body) as resp:
            assert resp.status == 200, await resp.text()
            first = (await resp.json())["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": first},
                     {"role": "user", "content": f"Second question {canary}"}]  # fmt: skip
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": True}
        bodies.append(body)
        async with client.post(url + CHAT, json=body) as resp:
            assert resp.status == 200
            second = (await resp.read()).decode()
        conversation = headers["X-Conversation-Id"]
        async with client.delete(f"{url}/v1/conversations/{conversation}") as resp:
            assert resp.status == 200
    return [first, second], bodies


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def _children(spans: Sequence[ReadableSpan], parent: ReadableSpan) -> dict[str, ReadableSpan]:
    assert parent.context is not None
    return {
        s.name: s
        for s in spans
        if s.parent is not None and s.parent.span_id == parent.context.span_id
    }


def _texts(span: ReadableSpan) -> list[str]:
    """Everything a span carries as text: name, attributes, events, status."""
    out = [span.name, str(span.status.description or "")]
    out += [f"{k}={v}" for k, v in (span.attributes or {}).items()]
    for event in span.events:
        out += [event.name, *(f"{k}={v}" for k, v in (event.attributes or {}).items())]
    return out


async def test_two_turns_trace_down_to_the_engines(
    engines: tuple[EngineSim, EngineSim], memory_spans: InMemorySpanExporter
) -> None:
    p, d = engines
    p.wait_idle()
    d.wait_idle()
    key = "sk-trace-" + secrets.token_hex(12)
    canary = "canary" + secrets.token_hex(8)
    conversation = "conv-" + secrets.token_hex(6)
    headers = {
        "Authorization": f"Bearer {key}",
        "X-Conversation-Id": conversation,
        # The client's own trace: the proxy continues it.
        "traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01",
        # The client's baggage is its own data: it must not reach the engines.
        "baggage": f"note={canary}",
    }
    async with recorded_fleet(p, d, key) as (url, rp, rd):
        answers, _ = await two_turns(url, headers, canary)
        p_received, d_received = rp.traceparents(CHAT), rd.traceparents(CHAT)
        engine_headers = [r.headers for r in (*rp.received, *rd.received)]
        p_url, d_url = rp.url, rd.url
    spans = memory_spans.get_finished_spans()

    turns = sorted((s for s in spans if s.name == "kvrelay.turn"), key=lambda s: s.start_time or 0)
    assert len(turns) == 2
    expected_reuse = ["miss", "hit"]
    for index, turn in enumerate(turns):
        assert turn.context is not None and turn.parent is not None
        # The client's trace is continued, both turns under the client's span.
        assert _hex(turn.context.trace_id, 32) == CLIENT_TRACE_ID
        assert _hex(turn.parent.span_id, 16) == CLIENT_SPAN_ID
        attrs = dict(turn.attributes or {})
        assert attrs["kvrelay.route"] == "chat"
        assert attrs["kvrelay.reuse"] == expected_reuse[index]
        assert attrs["kvrelay.prefill.url"] == p_url and attrs["kvrelay.decode.url"] == d_url
        assert attrs["kvrelay.retries"] == 0
        assert attrs["http.response.status_code"] == 200
        assert attrs["kvrelay.stream"] is (index == 1)
        assert str(attrs["kvrelay.tenant"]).startswith("t")

        children = _children(spans, turn)
        assert {"kvrelay.map.take", "kvrelay.prefill", "kvrelay.decode"} <= set(children)
        take = children["kvrelay.map.take"]
        prefill, decode = children["kvrelay.prefill"], children["kvrelay.decode"]
        assert take.attributes is not None
        assert take.attributes["kvrelay.reuse"] == attrs["kvrelay.reuse"]
        for leg, engine_url in ((prefill, p_url), (decode, d_url)):
            assert leg.attributes is not None
            assert leg.attributes["kvrelay.engine.url"] == engine_url
            assert leg.attributes["http.response.status_code"] == 200
            assert leg.attributes["kvrelay.attempts"] == 1
            assert [e.name for e in leg.events] == ["attempt"]
        assert decode.attributes is not None
        assert float(str(decode.attributes["kvrelay.time_to_first_byte_s"])) > 0
        # D's params became the conversation's entry, under the D leg.
        put = _children(spans, decode).get("kvrelay.map.put")
        assert put is not None and put.attributes is not None
        assert int(str(put.attributes["kvrelay.tokens"])) > 0

        # Each engine continued the leg's span: same trace, the leg as parent.
        for received, leg in ((p_received[index], prefill), (d_received[index], decode)):
            assert received is not None
            version, trace_id, parent_id, _flags = received.split("-")
            assert leg.context is not None
            assert (version, trace_id) == ("00", CLIENT_TRACE_ID)
            assert parent_id == _hex(leg.context.span_id, 16)

    assert engine_headers and not any("baggage" in {k.lower() for k in h} for h in engine_headers)
    hit = dict(turns[1].attributes or {})
    assert int(str(hit["kvrelay.tokens_reused"])) > 0
    assert hit["kvrelay.conversation"] == dict(turns[0].attributes or {})["kvrelay.conversation"]
    # Ending the conversation released D's hold through its side channel.
    releases = [s for s in spans if s.name == "kvrelay.side_channel.release"]
    assert releases and all(r.attributes and r.attributes["kvrelay.holder"] == "decode"
                            for r in releases)  # fmt: skip
    assert any(r.attributes and r.attributes.get("kvrelay.released") is True for r in releases)

    forbidden = [canary, key, conversation, *(a for a in answers if len(a) >= 8)]
    leaks = [(s.name, text) for s in spans for text in _texts(s)
             if any(f in text for f in forbidden)]  # fmt: skip
    assert not leaks, leaks
    p.wait_idle()
    d.wait_idle()


async def test_tracing_off_sends_no_traceparent(engines: tuple[EngineSim, EngineSim]) -> None:
    p, d = engines
    assert not tracing.enabled()
    key = "sk-off-" + secrets.token_hex(12)
    headers = {"Authorization": f"Bearer {key}", "X-Conversation-Id": "off-" + secrets.token_hex(4)}
    async with recorded_fleet(p, d, key) as (url, rp, rd):
        await two_turns(url, headers, "quiet")
        received = rp.traceparents(CHAT) + rd.traceparents(CHAT)
    assert received == [None] * 4
    p.wait_idle()
    d.wait_idle()


async def test_client_headers_reach_engines_only_when_listed(
    engines: tuple[EngineSim, EngineSim],
) -> None:
    """forward_headers: none by default (engines see X-Request-Id, not the client's other
    headers); the listed ones on every leg, whatever their case."""
    p, d = engines
    key = "sk-fwd-" + secrets.token_hex(12)
    extra = {"X-Session-ID": "sess-" + secrets.token_hex(4), "X-Team": "blue"}

    def seen(recorders: tuple[HeaderRecorder, ...]) -> list[dict[str, str | None]]:
        """Per engine request: the two headers (names compared without case) and the id."""
        out = []
        for rec in recorders:
            for r in rec.received:
                if r.path == CHAT:
                    lower = {k.lower(): v for k, v in r.headers.items()}
                    assert lower.get("x-request-id")
                    out.append({n: lower.get(n.lower()) for n in ("X-Session-ID", "X-Team")})
        return out

    for listed in ([], ["x-session-id", "X-Team"]):
        headers = {"Authorization": f"Bearer {key}", **extra,
                   "X-Conversation-Id": "fwd-" + secrets.token_hex(4)}  # fmt: skip
        async with recorded_fleet(p, d, key, forward_headers=listed) as (url, rp, rd):
            await two_turns(url, headers, "forwarded")
            got = seen((rp, rd))
        assert len(got) == 4
        want = {"X-Session-ID": extra["X-Session-ID"] if listed else None,
                "X-Team": "blue" if listed else None}  # fmt: skip
        assert got == [want] * 4
    p.wait_idle()
    d.wait_idle()


class _Refused(Exception):
    status = 404


@pytest.mark.parametrize(
    ("kind", "error", "failed"),
    [("server", _Refused("no such model: canary-secret"), False),
     ("server", ValueError("prompt canary-secret"), True),
     ("client", _Refused("canary-secret"), True)],
)  # fmt: skip
def test_errors_are_recorded_by_type_only(
    memory_spans: InMemorySpanExporter, kind: tracing.SpanKind, error: Exception, failed: bool
) -> None:
    with pytest.raises(type(error)), tracing.span("kvrelay.test", kind=kind):
        raise error
    (span,) = memory_spans.get_finished_spans()
    assert span.attributes is not None and span.attributes["error.type"] == type(error).__name__
    assert span.status.status_code == (StatusCode.ERROR if failed else StatusCode.UNSET)
    assert not span.events and "canary" not in " ".join(_texts(span))


@pytest.mark.parametrize(
    ("mode", "env", "on"),
    [
        ("auto", {}, False),
        ("auto", {"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ("auto", {"OTEL_TRACES_EXPORTER": "none"}, False),
        ("auto", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
        ("auto", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ("auto", {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"}, False),
        ("on", {}, True),
        ("off", {"OTEL_TRACES_EXPORTER": "otlp"}, False),
        ("on", {"OTEL_SDK_DISABLED": "true"}, False),
        ("auto", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "TRUE"}, False),
    ],
)
def test_when_tracing_is_on(mode: TracingMode, env: dict[str, str], on: bool) -> None:
    assert tracing.wanted(mode, env) is on


def test_unsupported_exporters_stop_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(tracing.TracingConfigError, match="zipkin"):
        tracing.check("auto")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with pytest.raises(tracing.TracingConfigError, match="grpc"):
        tracing.check("auto")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert tracing.check("auto") == ["otlp"]
    assert tracing.check("off") == []


class Collector:
    """A minimal OTLP/HTTP trace receiver on loopback: `POST /v1/traces`, protobuf."""

    def __init__(self) -> None:
        self.port = free_port()
        self.requests: list[ExportTraceServiceRequest] = []
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        raw = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            raw = gzip.decompress(raw)
        self.requests.append(ExportTraceServiceRequest.FromString(raw))
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def spans(self) -> list[tuple[str, Any, dict[str, Any]]]:
        """(service name, span, attributes) of every span received."""
        out = []
        for req in self.requests:
            for resource_spans in req.resource_spans:
                resource = {a.key: a.value for a in resource_spans.resource.attributes}
                service = resource["service.name"].string_value
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        out.append((service, span, {a.key: a.value for a in span.attributes}))
        return out


async def test_spans_reach_an_otlp_http_collector(
    engines: tuple[EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> None:
    p, d = engines
    collector = Collector()
    await collector.start()
    try:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}",
            "OTEL_SERVICE_NAME": "kvrelay-otlp-test",
            "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within 0.1 s, not the default 5 s
        }
        proxy = await asyncio.to_thread(proxy_factory, [p], [d], "/ready", env=env)
        body = {"model": MODEL, "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hello over OTLP"}]}  # fmt: skip
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + CHAT, json=body) as resp:
                assert resp.status == 200, await resp.text()

            def arrived() -> bool:
                names = {span.name for _, span, _ in collector.spans()}
                return {"kvrelay.turn", "kvrelay.prefill", "kvrelay.decode"} <= names

            await asyncio.to_thread(wait_until, arrived, 20.0, what="spans at the collector")
        received = collector.spans()
        assert {service for service, _, _ in received} == {"kvrelay-otlp-test"}
        turn = next(span for _, span, _ in received if span.name == "kvrelay.turn")
        legs = [(span, attrs) for _, span, attrs in received
                if span.name in ("kvrelay.prefill", "kvrelay.decode")]  # fmt: skip
        for span, attrs in legs:
            assert span.trace_id == turn.trace_id and span.parent_span_id == turn.span_id
            assert attrs["kvrelay.engine.url"].string_value in (p.url, d.url)
    finally:
        proxy_factory.close()
        await collector.stop()
    p.wait_idle()
    d.wait_idle()


_WITHOUT_OTEL = """
import sys
from importlib.abc import MetaPathFinder

class NoOtel(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError(f"{name} is not installed (test)")
        return None

sys.meta_path.insert(0, NoOtel())
from kvrelay.proxy.config import TracingMode, load_settings
from kvrelay.proxy.http.app import create_app
from kvrelay.proxy.telemetry import tracing

create_app(load_settings({"prefill": ["http://p:1"], "decode": ["http://d:1"]}, env_file=None))
assert tracing.configure("auto") is False and not tracing.enabled()
try:
    tracing.configure("on")
except tracing.TracingConfigError as exc:
    assert "kvrelay[otel]" in str(exc), exc
else:
    raise AssertionError("tracing on without the packages must stop start-up")
assert not any(m.startswith("opentelemetry") for m in sys.modules)
print("import-safe")
"""


def test_the_proxy_runs_without_the_otel_packages() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVRELAY_"))}
    env["PYTHONPATH"] = str(REPO_ROOT)
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_OTEL], env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and "import-safe" in done.stdout, done.stderr
