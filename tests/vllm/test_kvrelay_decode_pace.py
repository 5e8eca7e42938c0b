"""The proxy reads a real vLLM D's load as it reads enginesim's: its decode pace, the mean gap
between output tokens between two scrapes of `vllm:inter_token_latency_seconds` (what
`prefill_spill_max_inter_token_ms` weighs before moving prefill onto a D), and its pool's size
from `vllm:cache_config_info`, over which the turns that end on D without a hold lower its KV
usage until the next scrape (`Router.released`)."""

from __future__ import annotations

import time
import urllib.request
import uuid

import pytest
from openai import OpenAI

from kvrelay.devtools import ProxyFactory, vllm_servers
from kvrelay.proxy.fleet.engine_load import load_from_metrics
from kvrelay.proxy.fleet.load_reading import EngineLoad
from tests.harness import wait_until
from tests.vllm.conftest import PDFleet
from tests.vllm.test_reuse_report import SYSTEM, chat

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

HELD_BLOCKS = "vllm:kvrelay_held_blocks"


def _reading(url: str, previous: EngineLoad | None = None) -> EngineLoad:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        load = load_from_metrics(resp.read().decode(), time.monotonic(), previous)
    assert load is not None
    return load


def test_a_real_ds_inter_token_histogram_gives_its_decode_pace(kvrelay_fleet: PDFleet) -> None:
    d = kvrelay_fleet.decode
    before = _reading(d.url)
    assert before.itl_count is not None and before.itl_sum is not None
    counted = before.itl_count
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Pace?"}]
    out = chat(d, "pace-1", messages, max_tokens=16, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 16

    def gaps_counted() -> bool:  # vLLM publishes its stats after the answer
        now = _reading(d.url).itl_count
        return now is not None and now - counted >= 15

    wait_until(gaps_counted, 30, what="D to count the request's 15 token gaps")
    after = _reading(d.url, before)
    assert after.itl_count is not None and after.itl_count - counted == 15
    assert after.inter_token_s is not None and 0 < after.inter_token_s < 10


def test_turns_that_leave_no_hold_on_a_real_d_lower_its_kv_usage_until_the_next_reading(
    kvrelay_fleet: PDFleet,
) -> None:
    """The proxy reads D once (a poll interval longer than the test): D's pool as vLLM serves
    it (its `--num-gpu-blocks-override` blocks of `--block-size` tokens) and nothing freed yet.
    A completion with no conversation leaves no hold on D (vLLM's held-blocks gauge does not
    move): the tokens freed since the reading are the prompt tokens vLLM reported for it. A
    conversation's turn D holds frees none."""
    fleet, admin_key = kvrelay_fleet, "freed-kv-admin-key"
    d = fleet.decode
    factory = ProxyFactory()

    def freed() -> int:
        return int((proxy.engine_load() or {})["freed_tokens"])

    try:
        proxy = factory(
            [fleet.prefill.url], [d.url], ready_path="/ready", admin_key=admin_key,
            connector_secret=vllm_servers.CONNECTOR_SECRET, load_poll_interval_s="600",
        )  # fmt: skip
        wait_until(lambda: proxy.engine_load() is not None, 15, what="the proxy's reading of D")
        load = proxy.engine_load()
        assert load is not None and load["freed_tokens"] == 0
        assert load["pool_tokens"] == vllm_servers.DECODE_BLOCKS * vllm_servers.BLOCK_SIZE
        held = d.metric(HELD_BLOCKS)
        client = OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
        done = client.completions.create(
            model=vllm_servers.MODEL_NAME, prompt=f"{SYSTEM} Freed?", max_tokens=4, temperature=0
        )
        assert done.usage is not None and done.usage.prompt_tokens > 0
        assert d.metric(HELD_BLOCKS) == held
        assert freed() == done.usage.prompt_tokens
        chat = client.chat.completions.create(
            model=vllm_servers.MODEL_NAME,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hold?"}],
            max_tokens=4,
            temperature=0,
            extra_headers={"X-Conversation-Id": f"freed-kv-{uuid.uuid4().hex[:8]}"},
        )
        assert chat.choices[0].message.content is not None
        wait_until(lambda: d.metric(HELD_BLOCKS) > held, 10, what="D to hold the turn")
        assert freed() == done.usage.prompt_tokens
    finally:
        factory.close()
