"""The engines a module shares, idle around each test: every test starts from the state the
first one found, whatever the one before it left running (or, with `clear_faults`, injected)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from kvrelay.devtools import EngineSim

Shared = TypeVar("Shared")


def idle_around(
    shared: Shared, engines: Iterable[EngineSim], clear_faults: bool = False
) -> Iterator[Shared]:
    """A fixture's body: wait for every engine to be idle, yield `shared` (what the fixture
    gives the test), then clear the engines' injected queues when `clear_faults` and wait for
    them to be idle again (bounded: 15 s)."""
    every = tuple(engines)
    for engine in every:
        engine.wait_idle()
    yield shared
    for engine in every:
        if clear_faults:
            engine.request("/admin/faults", {"extra_waiting": 0})
        engine.wait_idle(15)
