"""Realized reuse through the proxy, as the engines report it (docs/ACCOUNTING.md §3), on
enginesim P and D (real NIXL) driven by the `openai` SDK.

Every figure the proxy returns (the `X-Kvrelay-*` headers of a JSON answer, the stream's final
usage event) and counts (`kvrelay_prompt_tokens_total`, `kvrelay_tokens_reused_total`,
`kvrelay_refused_blocks_total`) is compared with the engines' own counters
(`vllm:prompt_tokens_by_source_total` of the engine that prefilled the turn, the connector's
mismatch count), never with another figure of the proxy's. A map entry is an offer: a
re-rendered history is offered and reuses nothing, and a D without a prefix cache serves a
decode-only turn from nothing; both show 0 here, and the D loses its decode-only turns.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvrelay.devtools import EngineFactory, EngineSim, ProxyFactory, ProxyServer
from kvrelay.enginesim.chat import render_chat
from kvrelay.enginesim.reference import reference_chat, reference_completion
from tests.harness import wait_until
from tests.proxy.accounting_turns import Asker, returned_account
from tests.proxy.client import MODEL
from tests.proxy.idle_engines import idle_around
from tests.proxy.sdk_turns import MODES

pytestmark = pytest.mark.nixl

SYSTEM = "You are a careful assistant who explains caches. Answer briefly. " * 6
QUESTIONS = ["What is a cache?", "And a block?", "Why reuse it?", "Thanks, and then?"]
MAX_TOKENS = 12
CACHE = ("--enable-prefix-caching",)
PROMPTS = f'vllm:prompt_tokens_total{{engine="0",model_name="{MODEL}"}}'
SOURCE = f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="{MODEL}",source="%s"}}'
MISMATCH = "enginesim_connector_prefix_mismatch_blocks"
HELD_BLOCKS = "enginesim_blocks_held_for_remote"
# The proxy's sources and the engine's.
SOURCES = {"local_hit": "local_cache_hit", "loaded": "external_kv_transfer",
           "computed": "local_compute"}  # fmt: skip
WITHDRAWN = (
    'kvrelay_reuse_standing_changes_total{change="withdrawn",role="decode",turn="decode_only"}'
)
P_WITHDRAWN = (
    'kvrelay_reuse_standing_changes_total{change="withdrawn",role="prefill",turn="affinity"}'
)


@dataclass
class Engines:
    p_cached: EngineSim
    p_plain: EngineSim
    d_cached: EngineSim
    d_plain: EngineSim


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    """P and D with and without a local prefix cache, shared by the module."""
    factory = EngineFactory()
    try:
        yield Engines(*factory.many(
            ("Pc", ["--role", "prefill", *CACHE]), ("Pp", ["--role", "prefill"]),
            ("Dc", ["--role", "decode", *CACHE]), ("Dp", ["--role", "decode"]),
        ))  # fmt: skip
    finally:
        factory.close()


@pytest.fixture
def idle(engines: Engines) -> Iterator[Engines]:
    every = (engines.p_cached, engines.p_plain, engines.d_cached, engines.d_plain)
    yield from idle_around(engines, every)


class Counted:
    """One engine's prompt-token counters around one turn."""

    def __init__(self, engine: EngineSim) -> None:
        self.engine, self.before = engine, engine.metrics()

    def split(self, at_least: int = 1) -> dict[str, float]:
        """The turn's prompt tokens by source (the proxy's names), once the engine counted
        them, with `prompt_tokens` and the connector's refused (mismatching) blocks."""
        wait_until(lambda: self._delta(self.engine.metrics(), PROMPTS) >= at_least, 10,
                   what=f"{self.engine.name} to count the turn's prompt")  # fmt: skip
        now = self.engine.metrics()
        out = {ours: self._delta(now, SOURCE % theirs) for ours, theirs in SOURCES.items()}
        out["prompt_tokens"] = self._delta(now, PROMPTS)
        out["hash"] = self._delta(now, MISMATCH)
        return out

    def _delta(self, now: dict[str, float], name: str) -> float:
        return now.get(name, 0.0) - self.before.get(name, 0.0)


def assert_equals_engine(account: dict[str, Any], split: dict[str, float], leg: str) -> None:
    assert account["prefilled_by"] == leg
    assert account["prompt_tokens"] == split["prompt_tokens"]
    assert account["local_hit_tokens"] == split["local_hit"]
    assert account["loaded_tokens"] == split["loaded"]
    assert account["computed_tokens"] == split["computed"]
    assert account["reused_tokens"] == split["local_hit"] + split["loaded"]


