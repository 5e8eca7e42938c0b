"""Multi-turn routing policies through the proxy, on enginesim P and D (real NIXL) whose local
prefix caches are on: P affinity makes turn N+1's P load from D only what its own cache lacks;
conditional routing sends short follow-ups straight to the D holding the conversation. Answers
equal the single-engine reference in every mode, and nothing stays held afterwards, also when
D is busy (the follow-up goes through P) or fails a decode-only turn (the old hold is given back).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from kvrelay.devtools import (
    EngineFactory,
    EngineSim,
    ProxyFactory,
    ProxyServer,
    free_port,
    kv_events_args,
    wait_until,
)
from kvrelay.enginesim.reference import reference_chat
from tests.proxy.client import MODEL, chat_body, post, reply_of, stream, streamed_text
from tests.proxy.events_heard import until_events_heard
from tests.proxy.idle_engines import idle_around

pytestmark = pytest.mark.nixl

SYSTEM = "You are a careful assistant who explains caches. Answer briefly. " * 8
QUESTIONS = ["What is a cache?", "And a block?", "Why reuse it?", "Thanks, and then?"]
ADMIN_KEY = "routing-admin-key"
PULLS = "kvrelay_prefix_pulls_total"
CACHE = ("--enable-prefix-caching",)
# Both Ps publish their KV cache events (vLLM's flag), on these ports: chosen by `engines` just
# before the engines start, not at import, where another test worker could take one meanwhile.
EVENTS_PORTS: dict[str, int] = {}


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[EngineSim, EngineSim, EngineSim]]:
    """Two P and one D with local prefix caches, shared by the module (start-up is slow)."""
    factory = EngineFactory()
    EVENTS_PORTS.update(P0=free_port(), P1=free_port())
    try:
        p0, p1, d = factory.many(
            ("P0", ["--role", "prefill", *CACHE, *kv_events_args(EVENTS_PORTS["P0"])]),
            ("P1", ["--role", "prefill", *CACHE, *kv_events_args(EVENTS_PORTS["P1"])]),
            ("D", ["--role", "decode", *CACHE]),
        )
        yield p0, p1, d
    finally:
        factory.close()


@pytest.fixture
def idle(
    engines: tuple[EngineSim, EngineSim, EngineSim],
) -> Iterator[tuple[EngineSim, EngineSim, EngineSim]]:
    """The engines, idle before and after the test."""
    yield from idle_around(engines, engines)


def _events_proxy(
    proxy_factory: ProxyFactory, engines: tuple[EngineSim, EngineSim, EngineSim], **settings: str
) -> ProxyServer:
    """A proxy in front of the module's engines that follows both Ps' KV events, its
    routing-fed index's entries expiring at once (the events alone say what each P caches)."""
    p0, p1, d = engines
    endpoints = ",".join(
        f"{p.url}=tcp://127.0.0.1:{EVENTS_PORTS[name]}" for p, name in ((p0, "P0"), (p1, "P1"))
    )
    proxy = proxy_factory(
        [p0, p1],
        [d],
        ready_path="/ready",
        admin_key=ADMIN_KEY,
        kv_events_endpoints=endpoints,
        prefix_index_ttl_s="0.001",
        **settings,
    )
    for p in (p0, p1):
        until_events_heard(proxy, p)
    return proxy


def _turn(
    proxy: ProxyServer, messages: list[dict[str, Any]], conversation: str, streamed: bool
) -> str:
    headers = {"X-Conversation-Id": conversation}
    body = chat_body(messages)
    if streamed:
        status, events, raw = stream(proxy.url, "/v1/chat/completions", body, headers)
        assert status == 200, raw
        return streamed_text(events, chat=True)
    return reply_of(post(proxy.url, "/v1/chat/completions", body, headers))


