"""Unit tests of the proxy's pure parts: settings, conversation identity, SSE filtering, leg
bodies and pool decisions. No servers; the behaviour through real HTTP is in the other files."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kvrelay.connector.protocol import KVTransferParams
from kvrelay.proxy.base import ProxyError
from kvrelay.proxy.cli import serve_parser, settings_from_args
from kvrelay.proxy.config import Settings, SettingsError, load_settings
from kvrelay.proxy.fleet import Pool, Route, Router
from kvrelay.proxy.fleet.policies import policy_named
from kvrelay.proxy.http.validation import validate_chat
from kvrelay.proxy.turn import (
    chat_shape,
    completion_shape,
    conversation_id_from,
    request_id_from,
    tenant_of,
    upstream_request_id,
)
from kvrelay.proxy.turn.conversation import chained_fingerprints, chat_store_key_id, prompt_chars
from kvrelay.proxy.turn.legs import capped_num_tokens, decode_body, prefill_body
from kvrelay.proxy.turn.streaming import SSEFilter


def test_settings_from_env_lists_and_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_PREFILL", "http://p0:8000, http://p1:8000/")
    monkeypatch.setenv("KVRELAY_DECODE", '["http://d0:8000"]')
    monkeypatch.setenv("KVRELAY_API_KEYS", "k1,k2")
    monkeypatch.setenv("KVRELAY_FIRST_BYTE_TIMEOUT", "7.5")
    s = load_settings(env_file=None)
    assert s.prefill == ["http://p0:8000", "http://p1:8000"]
    assert s.decode == ["http://d0:8000"]
    assert s.first_byte_timeout == 7.5
    shown = json.dumps(s.public_dict())
    assert "k1" not in shown and "2 key(s)" in shown


def test_cli_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_PORT", "9000")
    args = serve_parser().parse_args(
        ["--env-file", "", "--port", "9100", "--prefill", "http://a:1", "http://b:2",
         "--decode", "http://c:3", "--no-fingerprint-conversations",
         "--side-channels", "http://c:3=127.0.0.1:4000"]
    )  # fmt: skip
    s = settings_from_args(args)
    assert s.port == 9100
    assert s.prefill == ["http://a:1", "http://b:2"]
    assert s.fingerprint_conversations is False
    assert s.side_channels == {"http://c:3": "127.0.0.1:4000"}


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"port": "x"}, "KVRELAY_PORT"),
        ({"decode": ["ftp://d"]}, "KVRELAY_DECODE"),
        ({"map_url": "mysql://x"}, "KVRELAY_MAP_URL"),
        ({"connect_timeout": "-1"}, "KVRELAY_CONNECT_TIMEOUT"),
        ({"log_level": "LOUD"}, "KVRELAY_LOG_LEVEL"),
        ({"side_channels": "http://d:1=nohost"}, "KVRELAY_SIDE_CHANNELS"),
        ({"forward_headers": "Authorization"}, "KVRELAY_FORWARD_HEADERS"),
        ({"forward_headers": "x-request-id"}, "KVRELAY_FORWARD_HEADERS"),
        ({"forward_headers": "X-Bad Header"}, "KVRELAY_FORWARD_HEADERS"),
        ({"forward_headers": "X-A,x-a"}, "KVRELAY_FORWARD_HEADERS"),
    ],
)
def test_invalid_settings_name_the_setting(overrides: dict[str, object], named: str) -> None:
    with pytest.raises(SettingsError, match=named):
        load_settings(overrides, env_file=None)


def test_forward_headers_default_to_none_and_take_a_list() -> None:
    assert load_settings({}, env_file=None).forward_headers == []
    listed = load_settings({"forward_headers": "X-Session-ID, X-Team"}, env_file=None)
    assert listed.forward_headers == ["X-Session-ID", "X-Team"]


def test_runnable_needs_fleet_and_shared_map_for_workers() -> None:
    with pytest.raises(SettingsError, match="decode"):
        Settings(prefill=["http://p:1"]).check_runnable()
    with pytest.raises(SettingsError, match="workers"):
        Settings(prefill=["http://p:1"], decode=["http://d:1"], workers=2).check_runnable()
    Settings(
        prefill=["http://p:1"], decode=["http://d:1"], workers=2, map_url="redis://r:6379/0"
    ).check_runnable()


def test_tenants_hash_keys() -> None:
    assert tenant_of("secret-key") != tenant_of("other-key")
    assert "secret" not in tenant_of("secret-key")
    assert tenant_of(None) == "anonymous"


def test_request_id_accepted_or_generated() -> None:
    assert request_id_from("abc-123") == "abc-123"
    assert request_id_from("bad id with spaces").startswith("kvr-")
    assert request_id_from(None) != request_id_from(None)


def test_generated_request_ids_stay_unique_and_random_across_buffer_refills() -> None:
    ids = [request_id_from(None) for _ in range(2000)]  # several 4 KiB refills
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 36 and int(i[4:], 16) >= 0 for i in ids)
    # Random, not a counter: the ids' bits are spread (a counter's top bits would not be).
    assert len({i[4] for i in ids}) == 16
    suffixed = {upstream_request_id("client-id", supplied=True) for _ in range(600)}
    assert len(suffixed) == 600 and all(s.startswith("client-id-") for s in suffixed)


def test_conversation_id_header_wins_and_body_field_is_removed() -> None:
    body = {"conversation_id": "from-body", "messages": []}
    assert conversation_id_from("from-header", body) == "from-header"
    assert "conversation_id" not in body
    with pytest.raises(ProxyError) as err:
        conversation_id_from(None, {"conversation_id": 5})
    assert err.value.status == 400
    with pytest.raises(ProxyError):
        conversation_id_from("fp:abc", {})


def test_conversation_id_precedence_header_then_body_then_session_header() -> None:
    def pick(header: str | None, in_body: str | None, session: str | None) -> str | None:
        body: dict[str, object] = {} if in_body is None else {"conversation_id": in_body}
        chosen = conversation_id_from(header, body, session)
        assert "conversation_id" not in body
        return chosen

    assert pick("h", "b", "s") == "h"
    assert pick(None, "b", "s") == "b"
    assert pick(None, None, "s") == "s"
    assert pick(None, None, None) is None
    # X-Session-ID is checked like the others when it is the one used, ignored otherwise.
    with pytest.raises(ProxyError) as err:
        pick(None, None, "fp:abc")
    assert err.value.status == 400
    assert pick("h", None, " ") == "h"


def _chat(*contents: str) -> dict[str, object]:
    roles = ["user", "assistant"]
    return {
        "model": "m",
        "messages": [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)],
    }


def test_chat_fingerprints_link_turns() -> None:
    turn1 = chat_shape(_chat("hello"))
    turn2 = chat_shape(_chat("hello", "hi!", "more"))
    # Turn 2 looks up the key turn 1 was stored under, and extends its prompt.
    assert turn1.lookup_key_id is None
    assert turn2.lookup_key_id == chat_store_key_id(turn1)
    assert turn1.store_fingerprint is not None
    assert turn2.extends(turn1.store_fingerprint)
    # Edited history does not extend, nor does the same prompt again.
    edited = chat_shape(_chat("HELLO", "hi!", "more"))
    assert not edited.extends(turn1.store_fingerprint)
    assert not turn1.extends(turn1.store_fingerprint)
    # Another model renders another prompt.
    other = chat_shape({**_chat("hello", "hi!", "more"), "model": "other"})
    assert not other.extends(turn1.store_fingerprint)


def test_completion_fingerprints() -> None:
    first = completion_shape({"prompt": "Once upon a time"})
    assert first.store_fingerprint is not None
    assert completion_shape({"prompt": "Once upon a time, there"}).extends(first.store_fingerprint)
    assert not completion_shape({"prompt": "Twice upon a time"}).extends(first.store_fingerprint)
    tokens = completion_shape({"prompt": [1, 2, 3]})
    assert tokens.store_fingerprint is not None
    assert completion_shape({"prompt": [1, 2, 3, 4]}).extends(tokens.store_fingerprint)
    assert completion_shape({"prompt": ["a", "b"]}).store_fingerprint is None


def test_completion_fingerprints_are_scoped_by_model() -> None:
    # Another model (or LoRA adapter, which is a model name) computes other KV for the same text.
    for prompt, longer in (("Once upon a time", "Once upon a time, there"), ([1, 2], [1, 2, 3])):
        stored = completion_shape({"model": "base", "prompt": prompt}).store_fingerprint
        assert stored is not None
        assert completion_shape({"model": "base", "prompt": longer}).extends(stored)
        assert not completion_shape({"model": "adapter-a", "prompt": longer}).extends(stored)


def test_prompt_chars_count_contents_as_text() -> None:
    parts = [{"type": "text", "text": "hi"}]
    messages = [
        {"role": "system", "content": "abc"},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": None},
        {"role": "user", "content": parts},
    ]
    chat = {"messages": messages}
    assert prompt_chars("chat", chat) == 3 + len(str(parts))
    assert prompt_chars("completions", {"prompt": "hello"}) == 5
    assert prompt_chars("completions", {"prompt": [1, 2, 3]}) == len("[1, 2, 3]")


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "user", "content": "x"}, "not an object"], "messages[1]"),
        ([{"role": "user"}, {"role": "assistant"}, {"role": 7}], "messages[2]"),
        ([{"content": "no role"}], "messages[0]"),
    ],
)
def test_chat_messages_need_objects_with_string_roles(messages: list[Any], param: str) -> None:
    validate_chat({"model": "m", "messages": [{"role": "user", "content": "ok"}] * 3})
    with pytest.raises(ProxyError) as refused:
        validate_chat({"model": "m", "messages": messages})
    assert refused.value.status == 400 and refused.value.param == param


def test_sse_filter_passes_bytes_through_and_strips_params() -> None:
    plain = b'data: {"choices":[{"text":"a"}]}\n\n'
    tail = {"choices": [], "usage": {"prompt_tokens": 3}, "kv_transfer_params": {"x": 1}}
    with_params = b"data: " + json.dumps(tail).encode() + b"\n\n"
    stream = plain + with_params + b"data: [DONE]\n\n"
    sse = SSEFilter()
    out = b"".join(sse.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)) + sse.flush()
    assert out.startswith(plain)  # untouched bytes
    assert b"kv_transfer_params" not in out
    assert sse.params == {"x": 1}
    assert sse.saw_done
    events = [e for e in out.split(b"\n\n") if e]
    assert json.loads(events[1][6:]) == {"choices": [], "usage": {"prompt_tokens": 3}}


def test_prefill_body_is_one_token_without_streaming() -> None:
    body = {"model": "m", "prompt": "x", "stream": True, "max_tokens": 50,
            "max_completion_tokens": 50, "stream_options": {"include_usage": True},
            "min_tokens": 3}  # fmt: skip
    p = prefill_body(body, None)
    assert p["stream"] is False and p["max_tokens"] == 1 and p["max_completion_tokens"] == 1
    assert "stream_options" not in p and "min_tokens" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert p["kv_transfer_params"]["remote_block_ids"] is None
    assert body["max_tokens"] == 50  # the client's body is not modified
    reuse = KVTransferParams(remote_engine_id="D", do_remote_decode=False)
    hit = prefill_body(body, reuse)
    assert hit["kv_transfer_params"]["remote_engine_id"] == "D"
    assert hit["kv_transfer_params"]["do_remote_decode"] is True


def test_decode_body_carries_p_params_and_hold() -> None:
    p_params = KVTransferParams.from_wire({"remote_engine_id": "P", "do_remote_decode": True})
    d = decode_body({"prompt": "x"}, p_params, "http://p", hold=True)
    params = d["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["hold_blocks"] is True
    assert "kv_transfer_params" not in decode_body({"prompt": "x"}, None, None, hold=False)
    assert capped_num_tokens(KVTransferParams(remote_num_tokens=90), 40) == 40


def _router(**settings: object) -> tuple[Router, Pool, Pool]:
    prefill = Pool("prefill", eject_after=2, readmit_after=2)
    decode = Pool("decode", eject_after=1, readmit_after=1)
    return Router(Settings(_env_file=None, **settings), prefill, decode), prefill, decode  # type: ignore[arg-type]


def test_pool_ejects_and_readmits_by_probe() -> None:
    router, pool, _ = _router()
    a, b = pool.add("http://a"), pool.add("http://b")
    a.outstanding_work = 10
    assert router.pick_prefill(None, set())[:2] == (b, False)
    pool.record_failure(b, "x")
    assert b.healthy
    pool.record_failure(b, "x")
    assert not b.healthy
    assert router.pick_prefill(None, set())[:2] == (a, False)
    pool.record_success(b, probe=False)
    pool.record_success(b, probe=True)
    assert not b.healthy
    pool.record_success(b, probe=True)
    assert b.healthy


def test_decode_affinity_yields_when_overloaded() -> None:
    router, _, pool = _router(decode_overload_inflight=2)
    a, b = pool.add("http://a"), pool.add("http://b")
    assert router.pick_decode("http://b", set()) is b
    b.inflight = 2
    assert router.pick_decode("http://b", set()) is a
    pool.drain("http://a")
    assert router.pick_decode(None, set()) is b


def test_a_turn_p_prefilled_goes_to_a_d_with_no_prompt_to_prefill_before_its_first_token() -> None:
    """Without affinity the decode leg goes to the D with the fewest whole steps of decode-only
    or spilled prompt tokens still to prefill, then the least loaded: a D with fewer requests
    but a spilled 8,000-token prompt pending is passed over; under a step's worth, the count
    of requests decides again."""
    router, _, pool = _router(prefill_step_tokens=4096)
    a, b = pool.add("http://a"), pool.add("http://b")
    a.inflight, a.outstanding_work = 1, 1 + 8000  # one spilled turn, its prompt still pending
    b.inflight, b.outstanding_work = 3, 3  # three decodes
    assert router.pick_decode(None, set()) is b
    assert router.pick_decode("http://a", set()) is a  # the holder still wins by affinity
    a.outstanding_work = 1 + 4000  # under a step: the fewer requests win
    assert router.pick_decode(None, set()) is a


def test_a_turn_spills_to_the_least_loaded_d_when_ps_own_queue_is_longer() -> None:
    """The proxy's own counts decide without any load reading: P's queued prompt characters
    (in tokens, 4 characters each until an entry says) against D's decode-only tokens."""
    router, prefill, decode = _router(prefill_spill_factor=2.0)
    p = prefill.add("http://p")
    a, b = decode.add("http://a"), decode.add("http://b")
    a.inflight, a.outstanding_work = 1, 1  # one decode leg: no prefill of its own
    # P idle, or one turn of this size queued: P's time (queue + 4000) is at most 2x D's.
    assert router.spill(None, 16_000) is None
    p.inflight, p.outstanding_work = 1, 16_000
    assert router.spill(None, 16_000) is None
    # Two queued: 12000 tokens against 2 x 4000: the turn goes to the least loaded D.
    p.inflight, p.outstanding_work = 2, 32_000
    spill = router.spill(None, 16_000)
    assert spill is not None and (spill.backend, spill.tokens, spill.holder) == (b, 4000, False)
    # A D whose decode-only tokens to prefill reach prefill_spill_max_inflight_tokens
    # takes none.
    b.inflight, b.outstanding_work = 1, 1 + 32768
    a.inflight, a.outstanding_work = 2, 2 + 32768
    assert router.spill(None, 16_000) is None
    # Nor does any D with the factor at 0, or under a policy other than conditional.
    b.inflight, b.outstanding_work = 0, 0
    assert router.spill(None, 16_000) is not None
    # A prompt whose own tokens would take D past the budget goes through P, however long
    # P's queue: 24,000 tokens on a D with 10,000 queued; 20,000 still spill there.
    a.inflight, a.outstanding_work = 2, 2 + 32768
    b.inflight, b.outstanding_work = 1, 1 + 10_000
    p.inflight, p.outstanding_work = 40, 10**7
    assert router.spill(None, 96_000) is None
    spill = router.spill(None, 80_000)
    assert spill is not None and (spill.backend, spill.tokens) == (b, 20_000)
    # Judged again on D's own count: 23,000 tokens no longer fit.
    assert spill.counted(23_000, 0, 80_000) is None
    assert spill.counted(22_000, 0, 80_000) is not None
    p.inflight, p.outstanding_work = 2, 32_000
    b.inflight, b.outstanding_work = 0, 0
    a.inflight, a.outstanding_work = 1, 1
    other, other_p, other_d = _router(prefill_spill_factor=0)
    other_p.add("http://p").outstanding_work = 10**9
    other_d.add("http://a")
    assert other.spill(None, 16_000) is None

    async def count(url: str) -> int:
        return 4000

    for name, route in (("conditional", Route.SPILL), ("affinity", Route.THROUGH_P)):
        plan = asyncio.run(policy_named(name, router).plan(None, 16_000, "", count))
        assert plan.route is route, name
        if route is Route.SPILL:
            assert (plan.decode_first, plan.decode_tokens) == (b.url, 4000)