def proxy_counts(proxy: ProxyServer, leg: str) -> dict[str, float]:
    m = proxy.metrics()
    out = {s: m.get(f'kvrelay_prompt_tokens_total{{leg="{leg}",source="{s}"}}', 0.0)
           for s in SOURCES}  # fmt: skip
    out["reused"] = m.get(f'kvrelay_tokens_reused_total{{leg="{leg}"}}', 0.0)
    out["hash"] = m.get(f'kvrelay_refused_blocks_total{{leg="{leg}",reason="hash"}}', 0.0)
    out["unknown"] = m.get(f'kvrelay_leg_accounts_total{{leg="{leg}",result="unknown"}}', 0.0)
    return out


def add(total: dict[str, float], split: dict[str, float]) -> None:
    for key in (*SOURCES, "hash"):
        total[key] = total.get(key, 0.0) + split[key]
    total["reused"] = total.get("reused", 0.0) + split["local_hit"] + split["loaded"]


def run_through_p(proxy: ProxyServer, p: EngineSim, d: EngineSim, conversation: str,
                  use_async: bool) -> None:  # fmt: skip
    """QUESTIONS through P then D, cycling streamed with usage, JSON, streamed without; every
    returned account and the proxy's counts equal P's (and D's) counters."""
    ask = Asker(proxy, MODEL, MAX_TOKENS, use_async)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    p_total: dict[str, float] = {}
    d_total: dict[str, float] = {}
    for turn, question in enumerate(QUESTIONS):
        stream, include_usage = MODES[turn % len(MODES)]
        messages.append({"role": "user", "content": question})
        p_counted, d_counted = Counted(p), Counted(d)
        result = ask.turn(messages, conversation, stream, include_usage)
        assert result.answer == reference_chat(messages, MAX_TOKENS), f"turn {turn}"
        messages.append({"role": "assistant", "content": result.answer})
        p_split, d_split = p_counted.split(), d_counted.split()
        add(p_total, p_split)
        add(d_total, {**d_split, "hash": 0.0})
        account = returned_account(result)
        assert (account is None) == (stream and not include_usage)
        if account is not None:
            assert_equals_engine(account, p_split, "prefill")
            assert account["refused_blocks"].get("hash", 0) == p_split["hash"] == 0
        if turn > 0:
            assert p_split["local_hit"] + p_split["loaded"] > 0, "nothing reused after turn 1"
    prefill, decode = proxy_counts(proxy, "prefill"), proxy_counts(proxy, "decode")
    assert {k: prefill[k] for k in (*SOURCES, "reused", "hash")} == p_total
    assert prefill["unknown"] == 0 and decode["unknown"] == 0
    # D's leg: its local hit and what it loaded from P, as D counted them; not reuse.
    assert {k: decode[k] for k in SOURCES} == {k: d_total[k] for k in SOURCES}
    assert decode["reused"] == 0
    ask.forget(conversation)


@pytest.mark.parametrize("use_async", [False, True], ids=["OpenAI", "AsyncOpenAI"])
@pytest.mark.parametrize("p_cache", [True, False], ids=["P-prefix-cache", "P-no-cache"])
@pytest.mark.parametrize("policy", ["always_p", "affinity"])
def test_turns_through_p_return_and_count_what_p_reported(
    idle: Engines, proxy_factory: ProxyFactory, policy: str, p_cache: bool, use_async: bool
) -> None:
    p = idle.p_cached if p_cache else idle.p_plain
    proxy = proxy_factory([p], [idle.d_cached], ready_path="/ready", routing_policy=policy)
    run_through_p(proxy, p, idle.d_cached, f"{policy}-{p_cache}-{use_async}", use_async)
    m = proxy.metrics()
    affine = m.get('kvrelay_routing_decisions_total{decision="prefill_affinity"}', 0)
    withdrawn = m.get(P_WITHDRAWN, 0)
    if policy == "always_p":
        assert affine == withdrawn == 0
    elif p_cache:
        # Its prefix cache has the previous prompt: every later turn goes back to it.
        assert affine == len(QUESTIONS) - 1 and withdrawn == 0
    else:
        # Its first affinity turn hit nothing locally: no other turn is sent by affinity.
        assert affine == 1 and withdrawn == 1


