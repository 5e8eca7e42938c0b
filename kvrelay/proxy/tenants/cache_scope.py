"""Whose KV an engine may reuse for a request: vLLM's `cache_salt`, set by the proxy per tenant.

vLLM's prefix cache (and kvrelay's connector, which seeds its block hashes the same way) only
matches blocks computed under the same `cache_salt`. Without one, every tenant's prompts share
one cache: a tenant that sends a guess of another's prompt and reads how many tokens were
cached (the `X-Kvrelay-*` headers, `usage.kvrelay`, vLLM's own `cached_tokens`, or the time to
its first token) learns whether the other sent it. So the proxy sets `cache_salt` on every
request it sends for a tenant (`cache_isolation: tenant`, the default): a digest of the tenant's
*cache group* (itself unless `cache_share_groups` puts it in a named group with others) and of
the client's own `cache_salt`, if it sent one. A client can narrow its cache further (its own
end users apart), never widen it to another group's. `cache_isolation: shared` turns this off
(one tenant, or tenants that trust each other); the client's salt then passes as it is.

The salt is derived, not random: every worker and replica gives the same tenant the same salt,
so a conversation's next turn finds its blocks on whichever proxy process serves it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

CACHE_SALT = "cache_salt"
# What vLLM 0.32 accepts as a salt (`validate_cache_salt`): the proxy refuses the rest first.
MAX_SALT_CHARS = 128
_FORBIDDEN_SALT_CHARS = frozenset("@/\\\x00")
# The same character rule as a regular expression: the `pattern` of `/openapi.json`'s schemas.
SALT_PATTERN = "^[^" + "".join(f"\\x{ord(c):02x}" for c in sorted(_FORBIDDEN_SALT_CHARS)) + "]*$"


def check_client_salt(value: object) -> str | None:
    """Why a client's `cache_salt` would be refused (None: it is absent or acceptable)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        return "`cache_salt` must be a non-empty string"
    if len(value) > MAX_SALT_CHARS or not _FORBIDDEN_SALT_CHARS.isdisjoint(value):
        return (
            f"`cache_salt` must be at most {MAX_SALT_CHARS} characters without '@', '/', "
            "'\\' or NUL"
        )
    return None


class CacheScopes:
    """The `cache_salt` each tenant's requests carry (see module docstring)."""

    def __init__(self, isolate: bool, share_groups: Mapping[str, str]) -> None:
        self._isolate = isolate
        self._groups = dict(share_groups)
        self._salts: dict[str, str] = {}  # group -> salt, for requests without their own

    def apply(self, body: dict[str, Any], tenant: str) -> None:
        """Set `body`'s `cache_salt` for `tenant` (in place), replacing the client's own with
        one derived from it and the tenant's group."""
        if not self._isolate:
            return
        group = self._groups.get(tenant, tenant)
        own = body.get(CACHE_SALT)
        if own is None:
            salt = self._salts.get(group)
            if salt is None:
                salt = self._salts[group] = _salt(group, "")
            body[CACHE_SALT] = salt
        else:  # checked by `check_client_salt` on the way in
            body[CACHE_SALT] = _salt(group, own)


def _salt(group: str, own: str) -> str:
    # A client's salt passed `check_client_salt`; surrogatepass only keeps a lone surrogate
    # (valid JSON) from failing here before the engine refuses it.
    own_bytes = own.encode("utf-8", "surrogatepass")
    data = b"kvrelay-cache-salt-v1\n" + group.encode() + b"\n" + own_bytes
    return hashlib.sha256(data).hexdigest()[:32]
