"""Realized reuse through the proxy on real vLLM (issue 30): what the proxy returns with each
answer (`X-Kvrelay-*` headers, the stream's final usage event) and counts in `/metrics` equals
vLLM's own `vllm:prompt_tokens_by_source_total` changes on the engine that prefilled the turn,
for turns through P (`always_p`, `affinity`) and decode-only turns, JSON and streamed.

The kvrelay fleet's P runs without a prefix cache and its D with vLLM's default one. The same
two engines with their roles swapped give a D without a prefix cache: its first decode-only
turn comes back with no cached tokens, and it gets no other. A chat template that re-renders
its first line every turn is offered D's hold by the map and reuses nothing: every offered
block is refused by hash.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvrelay.devtools import ProxyFactory, ProxyServer, tiny_model, vllm_servers
from kvrelay.prometheus_text import series_sum
from tests.harness import wait_until
from tests.proxy.accounting_turns import Asker, Result, returned_account
from tests.vllm.conftest import PDFleet

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = f'vllm:prompt_tokens_total{{engine="0",model_name="{vllm_servers.MODEL_NAME}"}}'
SOURCE = (
    f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="{vllm_servers.MODEL_NAME}",'
    'source="%s"}'
)
MISMATCH = "vllm:kvrelay_prefix_mismatch_blocks_total"  # the connector's, summed over labels
TOKENS_LOADED = "vllm:kvrelay_tokens_loaded_total"
SOURCES = {"local_hit": "local_cache_hit", "loaded": "external_kv_transfer",
           "computed": "local_compute"}  # fmt: skip
WITHDRAWN = (
    'kvrelay_reuse_standing_changes_total{change="withdrawn",role="decode",turn="decode_only"}'
)
DECODE_ONLY = 'kvrelay_routing_decisions_total{decision="decode_only"}'
MAX_TOKENS = 12
QUESTIONS = ["What is reused?", "And what is refused?", "Which blocks come from D?"]
# (stream, include_usage) per turn: every turn returns its account.
MODES = ((False, False), (True, True), (False, False))
RERENDERING = "Conversation of {{ messages|length }} messages.\n" + tiny_model.CHAT_TEMPLATE


def _system() -> str:
    # Each test its own history: no prefix hit from another test's turns.
    return (f"Session {uuid.uuid4().hex[:8]}. You answer questions about reuse. A block is "
            "reused only when every token before it and in it is the same as before.")  # fmt: skip


@pytest.fixture(scope="module")
def proxies(kvrelay_fleet: PDFleet) -> Iterator[dict[str, ProxyServer]]:
    p, d = kvrelay_fleet.prefill, kvrelay_fleet.decode
    factory = ProxyFactory()
    # Routing that depends on nothing but the hold and the reuse seen: D's /tokenize count may
    # take longer than the 1 s default on a loaded two-core runner, and no load reading makes a
    # D busy, so a turn that goes through P here went there for what the tests are about.
    common = {"ready_path": "/ready", "connector_secret": vllm_servers.CONNECTOR_SECRET,
              "side_channels": vllm_servers.side_channels_setting(p, d),
              "probe_timeout_s": "30", "decode_max_waiting": "1000",
              "decode_max_kv_usage": "1"}  # fmt: skip
    short = {"conditional_max_uncached_tokens": "4096"}
    try:
        yield {
            "always_p": factory([p.url], [d.url], routing_policy="always_p", **common),
            "affinity": factory([p.url], [d.url], routing_policy="affinity", **common),
            "conditional": factory([p.url], [d.url], routing_policy="conditional", **short,
                                   **common),
            "rerendered": factory([p.url], [d.url], routing_policy="always_p", **common),
            # Every turn that would go through P spills to D, however idle P is.
            "spill": factory([p.url], [d.url], routing_policy="conditional",
                             prefill_spill_factor="0.001", **common),
            # P (no prefix cache) as the D: decode-only turns find nothing cached there. No
            # spills: a load reading that shows P with requests (another test's, on a loaded
            # runner) would send a turn through P to this D instead, which is not a decode-only
            # turn but reads the same in the account (prefilled by D).
            "swapped": factory([d.url], [p.url], routing_policy="conditional", **short,
                               prefill_spill_factor="0", **common),
        }  # fmt: skip
    finally:
        factory.close()


class Counted:
    """One engine's prompt-token counters around one turn."""

    def __init__(self, server: vllm_servers.VLLMServer) -> None:
        self.server, self.before = server, server.metrics()

    def split(self, prompt_tokens: int) -> dict[str, float]:
        """The turn's prompt tokens by source, once vLLM counted them (its stats lag)."""
        wait_until(lambda: self._delta(self.server.metrics(), PROMPTS) >= prompt_tokens, 30,
                   what=f"{self.server.name} to count the prompt tokens")  # fmt: skip
        now = self.server.metrics()
        out = {ours: self._delta(now, SOURCE % theirs) for ours, theirs in SOURCES.items()}
        for key, name in (("mismatch", MISMATCH), ("tokens_loaded", TOKENS_LOADED)):
            out[key] = series_sum(now, name) - series_sum(self.before, name)
        return out

    def _delta(self, now: dict[str, float], name: str) -> float:
        return now.get(name, 0.0) - self.before.get(name, 0.0)


