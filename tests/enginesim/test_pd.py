"""P and D enginesim processes moving real KV over real NIXL (UCX on loopback).

Every test compares against the in-process single-engine reference and ends with every
engine's block pool back to its starting state (read from /metrics).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvrelay.connector.sidechannel_client import SideChannelClient
from kvrelay.devtools import CONNECTOR_SECRET, EngineFactory, EngineSim
from kvrelay.enginesim.config import EngineConfig
from kvrelay.enginesim.costs import get_link, get_profile
from kvrelay.enginesim.reference import reference_chat, reference_completion
from tests.harness import free_port, wait_until

pytestmark = pytest.mark.nixl

PROMPT = (
    "The kv cache of the model is a block of tokens that we would like to reuse every turn, "
    "and it should never be wrong or stale, not even once in a long conversation."
)
MISS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


@pytest.fixture(scope="module")
def shared_pd() -> Iterator[tuple[EngineSim, EngineSim]]:
    """One P and one D (default flags) shared by this module's tests: start-up is slow."""
    factory = EngineFactory()
    try:
        p, d = factory.many(("P", []), ("D", []))
        yield p, d
    finally:
        factory.close()


@pytest.fixture
def pd(shared_pd: tuple[EngineSim, EngineSim]) -> Iterator[tuple[EngineSim, EngineSim]]:
    """The shared P and D with faults cleared; both must end with an idle block pool."""
    for engine in shared_pd:
        engine.request("/admin/faults", {"refuse_admission": False, "fail_next_n": 0})
    yield shared_pd
    for engine in shared_pd:
        engine.wait_idle(timeout=10)
        engine.request("/admin/faults", {"refuse_admission": False, "fail_next_n": 0})


@pytest.fixture
def idle_after(engine_factory: EngineFactory) -> Iterator[EngineFactory]:
    """`engine_factory`, plus: every engine still running ends with an idle block pool."""
    yield engine_factory
    for engine in engine_factory.engines:
        if engine.process is not None and engine.process.alive:
            engine.wait_idle(timeout=10)


class Delta:
    """Metric changes on one engine since construction."""

    def __init__(self, engine: EngineSim) -> None:
        self.engine, self.start = engine, engine.metrics()

    def __call__(self, name: str) -> float:
        return self.engine.metric(name) - self.start.get(name, 0.0)


