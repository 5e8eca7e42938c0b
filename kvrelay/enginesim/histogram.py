"""Cumulative histograms kept as vLLM keeps its Prometheus histograms, with vLLM 0.32's buckets.

- `vllm:inter_token_latency_seconds` (`ITL_BUCKETS`): one gap before each output token after a
  request's first on this engine (the first token's time is its TTFT). enginesim counts the
  same gaps on its own clock, so the page an engine serves reads alike from either; the proxy
  derives a decode engine's recent step time from the histogram's sum and count.
- `vllm:kv_block_idle_before_evict_seconds` (`RESIDENCY_BUCKETS`, with `--kv-cache-metrics`):
  how long a sampled block went untouched before an allocation took it (`residency.py`).
"""

from __future__ import annotations

import bisect

# Upper bounds in seconds, from 10 ms decodes to multi-second stalls.
ITL_BUCKETS: tuple[float, ...] = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


# vLLM's `KV_CACHE_RESIDENCY_BUCKETS`: millisecond reuse gaps up to half-hour lifetimes (floats:
# Prometheus writes a bound as `1.0`, and the page must read alike).
RESIDENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1200.0,
    1800.0,
)


class Histogram:
    """A cumulative histogram over `bounds`: counts per bucket, their sum and count."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last bucket is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """`(le, count at or below it)` per bucket as Prometheus exposes them, +Inf last."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out
