"""The per-holder breaker (`HolderBreaker`), on its own clock: which loads reach a holder whose
claims or READs timed out."""

from __future__ import annotations

from kvrelay.connector.breaker import DownReason, HolderBreaker

HOLDER = ("10.0.0.1", 5600)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_holder_down_for_reads_lets_one_probe_through_until_its_read_ends() -> None:
    # The probe's claim is answered, but an answered claim says nothing of its READ: every
    # other load stays refused until that READ ends one way or the other.
    clock = Clock()
    breaker = HolderBreaker(10.0, clock)
    breaker.failed(HOLDER, DownReason.READ)
    assert not breaker.allow(HOLDER)
    clock.now = 10.0
    assert breaker.allow(HOLDER)  # the probe
    breaker.answered(HOLDER)  # its claim came back
    assert not breaker.allow(HOLDER) and not breaker.allow(HOLDER)
    breaker.failed(HOLDER, DownReason.READ)  # the probe's READ timed out: down again
    assert not breaker.allow(HOLDER)
    clock.now = 20.0
    assert breaker.allow(HOLDER)
    breaker.read_done(HOLDER)  # this probe's READ completed: up
    assert breaker.allow(HOLDER) and breaker.allow(HOLDER) and not breaker.is_down(HOLDER)


def test_a_probe_that_ends_without_a_read_lets_the_next_load_probe() -> None:
    clock = Clock()
    breaker = HolderBreaker(10.0, clock)
    breaker.failed(HOLDER, DownReason.READ)
    clock.now = 10.0
    assert breaker.allow(HOLDER) and not breaker.allow(HOLDER)
    breaker.probe_over(HOLDER)  # e.g. its hold was gone: no READ said anything
    assert breaker.allow(HOLDER)


def test_a_holder_down_for_its_side_channel_is_up_at_its_first_answer() -> None:
    clock = Clock()
    breaker = HolderBreaker(10.0, clock)
    breaker.failed(HOLDER, DownReason.SIDE_CHANNEL)
    clock.now = 10.0
    assert breaker.allow(HOLDER)
    breaker.answered(HOLDER)
    assert not breaker.is_down(HOLDER) and breaker.allow(HOLDER)
