"""The hold budget on real vLLM: a D whose connector may pin a quarter of its KV pool with
holds for next turns frees the oldest unclaimed ones past it (`freed_by_budget`) as new holds
come, keeps the newest, and never lets the held blocks grow past the budget. A freed hold's
blocks stay in vLLM's prefix cache, so the conversation's next turn still finds its history
there (vLLM's own `local_cache_hit` counter says so). With `hold_max_fraction` at the budget's
share a turn alone over the budget is not held at all: D says so in its params, pins nothing,
and the next turn still finds the history in vLLM's prefix cache, unless the proxy asked the
hold to be brief: then D keeps it (up to `hold_brief_max_fraction`, half the pool by default)
for the seconds asked, outside the budget, and frees it when they are over.

One vLLM D with kvrelay's connector (no P, no proxy): requests ask it to hold their blocks
directly, as the proxy's decode leg does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrelay.connector.protocol import KVTransferParams
from kvrelay.devtools import free_port, vllm_servers
from kvrelay.proxy.turn.legs import decode_body
from tests.harness import wait_until
from tests.vllm.test_kvrelay_pd import HELD_BLOCKS, SYSTEM, completion_body

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BUDGET_FRACTION = 0.25
BUDGET_BLOCKS = int(BUDGET_FRACTION * vllm_servers.DECODE_BLOCKS)  # the connector's rule
BRIEF_LEASE_S = 4.0  # how long D keeps a brief hold
FREED_BY_BUDGET = "vllm:kvrelay_freed_by_budget_total"
OVER_BUDGET = "vllm:kvrelay_holds_over_budget_total"
BRIEF = "vllm:kvrelay_holds_brief_total"
LOCAL_HIT = (
    'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_cache_hit"}'
)


@pytest.fixture(scope="module")
def budget_d(tiny_model: Path) -> Iterator[vllm_servers.VLLMServer]:
    side = free_port()
    config = vllm_servers.kvrelay_transfer_config(
        side,
        hold_budget_fraction=BUDGET_FRACTION,
        hold_max_fraction=BUDGET_FRACTION,
        hold_brief_lease_s=BRIEF_LEASE_S,
    )
    d = vllm_servers.VLLMServer(
        "budget-D", tiny_model, 1, config, side_channel_port=side,
        extra_args=["--num-gpu-blocks-override", str(vllm_servers.DECODE_BLOCKS)],
    )  # fmt: skip
    try:
        d.start()
        yield d
    finally:
        d.stop()


def _prompt(i: int) -> str:
    return f"Conversation {i}. " + SYSTEM


def _held(d: vllm_servers.VLLMServer) -> float:
    return d.metric(HELD_BLOCKS)


def test_holds_past_the_budget_free_the_oldest_and_the_history_stays_cached(
    budget_d: vllm_servers.VLLMServer,
) -> None:
    d = budget_d
    first_blocks = 0.0
    for i in range(8):
        held_before = _held(d)
        freed_before = d.metric(FREED_BY_BUDGET)
        # A decode-only turn asking D to hold its blocks, as the proxy's D leg sends it.
        body = decode_body(completion_body(_prompt(i), max_tokens=8), None, None, hold=True)
        status, out = d.post("/v1/completions", body, timeout=60)
        assert status == 200, out
        # The hold is counted, or it pushed older ones out: either way the count moves.
        wait_until(
            lambda h=held_before, f=freed_before: _held(d) != h or d.metric(FREED_BY_BUDGET) > f,
            10, what="D to hold the request",
        )  # fmt: skip
        if i == 0:
            first_blocks = _held(d)
            assert 0 < first_blocks <= BUDGET_BLOCKS // 2, "each hold must be a fraction of it"
        # Past the budget the oldest went; the newest is always kept.
        assert first_blocks <= _held(d) <= BUDGET_BLOCKS
    assert d.metric(FREED_BY_BUDGET) > 0, "eight holds never went past a quarter of the pool"

    # Conversation 0's hold was the first to go, but its blocks are still in vLLM's prefix
    # cache: its next turn computes only what is new.
    hit_before = d.metric(LOCAL_HIT)
    body = completion_body(_prompt(0) + " And a follow-up question?", max_tokens=4)
    status, out = d.post("/v1/completions", body, timeout=60)
    assert status == 200, out
    wait_until(
        lambda: d.metric(LOCAL_HIT) - hit_before >= vllm_servers.BLOCK_SIZE, 30,
        what="vLLM to count the follow-up's prefix-cache hit",
    )  # fmt: skip


def _over_the_max(
    d: vllm_servers.VLLMServer, seed: int, brief: bool
) -> tuple[dict[str, Any], KVTransferParams]:
    """A decode-only turn four blocks over the budget and the one-hold max (token ids: their
    count is exact whatever the tokenizer), under half the pool, asking D to hold it (`brief`:
    as a brief hold): its body and D's params."""
    size = (BUDGET_BLOCKS + 4) * vllm_servers.BLOCK_SIZE
    ids = [seed + (7 * i + seed) % 1000 for i in range(size)]
    body = {**completion_body("", max_tokens=4), "prompt": ids}
    status, out = d.post("/v1/completions", decode_body(body, None, None, True, "", brief))
    assert status == 200, out
    params = KVTransferParams.from_wire(out["kv_transfer_params"])
    assert params is not None
    return body, params


