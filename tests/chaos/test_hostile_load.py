"""Hostile load that takes too long for the security suite.

1. 20,000 conversation ids (and as many request ids and API-key attempts) through the proxy:
   its `/metrics` must not grow a series per conversation, request or key.
2. Thirty concurrent ~7.7 MiB bodies: the proxy answers each with its engines' answer or a
   shaped 503 for the in-flight body budget, and its memory grows by a bounded multiple of
   that budget, not by the sum of the bodies.

Run with `make test-chaos` (or `pytest -m chaos tests/chaos/test_hostile_load.py`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvrelay.devtools import EngineFactory, EngineSim, ProxyFactory, chaos_load

pytestmark = pytest.mark.chaos

MODEL = "kvrelay-sim"
CONVERSATIONS = 20_000
REAL_TURNS = 300
CONCURRENCY = 24


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[EngineSim, EngineSim]]:
    factory = EngineFactory()
    try:
        prefill, decode = factory.many(
            ("HP", ("--role", "prefill", "--lease-seconds", "10")),
            ("HD", ("--role", "decode", "--lease-seconds", "10")),
        )
        yield prefill, decode
    finally:
        factory.close()


def _series(text: str) -> set[str]:
    return {line.rpartition(" ")[0] for line in text.splitlines() if line and line[0] != "#"}


async def _many(url: str, calls: list[tuple[str, str, dict[str, str], Any]]) -> list[int]:
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(method: str, path: str, headers: dict[str, str], body: Any) -> int:
            async with gate:
                if isinstance(body, bytes):  # pre-encoded (large bodies: encode once)
                    resp = await client.request(method, path, headers=headers, content=body)
                else:
                    resp = await client.request(method, path, headers=headers, json=body)
                return resp.status_code

        return await asyncio.gather(*(one(*call) for call in calls))


@pytest.mark.timeout(900)
def test_twenty_thousand_conversations_grow_no_metric_series(
    engines: tuple[EngineSim, EngineSim],
) -> None:
    prefill, decode = engines
    proxies = ProxyFactory()
    key = "sk-" + secrets.token_hex(8)
    try:
        proxy = proxies([prefill], [decode], ready_path="/ready", api_keys=key)
        auth = {"Authorization": f"Bearer {key}"}

        def turns(start: int, stop: int) -> list[tuple[str, str, dict[str, str], Any]]:
            return [("POST", "/v1/chat/completions",
                     {**auth, "X-Conversation-Id": f"conv-{i}", "X-Request-Id": f"req-{i}"},
                     {"model": MODEL, "max_tokens": 2,
                      "messages": [{"role": "user", "content": f"conversation {i}"}]})
                    for i in range(start, stop)]  # fmt: skip

        warm = asyncio.run(_many(proxy.url, turns(0, 40)))
        assert set(warm) == {200}
        # Refusals and deletes too, so their label values exist before the baseline.
        asyncio.run(_many(proxy.url, [("DELETE", "/v1/conversations/conv-0", auth, None),
                                      ("GET", "/v1/models", {"Authorization": "Bearer no"},
                                       None)]))  # fmt: skip
        baseline = _series(proxy.metrics_text())

        ids = range(40, CONVERSATIONS)
        calls = turns(40, REAL_TURNS)
        calls += [("DELETE", f"/v1/conversations/conv-{i}", auth, None) for i in ids]
        # Bad input with a fresh conversation and request id each: refused before an engine.
        calls += [("POST", "/v1/chat/completions",
                   {**auth, "X-Conversation-Id": f"bad-{i}", "X-Request-Id": f"bad-req-{i}"},
                   {"model": MODEL, "messages": [], "max_tokens": 2})
                  for i in ids]  # fmt: skip
        # A fresh wrong key each time (tenants are key hashes).
        calls += [("GET", "/v1/models", {"Authorization": f"Bearer wrong-{i}"}, None)
                  for i in range(0, CONVERSATIONS, 4)]  # fmt: skip
        statuses = asyncio.run(_many(proxy.url, calls))
        assert statuses.count(200) >= REAL_TURNS - 40, {s: statuses.count(s) for s in statuses}
        assert statuses.count(400) == len(ids)

        text = proxy.metrics_text()
        grown = _series(text) - baseline
        assert len(grown) <= 5, sorted(grown)  # a few late label values, not one per id
        for leaked in ("conv-1234", "req-1234", "bad-1234", "wrong-1234"):
            assert leaked not in text
    finally:
        proxies.close()
    for engine in engines:
        engine.wait_idle(30)


BIG = int(7.7 * 2**20)
BUDGET = 64 * 2**20


@pytest.mark.timeout(600)
def test_thirty_large_bodies_hold_a_bounded_multiple_of_the_budget(
    engines: tuple[EngineSim, EngineSim],
) -> None:
    prefill, decode = engines
    proxies = ProxyFactory()
    try:
        proxy = proxies([prefill], [decode], ready_path="/ready",
                        inflight_body_bytes=str(BUDGET), total_timeout="120",
                        first_byte_timeout="60")  # fmt: skip
        assert proxy.process is not None and proxy.process.proc is not None
        pid = proxy.process.proc.pid
        rss_before = chaos_load.tree_rss_bytes(pid)
        peak = rss_before
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, chaos_load.tree_rss_bytes(pid))
                stop.wait(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        # A big field the engines ignore: the body crosses the proxy to P and D in full.
        body = json.dumps(
            {
                "model": MODEL,
                "max_tokens": 2,
                "metadata": {"blob": "x" * BIG},
                "messages": [{"role": "user", "content": "big body"}],
            }
        ).encode()
        headers = {"Content-Type": "application/json"}  # fmt: skip
        try:
            calls: list[tuple[str, str, dict[str, str], Any]] = [
                ("POST", "/v1/chat/completions", headers, body) for _ in range(30)
            ]
            statuses = asyncio.run(_many(proxy.url, calls))
        finally:
            stop.set()
            sampler.join(10)
        assert set(statuses) <= {200, 503}, statuses
        assert 200 in statuses and 503 in statuses, statuses
        # The budget is back once those requests are done.
        after = httpx.post(proxy.url + "/v1/chat/completions", content=body, headers=headers,
                           timeout=60)  # fmt: skip
        assert after.status_code == 200, after.text
        growth = peak - rss_before
        # Received, parsed and one leg's payload per admitted body: a few times the budget,
        # never the 30 bodies times every copy (~1.1 GiB before the budget existed).
        assert growth <= 4 * BUDGET + 64 * 2**20, growth / 2**20
    finally:
        proxies.close()
