"""Units of realized-reuse accounting: reading an engine's account, keeping a stream's usage
event back, and the router's standing of engines whose reuse did not pay."""

from __future__ import annotations

import json

import pytest

from kvrelay.connector.protocol import KVTransferParams
from kvrelay.proxy.fleet.reuse_standing import ReuseStanding
from kvrelay.proxy.turn import PromptAccount
from kvrelay.proxy.turn.streaming import SSEFilter
from tests.proxy.manual_clock import Clock


def test_the_connector_report_is_the_account() -> None:
    params = KVTransferParams.from_wire({
        "kvr_prompt_tokens": 100, "kvr_local_hit_tokens": 32, "kvr_loaded_tokens": 48,
        "kvr_offered_blocks": 6, "kvr_refused_blocks": {"local": 2, "hash": 1},
        "remote_prefill_cached_tokens": 80,
    })  # fmt: skip
    account = PromptAccount.from_connector(params)
    assert account is not None
    assert (account.prompt_tokens, account.reused, account.computed) == (100, 80, 20)
    headers = account.headers("prefill")
    odd = KVTransferParams.from_wire({**params.to_wire(), "kvr_refused_blocks": {"x" * 9: 2}})
    odd_account = PromptAccount.from_connector(odd)
    assert odd_account is not None and odd_account.refused == (("other", 2),)  # no new labels
    assert headers["X-Kvrelay-Local-Hit-Tokens"] == "32"
    assert headers["X-Kvrelay-Loaded-Tokens"] == "48"
    assert headers["X-Kvrelay-Refused-Blocks"] == "hash=1,local=2"


def test_without_a_figure_the_account_is_unknown() -> None:
    # Stock params (no report) and usage without details: nothing to say what was reused.
    assert PromptAccount.from_connector(KVTransferParams.from_wire({"tp_size": 1})) is None
    account = PromptAccount.from_usage({"prompt_tokens": 40, "prompt_tokens_details": None})
    assert account.prompt_tokens == 40 and account.reused is None and account.computed is None
    assert account.headers("decode")["X-Kvrelay-Reused-Tokens"] == "unknown"
    # vLLM's own total (`cached_tokens`): reused known, its split not.
    cached = PromptAccount.from_usage({"prompt_tokens": 40,
                                       "prompt_tokens_details": {"cached_tokens": 32}})  # fmt: skip
    assert (cached.reused, cached.local_hit, cached.computed) == (32, None, 8)
    assert account.or_else(cached) == cached
    assert cached.or_else(account) == cached


@pytest.mark.parametrize("spaced", [False, True])
def test_the_final_usage_event_is_kept_back(spaced: bool) -> None:
    sep = (", ", ": ") if spaced else (",", ":")
    chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
    raw = (
        b"data: " + json.dumps(chunk, separators=sep).encode() + b"\r\n\r\n"
        + b"data: " + json.dumps(usage, separators=sep).encode() + b"\r\n\r\ndata: [DONE]\r\n\r\n"
    )  # fmt: skip
    sse = SSEFilter(hold_done=True, hold_usage=True)
    out = b"".join(sse.feed(raw[i : i + 7]) for i in range(0, len(raw), 7)) + sse.flush()
    assert out.count(b"data: ") == 1 and b'"hi"' in out
    assert sse.usage_event == usage and sse.done_event is not None
    # Without `hold_usage`, it passes through as it came.
    plain = SSEFilter(hold_done=True)
    assert b'"usage"' in plain.feed(raw.replace(b"\r\n", b"\n")) and plain.usage_event is None


def test_an_engine_whose_turns_reuse_nothing_is_withdrawn_and_probed() -> None:
    clock = Clock(0.0)
    standing = ReuseStanding("decode", "decode_only", 30.0, clock)
    assert standing.admits("d1", "ta")
    standing.unpaid("d1", "ta")
    standing.unpaid("d1", "ta")  # still withdrawn: one change
    assert not standing.admits("d1", "ta") and standing.admits("d2", "ta")
    clock.now = 29.0
    assert not standing.admits("d1", "ta")
    clock.now = 30.0
    assert standing.admits("d1", "ta")  # one probe turn ...
    assert not standing.admits("d1", "ta")  # ... and no second before the next interval
    standing.paid("d1", "ta")
    assert standing.admits("d1", "ta") and not standing.withdrawn("d1", "ta")


def test_one_tenants_turns_never_withdraw_an_engine_for_another() -> None:
    # Turns that reuse nothing (on purpose or not) withdraw the engine for their own tenant;
    # every other tenant keeps it, and memory is bounded however many tenants come.
    standing = ReuseStanding("decode", "decode_only", 30.0, Clock(0.0), limit=3)
    for _ in range(5):
        standing.unpaid("d1", "tb")
    assert not standing.admits("d1", "tb")
    assert standing.admits("d1", "ta") and not standing.withdrawn("d1", "ta")
    for tenant in ("t1", "t2", "t3"):
        standing.unpaid("d1", tenant)
    assert not standing.withdrawn("d1", "tb")  # the oldest forgotten: restored, not leaked
    assert standing.withdrawn("d1", "t3")