def test_a_turn_alone_over_the_budget_is_not_held_and_its_history_stays_cached(
    budget_d: vllm_servers.VLLMServer,
) -> None:
    d = budget_d
    held_before, over_before = _held(d), d.metric(OVER_BUDGET)
    body, params = _over_the_max(d, 3, False)
    ids = body["prompt"]
    assert params.hold_declined is True and params.kvr_prompt_tokens == len(ids)
    assert not params.remote_block_ids and not params.release_token
    wait_until(lambda: d.metric(OVER_BUDGET) > over_before, 10, what="D to count the decline")
    assert _held(d) == held_before, "the declined turn pinned blocks"

    hit_before = d.metric(LOCAL_HIT)
    status, out = d.post("/v1/completions", {**body, "prompt": [*ids, 5, 6, 7, 8]}, timeout=60)
    assert status == 200, out
    wait_until(
        lambda: d.metric(LOCAL_HIT) - hit_before >= BUDGET_BLOCKS * vllm_servers.BLOCK_SIZE, 30,
        what="vLLM to count the next turn's prefix-cache hit on the unheld history",
    )  # fmt: skip


def test_a_turn_over_the_max_asked_brief_is_held_for_its_short_lease(
    budget_d: vllm_servers.VLLMServer,
) -> None:
    d = budget_d
    held_before, brief_before = _held(d), d.metric(BRIEF)
    freed_before = d.metric(FREED_BY_BUDGET)
    asked = time.time()
    params = _over_the_max(d, 5, True)[1]
    assert not params.hold_declined
    assert params.remote_block_ids and params.release_token
    expiry = params.remote_blocks_expiry_time
    assert expiry is not None and asked + BRIEF_LEASE_S <= expiry <= time.time() + BRIEF_LEASE_S
    wait_until(lambda: d.metric(BRIEF) > brief_before, 10, what="D to count the brief hold")
    # Held whole, and no hold of the budget's was freed for it.
    wait_until(
        lambda: _held(d) - held_before >= BUDGET_BLOCKS + 4, 10, what="D to pin the brief hold"
    )
    assert d.metric(FREED_BY_BUDGET) == freed_before
    # Its lease over, D frees it at its next step (a request makes one).
    wait_until(lambda: time.time() > expiry, 10, what="the brief hold's lease to end")
    status, out = d.post("/v1/completions", completion_body("Step.", max_tokens=2))
    assert status == 200, out
    wait_until(lambda: _held(d) <= held_before, 30, what="D to free the brief hold")
