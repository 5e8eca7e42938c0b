"""The closed loop of the load generators: N clients, each sending its next request as soon
as its previous one ended, first unmeasured (warm-up) then measured."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def closed_loop(
    attempt: Callable[[int, bool], Awaitable[None]], concurrency: int, warmup: int, total: int
) -> tuple[float, float]:
    """Run requests 0..warmup-1 unmeasured, then warmup..warmup+total-1 measured, each by
    `attempt(index, measured)` over `concurrency` clients; the measured part's wall and CPU
    seconds (CPU: this process's, the load generator's own cost)."""
    next_i = 0

    async def client(limit: int, measured: bool) -> None:
        nonlocal next_i
        while next_i < limit:
            i = next_i
            next_i += 1
            await attempt(i, measured)

    await asyncio.gather(*(client(warmup, False) for _ in range(concurrency)))
    started, cpu_started = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client(warmup + total, True) for _ in range(concurrency)))
    return time.perf_counter() - started, time.process_time() - cpu_started
