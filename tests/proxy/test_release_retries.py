"""The proxy's releases: network failures are retried a bounded number of times; answers are
final (a fake holder that signs like a real one, behind a loopback fault relay)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvrelay.connector.protocol import HoldRef
from kvrelay.devtools import FaultProxy, nixl_peer
from kvrelay.proxy.engines import Releaser, Upstream
from kvrelay.proxy.engines.release import RELEASE_ATTEMPTS
from tests.connector.sidechannel_helpers import FakeHolder


@pytest.fixture
def relay() -> Iterator[tuple[FakeHolder, FaultProxy]]:
    holder = FakeHolder(nixl_peer.SECRET.encode(), answer={"released": True})
    relay = FaultProxy("127.0.0.1", holder.port).start()
    try:
        yield holder, relay
    finally:
        relay.stop()
        holder.close()


async def _release(port: int) -> bool:
    upstream = Upstream(connect_timeout=2.0)
    try:
        releaser = Releaser(nixl_peer.SECRET, upstream, timeout_s=2.0)
        return await releaser.release(
            "decode",
            HoldRef(
                remote_host="127.0.0.1",
                remote_port=port,
                remote_request_id="h1",
                release_token="token",
            ),
        )
    finally:
        upstream.close()


async def test_release_is_retried_after_reset_connections(
    relay: tuple[FakeHolder, FaultProxy],
) -> None:
    holder, proxy = relay
    proxy.refuse_next(RELEASE_ATTEMPTS - 1)
    assert await _release(proxy.listen_port)
    assert proxy.counters.refused == RELEASE_ATTEMPTS - 1 and holder.requests == 1


async def test_release_gives_up_after_bounded_attempts(
    relay: tuple[FakeHolder, FaultProxy],
) -> None:
    holder, proxy = relay
    proxy.refuse_next(100)
    assert not await _release(proxy.listen_port)
    assert proxy.counters.connections == RELEASE_ATTEMPTS and holder.requests == 0
