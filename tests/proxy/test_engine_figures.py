"""Reuse figures from an engine that lies, and errors after a stream started.

An engine's counts are believed only as counts a prompt can have (`accounting.MAX_ENGINE_COUNT`,
a split no larger than its prompt): anything else is `unknown`, the answer is served, and no
absurd value reaches the proxy's counters (`FakeFiguresEngine` says what each test tells it).
An unexpected error once a stream's headers are out ends that stream with an error event and a
clean close: never a second HTTP response inside the first one's body.
"""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvrelay.devtools import ProxyFactory, ProxyServer, ThreadedApp
from kvrelay.proxy.config import load_settings
from kvrelay.proxy.http.app import create_app
from kvrelay.proxy.turn import TurnReport
from tests.harness import free_port, wait_until
from tests.proxy.fake_figures_engine import MODEL, PROMPT_TOKENS, FakeFiguresEngine

HUGE = 10**400  # past a float's range: a Prometheus counter cannot take it


@pytest.fixture
def engine() -> Iterator[FakeFiguresEngine]:
    fake = FakeFiguresEngine().start()
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def proxy(engine: FakeFiguresEngine, proxy_factory: ProxyFactory) -> ProxyServer:
    return proxy_factory([engine.url], [engine.url], ready_path="/ready")


