"""One bad holder never stalls the rest; stuck reads are bounded; handles are kept until freed.

In-process engines over real NIXL (`tests/connector/inproc.py`): a hung holder (accepts TCP,
never answers), a holder whose worker stopped stepping (its side channel answers, its NIXL does
not progress), and a reader whose NIXL agent refuses to release a handle.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvrelay.connector.metadata import RequestView
from tests.connector.inproc import BS, HungHolder, InProcEngine, prompt_of
from tests.harness import wait_until

pytestmark = pytest.mark.nixl


@pytest.fixture
def engines() -> Iterator[list[Any]]:
    """Everything a test starts (engines, hung holders), closed afterwards."""
    started: list[Any] = []
    try:
        yield started
    finally:
        for item in started:
            item.close()


def _steps_until(engines: list[InProcEngine], done: Any, timeout: float = 30.0) -> None:
    def step() -> bool:
        for engine in engines:
            engine.step()
        return bool(done())

    wait_until(step, timeout, interval=0.01, what="engines reach the condition")


def test_a_hung_holder_delays_no_load_from_a_healthy_holder(engines: list[Any]) -> None:
    hung = HungHolder()
    holder = InProcEngine("h-ok", seed=1)
    reader = InProcEngine("r-hol", seed=2, handshake_timeout_s=3.0)
    engines += [hung, holder, reader]
    prompt = prompt_of(BS + 1)
    # Six loads name the hung holder (a D that hung after publishing its holds), then one a
    # healthy one. Claims share nothing across holders: the healthy load finishes while the
    # hung holder's claims are still waiting for their timeout.
    for i in range(6):
        params = holder.hold(f"x{i}", prompt, [10 + i])
        reader.load(f"dead{i}", [*prompt, 1], {**params, "remote_port": hung.port}, [i])
    good = holder.hold("g", prompt, [20])
    assert reader.load("good", [*prompt, 1], good, [8]) == BS
    _steps_until([holder, reader], lambda: "good" in reader.recving)
    assert reader.recving[0] == "good", reader.recving
    assert 8 not in reader.invalid
    assert reader.worker.stats()["failures"] == 0  # the hung holder's claims still wait
    # The first timed-out claim marks the hung holder down: its other loads fail at once
    # (recomputed) instead of each waiting out its own timeout in turn.
    _steps_until([reader], lambda: len(reader.recving) == 7, timeout=30)
    stats = reader.worker.stats()
    assert stats["holders_down"] == 1
    assert stats["failures_holder_down"] >= 1
    assert stats["failures_claim"] + stats["failures_holder_down"] == 6


def test_a_down_holder_gets_no_new_load_at_once(
    engines: list[Any],
) -> None:
    hung = HungHolder()
    holder = InProcEngine("h-back", seed=3)
    reader = InProcEngine("r-probe", seed=4, handshake_timeout_s=1.0, holder_retry_s=60.0)
    engines += [hung, holder, reader]
    prompt = prompt_of(BS + 1)
    params = holder.hold("x0", prompt, [10])
    dead = {**params, "remote_port": hung.port}
    reader.load("dead0", [*prompt, 1], dead, [0])
    _steps_until([reader], lambda: "dead0" in reader.recving)
    # Down: the next load naming it is refused in the very step it is planned, unclaimed.
    reader.load("dead1", [*prompt, 1], dead, [1])
    assert "dead1" in reader.step()
    stats = reader.worker.stats()
    assert stats["failures_holder_down"] == 1 and stats["failures_claim"] == 1
    assert 1 in reader.invalid


def test_stuck_reads_are_bounded_and_their_cost_is_counted(engines: list[Any]) -> None:
    holder = InProcEngine("h-stall", seed=5)
    reader = InProcEngine(
        "r-quar", seed=6, transfer_timeout_s=0.5, cancel_grace_s=0.5, max_quarantined_blocks=2,
        holder_retry_s=0.1,
    )  # fmt: skip
    engines += [holder, reader]
    prompt = prompt_of(2 * BS + 1)
    p1 = holder.hold("h1", prompt, [10, 11])
    # The holder's worker stops stepping: its side channel answers, its NIXL never progresses.
    assert reader.load("r1", [*prompt, 1], p1, [0, 1]) == 2 * BS
    _steps_until([reader], lambda: reader.worker.stats()["reads_cancelling"] == 1)
    assert reader.worker.stats()["quarantined_blocks"] == 2
    # At the bound: the next load from that holder is refused at once (recomputed), adding
    # no quarantined block, although the breaker would let a probe through by now.
    # (held without stepping the holder, which would let the stuck read progress)
    view = RequestView("h2", None, prompt, [*prompt, 7], {"do_remote_decode": True})
    p2 = holder.sched.request_finished(view, [[12, 13]])[1]
    assert p2 is not None
    reader.load("r2", [*prompt, 1], p2, [2, 3])
    assert "r2" in reader.step()
    stats = reader.worker.stats()
    assert stats["failures_quarantine"] == 1 and stats["quarantined_blocks"] == 2
    assert {2, 3} <= reader.invalid and "r1" not in reader.recving
    # The holder steps again: the stuck read ends, its blocks come back, its cost is counted.
    _steps_until([holder, reader], lambda: "r1" in reader.recving)
    stats = reader.worker.stats()
    assert stats["quarantined_blocks"] == 0 and stats["quarantined_block_ms"] >= 1


def test_a_handle_nixl_will_not_release_keeps_its_blocks(
    engines: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = InProcEngine("h-rel", seed=7)
    reader = InProcEngine("r-rel", seed=8, transfer_timeout_s=0.5)
    engines += [holder, reader]
    prompt = prompt_of(BS + 1)
    params = holder.hold("h1", prompt, [10])
    reader.load("r1", [*prompt, 1], params, [0])
    _steps_until([reader], lambda: reader.worker.stats()["reads_cancelling"] == 1)
    transport = reader.worker._transport
    assert transport is not None
    agent = transport._agent
    real_release = agent.release_xfer_handle
    refusals: list[object] = []

    def refusing(handle: object) -> None:
        refusals.append(handle)
        raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")

    monkeypatch.setattr(agent, "release_xfer_handle", refusing)
    # The read ends (the holder progresses) but NIXL refuses to let go of its handle: the
    # blocks stay with the request, whatever the state says.
    _steps_until([holder, reader], lambda: len(refusals) >= 3)
    assert "r1" not in reader.recving and 0 not in reader.invalid
    assert reader.worker.stats()["handle_releases_failed"] >= 3
    monkeypatch.setattr(agent, "release_xfer_handle", real_release)
    _steps_until([holder, reader], lambda: "r1" in reader.recving)
    assert 0 in reader.invalid


def test_claim_answering_other_blocks_releases_our_own_claim(engines: list[Any]) -> None:
    holder = InProcEngine("h-mis", seed=9)
    reader = InProcEngine("r-mis", seed=10)
    engines += [holder, reader]
    prompt = prompt_of(2 * BS + 1)
    params = holder.hold("h1", prompt, [10, 11])
    # The params name blocks the hold does not have (a stale or tampered id list).
    reader.load("r1", [*prompt, 1], {**params, "remote_block_ids": [[10, 12]]}, [0, 1])
    _steps_until([holder, reader], lambda: "r1" in reader.recving)
    assert reader.worker.stats()["failures_mismatch"] == 1
    # Our claim pinned the hold; the failure's release ends the pin, so it is freed now, not
    # after claim_timeout_s and then the lease.
    _steps_until([holder, reader], lambda: holder.sched.stats()["held"] == 0, timeout=10)
    assert holder.sched.stats()["freed_by_release"] == 1