def test_an_idle_p_keeps_its_turns_unless_the_factor_is_below_one() -> None:
    """With nothing queued on P, P computes the turn's uncached tokens and D at least as many:
    no factor of 1 or more spills it (the router says so without weighing the D pool); a
    factor below 1 asks for D even then."""
    for factor, spills in ((1.0, False), (2.0, False), (0.5, True)):
        router, prefill, decode = _router(prefill_spill_factor=factor)
        prefill.add("http://p")
        d = decode.add("http://d")
        spill = router.spill(None, 16_000)
        assert (spill is not None) == spills, factor
        if spill is not None:
            assert (spill.backend, spill.tokens) == (d, 4000)


def test_a_decode_only_legs_prompt_work_ends_at_its_first_token() -> None:
    """D's prefill budgets weigh prompt tokens still to prefill: once the first token is out
    the leg counts 1, like any decode, until it ends."""
    _, _, decode = _router()
    d = decode.add("http://d")
    busy = decode.busy(d, 1 + 15_000)
    with busy:
        assert (d.inflight, d.outstanding_work) == (1, 15_001)
        busy.prefilled()
        assert (d.inflight, d.outstanding_work) == (1, 1)
    assert (d.inflight, d.outstanding_work) == (0, 0)


def test_client_request_ids_get_a_unique_upstream_suffix() -> None:
    from kvrelay.proxy.turn import upstream_request_id

    assert upstream_request_id("kvr-abc", supplied=False) == "kvr-abc"
    one, two = upstream_request_id("mine", True), upstream_request_id("mine", True)
    assert one.startswith("mine-") and one != two


