"""A slow answer is a timeout for its request, not a strike against the engine that computes it.

A non-streamed answer arrives whole, so one that takes longer than `first_byte_timeout` to
generate times out however healthy its engine is. With `eject_after_failures=1` a single such
timeout counted against an engine would eject it; the long requests must get a shaped 504 and
every engine must stay in its pool, the other key served throughout. An engine that accepts a
request and then says nothing, and fails its health probe as well, is still judged at fault:
a failure is charged to it (toward its ejection), and its request fails as the engine's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from kvrelay.devtools import EngineFactory, FaultProxy, ProxyFactory, ProxyServer, chaos_load
from kvrelay.enginesim.reference import reference_chat
from tests.harness import wait_until

MODEL = "kvrelay-sim"
ADMIN = "slow-admin-key"


def _chat(proxy: ProxyServer, content: str, max_tokens: int, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, **extra}  # fmt: skip
    return httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=60)


def _backends(proxy: ProxyServer) -> list[dict[str, Any]]:
    status, body, _ = proxy.call("GET", "/admin/backends",
                                 headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
    assert status == 200, body
    return [b for role in body.values() for b in role]


@pytest.fixture
def blackhole() -> Iterator[list[FaultProxy]]:
    relays: list[FaultProxy] = []
    yield relays
    for relay in relays:
        relay.stop()


def test_a_long_non_streamed_answer_times_out_without_ejecting_engines(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    # 2 ms per decoded token: 1500 tokens take 3 s, past the 1 s first-byte timeout.
    slow = ("--decode-us-per-step", "2000")
    p, d1, d2 = engine_factory.many(
        ("SP", ("--role", "prefill")), ("SD1", ("--role", "decode", *slow)),
        ("SD2", ("--role", "decode", *slow)),
    )  # fmt: skip
    proxy = proxy_factory([p], [d1, d2], ready_path="/ready", first_byte_timeout="1",
                          eject_after_failures="1", admin_key=ADMIN)  # fmt: skip
    long_done = threading.Event()
    quick: list[tuple[int, bool]] = []

    def quick_loop() -> None:
        i = 0
        while not long_done.is_set():
            content = f"quick question {i}"
            resp = _chat(proxy, content, 4)
            right = resp.status_code == 200 and resp.json()["choices"][0]["message"][
                "content"
            ] == reference_chat([{"role": "user", "content": content}], 4)
            quick.append((resp.status_code, right))
            i += 1

    with ThreadPoolExecutor(max_workers=3) as pool:
        other = pool.submit(quick_loop)
        try:
            longs = list(pool.map(
                lambda i: _chat(proxy, f"Write a long essay #{i}.", 1500, ignore_eos=True),
                range(2),
            ))  # fmt: skip
        finally:
            long_done.set()
        other.result()

    for resp in longs:
        body = resp.json()
        assert resp.status_code == 504 and chaos_load.is_openai_error(body), resp.text
        assert body["error"]["code"] == "decode_timeout", body
        assert "first_byte_timeout" in body["error"]["message"], body
        assert "127.0.0.1" not in body["error"]["message"], body
    # Every engine stayed in its pool, and the other requests were all answered, right.
    assert all(b["healthy"] for b in _backends(proxy)), _backends(proxy)
    assert quick and all(q == (200, True) for q in quick), quick
    proxy.stop()
    for engine in (p, d1, d2):
        engine.wait_idle(20)


def test_an_engine_that_hangs_and_fails_its_probe_is_ejected(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory, blackhole: list[FaultProxy]
) -> None:
    p, d = engine_factory.many(("HP", ("--role", "prefill")), ("HD", ("--role", "decode")))
    relay = FaultProxy("127.0.0.1", d.port).start()
    blackhole.append(relay)
    # Background probes once a minute: the failure charged is the request's own judgement.
    proxy = proxy_factory([p], [relay.url], ready_path="/ready", first_byte_timeout="1",
                          probe_timeout_s="0.5", probe_interval_s="60",
                          admin_key=ADMIN)  # fmt: skip
    relay.blackhole(True)  # accepts, never answers: neither the request nor /health
    relay.drop_all()  # not even on the connections the proxy keeps open
    resp = _chat(proxy, "are you there", 4)
    body = resp.json()
    # The engine's fault, not a slow answer: no decode_timeout, and a failure charged to it.
    assert resp.status_code == 502 and body["error"]["code"] == "decode_unavailable", body
    hung = next(b for b in _backends(proxy) if b["url"] == relay.url)
    assert hung["consecutive_failures"] >= 1, hung
    assert hung["last_error"] == (
        "no answer within the first-byte timeout; health probe failed: TimeoutError"
    ), hung
    relay.heal()
    proxy.stop()
    wait_until(lambda: d.pool_idle() and p.pool_idle(), 20, what="engines idle")
