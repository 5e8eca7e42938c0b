"""Thread-safe integer counters behind `stats()` (plain dict of ints, never secrets)."""

from __future__ import annotations

import threading
from collections import Counter


class Counters:
    """A locked `Counter`; the side-channel thread and the engine thread both write to it."""

    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self._values: Counter[str] = Counter({name: 0 for name in names})

    def inc(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def set(self, name: str, value: int) -> None:
        with self._lock:
            self._values[name] = value

    def get(self, name: str) -> int:
        with self._lock:
            return self._values[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
