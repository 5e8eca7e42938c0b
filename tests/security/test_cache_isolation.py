"""Tenants isolated in the engines' prefix caches: one tenant cannot reuse another's prompt, nor
learn from the hit counts the proxy returns (`X-Kvrelay-Local-Hit-Tokens`, `usage.kvrelay`)
whether another sent it (the proxy sets each tenant's vLLM `cache_salt`,
`kvrelay.proxy.tenants.cache_scope`).

enginesim P and D with prefix caches (real NIXL), driven by the `openai` SDK. What a turn
reused is read from P's own counters (`vllm:prompt_tokens_by_source_total`), and the account the
proxy returned must say the same. A proxy with `cache_isolation: shared` in front of the same
engines shows the hit the isolation removes, so these tests fail when it is gone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvrelay.devtools import EngineFactory, EngineSim, ProxyFactory, ProxyServer
from kvrelay.proxy.tenants import CacheScopes
from kvrelay.proxy.turn import tenant_of
from tests.harness import wait_until
from tests.proxy.accounting_turns import Asker, returned_account
from tests.proxy.client import MODEL

pytestmark = pytest.mark.nixl

KEY_A, KEY_B, KEY_C = "sk-tenant-a", "sk-tenant-b", "sk-tenant-c"
SECRET = (
    "Internal memo for the finance team, quarter four. Do not forward it outside the company. "
    "The vault code is 4817. Use it only for the vault in building seven and report problems."
)
SOURCE = f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="{MODEL}",source="%s"}}'
LOCAL = SOURCE % "local_cache_hit"
PROMPTS = f'vllm:prompt_tokens_total{{engine="0",model_name="{MODEL}"}}'


@dataclass
class Fleet:
    p: EngineSim
    d: EngineSim
    isolated: ProxyServer  # keys A, B, C; A and C share one cache group
    shared: ProxyServer  # keys A, B; cache_isolation shared


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    engines, proxies = EngineFactory(), ProxyFactory()
    try:
        cache = ("--enable-prefix-caching",)
        p, d = engines.many(
            ("CP", ["--role", "prefill", *cache]), ("CD", ["--role", "decode", *cache])
        )
        team = f"{tenant_of(KEY_A)}=team,{tenant_of(KEY_C)}=team"
        isolated = proxies([p], [d], ready_path="/ready", api_keys=f"{KEY_A},{KEY_B},{KEY_C}",
                           cache_share_groups=team)  # fmt: skip
        shared = proxies([p], [d], ready_path="/ready", api_keys=f"{KEY_A},{KEY_B}",
                         cache_isolation="shared")  # fmt: skip
        yield Fleet(p, d, isolated, shared)
    finally:
        proxies.close()
        engines.close()


def _turn(proxy: ProxyServer, key: str, p: EngineSim, question: str, *, stream: bool = False,
          **extra: Any) -> tuple[dict[str, Any], float]:  # fmt: skip
    """One single-turn chat as `key`: the account the proxy returned and the local-hit tokens P
    counted for it (P's own counter, read once P counted the prompt)."""
    before = p.metrics()
    asker = Asker(proxy, MODEL, max_tokens=4, api_key=key)
    messages = [{"role": "system", "content": SECRET}, {"role": "user", "content": question}]
    result = asker.turn(messages, f"c-{question}", stream=stream, include_usage=True, **extra)
    wait_until(lambda: p.metrics().get(PROMPTS, 0) > before.get(PROMPTS, 0), 10,
               what="P to count the turn's prompt")  # fmt: skip
    account = returned_account(result)
    assert account is not None and account["prefilled_by"] == "prefill"
    return account, p.metrics().get(LOCAL, 0) - before.get(LOCAL, 0)


def test_another_tenant_reuses_nothing_and_is_told_nothing(fleet: Fleet) -> None:
    p, proxy = fleet.p, fleet.isolated
    first, p_hit = _turn(proxy, KEY_A, p, "Summarise the memo (a1).")
    assert first["local_hit_tokens"] == p_hit == 0
    # B sends A's very prompt: P finds none of A's blocks, and the proxy says so (JSON and a
    # stream's usage extension alike), so the hit count tells B nothing about A's prompt.
    for stream in (False, True):
        account, p_hit = _turn(proxy, KEY_B, p, "Summarise the memo (a1).", stream=stream)
        assert account["local_hit_tokens"] == p_hit
        if not stream:
            assert p_hit == 0  # the stream's turn hits B's own blocks, which is B's to know
    # A salt of B's own choosing cannot reach A's cache: the proxy folds it into B's scope,
    # even when it is the very salt the proxy gives A.
    a_salt: dict[str, Any] = {}
    CacheScopes(True, {}).apply(a_salt, tenant_of(KEY_A))
    account, p_hit = _turn(proxy, KEY_B, p, "Summarise the memo (b3).", **a_salt)
    assert account["local_hit_tokens"] == p_hit == 0
    # A's cache has the system prompt all along: the same turn from A hits it.
    account_a, p_hit_a = _turn(proxy, KEY_A, p, "Summarise the memo (b3).")
    assert account_a["local_hit_tokens"] == p_hit_a > 0


def test_the_owner_and_its_cache_group_reuse_the_prompt(fleet: Fleet) -> None:
    p, proxy = fleet.p, fleet.isolated
    _turn(proxy, KEY_A, p, "Summarise the memo (g1).")
    again, p_hit = _turn(proxy, KEY_A, p, "Summarise the memo (g2).")
    assert again["local_hit_tokens"] == p_hit > 0
    team, p_hit_c = _turn(proxy, KEY_C, p, "Summarise the memo (g3).")
    assert team["local_hit_tokens"] == p_hit_c > 0


def test_without_isolation_the_other_tenants_hit_shows(fleet: Fleet) -> None:
    # What the isolation removes, on the same engines: B's hit on A's prompt.
    p, proxy = fleet.p, fleet.shared
    _turn(proxy, KEY_A, p, "Summarise the memo (s1).")
    account, p_hit = _turn(proxy, KEY_B, p, "Summarise the memo (s1).")
    assert account["local_hit_tokens"] == p_hit > 0
