"""The one rule for a count an engine reports (prompt, cached, loaded tokens; blocks).

No model's context comes near 2^24 tokens (16.8 M): a count above that, a negative one or one
that is not an integer is no count. Such a figure is `unknown` wherever the proxy reads one: it
is counted in process-lifetime Prometheus counters and returned to clients, and one absurd
value from a broken or hostile engine (1e30, or past a float's range) must neither stay in them
nor fail the answer that carried it.
"""

from __future__ import annotations

MAX_ENGINE_COUNT = 1 << 24


def count_or_none(value: object) -> int | None:
    """An engine's count, when it is one: an int from 0 to `MAX_ENGINE_COUNT`."""
    return value if type(value) is int and 0 <= value <= MAX_ENGINE_COUNT else None
