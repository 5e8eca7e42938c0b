"""The hold budget: holds pin at most `hold_budget_fraction` of the engine's blocks, the least
recently used going first, through the same free path as reclaim and expiry."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from kvrelay.connector.config import ConnectorConfig
from kvrelay.connector.holds import FreeReason, HoldEntry, HoldTable
from kvrelay.connector.metadata import RequestView
from kvrelay.connector.protocol import HOLD_BLOCKS, HOLD_BRIEF, KVTransferParams
from kvrelay.connector.scheduler import ConnectorScheduler
from kvrelay.connector.sidechannel_client import SideChannelClient
from kvrelay.connector.stats import Counters
from kvrelay.devtools import nixl_peer
from tests.connector.sidechannel_helpers import drain, hold_params

MakeScheduler = Callable[..., ConnectorScheduler]


def turn(sched: ConnectorScheduler, rid: str) -> None:
    """D finishes a turn holding its 3 blocks for the conversation's next one."""
    hold_params(sched, rid, next_turn=True)


def test_oldest_holds_go_past_the_budget(make_scheduler: MakeScheduler) -> None:
    # 12 blocks, half for holds: two holds of 3 blocks fit, a third pushes the oldest out.
    sched = make_scheduler(num_blocks=12, hold_budget_fraction=0.5, hold_max_fraction=1.0)
    turn(sched, "r0")
    turn(sched, "r1")
    assert drain(sched) == set()
    turn(sched, "r2")
    assert drain(sched) == {"r0"}
    stats = sched.stats()
    assert stats["freed_by_budget"] == 1 and stats["held_blocks"] == 6
    assert not sched.holds.is_held("r0") and sched.holds.is_held("r2")


def test_one_owners_flood_frees_its_own_holds_and_not_anothers(
    make_scheduler: MakeScheduler,
) -> None:
    # 24 blocks, half for holds (4 holds of 3). Tenant A holds two conversations; tenant B
    # then finishes ten single turns. Oldest-first would free A's (they are older); fairly,
    # B pins the most and gives back its own, and A keeps its half.
    sched = make_scheduler(num_blocks=24, hold_budget_fraction=0.5, hold_max_fraction=1.0)
    for rid in ("a0", "a1"):
        hold_params(sched, rid, next_turn=True, owner="tenant-a")
    freed: set[str] = set()
    for i in range(10):
        hold_params(sched, f"b{i}", next_turn=True, owner="tenant-b")
        freed |= drain(sched)
    assert freed == {f"b{i}" for i in range(8)}
    assert sched.holds.is_held("a0") and sched.holds.is_held("a1")
    assert sched.stats()["held_blocks"] == 12
    # Now A grows past its half: A's oldest go, and B keeps its share.
    for rid in ("a2", "a3"):
        hold_params(sched, rid, next_turn=True, owner="tenant-a")
        freed |= drain(sched)
    assert {"a0", "a1"} <= freed
    assert all(sched.holds.is_held(r) for r in ("a2", "a3", "b8", "b9"))


