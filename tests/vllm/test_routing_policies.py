"""Routing policies on real vLLM P and D (kvrelay's connector, prefix caching on at both).

- P's own prefix cache has the previous turn's prompt: the connector loads from D only what
  lies beyond that local hit, at most the previous reply's blocks (issue 17, P affinity).
- `conditional`: a short follow-up goes straight to the D holding the conversation; D serves
  the history from its held blocks (prefix-cache hit) and the answer equals plain vLLM's.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrelay.devtools import ProxyFactory, ProxyServer, vllm_servers
from tests.harness import wait_until
from tests.vllm.conftest import Reference

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TOKENS_LOADED = "vllm:kvrelay_tokens_loaded_total"
HELD_BLOCKS = "vllm:kvrelay_held_blocks"
CACHE_HITS = "vllm:prefix_cache_hits_total"
REQUESTS = "vllm:request_success_total"

SYSTEM = (
    "You are a relay engine. Each turn of the conversation is a request that the decode engine "
    "answers after the prefill engine computed the cache blocks of the prompt. Keep every reply "
    "short, and when a user asks about a block, say which model and which turn it came from."
)
USER_TURNS = [
    "Tell me about the first block of the cache.",
    "And what did the decode engine do with it?",
    "Write one more sentence about the next turn.",
]


class CachedFleet:
    """vLLM P and D with prefix caching (vLLM's default) and one proxy per policy."""

    def __init__(
        self, prefill: vllm_servers.VLLMServer, decode: vllm_servers.VLLMServer,
        reference: vllm_servers.VLLMServer, proxies: dict[str, ProxyServer],
    ) -> None:  # fmt: skip
        self.prefill, self.decode, self.reference, self.proxies = (
            prefill, decode, reference, proxies
        )  # fmt: skip


@pytest.fixture(scope="module")
def cached_fleet(tiny_model: Path, reference_launch: Reference) -> Iterator[CachedFleet]:
    prefill, decode = vllm_servers.kvrelay_pair(tiny_model)
    factory = ProxyFactory()
    try:
        vllm_servers.start_all(prefill, decode)
        proxies = {
            policy: factory(
                [prefill.url], [decode.url], ready_path="/ready",
                connector_secret=vllm_servers.CONNECTOR_SECRET,
                side_channels=vllm_servers.side_channels_setting(prefill, decode),
                routing_policy=policy, conditional_max_uncached_tokens="96",
            )
            for policy in ("affinity", "conditional")
        }  # fmt: skip
        yield CachedFleet(prefill, decode, reference_launch.server(), proxies)
    finally:
        factory.close()
        vllm_servers.stop_all(prefill, decode)


def _body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "model": vllm_servers.MODEL_NAME,
        "messages": messages,
        "max_tokens": 24,
        "temperature": 0,
    }


def _ask(proxy: ProxyServer, body: dict[str, Any], conversation: str) -> dict[str, Any]:
    status, out, _ = proxy.call(
        "POST", "/v1/chat/completions", body, headers={"X-Conversation-Id": conversation},
        timeout=120,
    )  # fmt: skip
    assert status == 200, out
    assert "kv_transfer_params" not in out
    return dict(out)


def _reference(fleet: CachedFleet, body: dict[str, Any]) -> str:
    status, out = fleet.reference.post("/v1/chat/completions", body)
    assert status == 200, out
    return str(out["choices"][0]["message"]["content"])


def _settled(server: vllm_servers.VLLMServer, name: str) -> float:
    """A counter once two reads agree (vLLM publishes its stats a moment after answering)."""
    seen = [server.metric(name)]

    def stable() -> bool:
        seen.append(server.metric(name))
        return seen[-1] == seen[-2]

    wait_until(stable, 10, interval=0.5, what=f"{name} to settle")
    return seen[-1]


def test_p_with_prefix_caching_loads_only_beyond_its_local_hit(cached_fleet: CachedFleet) -> None:
    fleet, p = cached_fleet, cached_fleet.prefill
    conversation = f"aff-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": SYSTEM}]
    previous: dict[str, Any] | None = None
    for turn, user in enumerate(USER_TURNS):
        messages.append({"role": "user", "content": user})
        body = _body(messages)
        loaded, hits = _settled(p, TOKENS_LOADED), _settled(p, CACHE_HITS)
        out = _ask(fleet.proxies["affinity"], body, conversation)
        reply = out["choices"][0]["message"]["content"]
        assert reply == _reference(fleet, body), f"turn {turn}"
        messages.append({"role": "assistant", "content": reply})
        if previous is not None:
            # P computed the previous prompt itself: its full blocks are a local hit, and
            # only what lies beyond them (the previous reply's blocks) comes from D.
            prompt = previous["usage"]["prompt_tokens"]
            reply_tokens = previous["usage"]["completion_tokens"]
            hit = _settled(p, CACHE_HITS) - hits
            pulled = _settled(p, TOKENS_LOADED) - loaded
            assert hit >= (prompt // vllm_servers.BLOCK_SIZE) * vllm_servers.BLOCK_SIZE, (
                hit,
                prompt,
            )
            assert pulled <= reply_tokens + vllm_servers.BLOCK_SIZE, (pulled, reply_tokens)
            assert pulled < prompt
        previous = out
    status, _, _ = fleet.proxies["affinity"].call("DELETE", f"/v1/conversations/{conversation}")
    assert status == 200


def test_conditional_serves_a_short_follow_up_on_the_holding_decode(
    cached_fleet: CachedFleet,
) -> None:
    fleet = cached_fleet
    proxy = fleet.proxies["conditional"]
    conversation = f"cond-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": SYSTEM}]
    p_requests = None
    for turn, user in enumerate(USER_TURNS):
        messages.append({"role": "user", "content": user})
        body = _body(messages)
        d_hits = _settled(fleet.decode, CACHE_HITS)
        out = _ask(proxy, body, conversation)
        reply = out["choices"][0]["message"]["content"]
        assert reply == _reference(fleet, body), f"turn {turn}"
        messages.append({"role": "assistant", "content": reply})
        if turn == 0:
            p_requests = _settled(fleet.prefill, REQUESTS)
            continue
        # No P leg: D found the history in its held blocks.
        assert _settled(fleet.prefill, REQUESTS) == p_requests
        assert _settled(fleet.decode, CACHE_HITS) - d_hits >= vllm_servers.BLOCK_SIZE
    decisions = proxy.metrics()['kvrelay_routing_decisions_total{decision="decode_only"}']
    assert decisions == len(USER_TURNS) - 1
    assert fleet.decode.metric(HELD_BLOCKS) > 0  # the last turn, for a next one
    status, _, _ = proxy.call("DELETE", f"/v1/conversations/{conversation}")
    assert status == 200
    wait_until(lambda: fleet.decode.metric(HELD_BLOCKS) == 0, 30, what="D to hold nothing")
