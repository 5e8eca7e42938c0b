"""A turn that shares most of its prompt with a prefix another turn is computing waits for it
(`prefix_wait_max_s`), on enginesim P and D (real NIXL) whose prefills take modelled time: the
second of two requests sharing a long system prompt, sent while the first's P computes it, is
sent only once that P answered, to that P, which serves the system prompt from its cache (its
own counter), and so does one sharing a document at the start of its user message; a request
spilled to D and streamed leads until D's first token. Without the wait the shared prefix is
computed twice."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvrelay.devtools import EngineFactory, EngineSim, ProxyFactory, ProxyServer, wait_until
from kvrelay.enginesim.reference import reference_chat
from tests.proxy.client import chat_body, post, reply_of, stream, streamed_text

pytestmark = pytest.mark.nixl

CACHE = ("--enable-prefix-caching",)
# The first request's prompt (about 870 tokens) takes about 1.7 s to prefill: time for the
# second to arrive while it is computed.
SLOW_PREFILL = ("--prefill-us-per-token", "2000")
CACHED = "enginesim_prompt_tokens_cached_total"
SYSTEM_TOKENS = 512  # fewer than the system prompt's whole blocks (848 tokens)
COMPUTED = "enginesim_prompt_tokens_computed_total"
SYSTEM_PROMPT_TOKENS = 900  # the spilled test's system prompt, about (26 repeats)
WAITS = "kvrelay_prefix_waits_total"


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[EngineSim, EngineSim, EngineSim]]:
    """Two P and one D with slow prefills, each with a local prefix cache."""
    factory = EngineFactory()
    try:
        p0, p1, d = factory.many(
            ("P0", ["--role", "prefill", *CACHE, *SLOW_PREFILL]),
            ("P1", ["--role", "prefill", *CACHE, *SLOW_PREFILL]),
            ("D", ["--role", "decode", *CACHE, *SLOW_PREFILL]),
        )
        yield p0, p1, d
    finally:
        factory.close()


def _ask(proxy: ProxyServer, messages: list[dict[str, Any]], answers: list[str]) -> None:
    answers.append(reply_of(post(proxy.url, "/v1/chat/completions", chat_body(messages))))


def _shared(prefix: str, question: str, as_system: bool) -> list[dict[str, Any]]:
    """A prompt sharing `prefix`: as its system message, or as the start of its user message
    (a document the question follows)."""
    if as_system:
        return [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
    return [{"role": "user", "content": prefix + question}]


@pytest.mark.parametrize("as_system", [True, False], ids=["system", "in-user-message"])
@pytest.mark.parametrize("wait_s", ["10", "0"])
def test_a_request_waits_for_the_turn_computing_its_system_prompt(
    engines: tuple[EngineSim, EngineSim, EngineSim],
    proxy_factory: ProxyFactory,
    wait_s: str,
    as_system: bool,
) -> None:
    p0, p1, d = engines
    for engine in engines:
        engine.wait_idle()
    proxy = proxy_factory([p0, p1], [d], ready_path="/ready", prefix_wait_max_s=wait_s)
    system = f"You wait for the prefix another request is computing ({wait_s}, {as_system}). " * 24
    first = _shared(system, "Who computes?", as_system)
    second = _shared(system, "Who waits?", as_system)
    before = [p.metrics() for p in (p0, p1)]
    # The second is sent once the first is on its way to a P (its prompt is in the proxy's
    # index, which it enters as it is sent).
    _leader_then_follower(proxy, _ask, first, second, "kvrelay_prefix_index_entries")
    after = [p.metrics() for p in (p0, p1)]
    m = proxy.metrics()
    served = sorted(_grew(after, before, "enginesim_requests_total"))
    if wait_s != "0":
        assert m.get(f'{WAITS}{{result="computed"}}', 0) == 1
        assert served == [0, 2]  # both on the P that computed the system prompt
        # The system prompt (about 850 tokens) served whole from that P's cache.
        assert sum(_grew(after, before, CACHED)) >= SYSTEM_TOKENS
    else:
        assert not any(k.startswith(WAITS) for k in m)
        # Sent beside the first, the second found only the blocks computed so far: the rest
        # of the system prompt was computed twice.
        assert sum(_grew(after, before, CACHED)) < SYSTEM_TOKENS
    proxy.stop()


Send = Callable[[ProxyServer, list[dict[str, Any]], list[str]], None]


def _leader_then_follower(
    proxy: ProxyServer,
    send: Send,
    first: list[dict[str, Any]],
    second: list[dict[str, Any]],
    started: str,
) -> None:
    """`first` sent in a thread; `second` once the proxy's metric `started` shows the first on
    its way; both answers checked against the reference."""
    answers: list[str] = []
    leader = threading.Thread(target=send, args=(proxy, first, answers))
    leader.start()
    try:
        wait_until(lambda: proxy.metrics().get(started, 0) >= 1, 10, what=f"{started} of the first")
        follower: list[str] = []
        send(proxy, second, follower)
    finally:
        leader.join(60)
    assert answers == [reference_chat(first, 12)]
    assert follower == [reference_chat(second, 12)]


def _grew(after: list[dict[str, float]], before: list[dict[str, float]], name: str) -> list[float]:
    return [a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before, strict=True)]


def _stream(proxy: ProxyServer, messages: list[dict[str, Any]], answers: list[str]) -> None:
    status, events, raw = stream(proxy.url, "/v1/chat/completions", chat_body(messages))
    assert status == 200, raw
    answers.append(streamed_text(events, chat=True))


@pytest.mark.parametrize("wait_s", ["10", "0"])
def test_a_request_waits_for_a_spilled_stream_until_its_first_token(
    engines: tuple[EngineSim, EngineSim, EngineSim], proxy_factory: ProxyFactory, wait_s: str
) -> None:
    """The first request spills to D (`prefill_spill_factor` under 1: even an idle P loses to
    D) and streams; the second, sharing its system prompt, waits until D's first token (D has
    computed the prompt then, though its answer goes on) and then spills to D too, whose cache
    serves it; without the wait the system prompt is computed twice (by D beside the first,
    or by a P)."""
    p0, p1, d = engines
    for engine in engines:
        engine.wait_idle()
    proxy = proxy_factory(
        [p0, p1],
        [d],
        ready_path="/ready",
        prefix_wait_max_s=wait_s,
        prefill_spill_factor="0.5",
        routing_policy="conditional",
    )
    system = f"You wait for a spilled stream's first token ({wait_s}). " * 26
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Streamed?"}]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "And then?"}]
    before = [e.metrics() for e in engines]
    # The second is sent once the first is on its way to D (its spill counted as planned).
    spilled = 'kvrelay_prefill_spilled_total{turn="first"}'
    _leader_then_follower(proxy, _stream, first, second, spilled)
    after = [e.metrics() for e in engines]
    computed = sum(_grew(after, before, COMPUTED))
    m = proxy.metrics()
    if wait_s != "0":
        assert m.get(f'{WAITS}{{result="computed"}}', 0) == 1
        assert m.get('kvrelay_routing_decisions_total{decision="spilled"}', 0) == 2
        # The second served the system prompt whole from D's cache: computed once.
        assert _grew(after, before, CACHED)[2] >= SYSTEM_TOKENS
        assert computed < 1.5 * SYSTEM_PROMPT_TOKENS
    else:
        assert not any(k.startswith(WAITS) for k in m)
        assert computed > 1.5 * SYSTEM_PROMPT_TOKENS  # computed twice (by D, or by D and a P)
    proxy.stop()
