"""Application keys under which the shared state lives on the aiohttp app."""

from __future__ import annotations

from aiohttp import web

from kvrelay.proxy.fleet_sync import FleetSync
from kvrelay.proxy.pools import HealthChecker
from kvrelay.proxy.relay import Fleet
from kvrelay.proxy.settings import Settings

FLEET: web.AppKey[Fleet] = web.AppKey("fleet", Fleet)
HEALTH: web.AppKey[HealthChecker] = web.AppKey("health", HealthChecker)
SETTINGS: web.AppKey[Settings] = web.AppKey("settings", Settings)
FLEET_SYNC: web.AppKey[FleetSync] = web.AppKey("fleet_sync", FleetSync)
