"""The gaps between a request's consecutive output tokens, kept as vLLM keeps them.

vLLM observes one inter-token latency per output token after a request's first on this engine
(the first token's time is its TTFT) into `vllm:inter_token_latency_seconds`, a histogram with
the buckets below (vLLM 0.32's `INTER_TOKEN_LATENCY_BUCKETS`). enginesim counts the same gaps
on its own clock, so the page an engine serves reads alike from either; the proxy derives a
decode engine's recent step time from the histogram's sum and count.
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


class TokenGaps:
    """A cumulative histogram of inter-token gaps: counts per bucket, their sum and count."""

    __slots__ = ("count", "counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(ITL_BUCKETS) + 1)  # the last bucket is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, gap_s: float) -> None:
        self.counts[bisect.bisect_left(ITL_BUCKETS, gap_s)] += 1
        self.sum += gap_s
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """`(le, count at or below it)` per bucket as Prometheus exposes them, +Inf last."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip((*map(str, ITL_BUCKETS), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out
