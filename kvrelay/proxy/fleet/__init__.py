"""The engines and how to choose one: pools with health and ejection, each engine's load, the
routing mechanics and the policies that plan each turn with them, the fleet record shared
across processes, DNS and Kubernetes discovery, the merged model list and the engines'
versions, and `Fleet`, what a worker's turns share.
"""

from kvrelay.proxy.fleet.block_index import EXPECT_S, BlockIndex
from kvrelay.proxy.fleet.cache_residence import CacheResidence
from kvrelay.proxy.fleet.discovery import (
    Discovered,
    DnsSource,
    ResolveError,
    make_resolver,
    start_discovery,
)
from kvrelay.proxy.fleet.discovery_kube import (
    KubeRoleWatch,
    KubeScope,
    ready_engines,
    start_kube_discovery,
)
from kvrelay.proxy.fleet.engine_load import (
    STALE_INTERVALS,
    LoadPoller,
    fresh_load,
    load_from_metrics,
)
from kvrelay.proxy.fleet.engine_names import engine_name, name_key, use_name_key
from kvrelay.proxy.fleet.fleet_sync import (
    FleetSync,
    LocalFleetSync,
    RedisFleetSync,
    open_fleet_sync,
)
from kvrelay.proxy.fleet.held_reads import HeldReads
from kvrelay.proxy.fleet.hold_payoff import HoldPayoff
from kvrelay.proxy.fleet.kv_events import EngineEvents, KVEventsFeed, events_endpoint
from kvrelay.proxy.fleet.load_reading import EngineLoad
from kvrelay.proxy.fleet.models import ModelCatalog
from kvrelay.proxy.fleet.pin_rests import PinRests
from kvrelay.proxy.fleet.policies import (
    POLICIES,
    Affinity,
    AlwaysP,
    Conditional,
    CountCheck,
    Plan,
    Route,
    TokenCounter,
    TurnPolicy,
    policy_named,
)
from kvrelay.proxy.fleet.pools import (
    Backend,
    Busy,
    HealthChecker,
    Pool,
    engines_to_try,
    probe_health,
)
from kvrelay.proxy.fleet.prefix_index import PrefixIndex, PromptPrefixes
from kvrelay.proxy.fleet.prefix_wait import Lead, PrefixesInFlight
from kvrelay.proxy.fleet.reuse_standing import ReuseStanding
from kvrelay.proxy.fleet.routing import (
    PIN_WAIT_SHARE,
    PULL_COST,
    PrefillPick,
    PrefixSource,
    Router,
    uncached_tokens,
)
from kvrelay.proxy.fleet.shared import Fleet
from kvrelay.proxy.fleet.versions import EngineVersions

__all__ = [
    "EXPECT_S",
    "PIN_WAIT_SHARE",
    "POLICIES",
    "PULL_COST",
    "STALE_INTERVALS",
    "Affinity",
    "AlwaysP",
    "Backend",
    "BlockIndex",
    "Busy",
    "CacheResidence",
    "Conditional",
    "CountCheck",
    "Discovered",
    "DnsSource",
    "EngineEvents",
    "EngineLoad",
    "EngineVersions",
    "Fleet",
    "FleetSync",
    "HealthChecker",
    "HeldReads",
    "HoldPayoff",
    "KVEventsFeed",
    "KubeRoleWatch",
    "KubeScope",
    "Lead",
    "LoadPoller",
    "LocalFleetSync",
    "ModelCatalog",
    "PinRests",
    "Plan",
    "Pool",
    "PrefillPick",
    "PrefixIndex",
    "PrefixSource",
    "PrefixesInFlight",
    "PromptPrefixes",
    "RedisFleetSync",
    "ResolveError",
    "ReuseStanding",
    "Route",
    "Router",
    "TokenCounter",
    "TurnPolicy",
    "engine_name",
    "engines_to_try",
    "events_endpoint",
    "fresh_load",
    "load_from_metrics",
    "make_resolver",
    "name_key",
    "open_fleet_sync",
    "policy_named",
    "probe_health",
    "ready_engines",
    "start_discovery",
    "start_kube_discovery",
    "uncached_tokens",
    "use_name_key",
]