def _account(result: Result) -> dict[str, Any]:
    account = returned_account(result)
    assert account is not None
    return account


def _equals(account: dict[str, Any], split: dict[str, float], leg: str) -> None:
    assert account["prefilled_by"] == leg
    assert account["local_hit_tokens"] == split["local_hit"]
    assert account["loaded_tokens"] == split["loaded"]
    assert account["computed_tokens"] == split["computed"]
    assert account["reused_tokens"] == split["local_hit"] + split["loaded"]
    assert account["prompt_tokens"] == sum(split[s] for s in SOURCES)


def _why(metrics: dict[str, float]) -> str:
    """The proxy's own account of how it routed: the failure message of a routing assertion."""
    wanted = (
        "kvrelay_reuse_total",
        "kvrelay_routing_decisions_total",
        "kvrelay_decode_only_checks_total",
        "kvrelay_reuse_standing_changes_total",
    )
    return ", ".join(f"{k}={v:g}" for k, v in sorted(metrics.items()) if k.startswith(wanted))


def _counted(proxy: ProxyServer, leg: str) -> dict[str, float]:
    m = proxy.metrics()
    out = {s: m.get(f'kvrelay_prompt_tokens_total{{leg="{leg}",source="{s}"}}', 0.0)
           for s in SOURCES}  # fmt: skip
    out["reused"] = m.get(f'kvrelay_tokens_reused_total{{leg="{leg}"}}', 0.0)
    return out


@pytest.mark.parametrize("policy", ["always_p", "affinity"])
def test_turns_through_p_return_and_count_what_vllm_counted(
    kvrelay_fleet: PDFleet, proxies: dict[str, ProxyServer], policy: str
) -> None:
    p, d = kvrelay_fleet.prefill, kvrelay_fleet.decode
    ask = Asker(proxies[policy], vllm_servers.MODEL_NAME, MAX_TOKENS)
    conversation = f"acc-{policy}-{uuid.uuid4().hex[:6]}"
    messages = [{"role": "system", "content": _system()}]
    p_total = dict.fromkeys(SOURCES, 0.0)
    d_total = dict.fromkeys(SOURCES, 0.0)
    connector_loaded = 0.0
    for turn, (question, (stream, usage)) in enumerate(zip(QUESTIONS, MODES, strict=True)):
        messages.append({"role": "user", "content": question})
        p_counted, d_counted = Counted(p), Counted(d)
        result = ask.turn(messages, conversation, stream, usage)
        messages.append({"role": "assistant", "content": result.answer})
        account = _account(result)
        p_split = p_counted.split(account["prompt_tokens"])
        d_split = d_counted.split(account["prompt_tokens"])
        _equals(account, p_split, "prefill")
        if turn > 0:
            assert account["loaded_tokens"] > 0  # P has no prefix cache: the history is D's
        connector_loaded += p_split["tokens_loaded"]
        for key in SOURCES:
            p_total[key] += p_split[key]
            d_total[key] += d_split[key]
    prefill, decode = _counted(ask.proxy, "prefill"), _counted(ask.proxy, "decode")
    assert {k: prefill[k] for k in SOURCES} == p_total
    assert prefill["reused"] == p_total["local_hit"] + p_total["loaded"] > 0
    assert prefill["loaded"] == connector_loaded  # what P's connector read from D
    # D's leg: its own local hit and the transfer from P, as vLLM counted them on D.
    assert {k: decode[k] for k in SOURCES} == d_total
    ask.forget(conversation)


def test_decode_only_turns_return_and_count_what_vllm_counted_on_d(
    kvrelay_fleet: PDFleet, proxies: dict[str, ProxyServer]
) -> None:
    d = kvrelay_fleet.decode
    ask = Asker(proxies["conditional"], vllm_servers.MODEL_NAME, MAX_TOKENS)
    conversation = f"acc-cond-{uuid.uuid4().hex[:6]}"
    messages = [{"role": "system", "content": _system()}]
    reused = 0.0
    for turn, (question, (stream, usage)) in enumerate(zip(QUESTIONS, MODES, strict=True)):
        messages.append({"role": "user", "content": question})
        counted = Counted(d)
        result = ask.turn(messages, conversation, stream, usage)
        messages.append({"role": "assistant", "content": result.answer})
        account = _account(result)
        split = counted.split(account["prompt_tokens"])
        if turn == 0:
            continue  # through P
        assert account["prefilled_by"] == "decode", _why(ask.proxy.metrics())
        _equals(account, split, "decode")
        assert split["local_hit"] > 0 and split["loaded"] == 0  # D's own prefix cache
        reused += split["local_hit"]
    m = ask.proxy.metrics()
    assert m[DECODE_ONLY] == len(QUESTIONS) - 1 and m.get(WITHDRAWN, 0) == 0
    assert _counted(ask.proxy, "decode")["reused"] == reused
    ask.forget(conversation)


