"""Application keys under which the shared state lives on the aiohttp app."""

from __future__ import annotations

from aiohttp import web

from kvrelay.proxy.config import Settings
from kvrelay.proxy.fleet import (
    EngineVersions,
    Fleet,
    FleetSync,
    HealthChecker,
    KVEventsFeed,
    ModelCatalog,
)
from kvrelay.proxy.http.body import BodyBudget
from kvrelay.proxy.tenants import CacheScopes, Limiter, TenantBreaker
from kvrelay.proxy.turn import TurnCrew

CACHE_SCOPES: web.AppKey[CacheScopes] = web.AppKey("cache_scopes", CacheScopes)
BODY_BUDGET: web.AppKey[BodyBudget] = web.AppKey("body_budget", BodyBudget)
FLEET: web.AppKey[Fleet] = web.AppKey("fleet", Fleet)
HEALTH: web.AppKey[HealthChecker] = web.AppKey("health", HealthChecker)
SETTINGS: web.AppKey[Settings] = web.AppKey("settings", Settings)
TENANTS: web.AppKey[TenantBreaker] = web.AppKey("tenants", TenantBreaker)
TURN_CREW: web.AppKey[TurnCrew] = web.AppKey("turn_crew", TurnCrew)
FLEET_SYNC: web.AppKey[FleetSync] = web.AppKey("fleet_sync", FleetSync)
LIMITS: web.AppKey[Limiter] = web.AppKey("limits", Limiter)
MODELS: web.AppKey[ModelCatalog] = web.AppKey("models", ModelCatalog)
VERSIONS: web.AppKey[EngineVersions] = web.AppKey("versions", EngineVersions)
# Set only when the proxy follows the engines' KV events.
KV_EVENTS_FEED: web.AppKey[KVEventsFeed] = web.AppKey("kv_events_feed", KVEventsFeed)
