"""The proxy reads a real vLLM D's decode pace as it reads enginesim's: the mean gap between
output tokens between two scrapes of `vllm:inter_token_latency_seconds` (what
`prefill_spill_max_inter_token_ms` weighs before moving prefill onto a D)."""

from __future__ import annotations

import time
import urllib.request

import pytest

from kvrelay.proxy.fleet.engine_load import load_from_metrics
from kvrelay.proxy.fleet.load_reading import EngineLoad
from tests.harness import wait_until
from tests.vllm.conftest import PDFleet
from tests.vllm.test_reuse_report import SYSTEM, chat

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


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
