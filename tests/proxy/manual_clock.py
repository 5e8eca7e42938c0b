"""A clock a test moves by hand (`clock.now += 2.0`), for the proxy's parts that take one."""

from __future__ import annotations


class Clock:
    """Monotonic seconds as the test sets them, from `start`."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now
