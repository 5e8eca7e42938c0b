"""Prefill spill through the proxy, on enginesim P and D (real NIXL): under `conditional`, a turn
that would queue behind a backed-up P goes straight to a D that prefills it itself; with P idle
it goes through P, and `always_p` never spills. A spilled first turn leaves its history held on
that D, and the follow-up is served from it (D's own counters say so). Answers equal the
single-engine reference throughout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvrelay.devtools import EngineFactory, EngineSim, ProxyServer, wait_until
from kvrelay.enginesim.reference import reference_chat
from tests.proxy.client import chat_body, post, reply_of, stream, streamed_text
from tests.proxy.idle_engines import idle_around

pytestmark = pytest.mark.nixl

SYSTEM = "You are a careful assistant who explains queues. Answer briefly. " * 8
ADMIN_KEY = "spill-admin-key"
CACHE = ("--enable-prefix-caching",)
SPILLED = 'kvrelay_prefill_spilled_total{turn="%s"}'


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[EngineSim, EngineSim]]:
    """One P and one D with local prefix caches, shared by the module (start-up is slow)."""
    factory = EngineFactory()
    try:
        # D takes 20 ms a step: a long answer is still streaming while the next turn comes.
        p, d = factory.many(
            ("P", ["--role", "prefill", *CACHE]),
            ("D", ["--role", "decode", "--decode-us-per-step", "20000", *CACHE]),
        )
        yield p, d
    finally:
        factory.close()


@pytest.fixture
def idle(engines: tuple[EngineSim, EngineSim]) -> Iterator[tuple[EngineSim, EngineSim]]:
    """The engines, idle and without faults before and after the test."""
    yield from idle_around(engines, engines, clear_faults=True)


def _proxy(proxy_factory: Any, p: EngineSim, d: EngineSim, policy: str) -> ProxyServer:
    proxy: ProxyServer = proxy_factory(
        [p], [d], ready_path="/ready", routing_policy=policy, admin_key=ADMIN_KEY,
        load_poll_interval_s="0.3",
    )  # fmt: skip
    return proxy


def _prefill_waiting(proxy: ProxyServer, role: str = "prefill") -> float | None:
    """The queue the proxy last read from its P's (or D's) `/metrics` (None: no fresh reading)."""
    status, answer, _ = proxy.call(
        "GET", "/admin/backends", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert status == 200, answer
    load = answer[role][0]["load"]
    return None if load is None or load["age_s"] > 0.6 else float(load["waiting"])


def _back_up(p: EngineSim, proxy: ProxyServer, waiting: int) -> None:
    """P reports `waiting` queued requests (other clients' work), and the proxy has read it."""
    assert p.request("/admin/faults", {"extra_waiting": waiting})[0] == 200
    wait_until(lambda: _prefill_waiting(proxy) == waiting, 10, what="the proxy to read P's queue")


def _turn(proxy: ProxyServer, messages: list[dict[str, Any]], conv: str, streamed: bool) -> str:
    headers = {"X-Conversation-Id": conv}
    body = chat_body(messages)
    if streamed:
        status, events, raw = stream(proxy.url, "/v1/chat/completions", body, headers)
        assert status == 200, raw
        return streamed_text(events, chat=True)
    resp = post(proxy.url, "/v1/chat/completions", body, headers)
    # The account says who computed the prompt.
    assert resp.headers["x-kvrelay-prefilled-by"] in ("prefill", "decode")
    return reply_of(resp)


def _converse(
    proxy: ProxyServer, messages: list[dict[str, Any]], conv: str, question: str, streamed: bool
) -> None:
    messages.append({"role": "user", "content": question})
    answer = _turn(proxy, messages, conv, streamed)
    assert answer == reference_chat(messages, 12)
    messages.append({"role": "assistant", "content": answer})


def test_a_first_turn_spills_to_d_when_p_is_backed_up_and_its_follow_up_reuses_d(
    idle: tuple[EngineSim, EngineSim], proxy_factory: Any
) -> None:
    p, d = idle
    proxy = _proxy(proxy_factory, p, d, "conditional")
    wait_until(lambda: _prefill_waiting(proxy) == 0, 10, what="a fresh reading of P")
    # P idle: the first turn goes through P.
    p_before = p.metric("enginesim_requests_total")
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    _converse(proxy, messages, "spill-idle", "What is a queue?", streamed=False)
    assert p.metric("enginesim_requests_total") == p_before + 1
    assert SPILLED % "first" not in proxy.metrics()
    assert proxy.call("DELETE", "/v1/conversations/spill-idle")[0] == 200

    # P reports three queued prompts (each counted at this turn's size): waiting there takes
    # longer than D prefilling the turn itself, so the turn goes straight to D.
    _back_up(p, proxy, 3)
    p_before = p.metric("enginesim_requests_total")
    d_computed = d.metric("enginesim_prompt_tokens_computed_total")
    messages = [{"role": "system", "content": SYSTEM}]
    _converse(proxy, messages, "spill-1", "What is a queue?", streamed=True)
    assert p.metric("enginesim_requests_total") == p_before, "the spilled turn skips P"
    assert d.metric("enginesim_prompt_tokens_computed_total") > d_computed
    m = proxy.metrics()
    assert m[SPILLED % "first"] == 1
    assert m['kvrelay_routing_decisions_total{decision="spilled"}'] == 1
    wait_until(lambda: d.metric("enginesim_requests_held") == 1, 10, what="D to hold the turn")

    # P free again. The short follow-up goes straight to the D holding the history (which
    # needs the spilled turn's entry to carry its characters per token) and D serves the
    # history from its own held blocks.
    assert p.request("/admin/faults", {"extra_waiting": 0})[0] == 200
    wait_until(lambda: _prefill_waiting(proxy) == 0, 10, what="the proxy to read P free")
    d_cached = d.metric("enginesim_prompt_tokens_cached_total")
    _converse(proxy, messages, "spill-1", "And a stack?", streamed=False)
    assert p.metric("enginesim_requests_total") == p_before, "the follow-up skips P too"
    assert d.metric("enginesim_prompt_tokens_cached_total") - d_cached > 100
    assert proxy.metrics()['kvrelay_routing_decisions_total{decision="decode_only"}'] == 1
    wait_until(lambda: d.metric("enginesim_requests_held") == 1, 10, what="one hold on D")
    assert proxy.call("DELETE", "/v1/conversations/spill-1")[0] == 200


def test_always_p_never_spills(idle: tuple[EngineSim, EngineSim], proxy_factory: Any) -> None:
    p, d = idle
    proxy = _proxy(proxy_factory, p, d, "always_p")
    _back_up(p, proxy, 3)
    p_before = p.metric("enginesim_requests_total")
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    _converse(proxy, messages, "spill-never", "What is a queue?", streamed=False)
    assert p.metric("enginesim_requests_total") == p_before + 1
    m = proxy.metrics()
    assert SPILLED % "first" not in m
    assert m.get('kvrelay_routing_decisions_total{decision="spilled"}', 0.0) == 0
    assert proxy.call("DELETE", "/v1/conversations/spill-never")[0] == 200


def test_a_busy_d_takes_no_spill(idle: tuple[EngineSim, EngineSim], proxy_factory: Any) -> None:
    p, d = idle
    proxy = _proxy(proxy_factory, p, d, "conditional")
    # D reports more queued requests than decode_max_waiting (4): busy, so the turn waits for
    # P however backed up P is.
    assert d.request("/admin/faults", {"extra_waiting": 5})[0] == 200
    wait_until(lambda: _prefill_waiting(proxy, "decode") == 5, 10, what="the proxy to read D busy")
    _back_up(p, proxy, 3)
    p_before = p.metric("enginesim_requests_total")
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    _converse(proxy, messages, "spill-busy", "What is a queue?", streamed=False)
    assert p.metric("enginesim_requests_total") == p_before + 1
    assert SPILLED % "first" not in proxy.metrics()
    assert proxy.call("DELETE", "/v1/conversations/spill-busy")[0] == 200


def test_a_streamed_spill_stops_counting_against_ds_budget_at_its_first_token(
    idle: tuple[EngineSim, EngineSim], proxy_factory: Any
) -> None:
    p, d = idle
    # A budget of one prompt (about 400 tokens), not two: D takes a second spill only once
    # the first is prefilled.
    proxy: ProxyServer = proxy_factory(
        [p], [d], ready_path="/ready", routing_policy="conditional", admin_key=ADMIN_KEY,
        load_poll_interval_s="0.3", prefill_spill_max_inflight_tokens="600",
    )  # fmt: skip
    _back_up(p, proxy, 3)
    p_before = p.metric("enginesim_requests_total")
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Go on."}]
    body = {**chat_body(first, max_tokens=150), "stream": True}
    headers = {"X-Conversation-Id": "spill-long"}
    with httpx.stream(
        "POST", proxy.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: {")), "no first token"
        # The long answer streams on (150 steps of 20 ms); D has prefilled its prompt.
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        _converse(proxy, messages, "spill-next", "What is a queue?", streamed=False)
        assert d.metric("enginesim_requests_running") >= 1, "the first answer ended too soon"
        for _ in lines:
            pass
    assert p.metric("enginesim_requests_total") == p_before, "both turns skip P"
    assert proxy.metrics()[SPILLED % "first"] == 2
    for conversation in ("spill-long", "spill-next"):
        assert proxy.call("DELETE", f"/v1/conversations/{conversation}")[0] == 200