def prefill(p: EngineSim, rid: str, body: dict[str, Any], chat: bool = False) -> dict[str, Any]:
    """The proxy's P leg: max_tokens=1, do_remote_decode; returns P's params for D."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    leg = {**body, "max_tokens": 1, "stream": False}
    leg.setdefault("kv_transfer_params", MISS)
    status, resp = p.request(path, leg, headers={"X-Request-Id": rid})
    assert status == 200, resp
    params: dict[str, Any] = resp["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == p.name
    return params


def decode(
    d: EngineSim, rid: str, body: dict[str, Any], params: dict[str, Any], chat: bool = False
) -> tuple[int, dict[str, Any]]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return d.request(path, {**body, "kv_transfer_params": params},
                     headers={"X-Request-Id": rid})  # fmt: skip


def text_of(resp: dict[str, Any]) -> str:
    choice = resp["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def test_p_to_d_output_equals_single_engine(pd: tuple[EngineSim, EngineSim]) -> None:
    p, d = pd
    dd = Delta(d)
    body = {"prompt": PROMPT, "max_tokens": 30, "ignore_eos": True}
    params = prefill(p, "r1", body)
    assert p.metric("enginesim_blocks_held_for_remote") == len(params["remote_block_ids"][0])
    status, resp = decode(d, "r1", body, params)
    assert status == 200, resp
    assert text_of(resp) == reference_completion(PROMPT, 30, ignore_eos=True)
    # D computed only the last prompt token; everything else came over NIXL.
    prompt_len = resp["usage"]["prompt_tokens"]
    assert dd("enginesim_prompt_tokens_loaded_total") == prompt_len - 1
    assert dd("enginesim_prompt_tokens_computed_total") == 1
    assert dd("enginesim_kv_transfers_total") >= 1
    assert resp["kv_transfer_params"] is None  # D holds nothing unless asked (hold_blocks)
    # P's blocks are freed by the read notification.
    p.wait_idle(timeout=5)


def test_corrupted_block_changes_output(pd: tuple[EngineSim, EngineSim]) -> None:
    p, d = pd
    dd = Delta(d)
    body = {"prompt": PROMPT, "max_tokens": 30, "ignore_eos": True}
    params = prefill(p, "r-bad", body)
    # Damage one block in the middle of P's held prompt KV, then let D read it.
    status, _ = p.request(
        "/admin/corrupt_blocks", {"block_ids": [params["remote_block_ids"][0][1]]}
    )
    assert status == 200
    status, resp = decode(d, "r-bad", body, params)
    assert status == 200
    assert text_of(resp) != reference_completion(PROMPT, 30, ignore_eos=True)
    assert dd("enginesim_prompt_tokens_loaded_total") > 0


def test_params_in_stream_flag_carries_params_in_final_chunk(
    pd: tuple[EngineSim, EngineSim], idle_after: EngineFactory
) -> None:
    p, d = pd[0], idle_after("D-extra", "--params-in-stream")
    msgs = [{"role": "user", "content": PROMPT}]
    params = prefill(p, "s1", {"messages": msgs}, chat=True)
    body = {"messages": msgs, "max_tokens": 20, "stream": True, "ignore_eos": True,
            "kv_transfer_params": {**params, "hold_blocks": True}}  # fmt: skip
    resp = httpx.post(d.url + "/v1/chat/completions", json=body,
                      headers={"X-Request-Id": "s1"}, timeout=30)  # fmt: skip
    chunks = [json.loads(b[6:]) for b in resp.text.split("\n\n") if b.startswith("data: {")]
    assert resp.text.rstrip().endswith("data: [DONE]")
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == reference_chat(msgs, 20, ignore_eos=True)
    assert all("kv_transfer_params" not in c for c in chunks[:-1])
    d_params = chunks[-1]["kv_transfer_params"]
    assert d_params["remote_engine_id"] == d.name and d_params["release_token"]
    assert d.metric("enginesim_blocks_held_for_remote") == len(d_params["remote_block_ids"][0])
    # The same params are published on D's side channel under the client request id.
    client = SideChannelClient(CONNECTOR_SECRET.encode())
    try:
        assert client.finished("127.0.0.1", d.side_channel_port, "s1") == d_params
        # The proxy ends the conversation: D's held blocks come back at once.
        assert client.release("127.0.0.1", d.side_channel_port, d_params["remote_request_id"],
                              d_params["release_token"])  # fmt: skip
    finally:
        client.close()


def test_streams_have_no_params_by_default_like_stock_vllm(
    pd: tuple[EngineSim, EngineSim],
) -> None:
    p, d = pd
    params = prefill(p, "s2", {"prompt": PROMPT})
    body = {"prompt": PROMPT, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True},
            "kv_transfer_params": {**params, "hold_blocks": True}}  # fmt: skip
    resp = httpx.post(d.url + "/v1/completions", json=body, headers={"X-Request-Id": "s2"},
                      timeout=30)  # fmt: skip
    assert resp.status_code == 200 and "kv_transfer_params" not in resp.text
    assert resp.text.endswith("data: [DONE]\n\n")
    # The held blocks' params are on D's side channel only.
    client = SideChannelClient(CONNECTOR_SECRET.encode())
    try:
        d_params = client.finished("127.0.0.1", d.side_channel_port, "s2")
        assert d_params is not None and d_params["remote_engine_id"] == "D"
        assert client.release("127.0.0.1", d.side_channel_port, d_params["remote_request_id"],
                              d_params["release_token"])  # fmt: skip
    finally:
        client.close()


def _turn(
    p: EngineSim, d: EngineSim, rid: str, msgs: list[dict[str, str]],
    previous: dict[str, Any] | None, max_tokens: int = 24,
) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """One proxy-style turn: P (pulling D's previous KV if given), then D (holding for next)."""
    p_params = dict(MISS)
    if previous is not None:
        p_params = {**previous, "do_remote_decode": True, "do_remote_prefill": False}
    params = prefill(p, rid, {"messages": msgs, "kv_transfer_params": p_params}, chat=True)
    body = {"messages": msgs, "max_tokens": max_tokens, "ignore_eos": True}
    status, resp = decode(d, rid, body, {**params, "hold_blocks": True}, chat=True)
    assert status == 200, resp
    return text_of(resp), resp["kv_transfer_params"]


def test_bidirectional_turn_two_pulls_from_d(pd: tuple[EngineSim, EngineSim]) -> None:
    p, d = pd
    msgs = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "first question"}]
    reply1, d_params = _turn(p, d, "t1", msgs, None)
    assert reply1 == reference_chat(msgs, 24, ignore_eos=True)
    msgs2 = [*msgs, {"role": "assistant", "content": reply1},
             {"role": "user", "content": "and a second one"}]  # fmt: skip
    loaded_before = p.metric("enginesim_prompt_tokens_loaded_total")
    reply2, d_params2 = _turn(p, d, "t2", msgs2, d_params)
    assert reply2 == reference_chat(msgs2, 24, ignore_eos=True)
    pulled = p.metric("enginesim_prompt_tokens_loaded_total") - loaded_before
    # P pulled the turn-1 history from D: whole blocks, at most what D held.
    assert 0 < pulled <= d_params["remote_num_tokens"] and pulled % 16 == 0
    # Turn 1's hold on D was read by P and freed; turn 2's hold is released by "the proxy".
    client = SideChannelClient(CONNECTOR_SECRET.encode())
    try:
        assert client.release("127.0.0.1", d.side_channel_port, d_params2["remote_request_id"],
                              d_params2["release_token"])  # fmt: skip
    finally:
        client.close()


