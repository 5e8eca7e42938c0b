"""A pin's wait, measured: each holder's recent pin answer times (`PinWaits`) and the pace at
which Ps compute prompt tokens while busy (`PrefillPace`)."""

from __future__ import annotations

import pytest

from kvrelay.proxy.fleet.pin_wait import (
    PACE_HALF_LIFE_S,
    PACE_MIN_BUSY_S,
    PIN_WEIGHT,
    PinWaits,
    PrefillPace,
)
from tests.proxy.manual_clock import Clock


def test_a_holders_pin_wait_is_a_moving_mean_forgotten_after_a_quiet_spell() -> None:
    clock = Clock(50.0)
    waits = PinWaits(60.0, clock)
    assert waits.seconds("http://d0", "decode") is None
    waits.answered("http://d0", "decode", 0.1)
    assert waits.seconds("http://d0", "decode") == pytest.approx(0.1)  # the first is the mean
    waits.answered("http://d0", "decode", 0.6)
    assert waits.seconds("http://d0", "decode") == pytest.approx(0.1 + PIN_WEIGHT * 0.5)
    clock.now += 60.0
    assert waits.seconds("http://d0", "decode") is not None  # within forget_s of its last pin
    clock.now += 0.5
    assert waits.seconds("http://d0", "decode") is None
    waits.answered("http://d0", "decode", 0.02)  # a forgotten mean does not weigh the next
    assert waits.seconds("http://d0", "decode") == pytest.approx(0.02)


def test_a_holder_not_pinned_lately_is_weighed_by_its_pools_pins() -> None:
    """d1 was never pinned: it waits as d0's pins did (the decode pool's mean), until its own
    pins say otherwise; a P is not weighed by the Ds' pins."""
    clock = Clock(50.0)
    waits = PinWaits(60.0, clock)
    waits.answered("http://d0", "decode", 0.3)
    assert waits.seconds("http://d1", "decode") == pytest.approx(0.3)
    assert waits.seconds("http://p0", "prefill") is None
    waits.answered("http://d1", "decode", 0.05)
    assert waits.seconds("http://d1", "decode") == pytest.approx(0.05)  # its own, first
    assert waits.seconds("http://d0", "decode") == pytest.approx(0.3)
    # The pool's mean moved with d1's pin: a third D is weighed by both.
    assert waits.seconds("http://d2", "decode") == pytest.approx(0.3 + PIN_WEIGHT * -0.25)
    clock.now += 61.0
    assert waits.seconds("http://d2", "decode") is None


def test_the_pace_counts_each_ps_busy_time_once_however_many_legs_overlap() -> None:
    """Two overlapping legs on one P over 2 s are 2 s of busy time, not 3; a second P busy at
    the same time adds its own; a P never idle accrues at each answer."""
    clock = Clock(50.0)
    pace = PrefillPace(clock)
    pace.started("http://p0")
    clock.now += 1.0
    pace.started("http://p0")
    clock.now += 1.0
    assert pace.tokens_per_s() is None  # nothing answered yet
    pace.ended("http://p0", 3000)  # 2 s accrued
    clock.now += 1.0
    pace.started("http://p1")
    pace.ended("http://p0", 1000)  # 1 s more: 4,000 tokens in 3 s
    k = 0.5 ** (1.0 / PACE_HALF_LIFE_S)  # the first answer's figures, a second older
    tokens, busy = 3000 * k + 1000, 2 * k + 1
    assert pace.tokens_per_s() == pytest.approx(tokens / busy, rel=1e-9)
    clock.now += 0.5
    pace.ended("http://p1", 1000)  # p1 busy 0.5 s
    k = 0.5 ** (0.5 / PACE_HALF_LIFE_S)
    tokens, busy = tokens * k + 1000, busy * k + 0.5
    assert pace.tokens_per_s() == pytest.approx(tokens / busy, rel=1e-9)
    assert not pace.ended("http://p1", 500)  # never started here: nothing to count
    assert pace.tokens_per_s() == pytest.approx(tokens / busy, rel=1e-9)


def test_the_pace_needs_some_busy_time_and_keeps_its_value_as_it_decays() -> None:
    clock = Clock(50.0)
    pace = PrefillPace(clock)
    pace.started("http://p0")
    clock.now += PACE_MIN_BUSY_S / 2
    pace.ended("http://p0", 900)
    assert pace.tokens_per_s() is None  # half a second of one request says too little
    pace.started("http://p0")
    clock.now += PACE_MIN_BUSY_S / 2
    pace.ended("http://p0", 900)
    assert pace.tokens_per_s() == pytest.approx(1800 / PACE_MIN_BUSY_S, rel=0.01)
    clock.now += 10 * PACE_HALF_LIFE_S  # idle a long while: the evidence fades, not the pace
    assert pace.tokens_per_s() == pytest.approx(1800 / PACE_MIN_BUSY_S, rel=0.01)
    # A slower P now: the recent answers outweigh the faded ones.
    pace.started("http://p0")
    clock.now += 2.0
    pace.ended("http://p0", 400)
    assert pace.tokens_per_s() == pytest.approx(200.0, rel=0.05)


def test_a_failed_leg_counts_its_busy_time_and_no_tokens() -> None:
    clock = Clock(50.0)
    pace = PrefillPace(clock)
    pace.started("http://p0")
    clock.now += 1.0
    pace.ended("http://p0", 2000)
    pace.started("http://p0")
    clock.now += 1.0
    pace.ended("http://p0", 0)  # P failed: its time is spent, nothing computed
    assert pace.tokens_per_s() == pytest.approx(1000.0, rel=0.02)


def test_the_pace_is_shown_at_most_once_a_second() -> None:
    clock = Clock(50.0)
    pace = PrefillPace(clock)
    shown = []
    for _ in range(10):  # ten legs 0.25 s apart
        pace.started("http://p0")
        clock.now += 0.25
        shown.append(pace.ended("http://p0", 100))
    assert shown == [True, False, False, False, True, False, False, False, True, False]
