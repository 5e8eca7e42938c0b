"""One reading of keys for clients, admins and scrapers (`kvrelay.proxy.http.auth`)."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request
from pydantic import SecretStr

from kvrelay.proxy.http.auth import key_matches, presented_key


def test_key_matches_only_a_configured_key() -> None:
    keys = [SecretStr("alpha"), SecretStr("beta")]
    assert key_matches("beta", keys)
    assert not key_matches("gamma", keys)
    assert not key_matches(None, keys)
    assert not key_matches("beta", [])


@pytest.mark.parametrize(
    ("headers", "alt", "expected"),
    [
        ({"Authorization": "Bearer k1"}, None, "k1"),
        ({"Authorization": "bearer  k1 "}, None, "k1"),
        ({"Authorization": "Basic k1"}, None, None),
        ({"X-Admin-Key": "k2"}, None, None),
        ({"X-Admin-Key": "k2"}, "X-Admin-Key", "k2"),
        ({"X-Admin-Key": ""}, "X-Admin-Key", None),
        ({"Authorization": "Bearer k1", "X-Admin-Key": "k2"}, "X-Admin-Key", "k1"),
    ],
)
def test_presented_key_reads_the_bearer_token_then_the_alternative(
    headers: dict[str, str], alt: str | None, expected: str | None
) -> None:
    request = make_mocked_request("GET", "/", headers=headers)
    assert presented_key(request, "invalid_admin_key", alt) == expected
