"""Which blocks one READ descriptor covers: runs of blocks consecutive on both sides. Torch-free
(the engine simulator sizes its modelled transfers with it, without NIXL)."""

from __future__ import annotations

from collections.abc import Sequence


def block_runs(
    local: Sequence[int], remote: Sequence[int], coalesce: bool
) -> list[tuple[int, int, int]]:
    """(local_start, remote_start, count) runs; consecutive ids on both sides merge."""
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local, remote, strict=True):
        if coalesce and runs:
            l0, r0, n = runs[-1]
            if lb == l0 + n and rb == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((lb, rb, 1))
    return runs
