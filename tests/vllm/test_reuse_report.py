"""Real vLLM P and D report, per request, what their connector did; it equals vLLM's counters.

Direct to the engines (no proxy), as the proxy's legs send them: P's answer and D's answer
carry the connector's reuse report (`kvr_*` in `kv_transfer_params`), and its loaded and local
hit tokens equal the changes of vLLM's own `vllm:prompt_tokens_by_source_total` on that engine
(P runs without a prefix cache, D with vLLM's default one). A re-rendered history that P is
offered D's blocks for loads nothing and refuses every offered block by hash; a decode-only
turn reports D's own prefix hit.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import pytest

from kvrelay.connector.protocol import KV_TRANSFER_PARAMS, HoldRef, KVTransferParams
from kvrelay.connector.sidechannel_client import SideChannelClient
from kvrelay.devtools import vllm_servers
from kvrelay.proxy.turn.legs import decode_body, prefill_body
from tests.harness import wait_until
from tests.vllm.conftest import PDFleet

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPTS = 'vllm:prompt_tokens_total{engine="0",model_name="tiny"}'
SOURCE = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="%s"}'
SYSTEM = (
    "You answer questions about reuse. A block of the cache is reused only when every token "
    "before it and in it is the same as the one the engine computed before, turn after turn."
)


class Counted:
    """vLLM's prompt token counters of one engine around one request."""

    def __init__(self, server: vllm_servers.VLLMServer) -> None:
        self.server, self.before = server, server.metrics()

    def split(self, prompt_tokens: int) -> dict[str, float]:
        """Changes by source, once the request's prompt tokens are counted (stats lag)."""
        wait_until(
            lambda: self.server.metrics().get(PROMPTS, 0) - self.before.get(PROMPTS, 0)
            >= prompt_tokens, 30, what=f"{self.server.name} to count the prompt tokens",
        )  # fmt: skip
        now = self.server.metrics()
        return {
            s: now.get(SOURCE % s, 0) - self.before.get(SOURCE % s, 0)
            for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
        }


def chat(
    server: vllm_servers.VLLMServer, rid: str, messages: list[dict[str, str]], **extra: Any
) -> Any:
    body = {"model": vllm_servers.MODEL_NAME, "messages": messages, "temperature": 0, **extra}
    status, out = server.post("/v1/chat/completions", body, {"X-Request-Id": rid})
    assert status == 200, out
    return out


def p_leg(offered: dict[str, Any] | None = None) -> dict[str, Any]:
    """P's `kv_transfer_params` as the proxy's P leg sends them; `offered`: D's answer's params,
    whose hold P is offered to pull the history from."""
    params: dict[str, Any] = prefill_body({}, parsed(offered))[KV_TRANSFER_PARAMS]
    return params


def d_leg(prefilled: dict[str, Any] | None) -> dict[str, Any]:
    """D's `kv_transfer_params` as the proxy's D leg sends them, asking D to hold its blocks:
    P's answer's params (`prefilled`; None: a decode-only turn)."""
    params: dict[str, Any] = decode_body({}, parsed(prefilled), None, hold=True)[KV_TRANSFER_PARAMS]
    return params


def parsed(params: dict[str, Any] | None) -> KVTransferParams | None:
    return KVTransferParams.from_wire(params)


def reuse(params: dict[str, Any]) -> tuple[int, int, int, int, dict[str, int]]:
    """The connector's reuse report in an engine's answer: prompt, local hit and loaded
    tokens, blocks offered, blocks refused by reason."""
    got = parsed(params)
    assert got is not None
    prompt, local, loaded = got.kvr_prompt_tokens, got.kvr_local_hit_tokens, got.kvr_loaded_tokens
    offered, refused = got.kvr_offered_blocks, got.kvr_refused_blocks
    assert prompt is not None and local is not None and loaded is not None, params
    assert offered is not None and refused is not None, params
    return prompt, local, loaded, offered, refused


def held_blocks(params: dict[str, Any]) -> int:
    """How many blocks the hold in an engine's answer keeps."""
    got = parsed(params)
    assert got is not None and got.remote_block_ids, params
    return len(got.remote_block_ids[0])


def release(client: SideChannelClient, params: dict[str, Any]) -> bool:
    hold = HoldRef.from_params(params)
    assert hold is not None, params
    return client.release(
        hold.remote_host, hold.remote_port, hold.remote_request_id, hold.release_token
    )