def test_diverged_history_pulls_only_the_matching_prefix(
    pd: tuple[EngineSim, EngineSim],
) -> None:
    p, d = pd
    msgs = [{"role": "system", "content": PROMPT},
            {"role": "user", "content": "the original question"}]  # fmt: skip
    reply1, d_params = _turn(p, d, "v1", msgs, None)
    # The client edits its first user message: only the system prompt's blocks still match.
    msgs2 = [msgs[0], {"role": "user", "content": "an edited question instead"},
             {"role": "assistant", "content": reply1},
             {"role": "user", "content": "next"}]  # fmt: skip
    loaded_before = p.metric("enginesim_prompt_tokens_loaded_total")
    reply2, d_params2 = _turn(p, d, "v2", msgs2, d_params)
    assert reply2 == reference_chat(msgs2, 24, ignore_eos=True)
    pulled = p.metric("enginesim_prompt_tokens_loaded_total") - loaded_before
    from kvrelay.enginesim.chat import render_chat
    from kvrelay.enginesim.tokenizer import get_tokenizer

    tok = get_tokenizer()
    old, new = tok.encode(render_chat(msgs)), tok.encode(render_chat(msgs2))
    common = next(i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b)
    assert pulled == (common // 16) * 16 and pulled > 0
    client = SideChannelClient(CONNECTOR_SECRET.encode())
    try:
        client.release("127.0.0.1", d.side_channel_port, d_params2["remote_request_id"],
                       d_params2["release_token"])  # fmt: skip
    finally:
        client.close()


def test_d_rejection_before_admission_frees_p_quickly(pd: tuple[EngineSim, EngineSim]) -> None:
    p, d = pd
    dd = Delta(d)
    body = {"prompt": PROMPT}
    params = prefill(p, "rej", body)
    assert p.metric("enginesim_blocks_held_for_remote") > 0
    status, err = decode(d, "rej", {**body, "max_tokens": -3}, params)
    assert status == 400 and err["error"]["param"] == "max_tokens"
    p.wait_idle(timeout=2)
    # The same for an engine refusing admission (fault), not only for validation.
    params = prefill(p, "rej2", body)
    d.request("/admin/faults", {"refuse_admission": True})
    assert decode(d, "rej2", body, params)[0] == 503
    p.wait_idle(timeout=2)
    assert dd('enginesim_requests_by_outcome_total{outcome="rejected"}') == 2


def test_d_killed_after_p_finished_frees_on_lease(idle_after: EngineFactory) -> None:
    p, d = idle_after("P", "--lease-seconds", "2"), idle_after("D")
    params = prefill(p, "lease", {"prompt": PROMPT})
    assert params["remote_blocks_expiry_time"] > 0
    d.kill()
    assert p.metric("enginesim_blocks_held_for_remote") > 0
    p.wait_idle(timeout=10)
    assert p.metric("enginesim_connector_freed_by_expiry") >= 1


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_handshake_failure_follows_policy(
    pd: tuple[EngineSim, EngineSim], idle_after: EngineFactory, policy: str
) -> None:
    p, d = pd
    if policy == "fail":
        d = idle_after("D-fail", "--kv-load-failure-policy", "fail")
    dd = Delta(d)
    body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
    params = prefill(p, "hs", body)
    # Nothing listens on this side-channel port: the handshake/claim fails.
    broken = {**params, "remote_port": free_port()}
    status, resp = decode(d, "hs", body, broken)
    if policy == "recompute":
        assert status == 200
        assert text_of(resp) == reference_completion(PROMPT, 12, ignore_eos=True)
        assert dd("enginesim_prompt_tokens_loaded_total") == 0
    else:
        assert status >= 500 and resp["error"]["code"] == status
    # D could not reach P to release; the proxy does it with the release token.
    client = SideChannelClient(CONNECTOR_SECRET.encode())
    try:
        client.release("127.0.0.1", p.side_channel_port, params["remote_request_id"],
                       params["release_token"])  # fmt: skip
    finally:
        client.close()
    wait_until(p.pool_idle, 5, what="P idle after release")


def test_holds_are_reclaimed_under_block_pressure(idle_after: EngineFactory) -> None:
    # 24 blocks; every prefill leaves a 4-block hold that nobody reads. A hold for a transfer
    # is reclaimed only once its reader is late (the claim timeout: until then it is this
    # turn's KV on its way to D), so the prefill that finds the pool full waits that long.
    p = idle_after(
        "P-small", "--num-blocks", "24", "--max-model-len", "256", "--claim-timeout", "1"
    )
    held: list[dict[str, Any]] = []
    for i in range(12):
        held.append(prefill(p, f"fill-{i}", {"prompt": f"{i} {PROMPT[:150]}"}))
    # Nothing was refused: the oldest holds were given back instead.
    assert p.metric("enginesim_connector_freed_by_reclaim") >= 4
    assert p.metric("enginesim_reclaim_requests_total") >= 1
    client = SideChannelClient(CONNECTOR_SECRET.encode())
    try:
        released = sum(
            client.release("127.0.0.1", p.side_channel_port, h["remote_request_id"],
                           h["release_token"])
            for h in held
        )  # fmt: skip
    finally:
        client.close()
    assert 0 < released < len(held)  # reclaimed holds were already gone


def test_d_under_a_hold_budget_keeps_the_latest_conversations(
    idle_after: EngineFactory,
) -> None:
    # D: 256 blocks, holds may pin a tenth (25). Each conversation's first turn leaves a hold
    # of about 10 blocks on D, so three of them already exceed the budget.
    p = idle_after("P-budget")
    d = idle_after("D-budget", "--num-blocks", "256", "--hold-budget-fraction", "0.1")
    budget = 25
    system = {"role": "system", "content": " ".join([PROMPT] * 4)}
    convs: list[tuple[list[dict[str, str]], dict[str, Any]]] = []
    for i in range(5):
        msgs = [system, {"role": "user", "content": f"question number {i}"}]
        reply, held = _turn(p, d, f"budget-{i}", msgs, None)
        msgs.append({"role": "assistant", "content": reply})
        convs.append((msgs, held))
        wait_until(
            lambda: d.metric("enginesim_blocks_held_for_remote") <= budget, 5,
            what="D's holds within the budget",
        )  # fmt: skip
    assert d.metric("enginesim_connector_freed_by_budget") >= 3
    assert convs[-1][1]["remote_num_tokens"] > 8 * 16  # one hold is more than a third of it

    def next_turn(k: int) -> float:
        msgs, held = convs[k]
        loaded = p.metric("enginesim_prompt_tokens_loaded_total")
        follow = [*msgs, {"role": "user", "content": "and then?"}]
        reply, again = _turn(p, d, f"budget-{k}-2", follow, held)
        assert reply == reference_chat(follow, 24, ignore_eos=True)
        convs[k] = (follow, again)
        return p.metric("enginesim_prompt_tokens_loaded_total") - loaded

    # The latest conversation's next turn pulls its history from D's hold; the oldest's hold
    # went to the budget, so its next turn recomputes.
    assert next_turn(4) > 0
    assert next_turn(0) == 0
    client = SideChannelClient(CONNECTOR_SECRET.encode())
    try:
        for _, held in convs:
            client.release("127.0.0.1", d.side_channel_port, held["remote_request_id"],
                           held["release_token"])  # fmt: skip
    finally:
        client.close()


def test_dropped_nixl_agent_falls_back_to_recompute(
    pd: tuple[EngineSim, EngineSim], idle_after: EngineFactory
) -> None:
    p, d = idle_after("P-drop"), pd[1]
    body = {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True}
    expected = reference_completion(PROMPT, 16, ignore_eos=True)
    status, resp = decode(d, "drop-1", body, prefill(p, "drop-1", body))
    assert status == 200 and text_of(resp) == expected
    dd = Delta(d)
    params = prefill(p, "drop-2", body)
    assert p.request("/admin/faults", {"drop_nixl_agent": True})[0] == 200
    status, resp = decode(d, "drop-2", body, params)
    # D knew P's old agent: the read fails, D recomputes (policy recompute), output intact.
    assert status == 200 and text_of(resp) == expected
    assert dd("enginesim_connector_failures") == 1
    assert dd("enginesim_prompt_tokens_loaded_total") == 0


def test_p_holds_exactly_the_advertised_blocks(pd: tuple[EngineSim, EngineSim]) -> None:
    p, d = pd
    # 32 prompt tokens: the request used 3 blocks (the 33rd token's KV opens a third one),
    # but only the 2 prompt blocks are advertised and held; the third is free at once.
    prompt = list(range(300, 332))
    body = {"prompt": prompt, "max_tokens": 10, "ignore_eos": True}
    params = prefill(p, "exact", body)
    assert len(params["remote_block_ids"][0]) == 2 and params["remote_num_tokens"] == 32
    m = p.metrics()
    assert m["enginesim_blocks_held_for_remote"] == 2
    assert m["enginesim_blocks_free"] == m["enginesim_blocks_total"] - 2
    status, resp = decode(d, "exact", body, params)
    assert status == 200
    assert text_of(resp) == reference_completion(prompt, 10, ignore_eos=True)


def test_recompute_threshold_skips_small_loads_and_releases_p(
    pd: tuple[EngineSim, EngineSim], idle_after: EngineFactory
) -> None:
    p, d = pd[0], idle_after("D-threshold", "--kv-recompute-threshold", "100000")
    body = {"prompt": PROMPT, "max_tokens": 10, "ignore_eos": True}
    params = prefill(p, "thr", body)
    status, resp = decode(d, "thr", body, params)
    assert status == 200
    assert text_of(resp) == reference_completion(PROMPT, 10, ignore_eos=True)
    assert d.metric("enginesim_prompt_tokens_loaded_total") == 0
    # D will not read, so it releases P's hold right away instead of leaving it to the lease.
    p.wait_idle(timeout=2)


def test_preempted_request_never_loads_again(
    pd: tuple[EngineSim, EngineSim], idle_after: EngineFactory
) -> None:
    """D's pool runs out while a loaded request decodes: it is preempted and asked about again
    (as vLLM does). Its hold on P is consumed, so it recomputes; under policy `fail` a second
    load would error a correctly served request."""
    p = pd[0]
    d = idle_after(
        "D-preempt", "--kv-load-failure-policy", "fail", "--num-blocks", "16",
        "--max-model-len", "256", "--decode-us-per-step", "10000",
    )  # fmt: skip
    dd = Delta(d)
    filler = {"prompt": "fill", "max_tokens": 180, "ignore_eos": True}
    loaded = {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True}
    params = prefill(p, "pre-1", loaded)
    results: dict[str, tuple[int, dict[str, Any]]] = {}
    thread = threading.Thread(
        target=lambda: results.update(filler=d.request("/v1/completions", filler))
    )
    thread.start()
    try:
        wait_until(lambda: d.metric("enginesim_requests_running") >= 1, 10, what="filler runs")
        results["loaded"] = decode(d, "pre-1", loaded, params)
    finally:
        thread.join(60)

    assert dd("enginesim_preemptions_total") >= 1
    status, resp = results["loaded"]
    assert status == 200, resp
    assert text_of(resp) == reference_completion(PROMPT, 100, ignore_eos=True)
    assert dd("enginesim_prompt_tokens_loaded_total") > 0
    assert dd("enginesim_connector_loads_started") == 1
    assert text_of(results["filler"][1]) == reference_completion("fill", 180, ignore_eos=True)


def test_profiled_p_and_d_wait_the_modelled_load_over_real_nixl(
    idle_after: EngineFactory,
) -> None:
    name, scale, link = "llama3-8b-h100", 0.05, "rdma-400g-13us"
    profile = get_profile(name)
    args = ["--cost-profile", name, "--kv-scale", str(scale), "--kv-link", link]
    p, d = idle_after.many(("P-gpu", args), ("D-gpu", args))
    # The pool follows the profile's GPU memory, scaled down for the CPU.
    assert d.metric("enginesim_blocks_total") == round(profile.num_blocks() * scale)
    # A long prompt: its KV takes a modelled transfer on top of the real read.
    prompt = " ".join([PROMPT] * 200)
    body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    dd = Delta(d)
    params = prefill(p, "g1", body)
    started = time.monotonic()
    status, resp = decode(d, "g1", body, params)
    elapsed = time.monotonic() - started
    assert status == 200, resp
    long_context = EngineConfig(num_blocks=2048, max_model_len=32768)
    assert text_of(resp) == reference_completion(prompt, 2, long_context, ignore_eos=True)
    n = resp["usage"]["prompt_tokens"]
    assert dd("enginesim_prompt_tokens_loaded_total") == n - 1
    # D waited the modelled transfer of what it loaded, then computed the last prompt token
    # and decoded one more, each step its modelled time. (A lower bound only: D's own CPU
    # work on a long prompt takes longer than the modelled transfer here; the exact wait is
    # pinned in-process by tests/enginesim/test_costs.py.)
    # The fewest descriptors the read can have taken (one run of blocks on both sides): the
    # engine costs the runs the real read had, which a fresh pool keeps few.
    transfer = profile.transfer_time(n - 1, get_link(link), block_runs=1)
    steps = profile.prefill_time(1, n - 1) + profile.decode_step_time([n + 1])
    assert transfer > 0 and elapsed >= transfer + steps
    p.wait_idle(timeout=5)