@pytest.mark.parametrize("use_async", [False, True], ids=["OpenAI", "AsyncOpenAI"])
def test_decode_only_turns_return_and_count_what_d_reported(
    idle: Engines, proxy_factory: ProxyFactory, use_async: bool
) -> None:
    p, d = idle.p_plain, idle.d_cached
    proxy = proxy_factory([p], [d], ready_path="/ready", routing_policy="conditional",
                          conditional_max_uncached_tokens="4096")  # fmt: skip
    conversation = f"cond-{use_async}"
    ask = Asker(proxy, MODEL, MAX_TOKENS, use_async)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    d_total: dict[str, float] = {}
    for turn, question in enumerate(QUESTIONS):
        stream, include_usage = MODES[turn % len(MODES)]
        messages.append({"role": "user", "content": question})
        counted = Counted(d)
        result = ask.turn(messages, conversation, stream, include_usage)
        assert result.answer == reference_chat(messages, MAX_TOKENS), f"turn {turn}"
        messages.append({"role": "assistant", "content": result.answer})
        split = counted.split()
        account = returned_account(result)
        if turn == 0:
            continue  # through P
        add(d_total, {**split, "hash": 0.0})
        assert split["local_hit"] > 0 and split["loaded"] == 0  # D's own prefix cache
        if account is not None:
            assert_equals_engine(account, {**split, "hash": 0.0}, "decode")
    m = proxy.metrics()
    assert m['kvrelay_routing_decisions_total{decision="decode_only"}'] == len(QUESTIONS) - 1
    decode = proxy_counts(proxy, "decode")
    assert decode["reused"] == d_total["reused"] > 0
    assert m.get(WITHDRAWN, 0) == 0
    ask.forget(conversation)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_d_without_prefix_cache_loses_its_decode_only_turns(
    idle: Engines, proxy_factory: ProxyFactory, stream: bool
) -> None:
    p, d = idle.p_plain, idle.d_plain
    proxy = proxy_factory([p], [d], ready_path="/ready", routing_policy="conditional",
                          conditional_max_uncached_tokens="4096")  # fmt: skip
    conversation = f"no-cache-{stream}"
    ask = Asker(proxy, MODEL, MAX_TOKENS)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    decisions = 'kvrelay_routing_decisions_total{decision="decode_only"}'
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        counted = Counted(d)
        result = ask.turn(messages, conversation, stream, True)
        assert result.answer == reference_chat(messages, MAX_TOKENS), f"turn {turn}"
        messages.append({"role": "assistant", "content": result.answer})
        split = counted.split()
        account = returned_account(result)
        assert account is not None
        m = proxy.metrics()
        if turn == 1:
            # The map offered D's hold; D recomputed every prompt token.
            assert m[decisions] == 1
            assert split["local_hit"] == split["loaded"] == 0
            assert_equals_engine(account, {**split, "hash": 0.0}, "decode")
            assert m[WITHDRAWN] == 1
        elif turn > 1:
            assert m[decisions] == 1, "a D without cached tokens got another decode-only turn"
            assert account["prefilled_by"] == "prefill"
    assert proxy.metrics()[WITHDRAWN] == 1  # logged and counted once
    ask.forget(conversation)


FIRST_LINE = "Conversation of {messages} messages."


def test_a_rerendered_history_reuses_nothing_and_counts_its_blocks_refused_by_hash(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    # The chat template's first line changes every turn (the messages are the same): the
    # history check passes, P is offered D's hold, and every offered block differs by hash.
    template = ("--chat-template-first-line", FIRST_LINE)
    p, d = engine_factory.many(("Pr", ["--role", "prefill", *template]),
                               ("Dr", ["--role", "decode", *CACHE, *template]))  # fmt: skip
    proxy = proxy_factory([p], [d], ready_path="/ready", routing_policy="always_p")
    hits = 'kvrelay_reuse_total{result="hit"}'
    conversation = "rerendered"
    ask = Asker(proxy, MODEL, MAX_TOKENS)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    refused = 0.0
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        counted = Counted(p)
        offered = d.metric(HELD_BLOCKS)  # D holds the previous turn, nothing else
        result = ask.turn(messages, conversation, turn % 2 == 1, True)
        prompt = render_chat(messages, first_line=FIRST_LINE)
        assert result.answer == reference_completion(prompt, MAX_TOKENS), f"turn {turn}"
        messages.append({"role": "assistant", "content": result.answer})
        split = counted.split()
        account = returned_account(result)
        assert account is not None
        assert_equals_engine(account, split, "prefill")
        assert account["reused_tokens"] == 0
        refused += offered
        if turn > 0:
            # Every block D offered, as P's connector counted the mismatch (its count leaves
            # out a partial last block, which the report counts as refused by hash too).
            assert offered > 0 and account["refused_blocks"] == {"hash": offered}
            assert split["hash"] in (offered, offered - 1)
    m = proxy.metrics()
    assert m[hits] == len(QUESTIONS) - 1  # the map offered every time ...
    assert m['kvrelay_tokens_reused_total{leg="prefill"}'] == 0  # ... and nothing was reused
    assert m['kvrelay_refused_blocks_total{leg="prefill",reason="hash"}'] == refused > 0
    ask.forget(conversation)