def _admin(proxy: ProxyServer, method: str, path: str, body: dict[str, Any]) -> None:
    status, answer, _ = proxy.call(
        method, path, body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert status in (200, 201), answer


def _p_loads(
    policy: str,
    engines: tuple[EngineSim, EngineSim, EngineSim],
    proxy_factory: ProxyFactory,
    conversation: str,
    **settings: Any,
) -> tuple[list[float], float]:
    """Run QUESTIONS with turn 1 on P1 (P0 drained), P0 back for the later turns.

    Returns the tokens P loaded from D per later turn, and P0's requests meanwhile."""
    p0, p1, d = engines
    proxy = proxy_factory(
        [p0, p1],
        [d],
        ready_path="/ready",
        routing_policy=policy,
        admin_key=ADMIN_KEY,
        **settings,
    )
    _admin(proxy, "POST", "/admin/backends/drain", {"role": "prefill", "url": p0.url})
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    loads: list[float] = []
    p0_requests = p0.metric("enginesim_requests_total")
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        before = p0.metrics(), p1.metrics()
        answer = _turn(proxy, messages, conversation, streamed=turn % 2 == 1)
        assert answer == reference_chat(messages, 12)
        messages.append({"role": "assistant", "content": answer})
        after = p0.metrics(), p1.metrics()
        name = "enginesim_prompt_tokens_loaded_total"
        if turn == 0:
            # Both Ps are candidates from now on; with equal load the first one is chosen.
            _admin(proxy, "POST", "/admin/backends", {"role": "prefill", "url": p0.url})
            p0_requests = after[0].get("enginesim_requests_total", 0.0)
        else:
            loads.append(
                sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before, strict=True))
            )
    p0_used = p0.metric("enginesim_requests_total") - p0_requests
    assert proxy.call("DELETE", f"/v1/conversations/{conversation}")[0] == 200
    proxy.stop()
    return loads, p0_used


