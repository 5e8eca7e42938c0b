"""enginesim reports reuse as vLLM 0.32 does, from what the engine itself did.

`usage.prompt_tokens_details` follows `--enable-prompt-tokens-details` (JSON and streamed),
`vllm:prompt_tokens_by_source_total` and friends count every prompt token by where its KV came
from, and P's and D's `kv_transfer_params` carry the connector's reuse report (`kvr_*`). Each
figure is checked against the engine's own compute counters, with its prefix cache on and off,
including turns where the params a proxy sent promised reuse that the engine could not have.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from kvrelay.devtools import EngineFactory, EngineSim, sse

pytestmark = pytest.mark.nixl

BS = 16  # enginesim's default block size
SYSTEM = "You are a careful assistant who answers questions about caches and blocks of tokens."
HISTORY = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Why would a conversation reuse the KV cache of earlier turns?"},
]
P_LEG = {"do_remote_decode": True, "do_remote_prefill": False}
SOURCE = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="kvrelay-sim",source="%s"}'
CACHED = 'vllm:prompt_tokens_cached_total{engine="0",model_name="kvrelay-sim"}'
PROMPT = 'vllm:prompt_tokens_total{engine="0",model_name="kvrelay-sim"}'


class Delta:
    """vLLM-named and enginesim counter changes on one engine since construction."""

    def __init__(self, engine: EngineSim) -> None:
        self.engine, self.start = engine, engine.metrics()

    def __call__(self, name: str) -> float:
        return self.engine.metric(name) - self.start.get(name, 0.0)

    def source(self, source: str) -> float:
        return self(SOURCE % source)


@pytest.fixture(scope="module", params=["cache-on", "cache-off"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[EngineSim, EngineSim, bool]]:
    """A P and a D with their local prefix caches on, or both off."""
    cache = request.param == "cache-on"
    args = ["--enable-prefix-caching"] if cache else []
    factory = EngineFactory()
    try:
        p, d = factory.many(("P", ["--role", "prefill", *args]), ("D", ["--role", "decode", *args]))
        yield p, d, cache
    finally:
        factory.close()


def chat(engine: EngineSim, rid: str, messages: list[dict[str, str]], **body: Any) -> Any:
    status, resp = engine.request(
        "/v1/chat/completions",
        {"messages": messages, "ignore_eos": True, **body},
        headers={"X-Request-Id": rid},
    )
    assert status == 200, resp
    return resp


def stream(engine: EngineSim, path: str, body: dict[str, Any]) -> list[Any]:
    req = urllib.request.Request(
        engine.url + path, data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as resp:
        return sse.events(resp.read())


def check_sources(delta: Delta, prompt: int, local: int, external: int) -> None:
    """vLLM's prompt counters moved by exactly this request's split, and the engine really
    computed what they say it computed."""
    assert delta(PROMPT) == prompt
    assert delta.source("local_cache_hit") == local
    assert delta.source("external_kv_transfer") == external
    assert delta.source("local_compute") == prompt - local - external
    assert delta(CACHED) == local + external
    assert delta("enginesim_prompt_tokens_computed_total") == prompt - local - external
    assert delta("enginesim_prompt_tokens_loaded_total") == external
    assert delta("enginesim_prompt_tokens_cached_total") == local


def report(params: dict[str, Any]) -> tuple[int, int, int, int, dict[str, int]]:
    return (
        params["kvr_prompt_tokens"], params["kvr_local_hit_tokens"], params["kvr_loaded_tokens"],
        params["kvr_offered_blocks"], params["kvr_refused_blocks"],
    )  # fmt: skip


def turn(
    p: EngineSim, d: EngineSim, rid: str, messages: list[dict[str, str]],
    p_params: dict[str, Any], d_extra: dict[str, Any] | None = None,
) -> tuple[Any, Any, Delta, Delta]:  # fmt: skip
    """One disaggregated turn as the proxy runs it (P leg, then D leg holding for the next)."""
    dp, dd = Delta(p), Delta(d)
    p_out = chat(p, rid, messages, max_tokens=1, kv_transfer_params=p_params)
    d_params = {**p_out["kv_transfer_params"], "do_remote_prefill": True,
                "do_remote_decode": False, "hold_blocks": True, **(d_extra or {})}  # fmt: skip
    d_out = chat(d, rid, messages, max_tokens=12, kv_transfer_params=d_params)
    return p_out, d_out, dp, dd


def test_usage_details_follow_the_flag_as_in_vllm(engine_factory: EngineFactory) -> None:
    off = engine_factory("plain", "--no-enable-prompt-tokens-details", connector=False)
    on = engine_factory("details", "--enable-prefix-caching", connector=False)
    for engine in (off, on):
        for _ in range(2):  # the second finds the first's prompt in the prefix cache
            delta = Delta(engine)
            resp = chat(engine, "u", HISTORY, max_tokens=4)
            usage = resp["usage"]
            assert usage["completion_tokens_details"] is None
            prompt = usage["prompt_tokens"]
            if engine is off:
                assert usage["prompt_tokens_details"] is None
                continue
            cached = int(delta.source("local_cache_hit"))
            created = prompt // BS * BS - cached
            assert usage["prompt_tokens_details"] == {
                "cached_tokens": cached, "created_cache_tokens": created,
                "multimodal_tokens": None,
            }  # fmt: skip
        streamed = {"messages": HISTORY, "max_tokens": 3, "ignore_eos": True}
        last = stream(engine, "/v1/chat/completions", streamed)[-1]
        assert "usage" not in last  # no include_usage: no usage event
        with_usage = {**streamed, "stream_options": {"include_usage": True}}
        last = stream(engine, "/v1/chat/completions", with_usage)[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
        completion = {"prompt": SYSTEM, "max_tokens": 2, "ignore_eos": True,
                      "stream_options": {"include_usage": True}}  # fmt: skip
        comp_last = stream(engine, "/v1/completions", completion)[-1]
        if engine is off:
            assert "prompt_tokens_details" not in last["usage"]
            assert "prompt_tokens_details" not in comp_last["usage"]
        else:
            # vLLM's stream leaves unset details out; completions carry cached_tokens only.
            cached = last["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert last["usage"]["prompt_tokens_details"] == {
                "cached_tokens": cached, "created_cache_tokens": 0,
            }  # fmt: skip
            assert cached == last["usage"]["prompt_tokens"] - 1 - (
                (last["usage"]["prompt_tokens"] - 1) % BS
            )
            assert set(comp_last["usage"]["prompt_tokens_details"]) == {"cached_tokens"}


def test_p_and_d_report_what_they_loaded_and_found_locally(
    pair: tuple[EngineSim, EngineSim, bool],
) -> None:
    p, d, cache = pair
    p_out, d_out, dp, dd = turn(p, d, "t1", HISTORY, P_LEG)
    prompt = p_out["usage"]["prompt_tokens"]
    # Turn 1: nothing anywhere yet; P computes all, D loads all but the last token from P.
    assert report(p_out["kv_transfer_params"])[:4] == (prompt, 0, 0, 0)
    assert p_out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert p_out["kv_transfer_params"]["remote_prefill_cached_tokens"] == 0
    check_sources(dp, prompt, 0, 0)
    assert report(d_out["kv_transfer_params"]) == (
        prompt, 0, prompt - 1, len(p_out["kv_transfer_params"]["remote_block_ids"][0]), {},
    )  # fmt: skip
    check_sources(dd, prompt, 0, prompt - 1)
    # vLLM's D reports P's cached tokens (passed in P's params) as its own usage.
    assert d_out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # Turn 2 (affinity: the same P again, D's hold offered). P's local hit needs its cache.
    reply = d_out["choices"][0]["message"]["content"]
    messages = [*HISTORY, {"role": "assistant", "content": reply},
                {"role": "user", "content": "And when is it refused?"}]  # fmt: skip
    hold = {**d_out["kv_transfer_params"], **P_LEG}
    p_out, d_out, dp, dd = turn(p, d, "t2", messages, hold)
    prompt, local, loaded, offered, refused = report(p_out["kv_transfer_params"])
    assert prompt == p_out["usage"]["prompt_tokens"] and offered == len(hold["remote_block_ids"][0])
    assert (local > 0) == cache and loaded > 0
    check_sources(dp, prompt, local, loaded)
    assert p_out["usage"]["prompt_tokens_details"]["cached_tokens"] == local + loaded
    assert p_out["kv_transfer_params"]["remote_prefill_cached_tokens"] == local + loaded
    # Every offered block was loaded, or is accounted for (local ones included).
    assert sum(refused.values()) == offered - -(-loaded // BS)
    assert refused.get("local", 0) == min(local // BS, offered)
    d_prompt, d_local, d_loaded, _, _ = report(d_out["kv_transfer_params"])
    assert (d_local > 0) == cache and d_local + d_loaded == d_prompt - 1
    check_sources(dd, d_prompt, d_local, d_loaded)
    assert d_out["usage"]["prompt_tokens_details"]["cached_tokens"] == local + loaded

    # Turn 3, decode-only on D (no P): D's cached prompt tokens are its own prefix cache's.
    reply = d_out["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Thanks."}]
    dd = Delta(d)
    out = chat(d, "t3", messages, max_tokens=4, kv_transfer_params={"hold_blocks": True})
    prompt, local, loaded, offered, refused = report(out["kv_transfer_params"])
    # The proxy meant D to reuse the history; without a prefix cache D recomputed all of it.
    assert (loaded, offered, refused) == (0, 0, {}) and (local > 0) == cache
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == local
    check_sources(dd, prompt, local, 0)


def test_rerendered_template_loads_nothing_and_refuses_every_block(
    pair: tuple[EngineSim, EngineSim, bool],
) -> None:
    p, d, _ = pair
    first = [{"role": "system", "content": "Turn 1. " + SYSTEM}, *HISTORY[1:]]
    _, d_out, _, _ = turn(p, d, "r1", first, P_LEG)
    reply = d_out["choices"][0]["message"]["content"]
    # The template re-renders its first line every turn: the history's tokens all shift.
    second = [
        {"role": "system", "content": "Turn 2. " + SYSTEM}, *HISTORY[1:],
        {"role": "assistant", "content": reply}, {"role": "user", "content": "More?"},
    ]  # fmt: skip
    hold = {**d_out["kv_transfer_params"], **P_LEG}
    offered_blocks = len(hold["remote_block_ids"][0])
    p_out, _, dp, _ = turn(p, d, "r2", second, hold)
    prompt, local, loaded, offered, refused = report(p_out["kv_transfer_params"])
    # Blocks were offered (a map lookup would call this a hit), yet nothing was reused.
    assert offered == offered_blocks > 0
    assert (loaded, local, refused) == (0, 0, {"hash": offered})
    assert p_out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    check_sources(dp, prompt, 0, 0)
