"""The real `openai` SDK through kvrelay in front of real vLLM P and D (kvrelay's connector).

Stock vLLM streams carry no `kv_transfer_params`: the proxy fetches D's params from D's side
channel. The SDK hangs up the moment it sees `[DONE]`, and each next turn is sent at once; still
every turn after the first must reuse D's KV (the proxy counts a hit, P's loaded-token counter
grows) and every answer must equal the plain vLLM server's. Uses the module-scoped kvrelay
fleet of `conftest.py` (no engine of its own).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.devtools import vllm_servers
from tests.harness import wait_until
from tests.proxy.sdk_turns import MODES, SDKConversation, TurnResult
from tests.vllm.conftest import PDFleet

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TOKENS_LOADED = "vllm:kvrelay_tokens_loaded_total"
HELD_BLOCKS = "vllm:kvrelay_held_blocks"
HITS = 'kvrelay_reuse_total{result="hit"}'
SIDE_CHANNEL = 'kvrelay_finished_params_total{source="side_channel"}'
RELEASED = 'kvrelay_releases_total{holder="decode",result="released"}'
BATCH_CALLS = 'kvrelay_finished_calls_total{call="batch"}'
SINGLE_CALLS = 'kvrelay_finished_calls_total{call="single"}'
SYSTEM = (
    "You are a relay engine. Each turn of the conversation is a request that the decode engine "
    "answers after the prefill engine computed the cache blocks of the prompt. Keep every reply "
    "short, and when a user asks about a block, say which model and which turn it came from."
)
QUESTIONS = [
    "Tell me about the first block of the cache.",
    "And what did the decode engine do with it?",
    "Write one more sentence about the next turn.",
    "Which engine holds the history now?",
]
MAX_TOKENS = 24


def reference_answer(fleet: PDFleet, messages: list[dict[str, Any]]) -> str:
    body = {
        "model": vllm_servers.MODEL_NAME,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    status, out = fleet.reference.post("/v1/chat/completions", body)
    assert status == 200, out
    return str(out["choices"][0]["message"]["content"])


@pytest.mark.parametrize("use_async", [False, True], ids=["OpenAI", "AsyncOpenAI"])
@pytest.mark.parametrize("identify", ["conversation-id", "history"])
def test_sdk_turns_sent_at_once_all_reuse_and_match_reference(
    kvrelay_fleet: PDFleet, use_async: bool, identify: str
) -> None:
    fleet = kvrelay_fleet
    conversation_id = f"sdk-{use_async}" if identify == "conversation-id" else None
    conversation = SDKConversation(
        fleet.proxy.url + "/v1",
        vllm_servers.MODEL_NAME,
        SYSTEM,
        MAX_TOKENS,
        conversation_id,
        use_async,
    )
    before = fleet.proxy.metrics()
    loaded_start = fleet.prefill.metric(TOKENS_LOADED)
    hits: list[float] = []
    loaded: list[float] = []
    results: list[TurnResult] = []

    def after_turn(turn: int, result: TurnResult) -> None:
        # Quick reads only: the next turn is sent right after this returns.
        hits.append(fleet.proxy.metrics().get(HITS, 0) - before.get(HITS, 0))
        loaded.append(fleet.prefill.metric(TOKENS_LOADED))
        results.append(result)

    conversation.run(QUESTIONS, after_turn)

    # Turn k's hit was counted when it was sent, right after turn k-1's last chunk.
    assert hits == list(range(len(QUESTIONS))), f"reuse hits after each turn: {hits}"
    grew = [b - a for a, b in zip([loaded_start, *loaded], loaded, strict=False)]
    assert grew[0] == 0 and all(g >= vllm_servers.BLOCK_SIZE for g in grew[1:]), (
        f"P loaded per turn: {grew}"
    )
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for turn, (question, result) in enumerate(zip(QUESTIONS, results, strict=True)):
        messages.append({"role": "user", "content": question})
        assert result.answer == reference_answer(fleet, messages), f"turn {turn}"
        messages.append({"role": "assistant", "content": result.answer})
        if not result.stream or result.include_usage:
            assert result.usage is not None and result.usage.completion_tokens > 0
        else:
            assert result.usage is None
    after = fleet.proxy.metrics()
    streamed = sum(1 for stream, _ in (MODES * len(QUESTIONS))[: len(QUESTIONS)] if stream)
    assert after.get(SIDE_CHANNEL, 0) - before.get(SIDE_CHANNEL, 0) == streamed
    # Through vLLM's side channel's batch endpoint (`POST /v1/finished`): D had published each
    # turn's params before its last chunk left, so no lookup fell back to asking alone.
    assert after.get(BATCH_CALLS, 0) - before.get(BATCH_CALLS, 0) == streamed
    assert after.get(SINGLE_CALLS, 0) == before.get(SINGLE_CALLS, 0)
    assert after.get(RELEASED, 0) == before.get(RELEASED, 0), "the proxy gave a turn's hold back"
    # A restarted proxy releases every conversation it stored: D holds nothing afterwards.
    fleet.proxy.stop()
    fleet.proxy.start("/ready")
    wait_until(lambda: fleet.decode.metric(HELD_BLOCKS) == 0, 30, what="D to hold nothing")