def _chat(proxy: ProxyServer, stream: bool) -> tuple[int, dict[str, str], Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 2}  # fmt: skip
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    resp = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30)
    if not stream:
        return resp.status_code, dict(resp.headers), resp.json()
    events = [line[6:] for line in resp.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", resp.text
    return resp.status_code, dict(resp.headers), [json.loads(e) for e in events[:-1]]


def _sane_counters(proxy: ProxyServer) -> None:
    for name, value in proxy.metrics().items():
        assert math.isfinite(value) and abs(value) < 1e15, (name, value)


REPORT = {"kvr_prompt_tokens": PROMPT_TOKENS, "kvr_local_hit_tokens": 4, "kvr_loaded_tokens": 8}
ABSURD_REPORTS = {
    "huge": {**REPORT, "kvr_local_hit_tokens": HUGE},
    "1e30": {**REPORT, "kvr_loaded_tokens": 10**30},
    "negative": {**REPORT, "kvr_loaded_tokens": -5},
    "more_than_the_prompt": {**REPORT, "kvr_prompt_tokens": 10, "kvr_local_hit_tokens": 2000},
    "prompt_huge": {**REPORT, "kvr_prompt_tokens": HUGE},
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", list(ABSURD_REPORTS))
def test_an_absurd_connector_report_is_unknown_and_counted_nowhere(
    engine: FakeFiguresEngine, proxy: ProxyServer, case: str, stream: bool
) -> None:
    engine.prefill_params = ABSURD_REPORTS[case]
    status, headers, answer = _chat(proxy, stream)
    assert status == 200
    if stream:
        usage = answer[-1]["usage"]
        assert usage["kvrelay"]["reused_tokens"] is None
        assert usage["kvrelay"]["local_hit_tokens"] is None
    else:
        assert headers["x-kvrelay-reused-tokens"] == "unknown"
        assert headers["x-kvrelay-local-hit-tokens"] == "unknown"
    _sane_counters(proxy)


def test_a_sane_report_is_returned_as_the_engine_gave_it(
    engine: FakeFiguresEngine, proxy: ProxyServer
) -> None:
    # The same path with figures a prompt can have: the checks above are not "always unknown".
    engine.prefill_params = REPORT
    _, headers, _ = _chat(proxy, stream=False)
    assert headers["x-kvrelay-local-hit-tokens"] == "4"
    assert headers["x-kvrelay-loaded-tokens"] == "8"
    assert headers["x-kvrelay-reused-tokens"] == "12"


@pytest.mark.parametrize(
    "figures",
    [
        {"prefill_params": {"remote_prefill_cached_tokens": HUGE}},
        {"prefill_usage": {"prompt_tokens_details": {"cached_tokens": 10**5000}}},
        {"prefill_usage": {"prompt_tokens": HUGE}},
        {"prefill_usage": {"prompt_tokens_details": {"cached_tokens": PROMPT_TOKENS + 1}}},
        {"prefill_params": {"kvr_refused_blocks": {"hash": HUGE, "partial": 10**30}}, "report": 1},
    ],
    ids=["cached_huge", "usage_cached_huge", "usage_prompt_huge", "cached_over_prompt",
         "refused_huge"],
)  # fmt: skip
def test_absurd_usage_and_vllm_figures_are_unknown(
    engine: FakeFiguresEngine, proxy: ProxyServer, figures: dict[str, Any]
) -> None:
    engine.prefill_params = {**(REPORT if figures.pop("report", 0) else {}),
                             **figures.get("prefill_params", {})}  # fmt: skip
    engine.prefill_usage = figures.get("prefill_usage", {})
    for stream in (False, True):
        status, _, _ = _chat(proxy, stream)
        assert status == 200
    _sane_counters(proxy)


def test_an_absurd_decode_usage_in_a_stream_is_served(
    engine: FakeFiguresEngine, proxy: ProxyServer
) -> None:
    engine.decode_usage = {"prompt_tokens": HUGE, "completion_tokens": HUGE}
    engine.decode_params = {"kvr_prompt_tokens": HUGE, "kvr_local_hit_tokens": 1,
                            "kvr_loaded_tokens": 1}  # fmt: skip
    for stream in (False, True):
        status, _, _ = _chat(proxy, stream)
        assert status == 200
    _sane_counters(proxy)


# -- an error after the stream started ----------------------------------------------------------


def _http(port: int, body: bytes) -> bytes:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    head += b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    return head + body


def _read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One HTTP/1.1 response with a chunked body: (head, de-chunked body). Fails on anything
    that is not a chunk where a chunk belongs (a second status line, say)."""
    buf = b""

    def need(n: int) -> None:
        nonlocal buf
        while len(buf) < n:
            data = sock.recv(65536)
            assert data, f"connection closed mid-response: {buf!r}"
            buf += data

    def line() -> bytes:
        nonlocal buf
        while b"\r\n" not in buf:
            need(len(buf) + 1)
        out, _, buf = buf.partition(b"\r\n")
        return out

    head = []
    while (text := line()) != b"":
        head.append(text)
    assert head[0].startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding: chunked" in b"\n".join(head).lower(), head
    body = b""
    while True:
        size = int(line(), 16)  # a status line here would not parse
        need(size + 2)
        body, buf = body + buf[:size], buf[size + 2 :]
        if size == 0:
            assert buf == b"", f"bytes after the response's end: {buf!r}"
            return b"\n".join(head), body


def test_an_error_after_the_stream_started_ends_it_cleanly(
    engine: FakeFiguresEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The proxy's own app, in this process, so that a bug can be planted after the stream's
    # headers left: settling the turn's account raises. The client must get one response, its
    # stream ending in an error event, and the connection must serve the next request.
    def broken(self: TurnReport) -> Any:
        raise RuntimeError("a bug after the stream started")

    settings = load_settings({"prefill": [engine.url], "decode": [engine.url]}, env_file=None)
    port = free_port()
    server = ThreadedApp(create_app(settings), port, "proxy-in-process")
    server.start()
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200, 20,
                   what="the in-process proxy to be ready")  # fmt: skip
        monkeypatch.setattr(TurnReport, "count_accounts", broken)
        stream = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 2, "stream": True}  # fmt: skip
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(_http(port, json.dumps(stream).encode()))
            _, body = _read_response(sock)
            events = [e for e in body.split(b"\n\n") if e]
            last = json.loads(events[-1].removeprefix(b"data: "))
            assert last["error"]["code"] == "internal_error", events
            assert b"[DONE]" not in body  # not a whole answer: the client knows it failed
            monkeypatch.undo()
            sock.sendall(_http(port, json.dumps(stream).encode()))  # the same connection
            _, body = _read_response(sock)
            assert body.endswith(b"data: [DONE]\n\n"), body
    finally:
        server.stop()