def test_cli_dispatch(capsys: pytest.CaptureFixture[str]) -> None:
    from kvrelay.proxy.cli import main

    assert main([]) == 2
    assert main(["bogus"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert main(["--help"]) == 0
    with pytest.raises(SystemExit) as exit_info:
        main(["sim", "--help"])  # delegated to enginesim's own parser
    assert exit_info.value.code == 0
    assert "--side-channel-port" in capsys.readouterr().out


def test_sse_params_spread_over_several_data_lines_are_captured_and_stripped() -> None:
    sse = SSEFilter()
    out = sse.feed(b'data: {"id":"x",\ndata: "kv_transfer_params":{"release_token":"tok"}}\n\n')
    assert b"kv_transfer_params" not in out and b"tok" not in out
    assert json.loads(out.removeprefix(b"data: ")) == {"id": "x"}
    assert sse.params == {"release_token": "tok"}


def test_sse_crlf_events_stream_through_and_params_are_stripped() -> None:
    sse = SSEFilter()
    first = sse.feed(b'data: {"a":1}\r')  # the CR's LF arrives with the next chunk
    rest = sse.feed(b'\n\r\ndata: {"b":2,"kv_transfer_params":{"x":1}}\r\n\r\n')
    assert first + rest == b'data: {"a":1}\n\ndata: {"b":2}\n\n'
    assert sse.params == {"x": 1}


def test_sse_filter_holds_back_done_for_the_relay_to_send_last() -> None:
    sse = SSEFilter(hold_done=True)
    last = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    stream = b'data: {"choices":[{"delta":{"content":"a"},"finish_reason":null}]}\n\n' + last
    out = sse.feed(stream[:20])
    assert not sse.saw_finish
    out += sse.feed(stream[20:] + b"data: [DONE]\n\n") + sse.flush()
    assert out == stream  # every event but [DONE], byte for byte
    assert sse.saw_finish and sse.saw_done and sse.done_event == b"data: [DONE]\n\n"
    # Without hold_done, [DONE] passes through like any event.
    plain = SSEFilter()
    assert plain.feed(stream + b"data: [DONE]\n\n") == stream + b"data: [DONE]\n\n"
    assert plain.done_event is None


@pytest.mark.parametrize(
    "tail",
    [
        b"data: [DONE]\n\n",  # the usual end: [DONE] last, cut off without parsing
        b"data:[DONE]\n\n",  # no space after the colon: the general path finds it
        b"data: [DONE]\n\n: a comment after it\n\n",  # not last: the general path
    ],
)
def test_sse_filter_holds_back_done_when_the_whole_stream_comes_in_one_read(tail: bytes) -> None:
    events = b"".join(
        b'data: {"choices":[{"delta":{"content":"%d"},"finish_reason":null}]}\n\n' % i
        for i in range(16)
    )
    sse = SSEFilter(hold_done=True)
    out = sse.feed(events + tail) + sse.flush()
    assert sse.done_event is not None and b"[DONE]" in sse.done_event
    assert b"[DONE]" not in out and out.startswith(events) and sse.saw_done
    assert sse.events == 16 + tail.count(b"\n\n")


def test_owed_releases_what_is_still_owed_once() -> None:
    from kvrelay.proxy.turn.owed import Debt, Owed

    freed: list[str] = []
    owed = Owed()
    owed.owe(Debt.PREVIOUS_HOLD, lambda: freed.append("previous"))
    owed.owe(Debt.PREFILL_BLOCKS, lambda: freed.append("prefill"))
    owed.owe(Debt.DECODE_HOLD, lambda: freed.append("decode"))
    owed.settle(Debt.PREVIOUS_HOLD)  # P's connector took it over
    owed.release(Debt.DECODE_HOLD)  # released now
    owed.release(Debt.DECODE_HOLD)  # and never twice
    assert freed == ["decode"] and owed.owes(Debt.PREFILL_BLOCKS)
    owed.release_all()
    owed.release_all()
    assert freed == ["decode", "prefill"] and not owed.owes(Debt.PREFILL_BLOCKS)


def test_worker_freezes_start_up_objects_and_collects_young_objects_less_often() -> None:
    """The collector must not walk start-up's objects on every full collection (see
    `server.tune_gc`); requests' own cycles are still collected."""
    import asyncio
    import gc

    from aiohttp import web

    from kvrelay.proxy.http.server import GC_YOUNG_THRESHOLD, tune_gc

    before = gc.get_threshold()
    app = tune_gc(web.Application())
    try:
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:])

        async def start_and_stop() -> None:
            runner = web.AppRunner(app)
            await runner.setup()  # runs on_startup
            await runner.cleanup()

        gc.unfreeze()
        asyncio.run(start_and_stop())
        assert gc.get_freeze_count() > 0
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_chat_fingerprints_are_stable_across_versions() -> None:
    # Stored entries carry these: a change in how messages are encoded or hashed would make
    # every stored conversation miss after an upgrade. Values computed by earlier releases.
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Caf\u00e9? \x7f"},
        {"role": "assistant", "content": "Yes.", "name": "bot"},
        {"role": "user", "content": [{"type": "text", "text": "more"}]},
    ]
    assert chained_fingerprints(messages, b"ctx") == [
        "78873f56c08f4d840b4a869489754552",
        "78a9cc6008955cc4d99e6de5aad697ee",
        "4afca76bde80efd25edc088d02bf18ce",
        "eaabfe38dcf8645fa0ff2264e665411e",
        "4cff2f6a3986ab08f802a6711f5a0799",
    ]
    shape = chat_shape({"model": "m", "messages": messages})
    assert shape.store_fingerprint == "m:4:c99fda70e9f09ba30d2605bfca2e2102"


def test_metrics_page_has_no_created_series() -> None:
    from kvrelay.proxy.telemetry import metrics

    metrics.REQUESTS.labels("chat", "ok").inc()
    metrics.TTFT.labels("chat").observe(0.1)
    page = metrics.render()[0].decode()
    assert 'kvrelay_requests_total{outcome="ok",route="chat"}' in page
    assert "_created" not in page
