"""The clients: per-tenant in-flight and per-second limits (`Limiter`, shared through Redis or
kept in process), the per-API-key breaker (`TenantBreaker`) and each tenant's prefix-cache scope
(`CacheScopes`).
"""

from kvrelay.proxy.tenants.breaker import TenantBreaker
from kvrelay.proxy.tenants.cache_scope import (
    CACHE_SALT,
    MAX_SALT_CHARS,
    SALT_PATTERN,
    CacheScopes,
    check_client_salt,
)
from kvrelay.proxy.tenants.limits import Limiter, Slot, open_limiter

__all__ = [
    "CACHE_SALT",
    "MAX_SALT_CHARS",
    "SALT_PATTERN",
    "CacheScopes",
    "Limiter",
    "Slot",
    "TenantBreaker",
    "check_client_salt",
    "open_limiter",
]