def test_prefill_affinity_loads_only_what_ps_own_cache_lacks(
    idle: tuple[EngineSim, EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> None:
    p1 = idle[1]
    cached_before = p1.metric("enginesim_prompt_tokens_cached_total")
    sticky, p0_used = _p_loads("affinity", idle, proxy_factory, "aff-1")
    assert p0_used == 0, "every later turn should go to the P that served the first"
    assert p1.metric("enginesim_prompt_tokens_cached_total") > cached_before
    # always_p by load alone sends the later turns to the other P, whose cache does not have
    # this history.
    moving, p0_used = _p_loads("always_p", idle, proxy_factory, "aff-2", prefix_routing="false")
    assert p0_used == len(QUESTIONS) - 1
    # Turn 2 is where they differ (without affinity P0 then has this history cached too):
    # the other P loads the whole history from D, the previous P only what lies beyond its
    # own previous prompt, at most the previous reply's blocks and the new message's.
    assert moving[0] > 8 * sticky[0]
    assert all(a <= b for a, b in zip(sticky, moving, strict=True))


def _conditional_proxy(
    engines: tuple[EngineSim, EngineSim, EngineSim], proxy_factory: ProxyFactory, **settings: str
) -> ProxyServer:
    """A `conditional` proxy in front of the module's engines whose decode-only turns may leave
    up to 120 tokens for D to prefill."""
    p0, p1, d = engines
    return proxy_factory(
        [p0, p1],
        [d],
        ready_path="/ready",
        routing_policy="conditional",
        conditional_max_uncached_tokens="120",
        **settings,
    )


def test_conditional_sends_short_follow_ups_straight_to_the_holding_d(
    idle: tuple[EngineSim, EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> None:
    p0, p1, d = idle
    proxy = _conditional_proxy(idle, proxy_factory)
    p_requests = p0.metric("enginesim_requests_total") + p1.metric("enginesim_requests_total")
    d_cached = d.metric("enginesim_prompt_tokens_cached_total")
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        answer = _turn(proxy, messages, "cond-1", streamed=turn % 2 == 0)
        assert answer == reference_chat(messages, 12)
        messages.append({"role": "assistant", "content": answer})
        # The turn's hold replaced the previous one: D holds exactly one request (the old
        # hold is given back in the background once D finished the turn).
        wait_until(lambda: d.metric("enginesim_requests_held") == 1, 10, what="one hold on D")
    p_now = p0.metric("enginesim_requests_total") + p1.metric("enginesim_requests_total")
    assert p_now - p_requests == 1, "only the first turn needs P"
    assert d.metric("enginesim_prompt_tokens_cached_total") > d_cached
    m = proxy.metrics()
    assert m['kvrelay_routing_decisions_total{decision="decode_only"}'] == len(QUESTIONS) - 1
    # A long new message is more than the threshold: through P again, still correct.
    messages.append({"role": "user", "content": "Please explain it all again. " * 40})
    assert _turn(proxy, messages, "cond-1", streamed=False) == reference_chat(messages, 12)
    p_after = p0.metric("enginesim_requests_total") + p1.metric("enginesim_requests_total")
    assert p_after - p_now == 1
    wait_until(lambda: d.metric("enginesim_requests_held") == 1, 10, what="one hold on D")
    assert proxy.call("DELETE", "/v1/conversations/cond-1")[0] == 200


@pytest.mark.parametrize("cached_route", [True, False])
def test_a_request_whose_prefix_d_decoded_goes_straight_to_d_with_decode_only_cached(
    idle: tuple[EngineSim, EngineSim, EngineSim], proxy_factory: ProxyFactory, cached_route: bool
) -> None:
    """No held history (another conversation sharing the system prompt), but D decoded that
    prompt: with `decode_only_cached` the request goes straight to D, whose own prefix cache
    serves the system prompt (D's count of cached tokens grows, no P is asked); without it the
    request goes through P."""
    p0, p1, d = idle
    proxy = _conditional_proxy(
        idle,
        proxy_factory,
        decode_only_cached=str(cached_route).lower(),
        prefill_spill_factor="0",
    )
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me."}]
    assert _turn(proxy, first, "cached-a", streamed=False) == reference_chat(first, 12)
    p_requests = p0.metric("enginesim_requests_total") + p1.metric("enginesim_requests_total")
    d_cached = d.metric("enginesim_prompt_tokens_cached_total")
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And you?"}]
    assert _turn(proxy, other, "cached-b", streamed=True) == reference_chat(other, 12)
    p_now = p0.metric("enginesim_requests_total") + p1.metric("enginesim_requests_total")
    decode_only = proxy.metrics().get('kvrelay_routing_decisions_total{decision="decode_only"}')
    if cached_route:
        assert p_now == p_requests and decode_only == 1
        assert d.metric("enginesim_prompt_tokens_cached_total") - d_cached >= len(SYSTEM) // 8
    else:
        assert p_now == p_requests + 1 and not decode_only
    for conversation in ("cached-a", "cached-b"):
        assert proxy.call("DELETE", f"/v1/conversations/{conversation}")[0] == 200
    proxy.stop()


def _decode_waiting(proxy: ProxyServer) -> float | None:
    """The queue the proxy last read from its D's `/metrics` (None: no fresh reading)."""
    status, answer, _ = proxy.call(
        "GET", "/admin/backends", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert status == 200, answer
    load = answer["decode"][0]["load"]
    return None if load is None or load["age_s"] > 1.0 else float(load["waiting"])


def _decisions(proxy: ProxyServer) -> dict[str, float]:
    m = proxy.metrics()
    return {
        d: m.get(f'kvrelay_routing_decisions_total{{decision="{d}"}}', 0.0)
        for d in ("decode_only", "prefill_affinity", "prefill_chosen")
    }


@pytest.mark.parametrize("prefix_routing", [True, False])
def test_a_request_sharing_only_the_system_prompt_goes_to_the_p_that_cached_it(
    idle: tuple[EngineSim, EngineSim, EngineSim],
    proxy_factory: ProxyFactory,
    prefix_routing: bool,
) -> None:
    """Two unrelated requests with one system prompt: with prefix routing the second goes to
    the P that computed the first, which serves the system prompt from its cache (its own
    counter says so); by load alone it goes to the other, idle, P, which computes it all."""
    p0, p1, d = idle
    proxy = proxy_factory(
        [p0, p1],
        [d],
        ready_path="/ready",
        admin_key=ADMIN_KEY,
        prefix_routing=str(prefix_routing).lower(),
    )
    system = f"You route requests by prefix ({prefix_routing}), and say why. " * 10
    _admin(proxy, "POST", "/admin/backends/drain", {"role": "prefill", "url": p0.url})
    first = [{"role": "system", "content": system}, {"role": "user", "content": "A prefix?"}]
    assert reply_of(post(proxy.url, "/v1/chat/completions", chat_body(first))) == (
        reference_chat(first, 12)
    )
    _admin(proxy, "POST", "/admin/backends", {"role": "prefill", "url": p0.url})
    before = p0.metrics(), p1.metrics()
    second = [{"role": "system", "content": system}, {"role": "user", "content": "Cached where?"}]
    assert reply_of(post(proxy.url, "/v1/chat/completions", chat_body(second))) == (
        reference_chat(second, 12)
    )
    after = p0.metrics(), p1.metrics()

    def grew(name: str) -> list[float]:
        return [a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before, strict=True)]

    served = grew("enginesim_requests_total")
    cached = grew("enginesim_prompt_tokens_cached_total")
    if prefix_routing:
        assert served == [0, 1]
        assert cached[1] >= 64  # the system prompt's whole blocks, at least four of 16 tokens
    else:
        assert served == [1, 0]  # equal load: the first P
        assert cached[0] == 0
    proxy.stop()


def test_a_busy_holder_sends_the_follow_up_through_p(
    idle: tuple[EngineSim, EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> None:
    p0, p1, d = idle
    proxy = proxy_factory(
        [p0, p1],
        [d],
        ready_path="/ready",
        routing_policy="conditional",
        conditional_max_uncached_tokens="4096",
        decode_max_waiting="4",
        load_poll_interval_s="0.5",
        admin_key=ADMIN_KEY,
    )

    def p_requests() -> float:
        return p0.metric("enginesim_requests_total") + p1.metric("enginesim_requests_total")

    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]

    def turn(question: str) -> None:
        messages.append({"role": "user", "content": question})
        answer = _turn(proxy, messages, "busy-1", streamed=False)
        assert answer == reference_chat(messages, 12)
        messages.append({"role": "assistant", "content": answer})

    turn(QUESTIONS[0])
    try:
        # D reports more queued requests than decode_max_waiting: busy, however short the
        # follow-up, so it goes through P (and, with the only D, back to the same D).
        assert d.request("/admin/faults", {"extra_waiting": 5})[0] == 200
        wait_until(lambda: _decode_waiting(proxy) == 5, 10, what="the proxy to read D busy")
        before, p_before = _decisions(proxy), p_requests()
        turn(QUESTIONS[1])
        after = _decisions(proxy)
        assert p_requests() - p_before == 1
        assert after["decode_only"] == before["decode_only"]
        assert after["prefill_affinity"] + after["prefill_chosen"] == (
            before["prefill_affinity"] + before["prefill_chosen"] + 1
        )
        # D free again: the next short follow-up skips P.
        assert d.request("/admin/faults", {"extra_waiting": 0})[0] == 200
        wait_until(lambda: _decode_waiting(proxy) == 0, 10, what="the proxy to read D free")
        p_before = p_requests()
        turn(QUESTIONS[2])
        assert p_requests() == p_before
        assert _decisions(proxy)["decode_only"] == after["decode_only"] + 1
    finally:
        d.request("/admin/faults", {"extra_waiting": 0})
    wait_until(lambda: d.metric("enginesim_requests_held") == 1, 10, what="one hold on D")
    assert proxy.call("DELETE", "/v1/conversations/busy-1")[0] == 200


def test_a_decode_only_turn_that_d_fails_gives_the_old_hold_back(
    idle: tuple[EngineSim, EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> None:
    p0, p1, d = idle
    proxy = proxy_factory(
        [p0, p1],
        [d],
        ready_path="/ready",
        routing_policy="conditional",
        conditional_max_uncached_tokens="4096",
    )
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    messages.append({"role": "user", "content": QUESTIONS[0]})
    answer = _turn(proxy, messages, "fail-1", streamed=False)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    wait_until(lambda: d.metric("enginesim_requests_held") == 1, 10, what="one hold on D")
    # The follow-up goes decode-only to the holder, which fails it: the client gets a shaped
    # error and the previous turn's hold must not stay behind (the map entry was taken).
    assert d.request("/admin/faults", {"fail_next_n": 1, "fail_status": 503})[0] == 200
    status, body, _ = proxy.call(
        "POST", "/v1/chat/completions", chat_body(messages), {"X-Conversation-Id": "fail-1"}
    )
    assert status == 502 and body["error"]["code"] == "decode_unavailable", body
    assert proxy.metrics()['kvrelay_routing_decisions_total{decision="decode_only"}'] == 1
    wait_until(lambda: d.metric("enginesim_requests_held") == 0, 10, what="D to hold nothing")
    # The client's retry starts over through P, with the right answer.
    answer = _turn(proxy, messages, "fail-1", streamed=True)
    assert answer == reference_chat(messages, 12)
    wait_until(lambda: d.metric("enginesim_requests_held") == 1, 10, what="one hold on D")
    assert proxy.call("DELETE", "/v1/conversations/fail-1")[0] == 200


def test_with_kv_events_p_is_chosen_by_what_its_events_say_it_caches(
    idle: tuple[EngineSim, EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> None:
    """The Ps publish their cache's stored and evicted blocks; the proxy follows them. A
    request sharing a system prompt goes to the P whose events show it, against the list's
    order (the routing-fed index is given no time to count); once that P's events show the
    prompt evicted, the next such request goes to the first P, which computes it all."""
    p0, p1, _ = idle
    proxy = _events_proxy(proxy_factory, idle)
    system = "You follow the engines' own cache events, block by block. " * 10

    def ask(question: str) -> tuple[list[float], list[float]]:
        """Ask via the proxy; what each P served and served from its cache meanwhile."""
        body = chat_body(
            [{"role": "system", "content": system}, {"role": "user", "content": question}]
        )
        before = p0.metrics(), p1.metrics()
        messages = body["messages"]
        assert reply_of(post(proxy.url, "/v1/chat/completions", body)) == reference_chat(
            messages, 12
        )
        after = p0.metrics(), p1.metrics()
        return [
            [a.get(n, 0.0) - b.get(n, 0.0) for a, b in zip(after, before, strict=True)]
            for n in ("enginesim_requests_total", "enginesim_prompt_tokens_cached_total")
        ]  # type: ignore[return-value]

    probe = chat_body([{"role": "system", "content": system}, {"role": "user", "content": "?"}])
    # The admin API says when this worker's subscriptions have reached the engines.
    proxy.wait_for_events(lambda: proxy.events_connected(p0.url, p1.url), 10, what="both Ps")
    _admin(proxy, "POST", "/admin/backends/drain", {"role": "prefill", "url": p0.url})
    served, _ = ask("Which P has this?")
    assert served == [0, 1]
    _admin(proxy, "POST", "/admin/backends", {"role": "prefill", "url": p0.url})
    proxy.wait_for_events(
        lambda: proxy.events_cached(probe)[p1.url] >= 64, 10, what="P1's stored blocks"
    )
    assert proxy.events_cached(probe)[p0.url] == 0
    served, cached = ask("And now?")
    assert served == [0, 1] and cached[1] >= 64
    # Other prompts sent to P1 directly fill its pool (1024 blocks of 16 tokens), evicting
    # the system prompt's blocks: its events say so, and the index forgets them.
    rng = random.Random(7)
    for _ in range(6):
        flood = {
            "model": MODEL,
            "prompt": [rng.randrange(32, 256) for _ in range(3000)],
            "max_tokens": 1,
        }
        status, answer = p1.request("/v1/completions", flood, timeout=60)
        assert status == 200, answer
    proxy.wait_for_events(
        lambda: proxy.events_cached(probe)[p1.url] == 0, 10, what="P1's evicted blocks"
    )
    served, cached = ask("Where did it go?")
    assert served == [1, 0] and cached == [0, 0]
    # A wait that times out says what the feed applied, to tell a missed event from a slow one.
    with pytest.raises(TimeoutError, match=r'kvrelay_kv_events_total\{kind="removed"\}'):
        proxy.wait_for_events(lambda: False, 0.05, what="nothing")
    m = proxy.metrics()
    assert m['kvrelay_kv_events_total{kind="removed"}'] > 0
    proxy.stop()


def test_a_prefix_cached_before_the_proxy_followed_the_events_is_learnt_on_first_use(
    idle: tuple[EngineSim, EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> None:
    """A proxy restarted after P1 cached a system prompt: P1 never stores those blocks again, so
    its events name only the blocks after them, whose parent the new proxy never saw. The first
    request on that prompt the proxy routes to P1 names the prefix (its tokens, at a block
    boundary), and the index has the whole prompt from then on."""
    p0, p1, d = idle
    system = "Cached before this proxy subscribed, learnt on first use. " * 10
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Before."}]
    before = proxy_factory([p1], [d], ready_path="/ready")
    assert reply_of(post(before.url, "/v1/chat/completions", chat_body(messages))) == (
        reference_chat(messages, 12)
    )
    before.stop()
    proxy = _events_proxy(proxy_factory, idle)
    probe = chat_body([{"role": "system", "content": system}, {"role": "user", "content": "?"}])
    assert proxy.events_cached(probe)[p1.url] == 0  # cached, but not that this proxy knows
    _admin(proxy, "POST", "/admin/backends/drain", {"role": "prefill", "url": p0.url})
    cached_before = p1.metric("enginesim_prompt_tokens_cached_total")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "After."}]
    assert reply_of(post(proxy.url, "/v1/chat/completions", chat_body(messages))) == (
        reference_chat(messages, 12)
    )
    assert p1.metric("enginesim_prompt_tokens_cached_total") - cached_before >= 64
    # P1 stored only the blocks after the system prompt; the request named their parent.
    proxy.wait_for_events(
        lambda: proxy.events_cached(probe)[p1.url] >= 64, 10, what="the adopted prefix"
    )
    _admin(proxy, "POST", "/admin/backends", {"role": "prefill", "url": p0.url})
    proxy.stop()


def _prefill_load(proxy: ProxyServer, url: str) -> float | None:
    """The queue the proxy last read from the P at `url` (None: no fresh reading)."""
    status, answer, _ = proxy.call(
        "GET", "/admin/backends", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert status == 200, answer
    load = next(b["load"] for b in answer["prefill"] if b["url"] == url)
    return None if load is None or load["age_s"] > 1.0 else float(load["waiting"])


def _pull_settings(prefix_pull: bool) -> dict[str, str]:
    """The proxy of the prefix-pull tests: P loads read often, pins given 10 s, and the Ps'
    steps short: their reported queues are made up (a fault), so the router is told to weigh
    a pin's wait as one short step, not as the whole queue."""
    return {
        "load_poll_interval_s": "0.5",
        "prefix_pull": str(prefix_pull).lower(),
        "prefix_pull_min_tokens": "64",
        "prefix_pull_timeout_s": "10",
        "prefill_step_tokens": "64",
    }


def _asked(
    proxy: ProxyServer, engines: tuple[EngineSim, ...], system: str, question: str
) -> list[dict[str, float]]:
    """Ask `question` under `system` through the proxy (the answer checked against the
    reference); what each of `engines`' counters grew meanwhile."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    before = [e.metrics() for e in engines]
    answer = reply_of(post(proxy.url, "/v1/chat/completions", chat_body(messages)))
    assert answer == reference_chat(messages, 12)
    after = [e.metrics() for e in engines]
    return [
        {n: a.get(n, 0.0) - b.get(n, 0.0) for n in a} for a, b in zip(after, before, strict=True)
    ]


@pytest.mark.parametrize("prefix_pull", [True, False])
def test_a_prefix_cached_on_a_queued_p_is_pulled_by_the_p_that_runs_the_turn(
    idle: tuple[EngineSim, EngineSim, EngineSim], proxy_factory: ProxyFactory, prefix_pull: bool
) -> None:
    """P1 caches a system prompt (its events say so), then reports a long queue: the next
    request sharing that prompt runs on P0. With prefix_pull, P1 pins the prefix (a request of
    its own, served from its cache) and P0 loads it from P1 over NIXL instead of computing it;
    P0's and P1's own counters show each step, the answer is the reference's, and P1 holds
    nothing afterwards. Without it, P0 computes the whole prompt."""
    p0, p1, _ = idle
    proxy = _events_proxy(proxy_factory, idle, **_pull_settings(prefix_pull))
    # Unique from its first block: a block whose parent was stored before the proxy
    # subscribed cannot be named by the index (an earlier test's prompt would be its parent).
    system = f"{prefix_pull}: you pull prefixes from whoever caches them. " * 10

    def ask(question: str) -> list[dict[str, float]]:
        return _asked(proxy, (p0, p1), system, question)

    probe = chat_body([{"role": "system", "content": system}, {"role": "user", "content": "?"}])
    _admin(proxy, "POST", "/admin/backends/drain", {"role": "prefill", "url": p0.url})
    ask("Who computes this first?")
    _admin(proxy, "POST", "/admin/backends", {"role": "prefill", "url": p0.url})
    proxy.wait_for_events(
        lambda: proxy.events_cached(probe)[p1.url] >= 64, 10, what="P1's stored blocks"
    )
    try:
        assert p1.request("/admin/faults", {"extra_waiting": 6})[0] == 200
        wait_until(lambda: _prefill_load(proxy, p1.url) == 6, 10, what="the proxy to read P1")
        grew0, grew1 = ask("And who pulls it?")
    finally:
        p1.request("/admin/faults", {"extra_waiting": 0})
    loaded, cached = "enginesim_prompt_tokens_loaded_total", "enginesim_prompt_tokens_cached_total"
    m = proxy.metrics()
    if prefix_pull:
        # P1 served the pin from its cache; P0 loaded the prefix and computed only the rest.
        assert grew1["enginesim_requests_total"] == 1 and grew1[cached] >= 64
        assert grew0["enginesim_requests_total"] == 1 and grew0[loaded] >= 64
        assert grew0[cached] == 0
        assert m[f'{PULLS}{{leg="prefill",result="pinned"}}'] == 1
        assert m[f'{PULLS}{{leg="prefill",result="pulled"}}'] == 1
        assert sum(v for k, v in m.items() if k.startswith(f'{PULLS}{{leg="decode"')) == 0
        assert m["kvrelay_prefix_pulled_tokens_total"] == grew0[loaded]
        assert m['kvrelay_prefix_routing_total{result="pull"}'] == 1
    else:
        assert grew1["enginesim_requests_total"] == 0
        assert grew0["enginesim_requests_total"] == 1 and grew0[loaded] == grew0[cached] == 0
        assert sum(v for k, v in m.items() if k.startswith(PULLS)) == 0
    # The pin's hold was read (or released): nothing stays held on P1.
    wait_until(lambda: p1.metric("enginesim_requests_held") == 0, 10, what="P1 holds nothing")
    proxy.stop()


@pytest.mark.parametrize("prefix_pull", [True, False])
def test_a_spilled_turn_pulls_the_prefix_from_the_p_caching_it(
    idle: tuple[EngineSim, EngineSim, EngineSim], proxy_factory: ProxyFactory, prefix_pull: bool
) -> None:
    """P1 caches a system prompt (its events say so), then both Ps report long queues: the
    next request sharing that prompt spills to D. With prefix_pull, P1 pins the prefix and D
    loads it from P1 over NIXL, computing only the rest; without it, D computes the whole
    prompt. The engines' own counters show each step, the answer is the reference's, and P1
    holds nothing afterwards."""
    p0, p1, d = idle
    proxy = _events_proxy(
        proxy_factory,
        idle,
        routing_policy="conditional",
        # One cache scope: the request sent to P1 itself below (no salt) is the proxy's too.
        cache_isolation="shared",
        **_pull_settings(prefix_pull),
    )
    # Unique from its first block (see the test above).
    system = f"{prefix_pull}: a spilled turn pulls what a P caches. " * 10

    def ask(question: str) -> list[dict[str, float]]:
        return _asked(proxy, (p0, p1, d), system, question)

    probe = chat_body([{"role": "system", "content": system}, {"role": "user", "content": "?"}])
    # Sent to P1 itself: through the proxy, D would load the prompt from P1 and cache it too,
    # and a spill to D would find it in D's own cache (nothing to pull).
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Who first?"}]
    reply_of(post(p1.url, "/v1/chat/completions", chat_body(first)))
    proxy.wait_for_events(
        lambda: proxy.events_cached(probe)[p1.url] >= 64, 10, what="P1's stored blocks"
    )
    spilled = 'kvrelay_routing_decisions_total{decision="spilled"}'
    spills = proxy.metrics().get(spilled, 0.0)
    try:
        for p in (p0, p1):
            assert p.request("/admin/faults", {"extra_waiting": 6})[0] == 200
        for p in (p0, p1):
            wait_until(
                lambda p=p: _prefill_load(proxy, p.url) == 6, 10, what="the proxy to read the Ps"
            )
        grew0, grew1, grew_d = ask("And who pulls it?")
    finally:
        for p in (p0, p1):
            p.request("/admin/faults", {"extra_waiting": 0})
    loaded, cached = "enginesim_prompt_tokens_loaded_total", "enginesim_prompt_tokens_cached_total"
    m = proxy.metrics()
    seen = {k: v for k, v in m.items() if "prefix" in k or "routing" in k}, grew1, grew_d
    assert m.get(spilled, 0.0) == spills + 1, seen
    assert grew0["enginesim_requests_total"] == 0, seen
    if prefix_pull:
        # P1 served the pin from its cache; D loaded the prefix and computed only the rest.
        assert grew1["enginesim_requests_total"] == 1 and grew1[cached] >= 64, seen
        assert grew_d["enginesim_requests_total"] == 1 and grew_d[loaded] >= 64, seen
        # Counted as D's pull: the turn's P leg pulled nothing (there was none).
        assert m[f'{PULLS}{{leg="decode",result="pinned"}}'] == 1, seen
        assert m[f'{PULLS}{{leg="decode",result="pulled"}}'] == 1, seen
        assert sum(v for k, v in m.items() if k.startswith(f'{PULLS}{{leg="prefill"')) == 0, seen
        assert m["kvrelay_prefix_pulled_tokens_total"] == grew_d[loaded], seen
    else:
        assert grew1["enginesim_requests_total"] == 0, seen
        assert grew_d["enginesim_requests_total"] == 1 and grew_d[loaded] == 0, seen
        assert sum(v for k, v in m.items() if k.startswith(PULLS)) == 0, seen
    # The pin's hold was read (or released): nothing stays held on P1.
    wait_until(lambda: p1.metric("enginesim_requests_held") == 0, 10, what="P1 holds nothing")
    proxy.stop()


def test_holds_that_do_not_pay_are_given_back_before_their_lease(
    idle: tuple[EngineSim, EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> None:
    """One-off requests: every hold D keeps for them ends unused. Once the tenant's holds have
    been counted unused (a fifth of a second's patience here), the proxy stops asking for holds
    but for probes and gives the ones already made back, instead of leaving them pinned for
    D's lease (600 s): D's held requests fall from all of them to a few."""
    p0, p1, d = idle
    proxy = proxy_factory(
        [p0, p1], [d], ready_path="/ready", hold_judge_s="0.2", hold_min_use="0.5"
    )
    sent = [0]

    def one_off() -> float:
        sent[0] += 1
        body = chat_body([{"role": "user", "content": f"A one-off question, number {sent[0]}."}])
        assert reply_of(post(proxy.url, "/v1/chat/completions", body))
        return d.metric("enginesim_requests_held")

    peak = max(one_off() for _ in range(16))
    assert peak >= 12  # the first requests all hold: nothing is judged yet
    wait_until(lambda: one_off() <= 3, 30, interval=0.05, what="D to hold only a few")
    assert proxy.metrics()['kvrelay_hold_decisions_total{decision="released"}'] >= peak - 3
    proxy.stop()
    # The proxy gives back what it still has when it stops (its map's entries are released).
    wait_until(lambda: d.metric("enginesim_requests_held") == 0, 10, what="D to hold nothing")
