"""Each tenant's prefix-cache scope (`CacheScopes`): the `cache_salt` the proxy sets, and the
client salts it accepts. The engines' side of it is `tests/security/test_cache_isolation.py`."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvrelay.devtools import ProxiedPair
from kvrelay.proxy.tenants import CacheScopes, check_client_salt


def _salt(scopes: CacheScopes, tenant: str, own: str | None = None) -> Any:
    body: dict[str, Any] = {} if own is None else {"cache_salt": own}
    scopes.apply(body, tenant)
    return body.get("cache_salt")


def test_each_tenant_gets_its_own_salt_and_a_group_shares_one() -> None:
    scopes = CacheScopes(True, {"ta": "team", "tc": "team"})
    a, b, c = _salt(scopes, "ta"), _salt(scopes, "tb"), _salt(scopes, "tc")
    assert a == c != b
    assert _salt(CacheScopes(True, {}), "ta") == _salt(CacheScopes(True, {}), "ta")  # derived
    assert _salt(scopes, "ta") == a  # the same every time


def test_a_clients_salt_narrows_its_tenants_scope_and_never_reaches_anothers() -> None:
    scopes = CacheScopes(True, {})
    a = _salt(scopes, "ta")
    narrowed = _salt(scopes, "ta", "user-1")
    assert narrowed not in (a, "user-1") and narrowed != _salt(scopes, "ta", "user-2")
    # B sending A's salt, or the same salt A sends, gets a scope of B's own.
    assert _salt(scopes, "tb", a) not in (a, _salt(scopes, "ta", a))
    assert _salt(scopes, "tb", "user-1") != narrowed


def test_shared_caches_pass_the_clients_salt_as_sent() -> None:
    scopes = CacheScopes(False, {})
    assert _salt(scopes, "ta") is None
    assert _salt(scopes, "ta", "user-1") == "user-1"


@pytest.mark.parametrize(
    ("value", "ok"),
    [(None, True), ("u-1", True), ("x" * 128, True), ("", False), (7, False),
     ("x" * 129, False), ("a@b", False), ("a/b", False), ("a\\b", False), ("a\x00", False)],
)  # fmt: skip
def test_client_salts_are_checked_as_vllm_checks_them(value: object, ok: bool) -> None:
    assert (check_client_salt(value) is None) is ok


def test_a_salt_vllm_would_refuse_is_a_400_before_any_engine(pd_fleet: ProxiedPair) -> None:
    body = {"model": "kvrelay-sim", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "cache_salt": "a/b"}  # fmt: skip
    resp = httpx.post(pd_fleet.proxy.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "cache_salt"
    assert pd_fleet.prefill.metric("enginesim_requests_total") == 0
