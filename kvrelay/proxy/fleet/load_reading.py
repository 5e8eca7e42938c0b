"""`EngineLoad`: one reading of an engine's load, kept on its `Backend` (`pools.py`) and taken
by the poller (`engine_load.py`); here, below both, so neither imports the other to name it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLoad:
    """One scrape of one engine: its queue and KV usage (0..1), and when it was read."""

    running: float
    waiting: float
    kv_usage: float
    at: float  # time.monotonic() of the scrape
