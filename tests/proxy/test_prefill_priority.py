"""Shorter prefills first on P (`prefill_priority_tokens`): each request to P carries a vLLM
priority by the prompt tokens P computes, and a P under `--scheduling-policy priority` admits
a short prompt queued behind a long one first. On enginesim P (one request at a time, modelled
prefill time) and D with real NIXL: with the setting, a short prompt sent after a long one,
while a third keeps P busy, is answered first; without it, in arrival order. Answers equal the
reference either way."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvrelay.devtools import EngineFactory, EngineSim, ProxyFactory, ProxyServer, wait_until
from kvrelay.enginesim.reference import reference_chat
from kvrelay.proxy.turn.legs import prefill_body, prefill_priority
from tests.proxy.client import chat_body, post, reply_of


def test_priority_is_the_tokens_p_computes_over_the_level() -> None:
    assert prefill_priority(4000, 4.0, 0) is None  # off
    assert prefill_priority(4000, 4.0, 1000) == 1  # 1000 tokens: level 1
    assert prefill_priority(3996, 4.0, 1000) == 0  # 999 tokens
    assert prefill_priority(40_000, 2.0, 1000) == 20
    assert prefill_priority(-5, 4.0, 1000) == 0  # a held history longer than the estimate


def test_the_priority_replaces_the_clients_on_ps_request_only() -> None:
    body = {"model": "m", "prompt": "x", "priority": -7}
    assert prefill_body(body, None)["priority"] == -7  # off: the client's passes through
    assert prefill_body(body, None, 3)["priority"] == 3
    assert body["priority"] == -7  # the client's body is not modified
    assert "priority" not in prefill_body({"model": "m", "prompt": "x"}, None)


ADMIN_KEY = "prefill-priority-admin-key"
COMPUTED = "enginesim_prompt_tokens_computed_total"


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[EngineSim, EngineSim]]:
    """P admits one request at a time by priority, its prefills taking 3 ms a token; D fast."""
    factory = EngineFactory()
    try:
        p, d = factory.many(
            ("P", ["--role", "prefill", "--scheduling-policy", "priority", "--max-num-seqs", "1",
                   "--prefill-us-per-token", "3000"]),
            ("D", ["--role", "decode"]),
        )  # fmt: skip
        yield p, d
    finally:
        factory.close()


def _messages(topic: str, repeats: int) -> list[dict[str, Any]]:
    text = f"Say what the queue does with a {topic} prompt. " * repeats
    return [{"role": "user", "content": text}]


def _sent_to_p(proxy: ProxyServer) -> int:
    """The requests the proxy has in flight to P (its own count, `/admin/backends`)."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    status, out, _ = proxy.call("GET", "/admin/backends", headers=headers)
    assert status == 200, out
    (p,) = out["prefill"]
    return int(p["inflight"])


@pytest.mark.nixl
@pytest.mark.parametrize("level", ["64", "0"], ids=["shorter-first", "off"])
def test_a_short_prompt_overtakes_a_long_one_queued_on_p(
    engines: tuple[EngineSim, EngineSim], proxy_factory: ProxyFactory, level: str
) -> None:
    """A prompt of about 2,900 tokens keeps P busy for about 9 s; a long one (about 2,100
    tokens) and then a short one (about 80) are sent to P meanwhile. P takes the next request
    from its queue only when it is done with the first: by priority the short one, else the
    long one. The order is read from P's own count of prompt tokens computed, which grows by
    each prompt as P admits it (the clients' answers cannot tell: D's reads from P wait for
    P's step to end, so both may come back together). The short prompt's prefill (about
    0.23 s) is several of the watcher's polls long, so two prompts never read as one step."""
    p, d = engines
    p.wait_idle()
    d.wait_idle()
    proxy = proxy_factory(
        [p], [d], ready_path="/ready", prefill_priority_tokens=level, admin_key=ADMIN_KEY
    )
    busy, long, short = _messages("busy", 120), _messages("long", 90), _messages("short", 3)
    answers: dict[str, str] = {}
    computed = [p.metric(COMPUTED)]  # P's count, each time it changed
    stop = threading.Event()

    def ask(name: str, messages: list[dict[str, Any]]) -> None:
        answers[name] = reply_of(post(proxy.url, "/v1/chat/completions", chat_body(messages)))

    def read() -> None:
        now = p.metric(COMPUTED)
        if now != computed[-1]:
            computed.append(now)

    def watch() -> None:
        while not stop.is_set():
            read()
            stop.wait(0.02)

    threads: list[threading.Thread] = []

    def send(name: str, messages: list[dict[str, Any]], in_flight: int) -> None:
        thread = threading.Thread(target=ask, args=(name, messages))
        threads.append(thread)
        thread.start()
        wait_until(lambda: _sent_to_p(proxy) >= in_flight, 10, what=f"the {name} prompt to P")

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        send("busy", busy, 1)
        send("long", long, 2)
        send("short", short, 3)
        assert len(computed) == 1, "P finished the first prompt before the others were sent"
    finally:
        for thread in threads:
            thread.join(60)
        stop.set()
        watcher.join(10)
    # The last prompt's answer can come back within one poll of P counting it (P publishes its
    # counters before it hands the step's outputs on), and the watcher stops without a reading
    # after it: one more, now that every answer is in, so the last step is never missed.
    read()
    for name, messages in (("busy", busy), ("long", long), ("short", short)):
        assert answers[name] == reference_chat(messages, 12)
    steps = [b - a for a, b in itertools.pairwise(computed)]
    assert len(steps) == 3, steps  # one prompt finished at a time
    assert steps[0] > 1000  # the busy one first
    if level != "0":
        assert steps[1] < 100 and steps[2] > 1000  # the short one next: its level is lower
    else:
        assert steps[1] > 1000 and steps[2] < 100  # arrival order
    proxy.stop()
