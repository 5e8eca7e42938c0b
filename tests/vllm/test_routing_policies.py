"""Routing policies on real vLLM P and D (kvrelay's connector, prefix caching on at both).

- P's own prefix cache has the previous turn's prompt: the connector loads from D only what
  lies beyond that local hit, at most the previous reply's blocks (issue 17, P affinity).
- `conditional`: a short follow-up goes straight to the D holding the conversation; D serves
  the history from its held blocks (prefix-cache hit) and the answer equals plain vLLM's.
- Prefix routing, with a second P: a request that shares only a system prompt with an earlier
  one (or a document its user message starts with) goes to the P that computed it, whose own
  counter shows the prefix served from its cache;
  by load alone it goes to the idle P, which computes it all.
- Prefix routing from vLLM's own KV events (both Ps publish them): the index shows a stored
  block once P2 computed it and forgets it once P2's events say it was evicted, and the routing
  follows: to P2 while it caches the system prompt, to the first P after.
- A proxy started after P2 cached a system prompt learns it on the first request it routes
  there (vLLM's events name only the blocks after it; the routed prompt names their parent).
- `decode_only_cached`: a request with no held history whose system prompt D decoded goes
  straight to D, whose own prefix cache serves it (by the routing-fed index, or by D's own KV
  events where the proxy follows them).
- A conversation whose hold is gone, its history last served decode-only on D: with every P
  idle its next turn still goes to D (spilled), whose own prefix cache serves the history.
- D publishes its KV events too: a conversation whose hold is gone has its history pinned on D
  for the next turn's P (one that never saw it), which loads it over NIXL by its own counter.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrelay.devtools import ProxyFactory, ProxyServer, free_port, kv_events_args, vllm_servers
from kvrelay.proxy.tenants import CacheScopes
from kvrelay.proxy.turn import tenant_of
from tests.harness import wait_until
from tests.vllm.conftest import Reference, settled

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


ADMIN_KEY = "prefix-routing-admin-key"
# P2's KV pool, small enough for a few prompts to evict what it cached (48 blocks of 32).
SMALL_POOL_BLOCKS = 48


def _publish_events(server: vllm_servers.VLLMServer, replay_port: int | None = None) -> str:
    """Start `server` publishing its KV cache events (vLLM's flag; the wildcard endpoint binds),
    answering replay requests on `replay_port` if given; the endpoint the proxy connects to."""
    port = free_port()
    server.extra_args += list(kv_events_args(port, replay_port))
    return f"tcp://127.0.0.1:{port}"


class CachedFleet:
    """vLLM P and D with prefix caching (vLLM's default), a second P, and proxies: one per
    policy in front of P and D, and two in front of both Ps and D (`prefix routing`, `by
    load`: prefix routing on and off), the second P listed first."""

    events_endpoints = ""  # both Ps' KV events, as kv_events_endpoints
    decode_events = ""  # D's KV events endpoint
    replay_endpoints = ""  # P2's replay endpoint, as kv_events_replay_endpoints
    side_channels = ""  # every engine's side channel, as side_channels

    def __init__(
        self, prefill: vllm_servers.VLLMServer, decode: vllm_servers.VLLMServer,
        second: vllm_servers.VLLMServer, reference: vllm_servers.VLLMServer,
        proxies: dict[str, ProxyServer],
    ) -> None:  # fmt: skip
        self.prefill, self.decode, self.second, self.reference, self.proxies = (
            prefill,
            decode,
            second,
            reference,
            proxies,
        )


@pytest.fixture(scope="module")
def cached_fleet(tiny_model: Path, reference_launch: Reference) -> Iterator[CachedFleet]:
    prefill, decode = vllm_servers.kvrelay_pair(tiny_model)
    second = vllm_servers.kvrelay_server("P2", tiny_model, 0)
    second.extra_args += ["--num-gpu-blocks-override", str(SMALL_POOL_BLOCKS)]
    # The queue a pin is sent ahead of (the proxy's pins carry prefix_pull_priority).
    second.extra_args += ["--scheduling-policy", "priority"]
    replay_port = free_port()  # P2 also answers replay requests (vLLM's replay_endpoint)
    endpoints = {
        p.url: _publish_events(p, replay_port if p is second else None) for p in (prefill, second)
    }
    decode_events = _publish_events(decode)  # followed only by the proxy of the D-pull test
    factory = ProxyFactory()
    try:
        vllm_servers.start_all(prefill, decode, second)
        side_channels = vllm_servers.side_channels_setting(prefill, decode, second)
        proxies = {
            policy: factory(
                [prefill.url], [decode.url], ready_path="/ready",
                connector_secret=vllm_servers.CONNECTOR_SECRET, side_channels=side_channels,
                routing_policy=policy, conditional_max_uncached_tokens="96",
            )
            for policy in ("affinity", "conditional")
        }  # fmt: skip
        for label, on in (("prefix routing", "true"), ("by load", "false")):
            proxies[label] = factory(
                [second.url, prefill.url], [decode.url], ready_path="/ready",
                connector_secret=vllm_servers.CONNECTOR_SECRET, side_channels=side_channels,
                prefix_routing=on, admin_key=ADMIN_KEY,
            )  # fmt: skip
        # P listed first; routed by the Ps' own events only (the routing-fed index's entries
        # expire at once).
        proxies["kv events"] = factory(
            [prefill.url, second.url],
            [decode.url],
            ready_path="/ready",
            connector_secret=vllm_servers.CONNECTOR_SECRET,
            side_channels=side_channels,
            admin_key=ADMIN_KEY,
            prefix_index_ttl_s="0.001",
            kv_events_endpoints=",".join(f"{u}={e}" for u, e in endpoints.items()),
        )
        fleet = CachedFleet(prefill, decode, second, reference_launch.server(), proxies)
        fleet.events_endpoints = ",".join(f"{u}={e}" for u, e in endpoints.items())
        fleet.side_channels = side_channels
        fleet.decode_events = f"{decode.url}={decode_events}"
        fleet.replay_endpoints = f"{second.url}=tcp://127.0.0.1:{replay_port}"
        yield fleet
    finally:
        factory.close()
        vllm_servers.stop_all(prefill, decode, second)


def _body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "model": vllm_servers.MODEL_NAME,
        "messages": messages,
        "max_tokens": 24,
        "temperature": 0,
    }


def _with_system(system: str, user: str) -> dict[str, Any]:
    return _body([{"role": "system", "content": system}, {"role": "user", "content": user}])


def _ask(proxy: ProxyServer, body: dict[str, Any], conversation: str) -> dict[str, Any]:
    status, out, _ = proxy.call(
        "POST", "/v1/chat/completions", body, headers={"X-Conversation-Id": conversation},
        timeout=120,
    )  # fmt: skip
    assert status == 200, out
    assert "kv_transfer_params" not in out
    return dict(out)


def _conditional_proxy(factory: ProxyFactory, fleet: CachedFleet, **settings: str) -> ProxyServer:
    """A proxy in front of both Ps and D, `conditional` routing, with `settings`."""
    return factory(
        [fleet.prefill.url, fleet.second.url], [fleet.decode.url], ready_path="/ready",
        connector_secret=vllm_servers.CONNECTOR_SECRET, side_channels=fleet.side_channels,
        routing_policy="conditional", **settings,
    )  # fmt: skip


def _reference(fleet: CachedFleet, body: dict[str, Any]) -> str:
    status, out = fleet.reference.post("/v1/chat/completions", body)
    assert status == 200, out
    return str(out["choices"][0]["message"]["content"])


def test_p_with_prefix_caching_loads_only_beyond_its_local_hit(cached_fleet: CachedFleet) -> None:
    fleet, p = cached_fleet, cached_fleet.prefill
    conversation = f"aff-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": SYSTEM}]
    previous: dict[str, Any] | None = None
    for turn, user in enumerate(USER_TURNS):
        messages.append({"role": "user", "content": user})
        body = _body(messages)
        loaded, hits = settled(p, TOKENS_LOADED), settled(p, CACHE_HITS)
        out = _ask(fleet.proxies["affinity"], body, conversation)
        reply = out["choices"][0]["message"]["content"]
        assert reply == _reference(fleet, body), f"turn {turn}"
        messages.append({"role": "assistant", "content": reply})
        if previous is not None:
            # P computed the previous prompt itself: its full blocks are a local hit, and
            # only what lies beyond them (the previous reply's blocks) comes from D.
            prompt = previous["usage"]["prompt_tokens"]
            reply_tokens = previous["usage"]["completion_tokens"]
            hit = settled(p, CACHE_HITS) - hits
            pulled = settled(p, TOKENS_LOADED) - loaded
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
        d_hits = settled(fleet.decode, CACHE_HITS)
        out = _ask(proxy, body, conversation)
        reply = out["choices"][0]["message"]["content"]
        assert reply == _reference(fleet, body), f"turn {turn}"
        messages.append({"role": "assistant", "content": reply})
        if turn == 0:
            p_requests = settled(fleet.prefill, REQUESTS)
            continue
        # No P leg: D found the history in its held blocks.
        assert settled(fleet.prefill, REQUESTS) == p_requests
        assert settled(fleet.decode, CACHE_HITS) - d_hits >= vllm_servers.BLOCK_SIZE
    decisions = proxy.metrics()['kvrelay_routing_decisions_total{decision="decode_only"}']
    assert decisions == len(USER_TURNS) - 1
    assert fleet.decode.metric(HELD_BLOCKS) > 0  # the last turn, for a next one
    status, _, _ = proxy.call("DELETE", f"/v1/conversations/{conversation}")
    assert status == 200
    wait_until(lambda: fleet.decode.metric(HELD_BLOCKS) == 0, 30, what="D to hold nothing")


def _admin(proxy: ProxyServer, method: str, path: str, body: dict[str, Any]) -> None:
    status, answer, _ = proxy.call(
        method, path, body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert status in (200, 201), answer


def _sharing(prefix: str, question: str, as_system: bool) -> dict[str, Any]:
    """A request sharing `prefix`: as its system message, or as the start of its user message
    (a document the question follows)."""
    if as_system:
        return _with_system(prefix, question)
    return _body([{"role": "user", "content": prefix + question}])


@pytest.mark.parametrize(
    ("label", "as_system"),
    [("prefix routing", True), ("by load", True), ("prefix routing", False)],
    ids=["prefix routing", "by load", "prefix routing, in the user message"],
)
def test_a_request_sharing_only_a_system_prompt_goes_to_the_p_that_cached_it(
    cached_fleet: CachedFleet, label: str, as_system: bool
) -> None:
    fleet = cached_fleet
    proxy, p, second = fleet.proxies[label], fleet.prefill, fleet.second
    # New to every cache (the module's other tests send SYSTEM): one shared prefix, two
    # questions; the prefix a system prompt, or a document the user message starts with.
    system = f"{SYSTEM} This fleet routes by {label} ({as_system}). " * 2
    first = _sharing(system, "Hello.", as_system)
    second_body = _sharing(system, "Where from?", as_system)
    # The first request goes to P (the second P drained), then both Ps are candidates again.
    _admin(proxy, "POST", "/admin/backends/drain", {"role": "prefill", "url": second.url})
    out = _ask(proxy, first, f"first-{uuid.uuid4().hex[:8]}")
    assert out["choices"][0]["message"]["content"] == _reference(fleet, first)
    _admin(proxy, "POST", "/admin/backends", {"role": "prefill", "url": second.url})
    before = {s.name: (settled(s, REQUESTS), settled(s, CACHE_HITS)) for s in (p, second)}
    out = _ask(proxy, second_body, f"second-{uuid.uuid4().hex[:8]}")
    assert out["choices"][0]["message"]["content"] == _reference(fleet, second_body)
    served = {s.name: settled(s, REQUESTS) - before[s.name][0] for s in (p, second)}
    hits = {s.name: settled(s, CACHE_HITS) - before[s.name][1] for s in (p, second)}
    assert out["usage"]["prompt_tokens"] > 3 * vllm_servers.BLOCK_SIZE
    if label == "prefix routing":
        assert served == {p.name: 1, second.name: 0}
        # P served the system prompt's full blocks from its own cache: at least two blocks
        # of the prompt were not recomputed (the questions differ only in their last block).
        assert hits[p.name] >= 2 * vllm_servers.BLOCK_SIZE, hits
    else:
        assert served == {p.name: 0, second.name: 1}  # equal load: the first P listed
        assert hits[second.name] == 0, hits


def test_the_index_follows_vllms_kv_events_and_routing_follows_the_index(
    cached_fleet: CachedFleet,
) -> None:
    fleet = cached_fleet
    proxy, p, p2 = fleet.proxies["kv events"], fleet.prefill, fleet.second
    # New to every cache from its first block on (the module's other prompts begin with SYSTEM).
    system = f"The index follows what each engine says it stored and evicted. {SYSTEM}" * 2

    def body(user: str) -> dict[str, Any]:
        return _with_system(system, user)

    def ask(user: str) -> tuple[dict[str, float], dict[str, float]]:
        """Ask via the proxy; per P, requests served and prompt tokens hit in its cache."""
        sent = body(user)
        before = {s.name: (settled(s, REQUESTS), settled(s, CACHE_HITS)) for s in (p, p2)}
        out = _ask(proxy, sent, f"events-{uuid.uuid4().hex[:8]}")
        assert out["choices"][0]["message"]["content"] == _reference(fleet, sent)
        served = {s.name: settled(s, REQUESTS) - before[s.name][0] for s in (p, p2)}
        hits = {s.name: settled(s, CACHE_HITS) - before[s.name][1] for s in (p, p2)}
        return served, hits

    probe, two_blocks = body("?"), 2 * vllm_servers.BLOCK_SIZE
    _admin(proxy, "POST", "/admin/backends/drain", {"role": "prefill", "url": p.url})
    served, _ = ask("Hello.")
    assert served == {p.name: 0, p2.name: 1}
    _admin(proxy, "POST", "/admin/backends", {"role": "prefill", "url": p.url})
    # A stored block appears: P2's events carried the prompt's blocks, with their tokens.
    proxy.wait_for_events(
        lambda: proxy.events_cached(probe)[p2.url] >= two_blocks,
        30,
        what="P2's stored blocks in the index",
    )
    assert proxy.events_cached(probe)[p.url] == 0
    served, hits = ask("Where from?")
    assert served == {p.name: 0, p2.name: 1}  # against the list's order: P2 caches it
    assert hits[p2.name] >= two_blocks, hits
    # Prompts sent to P2 directly fill its small pool and evict the system prompt's blocks.
    rng = random.Random(11)
    for _ in range(4):
        flood = {
            "model": vllm_servers.MODEL_NAME,
            "max_tokens": 1,
            "prompt": [rng.randrange(10, 1000) for _ in range(900)],
        }
        status, out = p2.post("/v1/completions", flood)
        assert status == 200, out
    # An evicted block disappears: P2's BlockRemoved events reached the index.
    proxy.wait_for_events(
        lambda: proxy.events_cached(probe)[p2.url] == 0,
        30,
        what="P2's evicted blocks gone from the index",
    )
    served, hits = ask("And now?")
    assert served == {p.name: 1, p2.name: 0}  # nothing cached anywhere: the first P listed
    assert hits[p.name] == 0, hits


def _late_proxy(
    factory: ProxyFactory, fleet: CachedFleet, system: str, **settings: str
) -> ProxyServer:
    """P2 caches `system` (as the proxy would send it: the anonymous tenant's cache_salt),
    then a proxy in front of both Ps and D starts following the Ps' events, with `settings`."""
    early = _with_system(system, "Before the proxy.") | {"max_tokens": 1}
    CacheScopes(isolate=True, share_groups={}).apply(early, tenant_of(None))
    status, out = fleet.second.post("/v1/chat/completions", early)
    assert status == 200, out
    return factory(
        [fleet.prefill.url, fleet.second.url], [fleet.decode.url], ready_path="/ready",
        connector_secret=vllm_servers.CONNECTOR_SECRET, side_channels=fleet.side_channels,
        admin_key=ADMIN_KEY, prefix_index_ttl_s="0.001",
        kv_events_endpoints=fleet.events_endpoints, **settings,
    )  # fmt: skip


def test_a_prefix_cached_before_a_proxy_followed_the_events_is_learnt_on_first_use(
    cached_fleet: CachedFleet,
) -> None:
    """P2 cached a system prompt before this proxy started: vLLM never stores those blocks
    again while they stay cached, so its events name only the blocks after them, whose parent
    the proxy never saw. The first request on that prompt it routes to P2 names the prefix, and
    the index has the whole system prompt on P2 from then on."""
    fleet = cached_fleet
    p, p2 = fleet.prefill, fleet.second
    system = f"Learnt on first use by a proxy that came later. {SYSTEM}" * 2
    factory = ProxyFactory()
    try:
        proxy = _late_proxy(factory, fleet, system)
        proxy.wait_for_events(
            lambda: proxy.events_connected(p.url, p2.url), 30, what="the Ps' events followed"
        )
        probe, two_blocks = _with_system(system, "?"), 2 * vllm_servers.BLOCK_SIZE
        assert proxy.events_cached(probe)[p2.url] == 0  # cached, not that this proxy knows
        _admin(proxy, "POST", "/admin/backends/drain", {"role": "prefill", "url": p.url})
        hits = settled(p2, CACHE_HITS)
        # Long enough to fill whole blocks after the cached prefix: vLLM stores (and reports)
        # only full blocks, and those are what name their parent.
        sent = _with_system(system, "After the proxy, " + "tell me about the blocks. " * 12)
        out = _ask(proxy, sent, f"adopt-{uuid.uuid4().hex[:8]}")
        assert out["choices"][0]["message"]["content"] == _reference(fleet, sent)
        assert settled(p2, CACHE_HITS) - hits >= two_blocks  # P2 had it cached
        proxy.wait_for_events(
            lambda: proxy.events_cached(probe)[p2.url] >= two_blocks,
            30,
            what="the prefix named through the routed prompt",
        )
    finally:
        factory.close()


def test_a_proxy_that_follows_late_learns_what_p2_cached_from_vllms_replay(
    cached_fleet: CachedFleet,
) -> None:
    """P2 answers replay requests (vLLM's `replay_endpoint`). A proxy started after P2 cached a
    system prompt asks P2 for the batches it keeps as soon as it connects: the index has the
    whole prompt on P2 before any request is routed (no prompt names it, as in the test above),
    and the next request sharing it goes to P2, whose cache serves it (vLLM's own counter)."""
    fleet = cached_fleet
    p, p2 = fleet.prefill, fleet.second
    system = f"Learnt from the engine's replay, before any request. {SYSTEM}" * 2
    factory = ProxyFactory()
    try:
        proxy = _late_proxy(
            factory, fleet, system, kv_events_replay_endpoints=fleet.replay_endpoints
        )
        probe, two_blocks = _with_system(system, "?"), 2 * vllm_servers.BLOCK_SIZE
        proxy.wait_for_events(
            lambda: proxy.events_cached(probe)[p2.url] >= two_blocks,
            30,
            what="P2's replayed blocks in the index",
        )
        assert proxy.metrics()['kvrelay_kv_events_replays_total{result="answered"}'] >= 1
        assert proxy.events_cached(probe)[p.url] == 0
        hits = settled(p2, CACHE_HITS)
        sent = _with_system(system, "After the proxy.")
        out = _ask(proxy, sent, f"replay-{uuid.uuid4().hex[:8]}")
        assert out["choices"][0]["message"]["content"] == _reference(fleet, sent)
        assert settled(p2, CACHE_HITS) - hits >= two_blocks  # P2 was chosen, and had it
    finally:
        factory.close()


@pytest.mark.parametrize("events", [False, True], ids=["routing-fed", "d-events"])
def test_decode_only_cached_sends_a_request_whose_prefix_d_decoded_straight_to_d(
    cached_fleet: CachedFleet, events: bool
) -> None:
    """No held history (another conversation sharing the system prompt), but D decoded that
    prompt: with `decode_only_cached` the request goes straight to D, whose own prefix cache
    serves the system prompt (vLLM's prefix-cache hits on D grow by its full blocks), no P is
    asked, and the answer equals plain vLLM's. With `events` the proxy follows every engine's
    KV events and its routing-fed index expires at once: D's own events showing the prompt
    cached are what send the request there."""
    fleet = cached_fleet
    p, p2, d = fleet.prefill, fleet.second, fleet.decode
    system = f"{SYSTEM} Served again from the decode engine's own cache ({events}). " * 2
    followed: dict[str, str] = {}
    if events:
        followed = {
            "prefix_index_ttl_s": "0.001",
            "admin_key": ADMIN_KEY,
            "kv_events_endpoints": f"{fleet.events_endpoints},{fleet.decode_events}",
        }
    factory = ProxyFactory()
    try:
        proxy = _conditional_proxy(
            factory, fleet, conditional_max_uncached_tokens="96", decode_only_cached="true",
            prefill_spill_factor="0", **followed,
        )  # fmt: skip
        if events:  # D's events of the first turn are what the test looks for: none missed
            proxy.wait_for_events(lambda: proxy.events_connected(d.url), 30, what="D followed")
        first = _with_system(system, "Hello.")
        conversations = [f"cached-{uuid.uuid4().hex[:8]}" for _ in range(2)]
        out = _ask(proxy, first, conversations[0])
        assert out["choices"][0]["message"]["content"] == _reference(fleet, first)
        other = _with_system(system, "Where from?")
        if events:
            # The first turn's hold given back: its blocks stay in D's cache, as D's events say.
            assert proxy.call("DELETE", f"/v1/conversations/{conversations[0]}")[0] == 200
            prompt_tokens = int(out["usage"]["prompt_tokens"])
            proxy.wait_for_events(
                lambda: proxy.events_cached(other, "decode")[d.url] >= prompt_tokens // 2,
                30,
                what="D's events to show the system prompt",
            )
        p_requests = settled(p, REQUESTS) + settled(p2, REQUESTS)
        d_hits = settled(d, CACHE_HITS)
        out = _ask(proxy, other, conversations[1])
        assert out["choices"][0]["message"]["content"] == _reference(fleet, other)
        assert settled(p, REQUESTS) + settled(p2, REQUESTS) == p_requests
        assert settled(d, CACHE_HITS) - d_hits >= 2 * vllm_servers.BLOCK_SIZE
        decisions = proxy.metrics()['kvrelay_routing_decisions_total{decision="decode_only"}']
        assert decisions == 1
        for conversation in conversations[1:] if events else conversations:
            assert proxy.call("DELETE", f"/v1/conversations/{conversation}")[0] == 200
    finally:
        factory.close()


def test_an_idle_p_yields_a_turn_whose_history_only_ds_cache_holds(
    cached_fleet: CachedFleet,
) -> None:
    """Turn 2 of a conversation ran decode-only on D (its hold), so of the engines only D saw
    its prompt. The conversation's entry is then deleted (its hold released: the blocks stay in
    D's prefix cache), so turn 3 has no held history, and with every P idle it would have gone
    through a P, which would compute all of it beyond turn 1's prompt. It goes to D instead
    (spilled, at the defaults' spill factor: D computes only the last reply and the question),
    no P is asked, vLLM's prefix-cache hits on D grow by at least turn 2's prompt, and every
    answer equals plain vLLM's. `decode_only_cached` (on by default) is off here: it would send
    the turn to D's cache before the spill is weighed (its own test is above)."""
    fleet = cached_fleet
    p, p2, d = fleet.prefill, fleet.second, fleet.decode
    system = f"{SYSTEM} The history comes back from the decode engine's cache. " * 2
    factory = ProxyFactory()
    try:
        proxy = _conditional_proxy(
            factory, fleet, conditional_max_uncached_tokens="400", decode_only_cached="false"
        )
        conversation = f"yield-{uuid.uuid4().hex[:8]}"
        messages = [{"role": "system", "content": system}]

        def turn(user: str) -> int:
            """One turn through the proxy (short replies: turn 2 is mostly its question); its
            prompt's tokens."""
            messages.append({"role": "user", "content": user})
            sent = _body(list(messages)) | {"max_tokens": 8}
            out = _ask(proxy, sent, conversation)
            reply = out["choices"][0]["message"]["content"]
            assert reply == _reference(fleet, sent)
            messages.append({"role": "assistant", "content": reply})
            return int(out["usage"]["prompt_tokens"])

        def decisions(decision: str) -> float:
            return proxy.metrics().get(
                f'kvrelay_routing_decisions_total{{decision="{decision}"}}', 0.0
            )

        turn("Hello.")
        second = turn("Say more about the blocks: " + "which engine computed them and when. " * 8)
        assert decisions("decode_only") == 1
        assert proxy.call("DELETE", f"/v1/conversations/{conversation}")[0] == 200
        p_requests = settled(p, REQUESTS) + settled(p2, REQUESTS)
        d_hits = settled(d, CACHE_HITS)
        spilled = decisions("spilled")
        turn("Go on.")
        assert decisions("spilled") == spilled + 1
        assert settled(p, REQUESTS) + settled(p2, REQUESTS) == p_requests
        # Turn 2's prompt in whole blocks, less one: the template may render its last block
        # differently once the reply follows it.
        hit = settled(d, CACHE_HITS) - d_hits
        assert hit >= vllm_servers.BLOCK_SIZE * (second // vllm_servers.BLOCK_SIZE - 1), hit
        assert proxy.call("DELETE", f"/v1/conversations/{conversation}")[0] == 200
    finally:
        factory.close()


def test_a_p_pulls_a_history_whose_hold_is_gone_from_ds_cache(cached_fleet: CachedFleet) -> None:
    """Turn 1 runs on P (P2 drained); its conversation's entry is then deleted (D's hold
    released: the blocks stay in D's prefix cache, and D's events still show them). Turn 2 runs
    on P2 (P drained), whose cache never saw the history, no spill allowed: the proxy pins the
    history on D (the engine whose events show the longest prefix), P2 loads it over NIXL
    (vLLM's own counter on P2), D's pin is given back after, and the answer equals plain
    vLLM's."""
    fleet = cached_fleet
    p, p2, d = fleet.prefill, fleet.second, fleet.decode
    system = f"{SYSTEM} The decode engine's cache keeps the history for the next prefill. " * 2
    factory = ProxyFactory()
    try:
        proxy = factory(
            [p.url, p2.url], [d.url], ready_path="/ready",
            connector_secret=vllm_servers.CONNECTOR_SECRET, side_channels=fleet.side_channels,
            admin_key=ADMIN_KEY, prefix_index_ttl_s="0.001", prefill_spill_factor="0",
            prefix_pull_min_tokens=str(2 * vllm_servers.BLOCK_SIZE),
            kv_events_endpoints=f"{fleet.events_endpoints},{fleet.decode_events}",
        )  # fmt: skip
        proxy.wait_for_events(
            lambda: proxy.events_connected(p.url, p2.url, d.url), 30, what="the events followed"
        )
        conversation = f"dpull-{uuid.uuid4().hex[:8]}"

        def admin(path: str, url: str) -> None:
            status, out, _ = proxy.call(
                "POST", path, {"role": "prefill", "url": url},
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            )  # fmt: skip
            assert status in (200, 201), out

        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hello."}]
        held_before = settled(d, HELD_BLOCKS)  # the module's earlier conversations' holds
        admin("/admin/backends/drain", p2.url)
        first = _body(list(messages))
        out = _ask(proxy, first, conversation)
        reply = out["choices"][0]["message"]["content"]
        assert reply == _reference(fleet, first)
        prompt_tokens = int(out["usage"]["prompt_tokens"])
        assert proxy.call("DELETE", f"/v1/conversations/{conversation}")[0] == 200
        admin("/admin/backends", p2.url)
        admin("/admin/backends/drain", p.url)
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "Who reads it now?"},
        ]
        second = _body(list(messages))
        proxy.wait_for_events(
            lambda: proxy.events_cached(second, "decode")[d.url] >= prompt_tokens // 2,
            30,
            what="D's events to show the history",
        )
        assert proxy.events_cached(second)[p2.url] == 0
        loaded = settled(p2, TOKENS_LOADED)
        out = _ask(proxy, second, conversation)
        assert out["choices"][0]["message"]["content"] == _reference(fleet, second)
        got = settled(p2, TOKENS_LOADED) - loaded
        # Turn 1's prompt in whole blocks, less one (the template may render its last block
        # differently once the reply follows it), came from D's pin.
        assert got >= vllm_servers.BLOCK_SIZE * (prompt_tokens // vllm_servers.BLOCK_SIZE - 1)
        m = proxy.metrics()
        assert m.get('kvrelay_prefix_pins_total{holder="decode"}', 0) == 1
        # vLLM's answer to the pin, timed once under D's pool.
        assert m.get('kvrelay_prefix_pin_seconds_count{holder="decode"}', 0) == 1
        assert m.get('kvrelay_prefix_pulls_total{leg="prefill",result="pulled"}', 0) == 1
        admin("/admin/backends", p.url)
        assert proxy.call("DELETE", f"/v1/conversations/{conversation}")[0] == 200
        wait_until(
            lambda: d.metric(HELD_BLOCKS) <= held_before,
            15,
            what="D to hold no more than before (the pin given back after P2 read it)",
        )
    finally:
        factory.close()


def test_ps_requests_carry_a_priority_by_size_and_answer_as_plain_vllm(
    cached_fleet: CachedFleet,
) -> None:
    """`prefill_priority_tokens` on real vLLM: P's request carries a `priority` (the prompt's
    tokens over 16 here), which P2 (`--scheduling-policy priority`) schedules by and P (fcfs)
    ignores. Either way P computes the prompt (its own count of requests served) and the
    answer equals plain vLLM's."""
    fleet = cached_fleet
    factory = ProxyFactory()
    try:
        for p in (fleet.second, fleet.prefill):
            proxy = factory(
                [p.url], [fleet.decode.url], ready_path="/ready",
                connector_secret=vllm_servers.CONNECTOR_SECRET, side_channels=fleet.side_channels,
                prefill_priority_tokens="16",
            )  # fmt: skip
            served = settled(p, REQUESTS)
            system = f"{SYSTEM} Shorter prompts go first ({uuid.uuid4().hex[:8]})."
            body = _body(
                [{"role": "system", "content": system}, {"role": "user", "content": "Hi."}]
            )
            out = _ask(proxy, body, f"prio-{uuid.uuid4().hex[:8]}")
            assert out["choices"][0]["message"]["content"] == _reference(fleet, body)
            wait_until(
                lambda p=p, served=served: settled(p, REQUESTS) > served, 10, what="P to count it"
            )
    finally:
        factory.close()
