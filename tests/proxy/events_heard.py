"""Waiting until a proxy hears an engine's KV events, before a test counts on them."""

from __future__ import annotations

import random

from kvrelay.devtools import EngineSim, ProxyServer, wait_until
from tests.proxy.client import MODEL


def until_events_heard(
    proxy: ProxyServer, engine: EngineSim, role: str = "prefill", timeout: float = 30
) -> None:
    """Until the proxy's index holds blocks of `engine`'s events. ZMQ drops what is published
    before a subscriber's connection is up, and the proxy is ready before its subscriptions
    are, so a test's first prompt could go unheard: `engine` is sent prompts of its own until
    one is heard. Each is new from its first token (a prompt the engine caches already
    publishes nothing again)."""
    rng = random.Random()

    def heard() -> bool:
        if proxy.events_blocks(role)[engine.url] > 0:
            return True
        prompt = [rng.randrange(32, 256) for _ in range(64)]
        status, answer = engine.request(
            "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        )
        assert status == 200, answer
        return False

    wait_until(heard, timeout, interval=0.2, what=f"the proxy to hear {engine.url}'s KV events")
