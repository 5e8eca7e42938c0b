"""`GET /version`: the proxy's version and the versions its engines report.

Clients of vLLM ask `/version` before they start (vLLM's multi-turn benchmark among them), so
the proxy answers it as vLLM does (`{"version": ...}`, the proxy's own), to anyone, as vLLM
does. A caller with an API key (any caller when no keys are configured) also gets, per usable
engine, what that engine's `/version` said (None when it did not answer): the fleet is the
operator's business, not the open internet's. Engines are named as on `/metrics` (role and a
keyed hash, `engine_names`), never by address. The engines' answers are cached for
`models_refresh_s` and fetched once for all callers, so the route cannot make the proxy query
the fleet on every request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvrelay import __version__
from kvrelay.proxy.fleet.pools import Backend
from kvrelay.proxy.fleet.refreshed import Refreshed
from kvrelay.proxy.fleet.shared import Fleet

log = logging.getLogger(__name__)


class EngineVersions(Refreshed):
    """The engines' `/version` answers, cached."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(fleet, fleet.settings.probe_timeout_s)
        self._engines: list[dict[str, Any]] = []

    def own(self) -> dict[str, Any]:
        """The proxy's own version, as vLLM answers `/version`."""
        return {"version": __version__}

    async def document(self) -> dict[str, Any]:
        if not self._fresh:
            await self.refresh()
        return {"version": __version__, "engines": list(self._engines)}

    async def _refresh(self) -> None:
        fleet = self._fleet
        engines = fleet.prefill.usable() + fleet.decode.usable()
        answers = await asyncio.gather(*(self._fetch(b) for b in engines))
        self._engines = [
            {"engine": b.name, "role": b.role, "version": v}
            for b, v in zip(engines, answers, strict=True)
        ]
        self._fetched()

    async def _fetch(self, backend: Backend) -> str | None:
        body = await self._fleet.engine_json(backend, "/version", self._timeout)
        version = body.get("version") if isinstance(body, dict) else None
        return version[:100] if isinstance(version, str) else None
