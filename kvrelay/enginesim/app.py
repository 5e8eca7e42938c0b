"""Wiring: config → block pool → connector host → engine core → runner → HTTP server."""

from __future__ import annotations

from kvrelay.enginesim.config import EngineConfig
from kvrelay.enginesim.engine import EngineCore
from kvrelay.enginesim.kv_events import KVEventPublisher, parse_events_config
from kvrelay.enginesim.kvhost import KVHost
from kvrelay.enginesim.runner import EngineRunner
from kvrelay.enginesim.server import EngineServer


def build_server(config: EngineConfig) -> EngineServer:
    """A started engine (thread running, connector side channel up) behind its HTTP app."""
    config.validate()
    pool = config.new_pool()
    kv_host: KVHost | None = None
    if config.connector is not None:
        from kvrelay.enginesim.nixl_host import NixlHost

        kv_host = NixlHost(config, pool)
    core = EngineCore(config, kv_host, pool)
    publisher = None
    events = parse_events_config(config.kv_events_config) if config.kv_events_config else None
    if events is not None:
        core.follow_cache()
        publisher = KVEventPublisher(
            events.endpoint,
            events.topic,
            config.block_size,
            events.replay_endpoint,
            events.buffer_steps,
        )
    runner = EngineRunner(core, publisher)
    runner.start()
    return EngineServer(runner)
