"""How long the prefix cache keeps a block nobody touches: `BlockResidency`, vLLM's KV cache
residency metrics (`--kv-cache-metrics`, `--kv-cache-metrics-sample`).

vLLM samples a share of the blocks it allocates and, for each sampled block, notes when it was
allocated and each time a request hit it in the prefix cache (`BlockPool.touch`). When an
allocation takes the block again (the block pool evicts it, cached or not) it observes the time
since the last of those into `vllm:kv_block_idle_before_evict_seconds`. The pool here keeps the
same notes at the same points (`BlockPool.allocate`, `BlockPool.share`), on the engine's clock.

Under LRU eviction the idle time of the blocks evicted is about how long an unreferenced block
survives in this engine's cache right now: what the proxy weighs a hold against (a history kept
by the cache anyway gains nothing from being pinned).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from kvrelay.enginesim.histogram import RESIDENCY_BUCKETS, Histogram


class BlockResidency:
    """Sampled blocks' last touch, and the idle-before-evict histogram of those evicted."""

    def __init__(
        self,
        sample: float,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 < sample <= 1:
            raise ValueError("the sample rate must be in (0, 1]")
        self._sample = sample
        self._clock = clock
        self._rng = rng or random.Random(0)
        self._last_touch: dict[int, float] = {}  # sampled block id -> allocated or last hit
        self.idle_before_evict = Histogram(RESIDENCY_BUCKETS)

    def allocated(self, block: int) -> None:
        """An allocation took `block`: its previous life ends (observed if it was sampled) and
        a new one begins (sampled at the configured rate)."""
        touched = self._last_touch.pop(block, None)
        now = self._clock()
        if touched is not None:
            self.idle_before_evict.observe(max(0.0, now - touched))
        if self._sample >= 1 or self._rng.random() < self._sample:
            self._last_touch[block] = now

    def hit(self, block: int) -> None:
        """A request found `block` in the prefix cache."""
        if block in self._last_touch:
            self._last_touch[block] = self._clock()