def leg(
    server: vllm_servers.VLLMServer,
    messages: list[dict[str, str]],
    params: dict[str, Any],
    max_tokens: int,
) -> tuple[dict[str, Any], str, dict[str, float]]:
    """One leg; returns its params, its text and vLLM's split of its prompt tokens."""
    counted = Counted(server)
    out = chat(server, f"acc-{uuid.uuid4().hex[:8]}", messages, max_tokens=max_tokens,
               kv_transfer_params=params)  # fmt: skip
    got: dict[str, Any] = out["kv_transfer_params"]
    prompt = out["usage"]["prompt_tokens"]
    split = counted.split(prompt)
    p_tokens, local, loaded, _, _ = reuse(got)
    # The connector's figures are vLLM's own: local hit and external tokens, by source.
    assert p_tokens == prompt
    assert (local, loaded) == (split["local_cache_hit"], split["external_kv_transfer"])
    assert split["local_compute"] == prompt - local - loaded
    return got, out["choices"][0]["message"]["content"], split


def test_engines_report_reuse_as_vllm_counts_it(kvrelay_fleet: PDFleet) -> None:
    p, d = kvrelay_fleet.prefill, kvrelay_fleet.decode
    question = f"Question {uuid.uuid4().hex[:6]}: what is reused?"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    p1, _, _ = leg(p, messages, p_leg(), 1)
    assert reuse(p1)[1:] == (0, 0, 0, {})
    d1, reply, _ = leg(d, messages, d_leg(p1), 12)
    d_prompt, d_local, d_loaded, _, _ = reuse(d1)
    assert d_loaded == d_prompt - d_local - 1

    # Affinity/always-P turn 2: P is offered D's hold and loads the history it verifies.
    messages += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "And which blocks are refused?"}]  # fmt: skip
    p2, _, _ = leg(p, messages, p_leg(d1), 1)
    _, local, loaded, offered, refused = reuse(p2)
    assert local == 0 and loaded >= vllm_servers.BLOCK_SIZE  # P has no prefix cache: all from D
    assert offered == held_blocks(d1)
    assert sum(refused.values()) == offered - math.ceil(loaded / vllm_servers.BLOCK_SIZE)
    # vLLM's own figure for D (P's cached tokens) agrees.
    p2_params = parsed(p2)
    assert p2_params is not None and p2_params.remote_prefill_cached_tokens == local + loaded
    d2, reply, _ = leg(d, messages, d_leg(p2), 12)

    # A template that re-renders its first line: every offered block is refused by hash.
    rerendered = [{"role": "system", "content": "Now: " + SYSTEM}, *messages[1:],
                  {"role": "assistant", "content": reply}]  # fmt: skip
    p3, _, split = leg(p, rerendered, p_leg(d2), 1)
    _, local, loaded, offered, refused = reuse(p3)
    assert offered == held_blocks(d2) > 0
    assert (local, loaded, refused) == (0, 0, {"hash": offered})
    assert split["external_kv_transfer"] == 0

    # Decode-only turn on D: its prompt's history is in D's own prefix cache.
    d4, _, split = leg(d, [*messages, {"role": "assistant", "content": reply}], d_leg(None), 4)
    _, d_local, _, d_offered, _ = reuse(d4)
    assert d_local >= vllm_servers.BLOCK_SIZE and d_offered == 0

    # Leave nothing held for the next module (P refused and released D's turn-2 hold).
    client = SideChannelClient(vllm_servers.CONNECTOR_SECRET.encode())
    try:
        for held in (p3, d4):
            assert release(client, held)
    finally:
        client.close()


def test_a_p_leg_asking_prompt_logprobs_reports_its_offer_not_taken(
    kvrelay_fleet: PDFleet,
) -> None:
    # vLLM reads no cache for a request that asks for prompt logprobs: it drops the load the
    # connector planned. The report must say so (offered, not taken: "threshold"), never that
    # the blocks were found locally, and its figures equal vLLM's (all computed).
    p, d = kvrelay_fleet.prefill, kvrelay_fleet.decode
    question = f"Question {uuid.uuid4().hex[:6]}: which tokens need logprobs?"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    p1, _, _ = leg(p, messages, p_leg(), 1)
    d1, reply, _ = leg(d, messages, d_leg(p1), 12)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "More?"}]
    counted = Counted(p)
    out = chat(p, f"lp-{uuid.uuid4().hex[:8]}", messages, max_tokens=1, prompt_logprobs=1,
               kv_transfer_params=p_leg(d1))  # fmt: skip
    got = out["kv_transfer_params"]
    split = counted.split(out["usage"]["prompt_tokens"])
    _, local, loaded, offered, refused = reuse(got)
    assert (local, loaded) == (0, 0) == (split["local_cache_hit"], split["external_kv_transfer"])
    assert offered == held_blocks(d1) > 0
    assert "local" not in refused and refused.get("threshold", 0) > 0, refused
    assert sum(refused.values()) == offered
    client = SideChannelClient(vllm_servers.CONNECTOR_SECRET.encode())
    try:
        assert release(client, got)
    finally:
        client.close()