def test_a_spilled_first_turn_is_prefilled_on_d_and_its_follow_up_reuses_it(
    kvrelay_fleet: PDFleet, proxies: dict[str, ProxyServer]
) -> None:
    d = kvrelay_fleet.decode
    ask = Asker(proxies["spill"], vllm_servers.MODEL_NAME, MAX_TOKENS)
    plain = Asker(proxies["always_p"], vllm_servers.MODEL_NAME, MAX_TOKENS)
    conversation = f"acc-spill-{uuid.uuid4().hex[:6]}"
    messages = [{"role": "system", "content": _system()}]
    for turn, (question, (stream, usage)) in enumerate(zip(QUESTIONS[:2], MODES, strict=False)):
        messages.append({"role": "user", "content": question})
        counted = Counted(d)
        result = ask.turn(messages, conversation, stream, usage)
        account = _account(result)
        split = counted.split(account["prompt_tokens"])
        _equals(account, split, "decode")  # D computed what it did not hold, and says so
        if turn == 0:
            assert split["local_hit"] == 0 and split["computed"] > 0
        else:
            assert split["local_hit"] > 0, "the follow-up reuses the spilled turn's KV on D"
        messages.append({"role": "assistant", "content": result.answer})
    m = ask.proxy.metrics()
    assert m['kvrelay_prefill_spilled_total{turn="first"}'] == 1
    assert m[DECODE_ONLY] == 1  # the follow-up went to the holder as a short one
    ask.forget(conversation)
    # Only now (D's cache would have served the turns above) the plain answer, through P.
    reference = plain.turn(messages[:2], f"{conversation}-plain", False, False)
    assert reference.answer == messages[2]["content"]
    plain.forget(f"{conversation}-plain")


def test_a_d_without_prefix_caching_loses_its_decode_only_turns(
    kvrelay_fleet: PDFleet, proxies: dict[str, ProxyServer]
) -> None:
    d_without_cache = kvrelay_fleet.prefill  # serving as the D here
    ask = Asker(proxies["swapped"], vllm_servers.MODEL_NAME, MAX_TOKENS)
    conversation = f"acc-nocache-{uuid.uuid4().hex[:6]}"
    messages = [{"role": "system", "content": _system()}]
    for turn, (question, (stream, usage)) in enumerate(zip(QUESTIONS, MODES, strict=True)):
        messages.append({"role": "user", "content": question})
        counted = Counted(d_without_cache)
        result = ask.turn(messages, conversation, stream, usage)
        messages.append({"role": "assistant", "content": result.answer})
        account = _account(result)
        split = counted.split(account["prompt_tokens"])
        m = ask.proxy.metrics()
        if turn == 1:
            # The map offered the hold; D recomputed every prompt token.
            assert account["prefilled_by"] == "decode", _why(m)
            _equals(account, split, "decode")
            assert account["reused_tokens"] == 0 and m[WITHDRAWN] == 1
        if turn == 2:
            assert account["prefilled_by"] == "prefill", f"D got another turn: {_why(m)}"
    m = ask.proxy.metrics()
    assert m[DECODE_ONLY] == 1 and m[WITHDRAWN] == 1
    ask.forget(conversation)


def test_a_rerendering_template_reuses_nothing_and_its_blocks_are_refused_by_hash(
    kvrelay_fleet: PDFleet, proxies: dict[str, ProxyServer]
) -> None:
    p = kvrelay_fleet.prefill
    ask = Asker(proxies["rerendered"], vllm_servers.MODEL_NAME, MAX_TOKENS)
    conversation = f"acc-rerender-{uuid.uuid4().hex[:6]}"
    messages = [{"role": "system", "content": _system()}]
    for turn, (question, (stream, usage)) in enumerate(zip(QUESTIONS, MODES, strict=True)):
        messages.append({"role": "user", "content": question})
        counted = Counted(p)
        result = ask.turn(messages, conversation, stream, usage, chat_template=RERENDERING)
        messages.append({"role": "assistant", "content": result.answer})
        account = _account(result)
        split = counted.split(account["prompt_tokens"])
        _equals(account, split, "prefill")
        assert account["reused_tokens"] == 0
        if turn > 0:
            refused = account["refused_blocks"]
            assert list(refused) == ["hash"] and refused["hash"] > 0
            # The connector's mismatch count leaves out a partial last block.
            assert refused["hash"] - split["mismatch"] in (0, 1)
    m = ask.proxy.metrics()
    assert m['kvrelay_reuse_total{result="hit"}'] == len(QUESTIONS) - 1  # offered ...
    assert m['kvrelay_tokens_reused_total{leg="prefill"}'] == 0  # ... never reused
    assert m['kvrelay_refused_blocks_total{leg="prefill",reason="hash"}'] > 0
    ask.forget(conversation)
