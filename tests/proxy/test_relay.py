"""The proxy in front of real enginesim P and D (real NIXL): answers equal a single,
non-disaggregated engine; later turns pull KV from D; nothing stays held afterwards."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import pytest

from kvrelay import __version__
from kvrelay.devtools import EngineFactory, EngineSim, ProxiedPair, ProxyFactory
from kvrelay.enginesim.reference import reference_chat, reference_completion
from tests.proxy.client import MODEL, chat_body, post, reply_of, stream, streamed_text

LONG_SYSTEM = (
    "You are a careful assistant. Answer briefly. " * 6
)  # a prefix of several full blocks, so reuse has something to pull


@pytest.fixture(scope="module")
def shared_engines() -> Iterator[tuple[EngineSim, EngineSim]]:
    """One P and one D for the whole module (engine start-up dominates the suite's time).
    Each test starts its own proxy and must leave both engines idle (checked by `pd_fleet`
    at the start of the next test, and by the tests themselves)."""
    factory = EngineFactory()
    try:
        yield factory("P", "--role", "prefill"), factory("D", "--role", "decode")
    finally:
        factory.close()


@pytest.fixture
def pd_fleet(
    shared_engines: tuple[EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> ProxiedPair:
    """Overrides the conftest fixture: the module's engines behind a fresh proxy."""
    prefill, decode = shared_engines
    prefill.wait_idle()
    decode.wait_idle()
    return ProxiedPair(prefill, decode, proxy_factory([prefill], [decode], ready_path="/ready"))


def _turns(fleet: ProxiedPair, questions: list[str], conversation: str | None,
           streamed: bool = False, header: str = "X-Conversation-Id",
           ) -> list[tuple[str, str]]:  # fmt: skip
    """Run a conversation (its id in `header`); returns (proxy answer, reference answer) per
    turn."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": LONG_SYSTEM}]
    headers = {header: conversation} if conversation else {}
    out = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        body = chat_body(messages)
        if streamed:
            status, events, raw = stream(fleet.proxy.url, "/v1/chat/completions", body, headers)
            assert status == 200, raw
            assert b"kv_transfer_params" not in raw
            answer = streamed_text(events, chat=True)
        else:
            resp = post(fleet.proxy.url, "/v1/chat/completions", body, headers)
            assert "kv_transfer_params" not in resp.json()
            answer = reply_of(resp)
        out.append((answer, reference_chat(messages, 12)))
        messages.append({"role": "assistant", "content": answer})
    return out


def test_single_turn_chat_and_completion_match_reference(pd_fleet: ProxiedPair) -> None:
    url = pd_fleet.proxy.url
    resp = post(url, "/v1/chat/completions", chat_body([{"role": "user", "content": "Hi"}]),
                headers={"X-Request-Id": "req-abc-1"})  # fmt: skip
    assert resp.headers["X-Request-Id"] == "req-abc-1"
    data = resp.json()
    assert reply_of(resp) == reference_chat([{"role": "user", "content": "Hi"}], 12)
    assert data["usage"]["completion_tokens"] > 0 and "id" in data and "created" in data
    resp = post(url, "/v1/completions", {"model": MODEL, "prompt": "The sky is", "max_tokens": 9})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == reference_completion("The sky is", 9)
    assert "kv_transfer_params" not in resp.json()
    status, events, raw = stream(
        url, "/v1/completions",
        {"model": MODEL, "prompt": "The sky is", "max_tokens": 9,
         "stream_options": {"include_usage": True}},
    )  # fmt: skip
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
    assert streamed_text(events, chat=False) == reference_completion("The sky is", 9)
    assert events[-1]["usage"]["completion_tokens"] == 9
    assert b"kv_transfer_params" not in raw
    pd_fleet.finish()


def test_multi_turn_reuses_decode_kv_and_matches_reference(pd_fleet: ProxiedPair) -> None:
    questions = ["What is a cache?", "And a block?", "Why reuse it?", "Thanks, and then?"]
    loaded_before = pd_fleet.prefill.metric("enginesim_prompt_tokens_loaded_total")
    for answer, expected in _turns(pd_fleet, questions, conversation="conv-1"):
        assert answer == expected
    loaded = pd_fleet.prefill.metric("enginesim_prompt_tokens_loaded_total") - loaded_before
    assert loaded > 0, "turns 2+ should pull the previous turn's KV from D"
    m = pd_fleet.proxy.metrics()
    assert m['kvrelay_reuse_total{result="hit"}'] == len(questions) - 1
    # D holds the last turn for a next one; ending the conversation frees it.
    assert pd_fleet.decode.metric("enginesim_blocks_held_for_remote") > 0
    status, _, _ = pd_fleet.proxy.call("DELETE", "/v1/conversations/conv-1")
    assert status == 200
    pd_fleet.wait_clean()


def test_streamed_turns_reuse_via_side_channel_params(pd_fleet: ProxiedPair) -> None:
    questions = ["Tell me about rivers.", "Which is longest?", "And the widest?"]
    loaded_before = pd_fleet.prefill.metric("enginesim_prompt_tokens_loaded_total")
    for answer, expected in _turns(pd_fleet, questions, conversation="s-1", streamed=True):
        assert answer == expected
    assert pd_fleet.prefill.metric("enginesim_prompt_tokens_loaded_total") > loaded_before
    assert pd_fleet.proxy.call("DELETE", "/v1/conversations/s-1")[0] == 200
    pd_fleet.wait_clean()


def test_x_session_id_names_the_conversation_and_its_turns_reuse(pd_fleet: ProxiedPair) -> None:
    """vLLM's multi-turn benchmark names its conversations with X-Session-ID: the turns are
    stored under that id (DELETE finds it), reuse D's KV, streamed or not."""
    for streamed in (False, True):
        session = f"bench-session-{int(streamed)}"
        loaded_before = pd_fleet.prefill.metric("enginesim_prompt_tokens_loaded_total")
        hits_before = pd_fleet.proxy.metrics().get('kvrelay_reuse_total{result="hit"}', 0.0)
        questions = ["What is a cache?", "And a block?", "Why reuse it?"]
        turns = _turns(pd_fleet, questions, session, streamed=streamed, header="X-Session-ID")
        for answer, expected in turns:
            assert answer == expected
        loaded = pd_fleet.prefill.metric("enginesim_prompt_tokens_loaded_total") - loaded_before
        assert loaded > 0
        hits = pd_fleet.proxy.metrics()['kvrelay_reuse_total{result="hit"}'] - hits_before
        assert hits == len(questions) - 1
        assert pd_fleet.proxy.call("DELETE", f"/v1/conversations/{session}")[0] == 200
        pd_fleet.wait_clean()


def test_version_names_the_proxy_and_each_engine(pd_fleet: ProxiedPair) -> None:
    status, body, _ = pd_fleet.proxy.call("GET", "/version")
    assert status == 200
    assert body["version"] == __version__
    engines = sorted(body["engines"], key=lambda e: e["role"])
    assert [e["role"] for e in engines] == ["decode", "prefill"]
    assert all(e["version"] == f"enginesim-{__version__}" for e in engines)
    # Engines are named, never addressed.
    assert "127.0.0.1" not in str(body)


def test_history_fingerprint_gives_reuse_without_an_id(pd_fleet: ProxiedPair) -> None:
    loaded_before = pd_fleet.prefill.metric("enginesim_prompt_tokens_loaded_total")
    for answer, expected in _turns(pd_fleet, ["One?", "Two?", "Three?"], conversation=None):
        assert answer == expected
    assert pd_fleet.prefill.metric("enginesim_prompt_tokens_loaded_total") > loaded_before
    pd_fleet.finish()


def test_edited_history_is_not_reused_and_stays_correct(pd_fleet: ProxiedPair) -> None:
    url = pd_fleet.proxy.url
    headers = {"X-Conversation-Id": "edit-1"}
    messages = [{"role": "system", "content": LONG_SYSTEM},
                {"role": "user", "content": "Name a colour."}]  # fmt: skip
    first = reply_of(post(url, "/v1/chat/completions", chat_body(messages), headers))
    edited = [{"role": "system", "content": LONG_SYSTEM.upper()},
              {"role": "user", "content": "Name a colour."},
              {"role": "assistant", "content": first},
              {"role": "user", "content": "Another one?"}]  # fmt: skip
    loaded_before = pd_fleet.prefill.metric("enginesim_prompt_tokens_loaded_total")
    answer = reply_of(post(url, "/v1/chat/completions", chat_body(edited), headers))
    assert answer == reference_chat(edited, 12)
    assert pd_fleet.prefill.metric("enginesim_prompt_tokens_loaded_total") == loaded_before
    assert pd_fleet.proxy.metrics()['kvrelay_reuse_total{result="refused"}'] == 1
    assert pd_fleet.proxy.call("DELETE", "/v1/conversations/edit-1")[0] == 200
    pd_fleet.wait_clean()


def test_concurrent_turns_of_one_conversation_are_both_correct(pd_fleet: ProxiedPair) -> None:
    url = pd_fleet.proxy.url
    headers = {"X-Conversation-Id": "race-1"}
    base = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Start."}]
    first = reply_of(post(url, "/v1/chat/completions", chat_body(base), headers))
    branches = [
        [*base, {"role": "assistant", "content": first}, {"role": "user", "content": q}]
        for q in ("Left branch?", "Right branch, please?")
    ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(
            lambda msgs: reply_of(post(url, "/v1/chat/completions", chat_body(msgs), headers)),
            branches,
        ))  # fmt: skip
    assert results == [reference_chat(b, 12) for b in branches]
    assert pd_fleet.proxy.call("DELETE", "/v1/conversations/race-1")[0] == 200
    pd_fleet.wait_clean()


def test_tenants_cannot_reach_each_other(
    shared_engines: tuple[EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> None:
    prefill, decode = shared_engines
    proxy = proxy_factory([prefill], [decode], ready_path="/ready", api_keys="key-a,key-b")
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    msgs = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Secret?"}]
    status, body, _ = proxy.call("POST", "/v1/chat/completions", chat_body(msgs))
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    first = reply_of(post(proxy.url, "/v1/chat/completions", chat_body(msgs),
                          {**a, "X-Conversation-Id": "shared-name"}))  # fmt: skip
    # Tenant b uses the same conversation id: it must not see a's entry.
    assert proxy.call("DELETE", "/v1/conversations/shared-name", headers=b)[0] == 404
    follow = [*msgs, {"role": "assistant", "content": first}, {"role": "user", "content": "More"}]
    loaded_before = prefill.metric("enginesim_prompt_tokens_loaded_total")
    answer = reply_of(post(proxy.url, "/v1/chat/completions", chat_body(follow),
                           {**b, "X-Conversation-Id": "shared-name"}))  # fmt: skip
    assert answer == reference_chat(follow, 12)
    assert prefill.metric("enginesim_prompt_tokens_loaded_total") == loaded_before
    assert proxy.call("DELETE", "/v1/conversations/shared-name", headers=a)[0] == 200
    assert proxy.call("DELETE", "/v1/conversations/shared-name", headers=b)[0] == 200
    prefill.wait_idle()
    decode.wait_idle()


def test_openai_client_works_streaming_and_not(pd_fleet: ProxiedPair) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=pd_fleet.proxy.url + "/v1", api_key="any", max_retries=0)
    msgs: list[Any] = [{"role": "user", "content": "Hello from the SDK"}]
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10,
                                          extra_headers={"X-Conversation-Id": "sdk"})  # fmt: skip
    assert full.choices[0].message.content == reference_chat(msgs, 10)
    assert full.usage is not None and full.usage.completion_tokens == 10
    parts = []
    for chunk in client.completions.create(model=MODEL, prompt="Streams are", max_tokens=7,
                                           stream=True):  # fmt: skip
        parts.extend(c.text for c in chunk.choices)
    assert "".join(parts) == reference_completion("Streams are", 7)
    pd_fleet.finish()


def test_streams_without_params_fetch_them_from_the_side_channel(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    # Like stock vLLM, this D puts no params in its stream; the proxy asks D's side channel.
    prefill = engine_factory("P", "--role", "prefill")
    decode = engine_factory("D", "--role", "decode", "--no-params-in-stream")
    fleet = ProxiedPair(prefill, decode, proxy_factory([prefill], [decode], ready_path="/ready"))
    loaded_before = prefill.metric("enginesim_prompt_tokens_loaded_total")
    for answer, expected in _turns(fleet, ["Stream one.", "Stream two."], "fs-1", streamed=True):
        assert answer == expected
    assert prefill.metric("enginesim_prompt_tokens_loaded_total") > loaded_before
    assert fleet.proxy.metrics()['kvrelay_finished_params_total{source="side_channel"}'] == 2
    fleet.finish()


def test_workers_share_the_port_and_aggregate_metrics(
    shared_engines: tuple[EngineSim, EngineSim], proxy_factory: ProxyFactory, redis: Any
) -> None:
    prefill, decode = shared_engines
    loaded_before = prefill.metric("enginesim_prompt_tokens_loaded_total")
    proxy = proxy_factory([prefill], [decode], ready_path="/ready", workers="2",
                          map_url=redis.url)  # fmt: skip
    fleet = ProxiedPair(prefill, decode, proxy)
    answers = _turns(fleet, ["First?", "Second?", "Third?", "Fourth?"], "w-1")
    assert all(answer == expected for answer, expected in answers)
    # Whichever worker answers /metrics reports every worker's requests.
    for _ in range(4):
        m = proxy.metrics()
        assert m['kvrelay_requests_total{outcome="ok",route="chat"}'] == len(answers)
    assert prefill.metric("enginesim_prompt_tokens_loaded_total") > loaded_before
    assert proxy.call("DELETE", "/v1/conversations/w-1")[0] == 200
    fleet.finish()


def test_decode_holds_nothing_when_the_conversation_cannot_continue(pd_fleet: ProxiedPair) -> None:
    # A completion without a conversation id has no next turn: D must not be asked to hold.
    resp = post(pd_fleet.proxy.url, "/v1/completions",
                {"model": MODEL, "prompt": LONG_SYSTEM, "max_tokens": 5})  # fmt: skip
    assert resp.status_code == 200
    pd_fleet.wait_clean()  # with the proxy still running: nothing held anywhere
    # Chat without fingerprinting and without an id: the same.
    proxy = pd_fleet.proxy
    proxy.stop()
    proxy.settings["fingerprint_conversations"] = "false"
    proxy.start("/ready")
    msgs = [{"role": "user", "content": LONG_SYSTEM}]
    assert reply_of(post(proxy.url, "/v1/chat/completions", chat_body(msgs)))
    pd_fleet.wait_clean()
