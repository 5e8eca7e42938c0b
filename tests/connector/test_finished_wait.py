"""`GET /v1/finished/{id}` waits (bounded) for params published just after the question.

The proxy asks for a streamed request's params as soon as the stream's last token reached it;
the engine's scheduler may publish them a moment later. The side channel must answer with
the params then, not "unknown".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

import kvrelay.connector.scheduler
from kvrelay.connector.scheduler import ConnectorScheduler
from kvrelay.connector.sidechannel_client import SideChannelClient
from kvrelay.connector.sidechannel_server import FINISHED_WAIT_S
from kvrelay.devtools import nixl_peer
from tests.connector.sidechannel_helpers import hold_params
from tests.harness import wait_until

MakeScheduler = Callable[..., ConnectorScheduler]


def _waiting(sched: ConnectorScheduler, client_request_id: str) -> bool:
    server = sched._server
    return server is not None and client_request_id in server._finished_waiters


def test_params_published_while_the_question_waits_are_answered(
    make_scheduler: MakeScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long bound: an answer that comes back quickly came from the publication, not the bound.
    monkeypatch.setattr(kvrelay.connector.scheduler, "FINISHED_WAIT_S", 30.0)
    sched = make_scheduler()
    client = SideChannelClient(nixl_peer.SECRET.encode(), timeout_s=60)
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(client.finished, "127.0.0.1", sched.side_channel_port, "late-1")
        wait_until(lambda: _waiting(sched, "late-1"), 10, what="the question to wait")
        published = time.monotonic()
        params = hold_params(sched, "r-late", client="late-1")
        assert asked.result(timeout=10) == params
        assert time.monotonic() - published < 10
    assert not _waiting(sched, "late-1")
    client.close()


def test_unknown_ids_are_answered_after_the_bound(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler()
    client = SideChannelClient(nixl_peer.SECRET.encode(), timeout_s=10)
    start = time.monotonic()
    assert client.finished("127.0.0.1", sched.side_channel_port, "never") is None
    elapsed = time.monotonic() - start
    assert FINISHED_WAIT_S <= elapsed < FINISHED_WAIT_S + 3
    # A published one is answered at once, with no wait at all.
    params = hold_params(sched, "r-now", client="now-1")
    assert client.finished("127.0.0.1", sched.side_channel_port, "now-1") == params
    client.close()


def test_an_engine_that_never_publishes_answers_unknown_at_once(
    make_scheduler: MakeScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvrelay.connector.scheduler, "FINISHED_WAIT_S", 30.0)
    sched = make_scheduler(publish_finished_params=False)
    client = SideChannelClient(nixl_peer.SECRET.encode(), timeout_s=10)
    start = time.monotonic()
    assert client.finished("127.0.0.1", sched.side_channel_port, "never") is None
    assert time.monotonic() - start < 5
    client.close()
