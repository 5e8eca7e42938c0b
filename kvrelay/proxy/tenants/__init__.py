"""The clients: per-tenant in-flight and per-second limits (`Limiter`, `RedisLimiter`) and the
per-API-key breaker (`TenantBreaker`).
"""

from kvrelay.proxy.tenants.breaker import TenantBreaker
from kvrelay.proxy.tenants.limits import (
    Limiter,
    RedisLimiter,
    Slot,
    TenantLimit,
    limits_from,
    open_limiter,
)

__all__ = [
    "Limiter",
    "RedisLimiter",
    "Slot",
    "TenantBreaker",
    "TenantLimit",
    "limits_from",
    "open_limiter",
]
