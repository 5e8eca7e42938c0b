"""The trace replayer (`bench/trace_replay.py`, `bench/_trace.py`): block text, conversation
reconstruction and the LRU bound on hand-made traces, then a slice of the Mooncake FAST'25
conversation trace replayed through a real kvrelay proxy in front of enginesim P and D."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from bench import _trace as tr
from bench import trace_replay
from kvrelay.connector.config import ConnectorConfig
from kvrelay.devtools import EngineFactory, ProxyFactory, ThreadedApp, free_port
from kvrelay.enginesim.chat import render_chat
from kvrelay.enginesim.tokenizer import get_tokenizer

TRACE = trace_replay.DEFAULT_TRACE


def req(index: int, t_ms: float, length: int, out: int, ids: list[int]) -> tr.TraceRequest:
    return tr.TraceRequest(index, t_ms, length, out, tuple(ids))


def test_block_text_is_exactly_its_tokens_and_the_same_for_the_same_id() -> None:
    tok = get_tokenizer()
    one = tr.text_at([7], 0, 512, 512)
    assert len(tok.encode(one)) == 512  # tolerance 0: every word is one token
    assert tr.text_at([7], 0, 512, 512) == one
    assert tr.text_at([8], 0, 512, 512) != one
    # Blocks side by side do not merge tokens across the boundary, wherever they start.
    assert len(tok.encode(tr.text_at([7, 8, 9], 100, 1500, 512))) == 1400
    # Inside a chat message the template adds only its own few tokens.
    rendered = render_chat([{"role": "user", "content": tr.text_at([7, 8], 0, 1024, 512)}])
    assert 1024 < len(tok.encode(rendered)) <= 1024 + 16  # role headers and end markers
    assert all(len(tok.encode(" " + w)) == 1 for w in tr.WORDS)


def test_lru_bound_counts_leading_hits_only_with_lru_eviction() -> None:
    trace = [
        req(0, 0, 1024, 1, [1, 2]),
        req(1, 1, 1500, 1, [1, 2, 3]),  # hits 1, 2: 1024 tokens
        req(2, 2, 600, 1, [4, 5]),
        req(3, 3, 1100, 1, [1, 2, 3]),  # 3 blocks: only 1 is left (2 and 3 were evicted)
        req(4, 4, 700, 1, [9, 4]),  # 4 is cached but not leading: no reuse
    ]
    small = tr.lru_bound(trace, 3)
    assert small["reused_tokens"] == 1024 + 512
    assert small["reused_blocks"] == 3
    assert small["prompt_tokens"] == 1024 + 1500 + 600 + 1100 + 700
    assert small["prompt_blocks"] == 12
    big = tr.lru_bound(trace, 1000)
    assert big["reused_tokens"] == 1024 + (512 + 512 + 76)  # the last block is 76 tokens
    assert tr.lru_bound(trace, 0)["reused_tokens"] == 0


def test_reconstruction_links_turns_and_keeps_shared_system_prefixes_apart() -> None:
    trace = [
        req(0, 0, 1300, 100, [0, 1, 2]),
        req(1, 1000, 900, 50, [0, 3]),
        req(2, 5000, 1900, 80, [0, 1, 4, 5]),  # extends 0 (its last block filled: 2 -> 4)
        req(3, 6000, 1000, 10, [0, 6]),  # shares only block 0 with 1: a new conversation
        req(4, 7000, 2100, 5, [0, 1, 4, 5, 7]),  # extends 2
    ]
    plan = tr.reconstruct(trace)
    got = [(t.conversation, t.turn, t.predecessor) for t in plan.turns]
    assert got == [(1, 1, None), (2, 1, None), (1, 2, 0), (3, 1, None), (1, 3, 2)]
    assert (plan.turns[1].system_end, plan.turns[1].user_start) == (512, 512)
    # The first of the conversations sharing block 0 sends it as a system message too (the
    # later first turns share it); blocks it shares only with its own later turns are not.
    assert (plan.turns[0].system_end, plan.turns[0].user_start) == (512, 512)
    # Later turn: the user message holds what the trace adds after the previous answer.
    assert (plan.turns[2].user_start, plan.turns[4].user_start) == (1300 + 100, 1900 + 80)
    assert plan.stats["later_turns"] == 2
    assert plan.stats["conversations"] == 3


def test_a_system_block_many_requests_start_with_does_not_chain_them() -> None:
    # The slice opens with a request of one full (system) block plus a partial one: the
    # requests after it start with the same block, nothing before it shows that block is
    # shared, and only the slice's branching at that block says they are new conversations
    # (the first sends the block as a system message all the same: the later ones share it).
    trace = [req(0, 0, 900, 10, [0, 1])]
    trace += [req(i, i * 10, 1300, 10, [0, 10 + i, 20 + i]) for i in range(1, 9)]
    plan = tr.reconstruct(trace)
    assert [t.turn for t in plan.turns] == [1] * 9
    assert [t.system_end for t in plan.turns] == [512] * 9


def test_a_first_turn_sends_as_system_the_longest_prefix_any_other_first_turn_shares() -> None:
    trace = [
        req(0, 0, 1100, 10, [0, 1, 2]),
        req(1, 10, 1100, 10, [0, 1, 3]),  # shares two blocks with 0, no longer: a first turn
        req(2, 20, 900, 10, [0, 4]),  # shares only block 0
        req(3, 30, 1100, 10, [0, 1, 2]),  # the same prompt as 0
    ]
    plan = tr.reconstruct(trace)
    assert [t.turn for t in plan.turns] == [1] * 4
    # 0 and 3 share every block (the system message keeps all but one token, the user message
    # that one), though 0 has no earlier request; 1 shares [0, 1] with them; 2 only block 0.
    assert [t.system_end for t in plan.turns] == [1099, 1024, 512, 1099]
    assert [t.user_start for t in plan.turns] == [1099, 1024, 512, 1099]


def test_the_trace_file_is_checked_line_by_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 2000, "output_length": 1,
                                "hash_ids": [1, 2]}) + "\n")  # fmt: skip
    with pytest.raises(tr.TraceError, match="line 1: 2 hash_ids do not cover"):
        tr.load_trace(path)


def test_scaled_settings_divide_the_lease_and_ttls_by_the_scale() -> None:
    settings = trace_replay.scaled_settings(4.0)
    lease = ConnectorConfig.model_fields["lease_seconds"].default / 4
    # A brief hold keeps the 5 s it leaves the next turn unscaled; the proxy's margin is scaled.
    assert settings["enginesim_args"] == [
        "--lease-seconds",
        f"{lease:g}",
        "--hold-brief-lease-s",
        "6.25",
    ]
    assert settings["proxy_env"]["KVRELAY_CONVERSATION_TTL_S"] == "150"
    assert settings["proxy_env"]["KVRELAY_ENTRY_SAFETY_MARGIN_S"] == "1.25"
    assert settings["proxy_env"]["KVRELAY_HOLD_BRIEF_S"] == "0"  # off by default
    assert f"--lease-seconds) must be {lease:g} s" in trace_replay.scale_warning(4.0, settings)
    assert trace_replay.scaled_settings(4.0, 120.0)["enginesim_args"][1] == "30"


async def _serve_models(_: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "ok"}]})


async def _serve_chat(request: web.Request) -> web.StreamResponse:
    """A chat endpoint whose events arrive cut anywhere (inside a line, between CR and LF) and
    whose model name says how it answers: "ok", "refused" (429) or "broken" (an error event)."""
    body = await request.json()
    assert body["stream"] is True and request.headers["Authorization"] == "Bearer k"
    if body["model"] == "refused":
        return web.json_response({"error": {"message": "slow down"}}, status=429)
    resp = web.StreamResponse(headers={"X-Request-Id": "r1", "Content-Type": "text/event-stream"})
    await resp.prepare(request)
    events = [{"choices": [{"delta": {"role": "assistant"}}]}]
    events += [{"choices": [{"delta": {"content": word}}]} for word in ("a", " b", " c")]
    if body["model"] == "broken":
        events.append({"error": {"message": "engine died", "code": 500}})
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "kvrelay": {"routing": "spilled"}}
    events.append({"choices": [], "usage": usage})
    wire = b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events)
    wire += b": comment\n\ndata: [DONE]\n\n"
    for start in range(0, len(wire), 7):  # 7-byte writes: lines split everywhere
        await resp.write(wire[start : start + 7])
        await asyncio.sleep(0)
    await resp.write_eof()
    return resp


def test_chat_streams_reads_events_cut_anywhere_and_raises_on_errors() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _serve_chat)
    app.router.add_get("/v1/models", _serve_models)
    ended: list[str] = []

    async def end(request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == "Bearer k"  # the client's key goes too
        ended.append(request.match_info["conv"])
        return web.json_response({"released": True})

    app.router.add_delete("/v1/conversations/{conv}", end)

    async def scenario(url: str) -> None:
        async with trace_replay.ChatStreams(url + "/", "k") as client:
            model = await client.first_model()
            ticks = iter(range(100))
            answer = await client.stream(
                {"model": model, "stream": True}, {}, lambda: float(next(ticks))
            )
            assert [text for _, text in answer.deltas] == ["a", " b", " c"]
            assert [t for t, _ in answer.deltas] == [0.0, 1.0, 2.0]
            assert answer.usage is not None and answer.usage["completion_tokens"] == 3
            assert answer.usage["kvrelay"] == {"routing": "spilled"}
            assert answer.headers["x-request-id"] == "r1"
            with pytest.raises(trace_replay.ApiError, match="429"):
                await client.stream({"model": "refused", "stream": True}, {}, float)
            with pytest.raises(trace_replay.ApiError, match="engine died"):
                await client.stream({"model": "broken", "stream": True}, {}, float)
            await client.end_conversation("trace-c1")
            assert ended == ["trace-c1"]

    with ThreadedApp(app, free_port(), "fake-chat") as server:
        asyncio.run(scenario(server.url))


def test_replay_through_kvrelay_sends_real_answers_as_history_and_reuses(
    tmp_path: Path, engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    engine_args = ["--max-model-len", "8192", "--num-blocks", "4096"]
    p, d = engine_factory.many(
        ("P", ["--role", "prefill", *engine_args]), ("D", ["--role", "decode", *engine_args])
    )
    proxy = proxy_factory([p], [d], ready_path="/ready")
    out = tmp_path / "replay.json"
    rc = trace_replay.main([
        "--trace", str(TRACE), "--base-url", proxy.url, "--duration-s", "900",
        "--conversations", "5", "--min-turns", "3", "--block-tokens", "8",
        "--max-output-tokens", "8", "--time-scale", "300", "--conversation-ids",
        "--record-messages", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    records = result["records"]
    by_index = {r["index"]: r for r in records}
    later = [r for r in records if r["turn"] > 1]
    assert len(records) >= 15 and len(later) >= 10
    assert [r for r in records if r["error"]] == []
    assert result["summary"]["answered"] == len(records)
    assert result["time_scale"] == 300 and "300x faster" in result["time_scale_warning"]
    for r in records:
        assert r["completion_tokens"] == r["expected_output_tokens"]  # min_tokens/ignore_eos
    for r in later:
        prev = by_index[r["predecessor"]]
        assert prev["reply"], "the previous answer came back empty"
        # The history is the previous turn's messages and the answer as the engine gave it.
        assert r["messages"][:-2] == prev["messages"]
        assert r["messages"][-2] == {"role": "assistant", "content": prev["reply"]}
        assert r["conversation_id"] == prev["conversation_id"]
    assert p.metric("enginesim_prompt_tokens_loaded_total") > 0
    assert sum(r["cached_tokens"] or 0 for r in later) > 0
    # Each turn's routing, from kvrelay's account in the stream's last event.
    decisions = {"decode_only", "spilled", "prefill_affinity", "prefill_chosen"}
    assert all(r["routing"] in decisions and r["prefilled_by"] for r in records)
    assert {r["routing"] for r in records if r["turn"] == 1} <= {"prefill_chosen", "spilled"}
    # And what the prefilling engine read from another's KV (the history D held), as it said.
    assert all(isinstance(r["loaded_tokens"], int) for r in records)
    assert sum(r["loaded_tokens"] for r in later) > 0
