"""Whom a reader trusts: only allowed holders, only answers the holder signed, and releases to
a dead holder never hold up releases to the others (real servers on loopback)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from kvrelay.connector.allowlist import HolderAllowlist
from kvrelay.connector.metadata import RequestView
from kvrelay.connector.scheduler import ConnectorScheduler
from kvrelay.connector.sidechannel_client import SideChannelClient, SideChannelError
from kvrelay.devtools import nixl_peer
from tests.connector.sidechannel_helpers import FakeHolder, drain, hold_params
from tests.harness import wait_until

MakeScheduler = Callable[..., ConnectorScheduler]


class _Blackhole:
    """Accepts TCP connections and never answers; counts them."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def blackhole() -> Iterator[_Blackhole]:
    hole = _Blackhole()
    try:
        yield hole
    finally:
        hole.close()


@pytest.mark.parametrize("forgery", ["unsigned", "other-key", "other-request"])
def test_answers_not_signed_by_the_holder_for_this_request_are_refused(forgery: str) -> None:
    key = {"unsigned": None, "other-key": b"attacker", "other-request": nixl_peer.SECRET.encode()}[
        forgery
    ]
    fake = FakeHolder(key, nonce="an-older-request" if forgery == "other-request" else None)
    client = SideChannelClient(nixl_peer.SECRET.encode(), timeout_s=5)
    try:
        with pytest.raises(SideChannelError, match="unauthenticated"):
            client.claim("127.0.0.1", fake.port, "h1", "reader", "r1")
    finally:
        client.close()
        fake.close()
    # The same fake holder with the right signature is believed (the check is not blanket).
    genuine = FakeHolder(nixl_peer.SECRET.encode())
    client = SideChannelClient(nixl_peer.SECRET.encode(), timeout_s=5)
    try:
        assert client.claim("127.0.0.1", genuine.port, "h1", "reader", "r1").status == "held"
    finally:
        client.close()
        genuine.close()


def test_holders_outside_the_allowlist_are_never_contacted(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler()
    params = hold_params(sched, "r1")
    port = sched.side_channel_port
    client = SideChannelClient(
        nixl_peer.SECRET.encode(), timeout_s=5, allowlist=HolderAllowlist(["10.0.0.0/8"])
    )
    try:
        with pytest.raises(SideChannelError, match="allowed_holders"):
            client.claim("127.0.0.1", port, "r1", "reader", "q1")
        with pytest.raises(SideChannelError, match="allowed_holders"):
            client.release("127.0.0.1", port, "r1", params["release_token"])
    finally:
        client.close()
    stats = sched.stats()
    assert stats.get("claims_held", 0) == 0 and stats.get("auth_rejected", 0) == 0
    assert stats["held"] == 1


def test_a_blackholed_holder_delays_no_other_holders_releases(
    make_scheduler: MakeScheduler, blackhole: _Blackhole
) -> None:
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader", release_timeout_s=1.0, release_attempts=3)
    dead = {**hold_params(holder, "unused"), "remote_port": blackhole.port}
    holder.release_hold("unused")
    drain(holder)
    for i in range(4):
        reader.request_rejected(RequestView(f"d{i}", None, [1], [1], dead))
    live = hold_params(holder, "h1")
    reader.request_rejected(RequestView("live", None, [1], [1], live))
    # Freed while every release to the dead holder is still waiting on it.
    wait_until(lambda: drain(holder) == {"h1"}, 3, what="release to the live holder")
    assert reader.stats().get("releases_failed", 0) == 0
    # Each release to the dead holder was tried a bounded number of times, then given up.
    wait_until(
        lambda: reader.stats().get("releases_failed", 0) == 4, 30, what="dead releases given up"
    )
    assert len(blackhole.accepted) == 4 * 3


def test_side_channel_client_is_created_once_under_concurrent_first_use() -> None:
    from kvrelay.connector.config import ConnectorConfig
    from kvrelay.connector.worker import ConnectorWorker

    worker = ConnectorWorker(ConnectorConfig(engine_id="w", secret=nixl_peer.SECRET), 0, 1)
    barrier = threading.Barrier(8)
    seen: list[int] = []

    def first_use() -> None:
        barrier.wait(5)
        seen.append(id(worker._side_channel()))

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    try:
        assert len(seen) == 8 and len(set(seen)) == 1
    finally:
        worker.shutdown()