def test_a_claimed_hold_is_never_freed_by_the_budget(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(num_blocks=12, hold_budget_fraction=0.5, hold_max_fraction=1.0)
    client = SideChannelClient(nixl_peer.SECRET.encode(), timeout_s=5)
    turn(sched, "r0")
    turn(sched, "r1")
    # A reader is pulling r0: the next oldest goes instead, and r0 still counts.
    assert client.claim("127.0.0.1", sched.side_channel_port, "r0", "reader", "q").status == "held"
    turn(sched, "r2")
    assert drain(sched) == {"r1"}
    turn(sched, "r3")
    assert drain(sched) == {"r2"}
    assert sched.holds.is_held("r0") and sched.stats()["freed_by_budget"] == 2


def test_the_newest_hold_is_kept_even_alone_over_the_budget(
    make_scheduler: MakeScheduler,
) -> None:
    sched = make_scheduler(num_blocks=12, hold_budget_fraction=0.1, hold_max_fraction=1.0)
    turn(sched, "r0")  # 3 blocks against a budget of 1
    assert drain(sched) == set() and sched.holds.is_held("r0")
    turn(sched, "r1")
    assert drain(sched) == {"r0"} and sched.holds.is_held("r1")


def finish(
    sched: ConnectorScheduler, rid: str, n_tokens: int, brief: bool = False
) -> tuple[bool, dict[str, Any] | None]:
    """D finishes `rid` (`n_tokens` of prompt, 4 per block) asked to hold it for a next turn
    (`brief`: as a brief hold)."""
    tokens = list(range(n_tokens + 1))
    asked: dict[str, Any] = {HOLD_BLOCKS: True}
    if brief:
        asked[HOLD_BRIEF] = True
    view = RequestView(rid, f"client-{rid}", tokens[:n_tokens], tokens, asked)
    return sched.request_finished(view, [list(range(100, 100 + n_tokens // 4 + 1))])


def test_a_turn_alone_over_the_budget_is_not_held_and_its_params_say_so(
    make_scheduler: MakeScheduler,
) -> None:
    # 40 blocks, a tenth for holds (4 blocks) and for one hold (the defaults): a 3-block turn
    # is held, a 5-block one is not.
    sched = make_scheduler(num_blocks=40)
    assert finish(sched, "small", 12)[0]
    delay, params = finish(sched, "large", 20)
    assert not delay, "the engine must free the blocks now (they stay in its prefix cache)"
    assert params is not None
    parsed = KVTransferParams.from_wire(params)
    assert parsed is not None and parsed.hold_declined and not parsed.has_remote_blocks
    assert parsed.kvr_prompt_tokens == 20, "the reuse report still comes back"
    assert not sched.holds.is_held("large") and sched.holds.is_held("small")
    assert drain(sched) == set(), "an older hold is not pushed out for one never kept"
    stats = sched.stats()
    assert stats["holds_over_budget"] == 1 and stats["held_blocks"] == 3
    # A stream's lookup finds the same answer on the side channel.
    assert sched.holds.finished("client-large") == params


def test_hold_max_fraction_sets_the_largest_hold_apart_from_the_budget(
    make_scheduler: MakeScheduler,
) -> None:
    sched = make_scheduler(num_blocks=40, hold_budget_fraction=0.1, hold_max_fraction=0.2)
    assert finish(sched, "five-blocks", 20)[0]  # over the budget alone, within the max
    assert not finish(sched, "nine-blocks", 36)[0]  # over the max (8 blocks)
    assert sched.stats()["holds_over_budget"] == 1


def test_a_brief_hold_is_kept_over_the_max_for_its_short_lease_outside_the_budget(
    make_scheduler: MakeScheduler,
) -> None:
    # 40 blocks: budget and max 4 blocks, a brief hold up to half the pool (20 blocks).
    sched = make_scheduler(num_blocks=40, lease_seconds=600.0, hold_brief_lease_s=5.0)
    assert finish(sched, "small", 12)[0]  # 3 blocks, within the budget
    before = time.time()
    delay, params = finish(sched, "large", 40, brief=True)  # 10 blocks: over the max
    assert delay, "a brief hold keeps its blocks"
    parsed = KVTransferParams.from_wire(params or {})
    assert parsed is not None and not parsed.hold_declined and parsed.has_remote_blocks
    expiry = parsed.remote_blocks_expiry_time
    assert expiry is not None and before + 5.0 <= expiry <= time.time() + 5.0, "its lease"
    # The budget neither counts it nor frees another hold for it.
    assert drain(sched) == set() and sched.holds.is_held("small")
    assert sched.holds.is_held("large")
    stats = sched.stats()
    assert stats["holds_brief"] == 1 and stats["holds_over_budget"] == 0
    # Nor does a later hold push the brief one out: the budget frees only counted holds.
    assert finish(sched, "next", 8)[0]
    assert drain(sched) == {"small"} and sched.holds.is_held("large")
    # Its short lease ends it.
    assert "large" in sched.holds.reap(now=time.monotonic() + 5.0)


def test_a_brief_hold_past_its_share_or_not_asked_brief_is_declined(
    make_scheduler: MakeScheduler,
) -> None:
    sched = make_scheduler(num_blocks=40, hold_brief_max_fraction=0.25)  # 10 blocks
    assert not finish(sched, "eleven-blocks", 44, brief=True)[0]
    assert not finish(sched, "not-brief", 40)[0]
    assert finish(sched, "ten-blocks", 40, brief=True)[0]
    stats = sched.stats()
    assert stats["holds_over_budget"] == 2 and stats["holds_brief"] == 1


def test_brief_holds_together_stay_within_their_share_the_oldest_going_first(
    make_scheduler: MakeScheduler,
) -> None:
    # 40 blocks: brief holds may pin 20 together; each of these is 8 blocks.
    sched = make_scheduler(num_blocks=40, hold_brief_max_fraction=0.5)
    assert finish(sched, "small", 12)[0]  # a budget's hold: not a brief hold's to free
    for rid in ("b0", "b1"):
        assert finish(sched, rid, 32, brief=True)[0]
    assert drain(sched) == set()
    assert finish(sched, "b2", 32, brief=True)[0]
    assert drain(sched) == {"b0"}
    assert all(sched.holds.is_held(r) for r in ("small", "b1", "b2"))
    assert sched.stats()["freed_by_budget"] == 1


def test_a_brief_holds_lease_is_never_longer_than_the_engines(
    make_scheduler: MakeScheduler,
) -> None:
    sched = make_scheduler(num_blocks=40, lease_seconds=2.0, hold_brief_lease_s=30.0)
    params = finish(sched, "large", 40, brief=True)[1]
    parsed = KVTransferParams.from_wire(params or {})
    assert parsed is not None and parsed.remote_blocks_expiry_time is not None
    assert parsed.remote_blocks_expiry_time <= time.time() + 2.0


def test_a_p_legs_hold_is_never_declined_by_the_max(make_scheduler: MakeScheduler) -> None:
    # P's hold is this turn's P -> D transfer, whatever its size.
    sched = make_scheduler(num_blocks=12, hold_budget_fraction=0.1, hold_max_fraction=0.1)
    hold_params(sched, "p0", n_tokens=30)
    assert sched.holds.is_held("p0") and sched.stats()["holds_over_budget"] == 0


def test_no_budget_at_one_or_without_the_pool_size(make_scheduler: MakeScheduler) -> None:
    unbounded = make_scheduler(num_blocks=12, hold_budget_fraction=1.0, hold_max_fraction=1.0)
    unknown_pool = make_scheduler(hold_budget_fraction=0.1)  # the max needs the pool too
    for sched in (unbounded, unknown_pool):
        for i in range(5):
            turn(sched, f"r{i}")
        assert drain(sched) == set() and sched.stats()["held_blocks"] == 15


def test_holds_for_this_turns_pull_are_neither_counted_nor_freed(
    make_scheduler: MakeScheduler,
) -> None:
    sched = make_scheduler(num_blocks=12, hold_budget_fraction=0.5, hold_max_fraction=1.0)
    for i in range(3):
        hold_params(sched, f"p{i}")  # a P leg's hold: D is about to pull it
    turn(sched, "r0")
    turn(sched, "r1")
    assert drain(sched) == set()
    turn(sched, "r2")
    assert drain(sched) == {"r0"}
    assert all(sched.holds.is_held(f"p{i}") for i in range(3))


def test_trim_skips_holds_already_freeing_and_counts_its_reason() -> None:
    counters = Counters("held", "held_blocks", "freed_by_expiry", "freed_by_budget")
    table = HoldTable(counters, claim_timeout_s=30)
    t = time.monotonic()
    for i, lease in enumerate([1, 100, 100]):
        entry = HoldEntry(f"h{i}", None, [[10 * i, 10 * i + 1]], 8, t + lease, "tok")
        entry.next_turn = True
        table.add(entry)
    # h0 expired and is already queued: it no longer counts, so freeing h1 is enough.
    assert table.reap(now=t + 10) == ["h0"]
    assert table.trim(2, keep="h2", now=t + 10) == 2
    assert table.take_frees() == ["h0", "h1"]
    assert table.finalize("h0") is FreeReason.EXPIRY
    assert table.finalize("h1") is FreeReason.BUDGET
    assert counters.snapshot()["freed_by_budget"] == 1


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5])
def test_budget_fraction_out_of_range_is_refused(fraction: float) -> None:
    with pytest.raises(ValidationError):
        ConnectorConfig(engine_id="e", hold_budget_fraction=fraction)
