"""The real `openai` SDK against the proxy and enginesim P/D (which stream like stock vLLM: no
params in any event, D's params only on its side channel).

The SDK hangs up the moment it sees `[DONE]` and each next turn is sent at once: every turn
after the first must still reuse D's KV (the proxy counts a hit, P loads tokens, D's hold is
never released by the proxy), and every answer must equal the non-disaggregated reference.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from kvrelay.devtools import EngineFactory, EngineSim, ProxiedPair, ProxyFactory
from kvrelay.enginesim.reference import reference_chat
from tests.harness import wait_until
from tests.proxy.client import MODEL, chat_body, post, reply_of, streamed_text
from tests.proxy.sdk_turns import MODES, SDKConversation, TurnResult

SYSTEM = "You are a careful assistant. Answer briefly. " * 6  # several full blocks
QUESTIONS = ["What is a cache?", "And a block?", "Why reuse it?", "Then what?", "Thanks!"]
MAX_TOKENS = 12
HITS = 'kvrelay_reuse_total{result="hit"}'
PULLED = 'kvrelay_prompt_tokens_total{leg="prefill",source="loaded"}'
LOADED = "enginesim_prompt_tokens_loaded_total"
BLOCK_SIZE = 16  # enginesim's default
SIDE_CHANNEL = 'kvrelay_finished_params_total{source="side_channel"}'
RELEASED = 'kvrelay_releases_total{holder="decode",result="released"}'


@pytest.fixture(scope="module")
def sdk_engines() -> Iterator[tuple[EngineSim, EngineSim]]:
    """One P and one D for the module; each test leaves both idle (checked by `finish`)."""
    factory = EngineFactory()
    try:
        yield factory("P", "--role", "prefill"), factory("D", "--role", "decode")
    finally:
        factory.close()


@pytest.fixture
def fleet(sdk_engines: tuple[EngineSim, EngineSim], proxy_factory: ProxyFactory) -> ProxiedPair:
    prefill, decode = sdk_engines
    prefill.wait_idle()
    decode.wait_idle()
    return ProxiedPair(prefill, decode, proxy_factory([prefill], [decode], ready_path="/ready"))


def run_conversation(fleet: ProxiedPair, conversation: SDKConversation) -> list[TurnResult]:
    """Run QUESTIONS with no pause between turns; check reuse on every turn after the first."""
    proxy = fleet.proxy
    loaded_before = fleet.prefill.metric(LOADED)
    before = proxy.metrics()
    hits: list[float] = []
    pulled: list[float] = []
    results: list[TurnResult] = []

    def after_turn(turn: int, result: TurnResult) -> None:
        # One quick read, no waiting: the next turn must follow at once.
        now = proxy.metrics()
        hits.append(now.get(HITS, 0) - before.get(HITS, 0))
        pulled.append(now.get(PULLED, 0))
        results.append(result)

    conversation.run(QUESTIONS, after_turn)
    # The hit of turn k was counted when turn k was sent, right after turn k-1 returned.
    assert hits == list(range(len(QUESTIONS))), f"reuse hits after each turn: {hits}"
    # P reported loaded tokens (its connector's report) on every turn after the first.
    grew = [b - a for a, b in zip([before.get(PULLED, 0), *pulled], pulled, strict=False)]
    assert grew[0] == 0 and all(g >= BLOCK_SIZE for g in grew[1:]), f"P loaded per turn: {grew}"
    messages = list(conversation.messages[:1])
    for turn, (question, result) in enumerate(zip(QUESTIONS, results, strict=True)):
        messages.append({"role": "user", "content": question})
        assert result.answer == reference_chat(messages, MAX_TOKENS), f"turn {turn}"
        messages.append({"role": "assistant", "content": result.answer})
        if not result.stream or result.include_usage:
            assert result.usage is not None and result.usage.completion_tokens > 0
        else:
            assert result.usage is None
    # Every hit loaded at least one full block on P (the metric lags a loop poll).
    minimum = loaded_before + (len(QUESTIONS) - 1) * BLOCK_SIZE
    wait_until(lambda: fleet.prefill.metric(LOADED) >= minimum, 10, what="P's loaded tokens")
    after = proxy.metrics()
    streamed = sum(1 for stream, _ in (MODES * len(QUESTIONS))[: len(QUESTIONS)] if stream)
    assert after.get(SIDE_CHANNEL, 0) - before.get(SIDE_CHANNEL, 0) == streamed
    assert after.get(RELEASED, 0) == before.get(RELEASED, 0), "the proxy gave a turn's hold back"
    return results


@pytest.mark.parametrize("use_async", [False, True], ids=["OpenAI", "AsyncOpenAI"])
@pytest.mark.parametrize("conversation_id", ["sdk-conv", None], ids=["conversation-id", "history"])
def test_sdk_turns_sent_at_once_all_reuse_and_match_reference(
    fleet: ProxiedPair, use_async: bool, conversation_id: str | None
) -> None:
    conversation = SDKConversation(
        fleet.proxy.url + "/v1", MODEL, SYSTEM, MAX_TOKENS, conversation_id, use_async
    )
    run_conversation(fleet, conversation)
    fleet.finish()


def test_a_client_leaving_after_the_last_token_keeps_the_turn(fleet: ProxiedPair) -> None:
    # This client hangs up as soon as it has the whole answer, before `[DONE]`: the turn is
    # complete, so it is stored and the next turn reuses it; the proxy releases nothing.
    headers = {"X-Conversation-Id": "leaves-early"}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}]
    body = {**chat_body(messages, MAX_TOKENS), "stream": True}
    before = fleet.proxy.metrics()
    received = b""
    with httpx.stream("POST", fleet.proxy.url + "/v1/chat/completions", json=body,
                      headers=headers, timeout=30) as resp:  # fmt: skip
        assert resp.status_code == 200
        for chunk in resp.iter_bytes():
            received += chunk
            if b'"finish_reason":"' in received:
                break
    assert b"[DONE]" not in received
    events = [json.loads(e[6:]) for e in received.split(b"\n\n") if e.startswith(b"data: {")]
    answer = streamed_text(events, chat=True)
    assert answer == reference_chat(messages, MAX_TOKENS)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}]
    wait_until(
        lambda: fleet.proxy.metrics().get(SIDE_CHANNEL, 0) > before.get(SIDE_CHANNEL, 0),
        10, what="the proxy to store the finished turn",
    )  # fmt: skip
    second = post(fleet.proxy.url, "/v1/chat/completions", chat_body(messages, MAX_TOKENS),
                  headers)  # fmt: skip
    assert reply_of(second) == reference_chat(messages, MAX_TOKENS)
    after = fleet.proxy.metrics()
    assert after[HITS] == before.get(HITS, 0) + 1
    assert after.get(RELEASED, 0) == before.get(RELEASED, 0)
    assert fleet.proxy.call("DELETE", "/v1/conversations/leaves-early")[0] == 200
    fleet.finish()


def test_a_side_channel_that_never_answers_delays_done_only_by_its_timeout(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    # D's side channel address leads to a socket that takes connections and never answers:
    # the stream still ends, one side-channel timeout after its last token, and is correct.
    lease = ("--lease-seconds", "4")  # the hold nobody could fetch ends with its lease
    p = engine_factory("P", "--role", "prefill", *lease)
    d = engine_factory("D", "--role", "decode", *lease)
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)
        side_channels = (f"{p.url}=127.0.0.1:{p.side_channel_port},"
                         f"{d.url}=127.0.0.1:{mute.getsockname()[1]}")  # fmt: skip
        proxy = proxy_factory([p], [d], ready_path="/ready", side_channels=side_channels,
                              side_channel_timeout="1.5")  # fmt: skip
        client = OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=30)
        messages: list[Any] = [{"role": "user", "content": SYSTEM}]
        start = time.monotonic()
        answer = "".join(
            choice.delta.content or ""
            for chunk in client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True,
                extra_headers={"X-Conversation-Id": "mute"},
            )
            for choice in chunk.choices
        )  # fmt: skip
        elapsed = time.monotonic() - start
        client.close()
    assert answer == reference_chat(messages, MAX_TOKENS)
    assert 1.5 <= elapsed < 1.5 + 5, f"the stream took {elapsed:.1f}s"
    missing = 'kvrelay_finished_params_total{source="missing"}'
    wait_until(lambda: proxy.metrics().get(missing) == 1, 5, what="the missing params counted")
    proxy.stop()
    p.wait_idle(15)
    d.wait_idle(15)
