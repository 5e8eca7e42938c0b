"""Connector fixtures: an in-process scheduler with its side channel, and peer engines."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvrelay.connector.config import ConnectorConfig
from kvrelay.connector.scheduler import ConnectorScheduler
from kvrelay.devtools import nixl_peer


@pytest.fixture
def make_scheduler() -> Iterator[Callable[..., ConnectorScheduler]]:
    """Start ConnectorSchedulers (side channel on a free port); all are shut down afterwards."""
    started: list[ConnectorScheduler] = []

    def make(num_blocks: int | None = None, **overrides: object) -> ConnectorScheduler:
        cfg = {"engine_id": "holder", "secret": nixl_peer.SECRET, "block_size": 4, "model": "m"}
        cfg.update(overrides)
        sched = ConnectorScheduler(ConnectorConfig(**cfg), num_blocks)  # type: ignore[arg-type]
        sched.start()
        started.append(sched)
        return sched

    try:
        yield make
    finally:
        for sched in started:
            sched.shutdown()


@pytest.fixture
def peers() -> Iterator[Callable[[nixl_peer.PeerSpec], nixl_peer.Peer]]:
    """Start peer engine processes; every one is stopped (or killed) after the test."""
    started: list[nixl_peer.Peer] = []

    def start(spec: nixl_peer.PeerSpec) -> nixl_peer.Peer:
        peer = nixl_peer.Peer.start(spec)
        started.append(peer)
        return peer

    try:
        yield start
    finally:
        for peer in started:
            peer.stop()
