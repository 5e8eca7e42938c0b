"""A spilled turn whose holder cannot take it reads the held history from the holder, on
enginesim P and two Ds (real NIXL): P is backed up, so the conversation's next turn spills to a
D; its holder is busy, so the turn goes to the other D, which loads the history from the
holder's held blocks (its own counter says so) and computes only the rest, as P would have.
With `prefix_pull` off that D computes the whole prompt and the proxy gives the hold back.
Answers equal the single-engine reference either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvrelay.devtools import EngineFactory, EngineSim, ProxyFactory, ProxyServer, wait_until
from kvrelay.enginesim.reference import reference_chat
from tests.proxy.client import chat_body, post, reply_of
from tests.proxy.idle_engines import idle_around

pytestmark = pytest.mark.nixl

ADMIN_KEY = "spill-reads-hold-admin-key"
CACHE = ("--enable-prefix-caching",)
LOADED = "enginesim_prompt_tokens_loaded_total"
COMPUTED = "enginesim_prompt_tokens_computed_total"
HELD = "enginesim_requests_held"
READ = 'kvrelay_hold_decisions_total{decision="read"}'
UNREAD = 'kvrelay_hold_decisions_total{decision="unread"}'
PULLED = 'kvrelay_prefix_pulls_total{leg="decode",result="pulled"}'
FOUND = 'kvrelay_held_reads_total{result="found"}'
GONE = 'kvrelay_held_reads_total{result="gone"}'


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[EngineSim, EngineSim, EngineSim]]:
    """One P and two Ds with local prefix caches, shared by the module (start-up is slow)."""
    factory = EngineFactory()
    try:
        p, d0, d1 = factory.many(
            ("P", ["--role", "prefill", *CACHE]),
            ("D0", ["--role", "decode", *CACHE]),
            ("D1", ["--role", "decode", *CACHE]),
        )
        yield p, d0, d1
    finally:
        factory.close()


@pytest.fixture
def idle(
    engines: tuple[EngineSim, EngineSim, EngineSim],
) -> Iterator[tuple[EngineSim, EngineSim, EngineSim]]:
    """The engines, idle and without faults before and after the test."""
    yield from idle_around(engines, engines, clear_faults=True)


def _waiting(proxy: ProxyServer, role: str, url: str) -> float | None:
    """The queue the proxy last read from the engine at `url` (None: no fresh reading)."""
    status, answer, _ = proxy.call(
        "GET", "/admin/backends", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert status == 200, answer
    (backend,) = (b for b in answer[role] if b["url"] == url)
    load = backend["load"]
    return None if load is None or load["age_s"] > 0.6 else float(load["waiting"])


def _report_waiting(proxy: ProxyServer, engine: EngineSim, role: str, waiting: int) -> None:
    """`engine` reports `waiting` queued requests (other clients' work); the proxy read it."""
    assert engine.request("/admin/faults", {"extra_waiting": waiting})[0] == 200
    wait_until(
        lambda: _waiting(proxy, role, engine.url) == waiting, 10, what="the proxy to read it"
    )


def _converse(proxy: ProxyServer, messages: list[dict[str, Any]], conv: str, question: str) -> None:
    messages.append({"role": "user", "content": question})
    resp = post(proxy.url, "/v1/chat/completions", chat_body(messages), {"X-Conversation-Id": conv})
    answer = reply_of(resp)
    assert answer == reference_chat(messages, 12)
    messages.append({"role": "assistant", "content": answer})


def _first_turn_held(
    proxy: ProxyServer, engines: tuple[EngineSim, EngineSim, EngineSim], conv: str
) -> tuple[list[dict[str, Any]], EngineSim, EngineSim]:
    """Turn 1 through the idle P; returns the messages, the D holding it and the other D. The
    system prompt names the conversation: no engine's cache holds an earlier test's."""
    p, d0, d1 = engines
    system = f"You are a careful assistant who keeps {conv} where it was decoded. " * 8
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    before = p.metric("enginesim_requests_total")
    _converse(proxy, messages, conv, "Where is my history kept?")
    assert p.metric("enginesim_requests_total") == before + 1, "turn 1 went through P"
    wait_until(lambda: d0.metric(HELD) + d1.metric(HELD) == 1, 10, what="one D to hold turn 1")
    return (messages, d0, d1) if d0.metric(HELD) == 1 else (messages, d1, d0)


def _spill_past_a_busy_holder(
    proxy: ProxyServer, p: EngineSim, holder: EngineSim, other: EngineSim
) -> None:
    """P backed up (the next turn spills) and the holder busy (it takes no spill)."""
    _report_waiting(proxy, holder, "decode", 5)  # over decode_max_waiting (4)
    _report_waiting(proxy, p, "prefill", 3)
    assert _waiting(proxy, "decode", other.url) == 0


def _proxy(
    proxy_factory: ProxyFactory, engines: tuple[EngineSim, EngineSim, EngineSim], pull: bool
) -> ProxyServer:
    p, d0, d1 = engines
    proxy: ProxyServer = proxy_factory(
        [p], [d0, d1], ready_path="/ready", routing_policy="conditional", admin_key=ADMIN_KEY,
        load_poll_interval_s="0.3", prefix_pull_min_tokens="32",
        prefix_pull="true" if pull else "false",
    )  # fmt: skip
    return proxy


def test_a_spill_past_a_busy_holder_reads_the_held_history_from_it(
    idle: tuple[EngineSim, EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> None:
    p = idle[0]
    proxy = _proxy(proxy_factory, idle, pull=True)
    messages, holder, other = _first_turn_held(proxy, idle, "reads-hold")
    _spill_past_a_busy_holder(proxy, p, holder, other)
    p_before = p.metric("enginesim_requests_total")
    loaded, computed = other.metric(LOADED), other.metric(COMPUTED)
    holder_requests = holder.metric("enginesim_requests_total")

    _converse(proxy, messages, "reads-hold", "And who reads it?")

    assert p.metric("enginesim_requests_total") == p_before, "the turn spilled past P"
    assert holder.metric("enginesim_requests_total") == holder_requests, "not on the holder"
    # The other D loaded the history from the holder's blocks and computed the rest only.
    history = other.metric(LOADED) - loaded
    assert history > 100
    last_turn = other.metric(COMPUTED) - computed
    assert 0 < last_turn < history
    m = proxy.metrics()
    assert m[READ] == 1 and m.get(UNREAD, 0.0) == 0
    assert m[PULLED] == 1
    assert m[FOUND] == 1 and m.get(GONE, 0.0) == 0  # the other D's report: the hold was there
    # The read freed the holder's blocks; the other D holds the new turn.
    wait_until(lambda: holder.metric(HELD) == 0, 10, what="the holder's hold to end")
    wait_until(lambda: other.metric(HELD) == 1, 10, what="the other D to hold turn 2")
    assert proxy.call("DELETE", "/v1/conversations/reads-hold")[0] == 200


def test_without_prefix_pull_the_other_d_computes_the_history_and_the_hold_is_given_back(
    idle: tuple[EngineSim, EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> None:
    p = idle[0]
    proxy = _proxy(proxy_factory, idle, pull=False)
    messages, holder, other = _first_turn_held(proxy, idle, "computes-history")
    _spill_past_a_busy_holder(proxy, p, holder, other)
    loaded, computed = other.metric(LOADED), other.metric(COMPUTED)

    _converse(proxy, messages, "computes-history", "And who reads it?")

    assert other.metric(LOADED) == loaded
    assert other.metric(COMPUTED) - computed > 100  # the whole prompt, history and all
    m = proxy.metrics()
    assert m[UNREAD] == 1 and m.get(READ, 0.0) == 0
    assert m.get(PULLED, 0.0) == 0
    assert m.get(FOUND, 0.0) == m.get(GONE, 0.0) == 0  # no engine was sent the held history
    wait_until(lambda: holder.metric(HELD) == 0, 10, what="the proxy to give the hold back")
    wait_until(lambda: other.metric(HELD) == 1, 10, what="the other D to hold turn 2")
    assert proxy.call("DELETE", "/v1/conversations/computes-history")[0] == 200
