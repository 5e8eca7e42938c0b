"""enginesim's modelled GPU timeline: steps laid end to end, the host's own time inside them."""

from __future__ import annotations

import pytest

from kvrelay.enginesim.timeline import MAX_BEHIND_S, GpuTimeline
from tests.enginesim.fakes import ModelledClock


def _step(line: GpuTimeline, clock: ModelledClock, work_s: float, cost_s: float) -> None:
    """One step: `work_s` of the engine thread's own Python work, then `cost_s` modelled."""
    line.begin()
    clock.now += work_s
    line.compute(cost_s)


def test_back_to_back_steps_hold_the_engine_threads_work_inside_their_modelled_time() -> None:
    clock = ModelledClock()
    line = GpuTimeline(clock.wait, clock.clock)
    for _ in range(3):
        _step(line, clock, 0.002, 0.010)
        line.end(computed=True, continues=True)
    # Each step lasts its modelled 10 ms, the 2 ms of the thread's own work included.
    assert clock.waits == pytest.approx([0.008, 0.008, 0.008])
    assert clock.now == pytest.approx(0.030)
    assert line.modelled_s == pytest.approx(0.030) and line.behind_s == 0.0


def test_a_sleep_that_overshoots_is_made_up_by_the_next_step() -> None:
    clock = ModelledClock()
    line = GpuTimeline(clock.wait, clock.clock)
    _step(line, clock, 0.0, 0.010)
    clock.now += 0.004  # the thread woke 4 ms late
    line.end(computed=True, continues=True)
    _step(line, clock, 0.0, 0.010)
    line.end(computed=True, continues=True)
    assert clock.waits == pytest.approx([0.010, 0.006])
    assert clock.now == pytest.approx(0.020) and line.behind_s == 0.0


def test_a_step_after_an_idle_engine_starts_when_it_begins() -> None:
    clock = ModelledClock()
    line = GpuTimeline(clock.wait, clock.clock)
    _step(line, clock, 0.0, 0.010)
    line.end(computed=True, continues=False)  # nothing left running: the runner polls
    clock.now += 0.003  # the GPU idles; no credit for it
    _step(line, clock, 0.001, 0.010)
    line.end(computed=True, continues=True)
    assert clock.waits == pytest.approx([0.010, 0.009])
    assert line.behind_s == 0.0


def test_a_step_without_compute_breaks_the_spell() -> None:
    clock = ModelledClock()
    line = GpuTimeline(clock.wait, clock.clock)
    _step(line, clock, 0.0, 0.010)
    line.end(computed=True, continues=True)
    line.begin()  # a step that computed nothing (only loads in flight): the GPU idled
    line.end(computed=False, continues=True)
    clock.now += 0.005
    _step(line, clock, 0.0, 0.010)
    assert clock.waits == pytest.approx([0.010, 0.010])


def test_time_behind_the_model_beyond_the_bound_is_counted_not_made_up() -> None:
    clock = ModelledClock()
    line = GpuTimeline(clock.wait, clock.clock)
    _step(line, clock, 0.0, 0.010)
    line.end(computed=True, continues=True)
    clock.now += 0.200  # the host did not run the engine thread for 200 ms
    _step(line, clock, 0.0, 0.010)
    line.end(computed=True, continues=True)
    # It catches up at most MAX_BEHIND_S: this step's 10 ms are inside it, no wait.
    assert clock.waits == pytest.approx([0.010])
    assert line.behind_s == pytest.approx(0.200 - MAX_BEHIND_S)
    # Still MAX_BEHIND_S - 10 ms behind: the next steps wait nothing until it is made up.
    for _ in range(4):
        _step(line, clock, 0.0, 0.010)
        line.end(computed=True, continues=True)
    _step(line, clock, 0.0, 0.010)
    waited = [w for w in clock.waits if w > 1e-9]  # float rounding may leave a zero-ish wait
    assert waited == pytest.approx([0.010, 0.010])
    assert clock.now == pytest.approx(0.220)  # the model's time: 70 ms of steps, 150 ms late
    assert line.modelled_s == pytest.approx(0.070)


def test_a_busy_spell_that_ends_late_counts_its_lateness() -> None:
    clock = ModelledClock()
    line = GpuTimeline(clock.wait, clock.clock)
    line.begin()
    clock.now += 0.015  # the step's own work took longer than its modelled 10 ms
    line.compute(0.010)
    line.end(computed=True, continues=False)
    assert clock.waits == []
    assert line.behind_s == pytest.approx(0.005)
