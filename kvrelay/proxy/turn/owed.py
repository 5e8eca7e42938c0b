"""What a turn owes the engines: the holds it made (or took over) that nobody else will free.

A turn takes over the previous turn's hold on D (until P's connector reads or releases it), or
has another P pin a cached prefix for its P to pull (the same way), makes P hold blocks for D
(until D's connector reads them), and asks D to hold for the next turn (until D's params are
stored, or handed to a task that stores them). `Owed` lists what is still
owed; each debt is settled when someone else takes it on, released now when the turn moves past
it, and everything still owed is released as a unit on any way out of the turn.
"""

from __future__ import annotations

import enum
from collections.abc import Callable


class Debt(enum.StrEnum):
    """The holds a turn can owe. A `StrEnum` hashes in C (a plain `Enum` member's hash is a
    Python call), and a turn looks debts up several times."""

    PREVIOUS_HOLD = "previous_hold"  # D's blocks of the taken entry, until P answered
    PINNED_PREFIX = "pinned_prefix"  # another P's pin of a cached prefix, until P answered
    PREFILL_BLOCKS = "prefill_blocks"  # P's blocks for D, until D's answer is complete
    DECODE_HOLD = "decode_hold"  # D's hold for the next turn, until its params are handled


class Owed:
    """The debts of one turn, each with the call that frees it."""

    def __init__(self) -> None:
        self._debts: dict[Debt, Callable[[], None]] = {}

    def owe(self, debt: Debt, release: Callable[[], None]) -> None:
        """From now on the turn owes `debt`; `release` frees it (in the background)."""
        self._debts[debt] = release

    def owes(self, debt: Debt) -> bool:
        return debt in self._debts

    def settle(self, debt: Debt) -> None:
        """Someone else frees it now (an engine's connector, a storing task): nothing to do."""
        self._debts.pop(debt, None)

    def release(self, debt: Debt) -> None:
        """Free `debt` now, if it is still owed."""
        release = self._debts.pop(debt, None)
        if release is not None:
            release()

    def release_all(self) -> None:
        """Free everything still owed (the turn ended without handing it on)."""
        debts, self._debts = self._debts, {}
        for release in debts.values():
            release()
