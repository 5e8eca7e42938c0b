"""`Fleet`: what a worker's turns share (settings, engine pools, their router and routing
policy, the conversation map, the engine connections, the releaser), built once per worker
process by `kvrelay.proxy.http.app`; its turns get the parts they use through a
`kvrelay.proxy.turn.TurnCrew`."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvrelay.kvcache_map import KVMap
from kvrelay.proxy.config import Settings
from kvrelay.proxy.engines import Releaser, Upstream, UpstreamError
from kvrelay.proxy.fleet.policies import TurnPolicy, policy_named
from kvrelay.proxy.fleet.pools import Backend, Pool
from kvrelay.proxy.fleet.routing import Router
from kvrelay.proxy.telemetry import metrics

log = logging.getLogger(__name__)


@dataclass
class Fleet:
    """What every turn shares: settings, pools, the map, the engine connections, the releaser."""

    settings: Settings
    prefill: Pool
    decode: Pool
    kvmap: KVMap
    upstream: Upstream  # every engine call: P, D, side channels, probes, pass-through
    releaser: Releaser
    map_errors_logged_at: float = 0.0
    router: Router = field(init=False)
    policy: TurnPolicy = field(init=False)  # `routing_policy`, over the router

    def __post_init__(self) -> None:
        self.router = Router(self.settings, self.prefill, self.decode)
        self.policy = policy_named(self.settings.routing_policy, self.router)

    def map_unavailable(self, op: str, exc: Exception) -> None:
        metrics.MAP_ERRORS.labels(op).inc()
        now = time.monotonic()
        if now - self.map_errors_logged_at > 10.0:  # one line per 10 s, not one per request
            self.map_errors_logged_at = now
            log.warning("conversation map unavailable (%s: %s); serving without reuse", op, exc)

    async def engine_json(self, backend: Backend, path: str, timeout_s: float) -> Any:
        """The JSON document of `GET path` on the engine (`/v1/models`, `/version`); None when
        the engine does not answer 200 with JSON in time."""
        try:
            status, raw = await self.upstream.get(backend.url, path, timeout_s=timeout_s)
            return json.loads(raw) if status == 200 else None
        except (UpstreamError, TimeoutError, ValueError) as exc:
            log.debug("%s of %s failed: %s", path, backend.url, type(exc).__name__)
            return None

    def side_channel_of(self, backend: Backend) -> tuple[str, int] | None:
        configured = self.settings.side_channels.get(backend.url)
        if configured is not None:
            host, _, port = configured.rpartition(":")
            return host, int(port)
        return backend.side_channel
