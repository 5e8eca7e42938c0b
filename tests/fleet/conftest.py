"""Fixtures of the fleet suite: a slow-decoding P/D pair so requests are in flight long enough
to be caught by a worker crash or a shutdown."""

from __future__ import annotations

import pytest

from kvrelay.devtools import EngineFactory, EngineSim


@pytest.fixture
def slow_pd(engine_factory: EngineFactory) -> tuple[EngineSim, EngineSim]:
    """P and D where each decode step takes 20 ms (a 16-token answer takes ~0.3 s)."""
    p, d = engine_factory.many(
        ("P", ["--role", "prefill"]),
        ("D", ["--role", "decode", "--decode-us-per-step", "20000"]),
    )
    return p, d
