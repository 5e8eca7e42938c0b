"""The models the fleet serves: `/v1/models` and the 404 for a model nobody serves.

`ModelCatalog` asks every usable engine (D and P) for its `/v1/models` at once and merges the
answers: each model id once, in the order first seen (decode engines first), base models and
LoRA adapters alike. It also remembers which engines listed each model, so that pass-through
requests go to an engine serving theirs. The merged list is cached for `models_refresh_s`. A
request naming a model outside it gets a 404 `model_not_found` without reaching an engine; the
check refreshes a stale list first (a new engine or adapter is found at once), but at most once
per `models_refresh_s` for unknown names, so made-up names cannot make the proxy query the
fleet on every request. When no engine answered, nothing is refused: the engines judge.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvrelay.proxy.base import ProxyError
from kvrelay.proxy.fleet.pools import Backend
from kvrelay.proxy.fleet.refreshed import Refreshed
from kvrelay.proxy.fleet.shared import Fleet

log = logging.getLogger(__name__)


class ModelCatalog(Refreshed):
    """The merged `/v1/models` of the fleet, cached."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(fleet, fleet.settings.first_byte_timeout)
        self._models: list[dict[str, Any]] = []
        self._ids: frozenset[str] = frozenset()
        self._servers: dict[str, frozenset[str]] = {}  # model id -> URLs of engines serving it
        self._answered = False  # whether any engine answered the last refresh

    async def listing(self) -> dict[str, Any]:
        """The merged list (an OpenAI `list` object), fetched now; 503 if no engine answered."""
        await self.refresh()
        if not self._answered:
            raise ProxyError(
                503, "no engine answered /v1/models; check /ready", code="backends_unavailable"
            )
        return {"object": "list", "data": list(self._models)}

    async def check(self, model: Any) -> None:
        """404 `model_not_found` when the fleet answered and serves no model `model`."""
        if not isinstance(model, str):
            return  # absent (the engine's default) or malformed (the engine answers 400)
        if model in self._ids:
            if not self._fresh:
                self._start_refresh()  # keep serving from the cache meanwhile
            return
        if not self._fresh:
            await self.refresh()
        if self._answered and model not in self._ids:
            raise ProxyError(
                404,
                f"the model {model!r} is not served by any engine of this fleet; "
                "GET /v1/models lists the models it serves",
                param="model",
                code="model_not_found",
            )

    def servers_of(self, model: Any) -> frozenset[str] | None:
        """URLs of the engines that listed `model` at the last refresh; None when unknown."""
        return self._servers.get(model) if isinstance(model, str) else None

    async def _refresh(self) -> None:
        fleet = self._fleet
        engines = fleet.decode.usable() + fleet.prefill.usable()
        answers = await asyncio.gather(*(self._fetch(b) for b in engines))
        merged: dict[str, dict[str, Any]] = {}
        servers: dict[str, set[str]] = {}
        answered = False
        for backend, data in zip(engines, answers, strict=True):
            if data is None:
                continue
            answered = True
            for model in data:
                merged.setdefault(model["id"], model)
                servers.setdefault(model["id"], set()).add(backend.url)
        self._answered = answered
        if answered:
            self._models = list(merged.values())
            self._ids = frozenset(merged)
            self._servers = {model: frozenset(urls) for model, urls in servers.items()}
        self._fetched()

    async def _fetch(self, backend: Backend) -> list[dict[str, Any]] | None:
        body = await self._fleet.engine_json(backend, "/v1/models", self._timeout)
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            return None
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
