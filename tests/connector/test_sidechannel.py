"""Side channel and lease table against a real in-process aiohttp server (no NIXL needed)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
import pytest

from kvrelay.connector.auth import destination, sign_headers
from kvrelay.connector.holds import HoldEntry, HoldTable
from kvrelay.connector.metadata import RequestView
from kvrelay.connector.protocol import PATH_CLAIM, PATH_RELEASE
from kvrelay.connector.scheduler import ConnectorScheduler
from kvrelay.connector.sidechannel_client import (
    AsyncSideChannelClient,
    SideChannelClient,
    SideChannelError,
)
from kvrelay.connector.stats import Counters
from kvrelay.devtools import nixl_peer
from tests.connector.sidechannel_helpers import drain, hold_params, raw_request, signed
from tests.harness import wait_until

MakeScheduler = Callable[..., ConnectorScheduler]


@pytest.fixture
def client() -> SideChannelClient:
    return SideChannelClient(nixl_peer.SECRET.encode(), timeout_s=5)


def test_release_frees_once_and_counts(make_scheduler: MakeScheduler, client) -> None:  # type: ignore[no-untyped-def]
    sched = make_scheduler()
    params = hold_params(sched, "r1")
    assert params["remote_num_tokens"] == 10 and params["remote_block_ids"] == [[100, 101, 102]]
    assert len(params["remote_block_hashes"]) == 2
    assert client.release("127.0.0.1", sched.side_channel_port, "r1", params["release_token"])
    assert drain(sched) == {"r1"}
    assert (
        client.release("127.0.0.1", sched.side_channel_port, "r1", params["release_token"]) is False
    )
    stats = sched.stats()
    assert stats["held"] == 0 and stats["freed_by_release"] == 1


def test_unauthenticated_and_wrong_token_refused(make_scheduler: MakeScheduler, client) -> None:  # type: ignore[no-untyped-def]
    sched = make_scheduler()
    params = hold_params(sched, "r1")
    url = f"http://127.0.0.1:{sched.side_channel_port}{PATH_RELEASE}"
    body = json.dumps({"request_id": "r1", "release_token": params["release_token"]}).encode()
    missing = httpx.post(url, content=body)
    wrong = httpx.post(
        url,
        content=body,
        headers=sign_headers(
            b"not-the-secret",
            "POST",
            PATH_RELEASE,
            body,
            dest=destination("127.0.0.1", sched.side_channel_port),
        ),
    )
    assert missing.status_code == wrong.status_code == 401
    assert "error" in missing.json()
    with pytest.raises(SideChannelError) as err:
        client.release("127.0.0.1", sched.side_channel_port, "r1", "wrong-token")
    assert err.value.status == 403
    assert drain(sched) == set() and sched.stats()["held"] == 1  # nothing acted on
    stats = sched.stats()
    assert stats["auth_rejected"] == 2 and stats["auth_rejected_missing_auth"] == 1
    assert client.release("127.0.0.1", sched.side_channel_port, "r1", params["release_token"])
    assert drain(sched) == {"r1"} and sched.stats()["held"] == 0


def test_bounded_and_malformed_bodies(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler()
    url = f"http://127.0.0.1:{sched.side_channel_port}{PATH_CLAIM}"
    big = b"{" + b" " * (70 * 1024) + b"}"
    assert (
        httpx.post(
            url, content=big, headers=signed(sched.side_channel_port, "POST", PATH_CLAIM, big)
        ).status_code
        == 413
    )
    for body in (
        b"not json",
        b'{"request_id": "x"}',
        b'{"request_id": "x", "reader_engine_id": "y", "z": 1}',
    ):
        resp = httpx.post(
            url, content=body, headers=signed(sched.side_channel_port, "POST", PATH_CLAIM, body)
        )
        assert resp.status_code == 400, body
    stats = sched.stats()
    assert stats["rejected_too_large"] == 1 and stats["rejected_malformed"] == 3


def test_claim_after_expiry_is_gone(make_scheduler: MakeScheduler, client) -> None:  # type: ignore[no-untyped-def]
    sched = make_scheduler(lease_seconds=0.2)
    params = hold_params(sched, "r1")
    deadline = time.monotonic() + 0.2
    wait_until(lambda: time.monotonic() > deadline, 5, what="lease to pass")
    claim = client.claim("127.0.0.1", sched.side_channel_port, "r1", "reader", "q1")
    assert claim.status == "gone"
    assert drain(sched) == {"r1"}
    assert sched.stats()["freed_by_expiry"] == 1 and sched.stats()["held"] == 0
    assert not client.release("127.0.0.1", sched.side_channel_port, "r1", params["release_token"])


def test_lease_reaper_frees_every_expired_entry_at_once(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(lease_seconds=0.3)
    for i in range(4):
        hold_params(sched, f"r{i}")

    def all_freed() -> bool:
        drain(sched)
        return sched.stats()["held"] == 0

    wait_until(all_freed, 10, what="every hold to expire")
    assert sched.stats()["freed_by_expiry"] == 4


def test_reaper_is_not_a_queue_head_scan() -> None:
    table = HoldTable(Counters(), claim_timeout_s=30)
    t = time.monotonic()
    # Insertion order deliberately differs from expiry order; one long lease sits in front.
    table.add(HoldEntry("long", None, [[1]], 4, t + 1000, "a"))
    for i, exp in enumerate([t + 3, t + 1, t + 2]):
        table.add(HoldEntry(f"e{i}", None, [[10 + i]], 4, exp, "a"))
    table.add(HoldEntry("pinned", None, [[20]], 4, t + 1, "a"))
    assert table.claim("pinned", ("reader", "q1"), now=t)[1] is not None
    assert sorted(table.reap(now=t + 10)) == ["e0", "e1", "e2"]
    # The claim pin ends; then the pinned entry expires too.
    assert table.reap(now=t + 40) == ["pinned"]


def test_claim_pins_until_the_claimer_gives_up(make_scheduler: MakeScheduler, client) -> None:  # type: ignore[no-untyped-def]
    sched = make_scheduler()
    params = hold_params(sched, "r1")
    port = sched.side_channel_port
    held = client.claim("127.0.0.1", port, "r1", "reader-a", "q1")
    assert held.status == "held" and held.block_ids == [[100, 101, 102]] and held.num_tokens == 10
    # A release by someone else (the proxy) cannot free blocks a claimed read may be copying.
    assert client.release("127.0.0.1", port, "r1", params["release_token"])
    assert drain(sched) == set()
    assert client.claim("127.0.0.1", port, "r1", "reader-b", "q2").status == "gone"
    # The claimer itself giving up ends the pin: freed now.
    client.release(
        "127.0.0.1", port, "r1", params["release_token"],
        reader_engine_id="reader-a", reader_request_id="q1",
    )  # fmt: skip
    assert drain(sched) == {"r1"} and sched.stats()["held"] == 0


def test_reclaim_frees_oldest_unclaimed_holds(make_scheduler: MakeScheduler, client) -> None:  # type: ignore[no-untyped-def]
    sched = make_scheduler()
    for i in range(3):
        hold_params(sched, f"r{i}", n_tokens=8, next_turn=True)  # 2 blocks each
    assert client.claim("127.0.0.1", sched.side_channel_port, "r0", "reader", "q").status == "held"
    assert sched.reclaim_holds(3) == 4  # r0 is claimed: r1 and r2 go
    assert drain(sched) == {"r1", "r2"}
    assert sched.stats()["freed_by_reclaim"] == 2
    assert sched.release_hold("r0")  # claimed: freed when the claim's pin ends
    assert drain(sched) == set()
    assert sched.holds.reap(now=time.monotonic() + 60) == ["r0"]
    assert drain(sched) == {"r0"} and sched.stats()["held"] == 0


def test_reclaim_leaves_a_transfer_in_progress_until_its_reader_is_late(
    make_scheduler: MakeScheduler,
) -> None:
    # P's hold for this turn's D is not cache: freeing it makes D recompute the whole prompt.
    # Under block pressure the next-turn holds go first; a transfer hold only once its reader
    # has not claimed it within the claim timeout.
    sched = make_scheduler(claim_timeout_s=30.0)
    hold_params(sched, "pull", n_tokens=8)  # a P -> D hold of this turn
    hold_params(sched, "cache", n_tokens=8, next_turn=True)
    now = time.monotonic()
    assert sched.holds.reclaim(10, now=now) == 2
    assert drain(sched) == {"cache"}
    assert sched.holds.reclaim(10, now=now + 1) == 0  # young: its D is on its way
    assert sched.holds.is_held("pull")
    assert sched.holds.reclaim(10, now=now + 31) == 2  # late: the engine needs the blocks
    assert drain(sched) == {"pull"}


async def test_finished_params_by_client_request_id(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler()
    params = hold_params(sched, "r1", client="client/req 1")
    aclient = AsyncSideChannelClient(nixl_peer.SECRET.encode())
    try:
        got = await aclient.finished("127.0.0.1", sched.side_channel_port, "client/req 1")
        assert got == params
        assert await aclient.finished("127.0.0.1", sched.side_channel_port, "nope") is None
        # Handshake before any worker registered: a clear refusal, not a crash.
        with pytest.raises(SideChannelError) as err:
            await aclient.handshake("127.0.0.1", sched.side_channel_port)
        assert err.value.status == 503
        assert await aclient.release(
            "127.0.0.1", sched.side_channel_port, "r1", params["release_token"]
        )
    finally:
        await aclient.close()
    assert drain(sched) == {"r1"}


def test_requests_that_did_not_ask_hold_nothing(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler()
    view = RequestView("d1", "c", [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6], {"do_remote_prefill": True})
    assert sched.request_finished(view, [[1, 2]]) == (False, None)
    view = RequestView("d2", "c", [1, 2, 3], [1, 2, 3, 4], None)
    assert sched.request_finished(view, [[1]]) == (False, None)
    view = RequestView("d3", "c", [1, 2, 3], [1, 2, 3, 4], {"remote_block_ids": "bad"})
    assert sched.request_finished(view, [[1]]) == (False, None)
    assert sched.stats()["held"] == 0


def test_body_split_over_tcp_segments_is_read_whole(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler()
    hold_params(sched, "r1")
    body = json.dumps({"request_id": "r1", "reader_engine_id": "rd", "reader_request_id": "q"})
    raw = body.encode() + b" " * 3000  # trailing JSON whitespace: still a valid claim
    headers = signed(sched.side_channel_port, "POST", PATH_CLAIM, raw)
    head = (
        f"POST {PATH_CLAIM} HTTP/1.1\r\nHost: 127.0.0.1:{sched.side_channel_port}\r\n"
        f"Content-Length: {len(raw)}\r\nConnection: close\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        + "\r\n"
    ).encode()
    answer = raw_request(sched.side_channel_port, head, [raw[:1000], raw[1000:2000], raw[2000:]])
    assert answer.split(b"\r\n", 1)[0] == b"HTTP/1.1 200 OK", answer[:300]
    assert b'"held"' in answer
    assert sched.stats().get("auth_rejected", 0) == 0


def test_a_claimed_hold_cannot_be_claimed_by_another_reader_request(
    make_scheduler: MakeScheduler, client: SideChannelClient
) -> None:
    sched = make_scheduler()
    params = hold_params(sched, "r1")
    port = sched.side_channel_port
    first = client.claim("127.0.0.1", port, "r1", "reader-a", "req-1")
    assert first.status == "held"
    # The same reader request asking again (a retried call, another TP rank) is the same claim.
    assert client.claim("127.0.0.1", port, "r1", "reader-a", "req-1").status == "held"
    # Anyone else is refused: another engine, or another request of the same engine.
    assert client.claim("127.0.0.1", port, "r1", "reader-b", "req-1").status == "claimed"
    assert client.claim("127.0.0.1", port, "r1", "reader-a", "req-2").status == "claimed"
    assert sched.stats()["claims_refused"] == 2
    # Another reader request giving up cannot end the first one's pin.
    token = params["release_token"]
    client.release(
        "127.0.0.1", port, "r1", token, reader_engine_id="reader-a", reader_request_id="req-2"
    )
    assert drain(sched) == set() and sched.stats()["held"] == 1
    # Only the claimer's own release ends it, at once.
    client.release(
        "127.0.0.1", port, "r1", token, reader_engine_id="reader-a", reader_request_id="req-1"
    )
    assert drain(sched) == {"r1"} and sched.stats()["held"] == 0
