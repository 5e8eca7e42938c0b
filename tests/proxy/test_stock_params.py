"""The proxy in front of engines that return stock vLLM params (no block hashes, no release
token), using `FakeStockEngine`: reuse is off by default and counted; opted in, P is offered
D's blocks capped at the previous turn's prompt tokens."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvrelay.devtools import ProxyFactory
from tests.proxy.client import post
from tests.proxy.fake_stock_engine import FakeStockEngine


@pytest.fixture
def fake_stock_pd() -> Iterator[tuple[FakeStockEngine, FakeStockEngine]]:
    p, d = FakeStockEngine("fakeP").start(), FakeStockEngine("fakeD").start()
    try:
        yield p, d
    finally:
        p.stop()
        d.stop()


def _two_turns(url: str) -> httpx.Response:
    headers = {"X-Conversation-Id": "stock-1"}
    first = post(url, "/v1/completions", {"model": "fake", "prompt": "one two three four"},
                 headers)  # fmt: skip
    assert first.status_code == 200 and "kv_transfer_params" not in first.json()
    second = post(
        url,
        "/v1/completions",
        {"model": "fake", "prompt": "one two three four a b c five six"},
        headers,
    )
    assert second.status_code == 200, second.text
    return second


def test_stock_params_are_not_reused_by_default(
    fake_stock_pd: tuple[FakeStockEngine, FakeStockEngine], proxy_factory: ProxyFactory
) -> None:
    p, d = fake_stock_pd
    proxy = proxy_factory([p.url], [d.url])
    _two_turns(proxy.url)
    turn2_to_p = p.requests[1]["kv_transfer_params"]
    assert turn2_to_p["remote_engine_id"] is None  # nothing offered
    m = proxy.metrics()
    # D's holds could not be released (no release token): counted, not hidden.
    assert m['kvrelay_releases_total{holder="decode",result="unsupported"}'] >= 2


def test_stock_reuse_opt_in_caps_tokens_at_previous_prompt(
    fake_stock_pd: tuple[FakeStockEngine, FakeStockEngine], proxy_factory: ProxyFactory
) -> None:
    p, d = fake_stock_pd
    proxy = proxy_factory([p.url], [d.url], stock_vllm_reuse="true")
    _two_turns(proxy.url)
    offered = p.requests[1]["kv_transfer_params"]
    assert offered["do_remote_decode"] is True and offered["remote_engine_id"] == "fakeD"
    # D held prompt + 3 generated tokens; only turn 1's 4 prompt tokens are offered.
    assert offered["remote_num_tokens"] == 4
    assert offered["remote_block_ids"] == [[5, 6, 7]]
    assert proxy.metrics()['kvrelay_reuse_total{result="hit"}'] == 1
    # D (stock) got P's params and a hold flag it will ignore.
    assert d.requests[1]["kv_transfer_params"]["do_remote_prefill"] is True


def test_engines_without_a_reuse_report_are_counted_unknown_never_from_the_map(
    fake_stock_pd: tuple[FakeStockEngine, FakeStockEngine], proxy_factory: ProxyFactory
) -> None:
    # Stock engines with prompt-token details off say nothing of what they reused: the map
    # offered P D's blocks, yet the proxy reports no reuse it was not told of.
    p, d = fake_stock_pd
    proxy = proxy_factory([p.url], [d.url], stock_vllm_reuse="true")
    second = _two_turns(proxy.url)
    assert second.headers["X-Kvrelay-Reused-Tokens"] == "unknown"
    assert second.headers["X-Kvrelay-Computed-Tokens"] == "unknown"
    assert second.headers["X-Kvrelay-Prompt-Tokens"] == "9"  # P's usage
    assert second.headers["X-Kvrelay-Prefilled-By"] == "prefill"
    m = proxy.metrics()
    assert m['kvrelay_reuse_total{result="hit"}'] == 1
    assert m.get('kvrelay_tokens_reused_total{leg="prefill"}', 0) == 0
    assert m['kvrelay_leg_accounts_total{leg="prefill",result="unknown"}'] == 2
    assert m['kvrelay_prompt_tokens_total{leg="prefill",source="unknown"}'] == 4 + 9
