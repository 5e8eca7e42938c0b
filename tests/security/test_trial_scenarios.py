"""Hostile-client scenarios the proxy already withstood, kept as tests so they keep holding:
concurrent turns on one conversation id, clients leaving mid-stream or right after the last
chunk, and a Redis outage. (Client `kv_transfer_params` aimed at a listener the test owns and
forged side-channel calls are in test_isolation.py and test_auth.py.)

Each scenario checks the answers against the reference and that nothing stays held: once the
test's conversations are ended, D holds no more blocks than before the test.
"""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from kvrelay.enginesim.reference import reference_chat
from tests.harness import wait_until
from tests.security.conftest import SecureFleet

MODEL = "kvrelay-sim"
SYSTEM = {"role": "system", "content": "You answer hostile clients politely. " * 6}


def _chat(fleet: SecureFleet, headers: dict[str, str], messages: list[dict[str, Any]],
          **extra: Any) -> httpx.Response:  # fmt: skip
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, **extra}
    return httpx.post(fleet.proxy.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=60)  # fmt: skip


def _held(fleet: SecureFleet) -> float:
    return fleet.decode.metric("enginesim_blocks_held_for_remote")


def _end(fleet: SecureFleet, headers: dict[str, str], conv: str) -> None:
    resp = httpx.delete(f"{fleet.proxy.url}/v1/conversations/{conv}", headers=headers)
    assert resp.status_code in (200, 404), resp.text


def _nothing_left_held(fleet: SecureFleet, before: float) -> None:
    wait_until(lambda: _held(fleet) <= before, 20, what="D to hold no more than before")


def test_concurrent_turns_on_one_id_answer_right_and_strand_nothing(
    secure_fleet: SecureFleet,
) -> None:
    fleet = secure_fleet
    before = _held(fleet)
    conv = "race-" + secrets.token_hex(4)
    headers = {**fleet.a, "X-Conversation-Id": conv}
    first = [SYSTEM, {"role": "user", "content": "Start the race."}]
    reply = _chat(fleet, headers, first)
    assert reply.status_code == 200, reply.text
    follow = [*first, {"role": "assistant", "content": reply.json()["choices"][0]["message"]
                       ["content"]}, {"role": "user", "content": "Who won?"}]  # fmt: skip
    hits = fleet.proxy.metrics().get('kvrelay_reuse_total{result="hit"}', 0.0)
    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = list(pool.map(lambda _: _chat(fleet, headers, follow), range(6)))
    expected = reference_chat(follow, 8)
    for resp in answers:
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == expected
    # The entry is taken once: at most one of the racing turns reused the held KV.
    assert fleet.proxy.metrics().get('kvrelay_reuse_total{result="hit"}', 0.0) <= hits + 1
    _end(fleet, fleet.a, conv)
    _nothing_left_held(fleet, before)


def _stream_and_leave(fleet: SecureFleet, headers: dict[str, str],
                      messages: list[dict[str, Any]], after_done: bool) -> None:  # fmt: skip
    body = {"model": MODEL, "messages": messages, "max_tokens": 200 if not after_done else 8,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", fleet.proxy.url + "/v1/chat/completions", json=body,
                      headers=headers, timeout=60) as resp:  # fmt: skip
        assert resp.status_code == 200
        seen = b""
        for chunk in resp.iter_raw():
            seen += chunk
            if not after_done or b"data: [DONE]" in seen:
                break  # leave: mid-stream, or right after the last chunk


def test_clients_leaving_mid_stream_or_after_the_last_chunk_strand_nothing(
    secure_fleet: SecureFleet,
) -> None:
    fleet = secure_fleet
    before = _held(fleet)
    for after_done in (False, True):
        conv = f"leave-{after_done}-" + secrets.token_hex(4)
        headers = {**fleet.a, "X-Conversation-Id": conv}
        messages = [SYSTEM, {"role": "user", "content": f"Stream then leave ({after_done})."}]
        for _ in range(3):
            _stream_and_leave(fleet, headers, messages, after_done)
        # The proxy still serves this conversation, correctly.
        resp = _chat(fleet, headers, messages)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == reference_chat(messages, 8)
        _end(fleet, fleet.a, conv)
    assert httpx.get(fleet.proxy.url + "/ready").status_code == 200
    _nothing_left_held(fleet, before)


def test_redis_outage_serves_without_reuse_and_recovers(secure_fleet: SecureFleet) -> None:
    fleet = secure_fleet
    before = _held(fleet)
    conv = "outage-" + secrets.token_hex(4)
    headers = {**fleet.a, "X-Conversation-Id": conv}
    messages = [SYSTEM, {"role": "user", "content": "Is the map there?"}]
    fleet.redis.stop()
    try:
        for _ in range(3):
            resp = _chat(fleet, headers, messages)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["message"]["content"] == reference_chat(messages, 8)
        assert httpx.get(fleet.proxy.url + "/ready").status_code == 200
        assert fleet.proxy.metrics().get('kvrelay_reuse_total{result="map_unavailable"}', 0) >= 1
    finally:
        fleet.redis.start()

    # Back: turns are stored again, so a conversation's next turn reuses D's KV.
    def reused() -> bool:
        first = _chat(fleet, headers, messages)
        assert first.status_code == 200, first.text
        follow = [
            *messages,
            {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And now?"},
        ]
        hits = fleet.proxy.metrics().get('kvrelay_reuse_total{result="hit"}', 0.0)
        resp = _chat(fleet, headers, follow)
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] \
            == reference_chat(follow, 8)  # fmt: skip
        return fleet.proxy.metrics().get('kvrelay_reuse_total{result="hit"}', 0.0) > hits

    wait_until(reused, 30, interval=0.5, what="reuse after Redis came back")
    _end(fleet, fleet.a, conv)
    _nothing_left_held(fleet, before)
