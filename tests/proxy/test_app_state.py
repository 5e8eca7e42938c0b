"""The proxy's shared state starts and stops resource by resource (`http/app.py`): a start that
fails halfway stops what had started, and every stop runs even when one before it raises."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web

from kvrelay.proxy.config import load_settings
from kvrelay.proxy.engines import Upstream
from kvrelay.proxy.fleet import HealthChecker, LoadPoller
from kvrelay.proxy.fleet.fleet_sync import LocalFleetSync
from kvrelay.proxy.http.app import create_app
from kvrelay.proxy.tenants import Limiter

SETTINGS = {"prefill": ["http://127.0.0.1:9"], "decode": ["http://127.0.0.1:9"]}


def _record_stops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    stopped: list[str] = []
    for cls, name in ((Upstream, "close"), (Limiter, "stop"), (LocalFleetSync, "stop"),
                      (HealthChecker, "stop"), (LoadPoller, "stop")):  # fmt: skip
        real = getattr(cls, name)

        def recorded(self: object, real: object = real, label: str = cls.__name__) -> object:
            stopped.append(label)
            return real(self)  # type: ignore[operator]

        monkeypatch.setattr(cls, name, recorded)
    return stopped


def test_a_start_that_fails_halfway_stops_what_had_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stopped = _record_stops(monkeypatch)

    async def broken(self: LocalFleetSync) -> None:
        raise RuntimeError("the fleet record cannot be read")

    monkeypatch.setattr(LocalFleetSync, "start", broken)

    async def start() -> None:
        runner = web.AppRunner(create_app(load_settings(SETTINGS, env_file=None)))
        with pytest.raises(RuntimeError, match="fleet record"):
            await runner.setup()

    asyncio.run(start())
    # The limiter and the engine client had started: both stopped, the sync never started.
    assert stopped == ["Limiter", "Upstream"]


def test_every_stop_runs_when_one_raises_and_its_error_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stopped = _record_stops(monkeypatch)

    async def broken(self: HealthChecker) -> None:
        stopped.append("HealthChecker")
        raise RuntimeError("the checker would not stop")

    monkeypatch.setattr(HealthChecker, "stop", broken)

    async def cycle() -> None:
        runner = web.AppRunner(create_app(load_settings(SETTINGS, env_file=None)))
        await runner.setup()
        await runner.cleanup()

    with caplog.at_level(logging.ERROR, logger="kvrelay.proxy.http.app"):
        asyncio.run(cycle())
    # Last started, first stopped; the checker's failure stops nothing after it.
    assert stopped == ["LoadPoller", "HealthChecker", "LocalFleetSync", "Limiter", "Upstream"]
    assert "stopping the health checker failed" in caplog.text
