"""Tools for running a kvrelay fleet on one machine: the demo, the tests and the benchmarks.

Reading order: `process` (free ports, bounded waits, server subprocesses that are always stopped
with their children), `redis` (a throw-away `redis-server`), `prometheus` (reading a `/metrics`
page), `sse` (reading an OpenAI-style event stream as a client does), `ucx` (UCX's loopback
settings, the one copy); then the fleets built on them: `engines` (enginesim processes),
`proxy_server` (the proxy in front of them), `faultproxy` (a loopback TCP relay that injects
network faults), `chaos_load` (the chaos fleet, its seeded multi-turn load and fault injector,
shared by the chaos suite and `bench.soak`); and the heavier ones: `nixl_peer` (a connector-
driving engine in its own process, needs the connector extra), `tiny_model` and `vllm_servers`
(real vLLM servers on a generated tiny model, need the vllm extra); `threaded_app` serves an
aiohttp app from a background thread for the fakes tests start.

The proxy's serving path never imports this package (only `kvrelay demo` does). Importing any
module here loads no torch, nixl or vLLM: those are imported inside the functions that need
them. `README.md` beside this file lists the modules.
"""
