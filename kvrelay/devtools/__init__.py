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

This face names what starts a dev fleet (the demo, the tests' fixtures and the benchmarks start
theirs through it); the other modules are imported by name.
"""

from kvrelay.devtools.engines import (
    CONNECTOR_SECRET,
    DEV_ENGINE_ARGS,
    EngineFactory,
    EngineSim,
    dev_env,
)
from kvrelay.devtools.env import fleet_env
from kvrelay.devtools.fleet import DevFleet
from kvrelay.devtools.process import ServerProcess, free_port, http_ready, pinned, wait_until
from kvrelay.devtools.proxy_server import (
    DEV_PROXY_SETTINGS,
    EngineAddress,
    ProxiedPair,
    ProxyFactory,
    ProxyServer,
)
from kvrelay.devtools.redis import RedisServer, redis_server

__all__ = [
    "CONNECTOR_SECRET",
    "DEV_ENGINE_ARGS",
    "DEV_PROXY_SETTINGS",
    "DevFleet",
    "EngineAddress",
    "EngineFactory",
    "EngineSim",
    "ProxiedPair",
    "ProxyFactory",
    "ProxyServer",
    "RedisServer",
    "ServerProcess",
    "dev_env",
    "fleet_env",
    "free_port",
    "http_ready",
    "pinned",
    "redis_server",
    "wait_until",
]
