"""How long an engine's prefix cache keeps a block nobody uses: `CacheResidence`, read from
vLLM's `vllm:kv_block_idle_before_evict_seconds` (served with `--kv-cache-metrics`).

vLLM samples a share of the blocks it allocates and, when an allocation takes one again,
observes how long it had gone untouched (since its allocation or its last prefix-cache hit).
Under LRU eviction that idle time is about how long any unreferenced block survives in the cache
right now, so the histogram of recent evictions tells how long a conversation's history stays on
its D without a hold. The proxy keeps, per engine, the buckets of the evictions seen since its
readings began, decayed by `HALF_LIFE` evictions (a cache's pressure changes with its traffic),
and takes their median (`keeps_s`), interpolated within its bucket as Prometheus'
`histogram_quantile` does. An engine that evicted nothing lately has no figure (None): its
cache keeps everything it has, or it was never asked to say.

A hold's age (`HoldPayoff.taken`) counts from the end of its turn, a block's idle time from its
allocation or last hit, which for a history is its turn's start: a take judged against the
median is late by up to a turn's length, seconds, where conversations' think times are minutes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.prometheus_text import bucket_counts

IDLE_BEFORE_EVICT = "vllm:kv_block_idle_before_evict_seconds"
HALF_LIFE = 64.0  # sampled evictions after which an older one weighs half
MIN_EVICTIONS = 8.0  # decayed evictions before the median is trusted


@dataclass(frozen=True)
class CacheResidence:
    """One engine's idle-before-evict histogram as last read, and its recent evictions."""

    bounds: tuple[float, ...]  # bucket upper bounds, +Inf last
    cumulative: tuple[float, ...]  # the counts as read (cumulative, summed over engine cores)
    recent: tuple[float, ...]  # per bucket (not cumulative), decayed

    @classmethod
    def read(
        cls, samples: dict[str, float], previous: CacheResidence | None
    ) -> CacheResidence | None:
        """The page's histogram (None: the engine serves none), its evictions since
        `previous` added to the decayed ones (a count that went back is a restarted engine:
        its figures start over)."""
        by_bound = bucket_counts(samples, IDLE_BEFORE_EVICT)
        if not by_bound:
            return None
        bounds = tuple(sorted(by_bound))
        cumulative = tuple(by_bound[b] for b in bounds)
        if previous is None or previous.bounds != bounds:
            return cls(bounds, cumulative, tuple(0.0 for _ in bounds))
        since = [now - then for now, then in zip(cumulative, previous.cumulative, strict=True)]
        # Per bucket: the cumulative counts' growth less the growth of the bucket below.
        new = [c - b for c, b in zip(since, (0.0, *since[:-1]), strict=True)]
        if any(n < 0 for n in new):  # a restart: its counters began again
            return cls(bounds, cumulative, tuple(0.0 for _ in bounds))
        keep = 0.5 ** (sum(new) / HALF_LIFE)
        recent = tuple(r * keep + n for r, n in zip(previous.recent, new, strict=True))
        return cls(bounds, cumulative, recent)

    def keeps_s(self) -> float | None:
        """The median idle time of the recent evictions (None: too few to tell)."""
        total = sum(self.recent)
        if total < MIN_EVICTIONS:
            return None
        half, running, lower = total / 2, 0.0, 0.0
        for bound, count in zip(self.bounds, self.recent, strict=True):
            if running + count >= half and count > 0:
                if bound == float("inf"):
                    return lower  # past the last finite bound: at least that
                return lower + (bound - lower) * (half - running) / count
            running += count
            lower = bound if bound != float("inf") else lower
        return lower
