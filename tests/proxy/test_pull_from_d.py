"""A P pulls a conversation's history from a D's prefix cache, on enginesim P and D (real NIXL)
publishing their KV events: D declines the next-turn hold (`--hold-max-fraction`, a hold alone
over that share of its pool), so no entry names the history, but D's events show it cached; the
next turn's P (one whose own cache lacks it) gets it pinned on D and loads it, by its own
counter, where a proxy that follows only the Ps' events has it computed. D cached the system
prompt before the proxy followed it, so D's events name the history's later blocks only, and
the index learns the prefix through the prompt the proxy sent D (`Router.sent_to`)."""

from __future__ import annotations

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
from tests.proxy.client import chat_body, post, reply_of, stream, streamed_text
from tests.proxy.events_heard import until_events_heard

pytestmark = pytest.mark.nixl

ADMIN_KEY = "pull-from-d-admin-key"
CACHE = ("--enable-prefix-caching",)
# A hold of more than one of D's 1024 blocks is declined: every turn here is longer.
DECLINES = ("--hold-max-fraction", "0.001")
# Chosen by `engines` just before the engines start, not at import, where another test worker
# could take one meanwhile.
EVENTS_PORTS: dict[str, int] = {}
LOADED = "enginesim_prompt_tokens_loaded_total"
PULLS = "kvrelay_prefix_pulls_total"


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[EngineSim, EngineSim, EngineSim]]:
    """Two P and one D, each with a local prefix cache and its KV events on."""
    factory = EngineFactory()
    EVENTS_PORTS.update(P0=free_port(), P1=free_port(), D=free_port())
    try:
        p0, p1, d = factory.many(
            ("P0", ["--role", "prefill", *CACHE, *kv_events_args(EVENTS_PORTS["P0"])]),
            ("P1", ["--role", "prefill", *CACHE, *kv_events_args(EVENTS_PORTS["P1"])]),
            ("D", ["--role", "decode", *CACHE, *DECLINES, *kv_events_args(EVENTS_PORTS["D"])]),
        )
        yield p0, p1, d
    finally:
        factory.close()


def _proxy(
    proxy_factory: ProxyFactory, engines: tuple[EngineSim, EngineSim, EngineSim], ds: bool
) -> ProxyServer:
    """A proxy following the Ps' KV events, and D's too when `ds`."""
    p0, p1, d = engines
    followed = [(p0, "P0"), (p1, "P1"), *([(d, "D")] if ds else [])]
    endpoints = ",".join(f"{e.url}=tcp://127.0.0.1:{EVENTS_PORTS[n]}" for e, n in followed)
    proxy = proxy_factory(
        [p0, p1],
        [d],
        ready_path="/ready",
        admin_key=ADMIN_KEY,
        kv_events_endpoints=endpoints,
        prefix_pull_min_tokens="32",
    )
    for engine, name in followed:
        until_events_heard(proxy, engine, "decode" if name == "D" else "prefill")
    return proxy


def _admin(proxy: ProxyServer, path: str, role: str, url: str) -> None:
    status, answer, _ = proxy.call(
        "POST", path, {"role": role, "url": url}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert status in (200, 201), answer


def _system(tag: str) -> str:
    return f"You keep a conversation's history where it was decoded ({tag}). " * 8


def _two_turns(
    proxy: ProxyServer, engines: tuple[EngineSim, EngineSim, EngineSim], tag: str
) -> tuple[float, dict[str, Any]]:
    """Turn 1 on P1 (P0 drained), turn 2 on P0 (P1 drained): P0's cache never saw the history.
    Returns the tokens P0 loaded in turn 2 and turn 2's body."""
    p0, p1, _ = engines
    system = _system(tag)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Where is my history kept?"},
    ]
    _admin(proxy, "/admin/backends/drain", "prefill", p0.url)
    answer = reply_of(post(proxy.url, "/v1/chat/completions", chat_body(messages)))
    assert answer == reference_chat(messages, 12)
    _admin(proxy, "/admin/backends", "prefill", p0.url)
    _admin(proxy, "/admin/backends/drain", "prefill", p1.url)
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And who reads it?"},
    ]
    body = chat_body(messages)
    before = p0.metric(LOADED)
    status, events, raw = stream(proxy.url, "/v1/chat/completions", body)
    assert status == 200, raw
    assert streamed_text(events, chat=True) == reference_chat(messages, 12)
    _admin(proxy, "/admin/backends", "prefill", p1.url)
    return p0.metric(LOADED) - before, body


def test_a_p_pulls_a_declined_holds_history_from_ds_cache(
    engines: tuple[EngineSim, EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> None:
    p0, _, d = engines
    for engine in engines:
        engine.wait_idle()
    declined = d.metric("enginesim_connector_holds_over_budget")
    # D caches the system prompt (under the tenant's cache salt, through a proxy not following
    # D's events) before the proxy below follows them: D never stores those blocks again, so
    # the blocks after them are named through the prompt that proxy sends D.
    warm = [{"role": "system", "content": _system("pulled")}, {"role": "user", "content": "Hi."}]
    before = _proxy(proxy_factory, engines, ds=False)
    _admin(before, "/admin/backends/drain", "prefill", p0.url)  # P0's cache stays without it
    assert reply_of(post(before.url, "/v1/chat/completions", chat_body(warm))) == (
        reference_chat(warm, 12)
    )
    before.stop()
    proxy = _proxy(proxy_factory, engines, ds=True)
    probe = {
        "model": "m",
        "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}],
    }
    assert proxy.events_cached(probe, "decode") == {d.url: 0}
    p0_loaded, body = _two_turns(proxy, engines, "pulled")
    # D declined turn 1's hold (its own counter): no entry names the history.
    assert d.metric("enginesim_connector_holds_over_budget") > declined
    # P0 loaded turn 1's prompt and answer, whole blocks of 16, from the pin on D.
    assert p0_loaded >= 64, p0_loaded
    m = proxy.metrics()
    assert m.get(f'{PULLS}{{leg="prefill",result="pinned"}}', 0) == 1
    assert m.get(f'{PULLS}{{leg="prefill",result="pulled"}}', 0) == 1
    assert m.get('kvrelay_prefix_pins_total{holder="decode"}', 0) == 1
    # The pin's wait, from its request to D's answer, observed once under D's pool.
    assert m.get('kvrelay_prefix_pin_seconds_count{holder="decode"}', 0) == 1
    assert m.get('kvrelay_prefix_pin_seconds_sum{holder="decode"}', 0) > 0
    assert m.get('kvrelay_prefix_pin_seconds_count{holder="prefill"}', 0) == 0
    assert proxy.events_cached(body, "decode")[d.url] >= p0_loaded
    # The pin's blocks are given back once P0 read them, and nothing else stays held.
    wait_until(lambda: d.metric("enginesim_requests_held") == 0, 10, what="D to hold nothing")
    wait_until(lambda: p0.metric("enginesim_requests_held") == 0, 10, what="P0 to hold nothing")
    proxy.stop()
    # The same two turns with D's events not followed: nothing names the history, P0
    # computes it all.
    proxy = _proxy(proxy_factory, engines, ds=False)
    p0_loaded, _ = _two_turns(proxy, engines, "computed")
    assert p0_loaded == 0
    assert proxy.metrics().get(f'{PULLS}{{leg="prefill",result="pinned"}}', 0) == 0
    proxy.stop()
