"""Tools for running a kvrelay fleet on one machine: the demo, the tests and the benchmarks.

Reading order: `process` (free ports, bounded waits, server subprocesses that are always stopped
with their children), `redis` (a throw-away `redis-server`), `prometheus` (reading a `/metrics`
page), `sse` (reading an OpenAI-style event stream as a client does), `ucx` (UCX's loopback
settings, the one copy), `env` (the one environment of every fleet process); then the fleets
built on them: `engines` (enginesim processes), `proxy_server` (the proxy in front of them),
`fleet` (`DevFleet`: engines, Redis and a proxy from one description, stopped as one),
`faultproxy` (a loopback TCP relay that injects network faults), `chaos_load` (the chaos fleet,
its seeded multi-turn load and fault injector, shared by the chaos suite and `bench.soak`); and
the heavier ones: `nixl_peer` (a connector-driving engine in its own process, needs the
connector extra), `tiny_model` and `vllm_servers` (real vLLM servers on a generated tiny model,
need the vllm extra); `threaded_app` serves an aiohttp app from a background thread for the
fakes tests start.

The proxy's serving path never imports this package (only `kvrelay demo` does). Importing any
module here loads no torch, nixl or vLLM: those are imported inside the functions that need
them. `README.md` beside this file lists the modules.

Code outside this package imports it through this face only. It names the general tools (what
starts a dev fleet, bounded waits, the fault relay, the threaded app, UCX's loopback settings)
and, as namespaces, the modules whose names only make sense qualified: `prometheus`, `sse`,
`chaos_load`, `nixl_peer`, `tiny_model`, `vllm_servers`, `image_lock` (e.g.
`vllm_servers.CONNECTOR_SECRET`, not the enginesim fleet's `CONNECTOR_SECRET`).
"""

from kvrelay.devtools import (
    chaos_load,
    image_lock,
    nixl_peer,
    prometheus,
    sse,
    tiny_model,
    vllm_servers,
)
from kvrelay.devtools.engines import (
    CONNECTOR_SECRET,
    DEV_ENGINE_ARGS,
    EngineFactory,
    EngineSim,
    dev_env,
    kv_events_args,
)
from kvrelay.devtools.env import fleet_env
from kvrelay.devtools.faultproxy import FaultCounters, FaultProxy
from kvrelay.devtools.fleet import DevFleet
from kvrelay.devtools.process import (
    ManagedServer,
    ServerProcess,
    free_port,
    http_ready,
    live_children,
    pinned,
    tcp_ready,
    wait_until,
)
from kvrelay.devtools.proxy_server import (
    DEV_PROXY_SETTINGS,
    EngineAddress,
    ProxiedPair,
    ProxyFactory,
    ProxyServer,
)
from kvrelay.devtools.redis import RedisServer, redis_server
from kvrelay.devtools.threaded_app import ThreadedApp
from kvrelay.devtools.ucx import LOOPBACK_UCX, with_loopback_ucx

__all__ = [
    "CONNECTOR_SECRET",
    "DEV_ENGINE_ARGS",
    "DEV_PROXY_SETTINGS",
    "LOOPBACK_UCX",
    "DevFleet",
    "EngineAddress",
    "EngineFactory",
    "EngineSim",
    "FaultCounters",
    "FaultProxy",
    "ManagedServer",
    "ProxiedPair",
    "ProxyFactory",
    "ProxyServer",
    "RedisServer",
    "ServerProcess",
    "ThreadedApp",
    "chaos_load",
    "dev_env",
    "fleet_env",
    "free_port",
    "http_ready",
    "image_lock",
    "kv_events_args",
    "live_children",
    "nixl_peer",
    "pinned",
    "prometheus",
    "redis_server",
    "sse",
    "tcp_ready",
    "tiny_model",
    "vllm_servers",
    "wait_until",
    "with_loopback_ucx",
]
