"""Holders that answered a pin late rest from serving pulls, longer the more often: `PinRests`.

A pin that does not come back within `prefix_pull_timeout_s` costs its turn that wait, and the
turn's engine then computes the prefix anyway. A holder that does not order its queue by
priority answers every pin late while it is busy, so it should serve no pulls for long; one
that does was only caught in a burst (its running prefills take each step's budget before the
pin is admitted) and answers on time again a few steps later. One fixed rest cannot serve both:
a minute sidelines a priority-scheduled P for a whole burst of requests its cache could have
served. So a holder's first late pin rests it for `FIRST_REST_TIMEOUTS` pin timeouts, each
late pin after that twice as long as the one before, up to `reuse_probe_interval_s`, and a pin
it answers on time ends the series.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# A first rest of a few pin timeouts: a burst on a priority-scheduled P clears in a few steps.
FIRST_REST_TIMEOUTS = 4.0


class PinRests:
    """Per holder URL: until when it serves no pulls, and how long its latest rest was."""

    def __init__(
        self, timeout_s: float, max_rest_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._first_s = min(max_rest_s, FIRST_REST_TIMEOUTS * timeout_s)
        self._max_s = max_rest_s
        self._clock = clock
        self._until: dict[str, float] = {}
        self._rest_s: dict[str, float] = {}  # the latest rest of a holder still in a series

    def late(self, url: str) -> float:
        """The holder at `url` answered a pin late: it rests; returns for how long."""
        last = self._rest_s.get(url)
        rest = self._first_s if last is None else min(self._max_s, 2 * last)
        self._rest_s[url] = rest
        self._until[url] = self._clock() + rest
        return rest

    def on_time(self, url: str) -> None:
        """The holder at `url` answered a pin in time: its next late pin rests it briefly."""
        self._rest_s.pop(url, None)

    def serves(self, url: str) -> bool:
        """The holder at `url` is not resting."""
        return self._until.get(url, 0.0) <= self._clock()
