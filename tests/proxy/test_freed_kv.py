"""A D's KV usage as the proxy routes by it: its reading less what this worker's turns freed
there since (`Router.released`, `FreedTokens`), on enginesim P and D, driven by the real
`openai` SDK.

The proxy reads D's `/metrics` once (its poll interval is longer than the test), so every turn
ends after that reading. `/admin/backends` then shows D's pool as D serves it (vLLM's
`vllm:cache_config_info`, which enginesim serves alike) and the tokens freed since the reading:
the prompt tokens D reported for each turn that left no hold on D, none for a turn D holds.
"""

from __future__ import annotations

from openai import OpenAI

from kvrelay.devtools import EngineSim, ProxyFactory
from tests.harness import wait_until
from tests.proxy.client import MODEL

ADMIN_KEY = "freed-kv-admin-key"
BLOCK_SIZE = 16  # enginesim's default
HELD = "enginesim_blocks_held_for_remote"
TEXT = "The decode engine frees the blocks of a finished turn unless it holds them. " * 6


def test_turns_that_leave_no_hold_on_d_lower_its_kv_usage_until_the_next_reading(
    pd_engines: tuple[EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> None:
    p, d = pd_engines
    proxy = proxy_factory(
        [p], [d], ready_path="/ready", admin_key=ADMIN_KEY, load_poll_interval_s="600"
    )
    wait_until(lambda: proxy.engine_load() is not None, 15, what="the proxy's reading of D")
    load = proxy.engine_load()
    assert load is not None
    assert load["pool_tokens"] == d.metric("enginesim_blocks_total") * BLOCK_SIZE
    assert load["freed_tokens"] == 0
    client = OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)

    # A completion with no conversation: nothing to store, so D holds nothing and frees all.
    done = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=8)
    assert done.usage is not None and done.usage.prompt_tokens > 0
    assert d.metric(HELD) == 0
    freed = done.usage.prompt_tokens
    assert (proxy.engine_load() or {})["freed_tokens"] == freed

    # Streamed without usage: D's prompt tokens are not in the answer, so the proxy counts
    # them from the prompt's characters.
    events = list(
        client.completions.create(model=MODEL, prompt=TEXT + " Again.", max_tokens=8, stream=True)
    )
    assert events and all(e.usage is None for e in events)
    assert d.metric(HELD) == 0
    streamed = (proxy.engine_load() or {})["freed_tokens"] - freed
    assert 0 < streamed <= len(TEXT) + 7
    freed += streamed

    # A conversation's turn that D holds for the next one: its blocks stay taken.
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": TEXT}],
        max_tokens=8,
        extra_headers={"X-Conversation-Id": "freed-kv-held"},
    )
    assert chat.choices[0].message.content
    assert d.metric(HELD) > 0
    assert (proxy.engine_load() or {})["freed_tokens"] == freed
