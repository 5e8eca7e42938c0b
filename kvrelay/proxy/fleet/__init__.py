"""The engines and how to choose one: pools with health and ejection, each engine's load, the
routing mechanics and the policies that plan each turn with them, the fleet record shared
across processes, DNS and Kubernetes discovery, the merged model list and the engines'
versions, and `Fleet`, what a worker's turns share.
"""

from kvrelay.proxy.fleet.block_index import BlockIndex
from kvrelay.proxy.fleet.discovery import start_discovery
from kvrelay.proxy.fleet.discovery_kube import start_kube_discovery
from kvrelay.proxy.fleet.engine_load import LoadPoller
from kvrelay.proxy.fleet.engine_names import name_key, use_name_key
from kvrelay.proxy.fleet.fleet_sync import FleetSync, open_fleet_sync
from kvrelay.proxy.fleet.kv_events import KVEventsFeed, events_endpoint
from kvrelay.proxy.fleet.models import ModelCatalog
from kvrelay.proxy.fleet.policies import (
    POLICIES,
    Affinity,
    AlwaysP,
    Conditional,
    CountCheck,
    Plan,
    Route,
    TurnPolicy,
)
from kvrelay.proxy.fleet.pools import (
    Backend,
    Busy,
    HealthChecker,
    Pool,
    engines_to_try,
    probe_health,
)
from kvrelay.proxy.fleet.prefix_index import PromptPrefixes
from kvrelay.proxy.fleet.prefix_wait import Lead
from kvrelay.proxy.fleet.routing import PrefillPick, PrefixSource, Router
from kvrelay.proxy.fleet.shared import Fleet
from kvrelay.proxy.fleet.versions import EngineVersions

__all__ = [
    "POLICIES",
    "Affinity",
    "AlwaysP",
    "Backend",
    "BlockIndex",
    "Busy",
    "Conditional",
    "CountCheck",
    "EngineVersions",
    "Fleet",
    "FleetSync",
    "HealthChecker",
    "KVEventsFeed",
    "Lead",
    "LoadPoller",
    "ModelCatalog",
    "Plan",
    "Pool",
    "PrefillPick",
    "PrefixSource",
    "PromptPrefixes",
    "Route",
    "Router",
    "TurnPolicy",
    "engines_to_try",
    "events_endpoint",
    "name_key",
    "open_fleet_sync",
    "probe_health",
    "start_discovery",
    "start_kube_discovery",
    "use_name_key",
]
