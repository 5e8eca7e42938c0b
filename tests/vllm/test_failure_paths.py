"""kvrelay's connector on vLLM's failure paths: the engine core survives, answers stay right.

One P/D pair loads `tests.vllm.faulty_connector` (kvrelay's connector with stalls a test arms
to widen a race window); D has a small KV pool and no prefix cache. Requests go straight to
the engines with the params the proxy would pass. Each test ends by asking the engine it
disturbed for a fresh answer: a connector that reports an id vLLM does not expect kills the
engine core on `assert req_id in self.requests`, and that answer then never comes.
"""

from __future__ import annotations

import http.client
import json
import threading
import uuid
from typing import Any

import pytest

from kvrelay.connector.protocol import HoldRef, KVTransferParams
from kvrelay.connector.sidechannel_client import SideChannelClient
from kvrelay.devtools import vllm_servers
from kvrelay.proxy.turn.legs import prefill_body
from tests.harness import wait_until
from tests.vllm.conftest import FaultPair

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

HELD_BLOCKS = "vllm:kvrelay_held_blocks"
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
PREEMPTIONS = "vllm:num_preemptions_total"
TOKENS_LOADED = "vllm:kvrelay_tokens_loaded_total"

TEXT = (
    "The decode engine keeps the blocks of every finished turn for a while, so that the next "
    "turn of the same conversation can read them instead of computing them again. "
)


def body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": vllm_servers.MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, **extra,
    }  # fmt: skip


def text(server: vllm_servers.VLLMServer, payload: dict[str, Any], rid: str | None = None) -> str:
    headers = {"X-Request-Id": rid} if rid else None
    status, out = server.post("/v1/completions", payload, headers)
    assert status == 200, f"{server.name}: {status} {out}"
    return str(out["choices"][0]["text"])


def hold_on_prefill(pair: FaultPair, prompt: str) -> dict[str, Any]:
    """P computes `prompt` and holds its blocks for D (the proxy's P leg)."""
    rid = f"hold-{uuid.uuid4().hex[:8]}"
    leg = prefill_body(body(prompt, 1), None)
    status, out = pair.prefill.post("/v1/completions", leg, {"X-Request-Id": rid})
    assert status == 200, out
    params: dict[str, Any] = out["kv_transfer_params"]
    held = KVTransferParams.from_wire(params)
    assert held is not None and held.remote_block_ids and held.release_token
    wait_until(lambda: pair.prefill.metric(HELD_BLOCKS) > 0, 10, what="P to hold the blocks")
    return params


def assert_serves_correctly(pair: FaultPair, server: vllm_servers.VLLMServer, prompt: str) -> None:
    """The engine core is alive and still computes the reference answer."""
    payload = body(prompt, 12)
    assert text(server, payload) == text(pair.reference, payload)


def test_abort_during_a_load_leaves_the_engine_serving(fault_pair: FaultPair) -> None:
    """A client gone while D loads: vLLM frees the request when the load ends; the connector
    must not report it finished-sending as well (vLLM has forgotten it by then)."""
    pair, decode = fault_pair, fault_pair.decode
    prompt = "Abort me while my cache is on its way. " + TEXT * 2
    params = hold_on_prefill(pair, prompt)
    faults = pair.arm(decode, "recv")
    conn = http.client.HTTPConnection("127.0.0.1", decode.port, timeout=120)
    try:
        conn.request(
            "POST", "/v1/completions",
            json.dumps(body(prompt, 8, kv_transfer_params=params)),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        wait_until((faults / "recv-stalled").exists, 60, what="D's load to stall")
        wait_until(lambda: decode.metric(WAITING) >= 1, 30, what="D to show the waiting load")
    finally:
        conn.close()  # the client is gone: vLLM aborts the request mid-load
    wait_until(lambda: decode.metric(WAITING) == 0, 30, what="D to abort the request")
    (faults / "resume-recv").touch()
    # The read itself completed: its notification freed P's blocks.
    wait_until(lambda: pair.prefill.metric(HELD_BLOCKS) == 0, 30, what="P to free its hold")

    assert_serves_correctly(pair, decode, "After the abort, " + TEXT)
    assert_serves_correctly(pair, decode, "And once more, " + TEXT)


def test_release_during_the_holders_step_frees_the_hold_once(fault_pair: FaultPair) -> None:
    """The reader gives up (its claimer release) just as its read's notification is being
    reported: the hold must be freed once, not once per cause."""
    pair, prefill = fault_pair, fault_pair.prefill
    prompt = "Free me exactly once. " + TEXT * 2
    params = hold_on_prefill(pair, prompt)
    faults = pair.arm(prefill, "send")
    answers: dict[str, str] = {}
    leg = body(prompt, 4, kv_transfer_params=params)
    reader = threading.Thread(target=lambda: answers.update(d=text(pair.decode, leg)))
    reader.start()
    client = SideChannelClient(vllm_servers.CONNECTOR_SECRET.encode())
    try:
        wait_until((faults / "send-stalled").exists, 60, what="P's step to stall mid-report")
        hold = HoldRef.from_params(params)
        assert hold is not None
        assert hold.remote_request_id in (faults / "send-stalled").read_text().split()
        assert client.release(
            "127.0.0.1", hold.remote_port, hold.remote_request_id, hold.release_token,
            reader_engine_id="faulty-D",
        ), "the release must land while P still holds the blocks"  # fmt: skip
    finally:
        (faults / "resume-send").touch()
        client.close()
        reader.join(120)

    assert answers.get("d") == text(pair.reference, body(prompt, 4))
    assert_serves_correctly(pair, prefill, "After the double free, " + TEXT)
    assert_serves_correctly(pair, prefill, "And once more, " + TEXT)
    assert_serves_correctly(pair, pair.decode, "D too, " + TEXT)


def test_preempted_request_recomputes_instead_of_loading_again(fault_pair: FaultPair) -> None:
    """D's pool runs out while a loaded request decodes: vLLM preempts it and asks the
    connector again. Its hold on P is consumed; loading again would fail (policy fail: an
    error for a correctly served request). It must recompute and answer like the reference."""
    pair, decode = fault_pair, fault_pair.decode
    prompt = "Preempt me after my load. " + TEXT * 5
    params = hold_on_prefill(pair, prompt)
    preempted_before = decode.metric(PREEMPTIONS)
    loaded_before = decode.metric(TOKENS_LOADED)
    long_body = body("A long answer that fills the pool. ", 900)
    results: dict[str, str] = {}

    def run(name: str, server: vllm_servers.VLLMServer, payload: dict[str, Any]) -> None:
        results[name] = text(server, payload)

    filler = threading.Thread(target=run, args=("filler", decode, long_body))
    filler.start()
    wait_until(lambda: decode.metric(RUNNING) >= 1, 30, what="the filler to run on D")
    loaded = body(prompt, 500, kv_transfer_params=params)
    run("loaded", decode, loaded)
    filler.join(300)

    wait_until(lambda: decode.metric(TOKENS_LOADED) > loaded_before, 30, what="D to load from P")
    assert decode.metric(PREEMPTIONS) > preempted_before, "D's pool ran out (preemption)"
    assert results["loaded"] == text(pair.reference, body(prompt, 500))
    assert results["filler"] == text(pair.reference, long_body)
