"""Where the modelled GPU is in time: `GpuTimeline`, which lays an engine's modelled steps end
to end on its clock and waits each one out.

A simulated step costs the engine thread two things: its own Python work (scheduling, the
pool's writes, outputs, the connector) and the wait for the step's modelled time. On a real
GPU the host's share of a step is inside the modelled time (the cost profile's per-step
overhead), so waiting the whole modelled time *after* the Python work would make every step
longer than the hardware it models, and by as much as the host is loaded: on two cores
driving eight engines at 32 req/s the engines' steps took about 1.5x their modelled time
(measured: 8-9 s of stepping for 5.5-6.1 s modelled per engine), which then read as the fleet's
limit in a comparison. So a step that follows the previous one without the GPU idling (the
engine had requests running and stepped again at once) starts where the previous one ended,
and waits only what is left of its modelled time; one that follows an idle engine starts when
it began. Time the engine thread fell behind and could not make up (more than
`MAX_BEHIND_S` behind, or late at the end of a busy spell) is counted in `behind_s`: a
benchmark reads it beside `modelled_s` to say how far the host, not the model, set the pace.
"""

from __future__ import annotations

from collections.abc import Callable

# How far the engine thread may run behind its modelled steps and still catch up by waiting
# less in the next ones: a few steps' worth. Beyond it the engine is late, counted.
MAX_BEHIND_S = 0.05


class GpuTimeline:
    """One engine's modelled GPU time: steps laid end to end (see the module's docstring)."""

    def __init__(self, wait: Callable[[float], None], clock: Callable[[], float]) -> None:
        self._wait = wait
        self._clock = clock
        self._began = 0.0  # when the current step began, on the clock
        self._free_at = 0.0  # when the modelled GPU ends its latest step
        self._late = 0.0  # how far past `_free_at` the latest step's wait ended
        self._back_to_back = False  # the next step follows the latest without the GPU idling
        self.modelled_s = 0.0  # modelled step time waited out, in total
        self.behind_s = 0.0  # time the engine ran past its modelled steps and never made up

    def begin(self) -> None:
        """A step begins: its Python work from here on is inside its modelled time."""
        self._began = self._clock()

    def compute(self, cost_s: float) -> None:
        """The step computes for `cost_s` modelled seconds: wait until the GPU would be done."""
        if self._back_to_back:
            start = self._free_at
            behind = self._began - start
            if behind > MAX_BEHIND_S:
                self.behind_s += behind - MAX_BEHIND_S
                start = self._began - MAX_BEHIND_S
        else:
            start = self._began
        self._free_at = start + cost_s
        self.modelled_s += cost_s
        remaining = self._free_at - self._clock()
        if remaining > 0:
            self._wait(remaining)
        self._late = max(0.0, self._clock() - self._free_at)

    def end(self, computed: bool, continues: bool) -> None:
        """The step ended. `computed`: it waited out modelled time; `continues`: the engine has
        requests running and steps again at once, so the GPU does not idle before the next."""
        self._back_to_back = computed and continues
        if computed and not continues:
            self.behind_s += self._late  # the busy spell ends late: nothing left to make it up
            self._late = 0.0
