"""Engine load signals: each engine's own `/metrics`, scraped on an interval.

The proxy's in-flight counts only see the requests this worker sent; an engine's queue also
holds other workers' and other proxies' requests. `LoadPoller` reads vLLM's gauges
(`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, and the
pool's size from `vllm:cache_config_info`; enginesim exports the same names) every
`load_poll_interval_s` and keeps the latest reading on each `Backend` (`Backend.load`).
`routing.py` combines it with the in-flight counts, and the KV usage with the blocks this
worker's turns freed on the engine since the reading (`Backend.freed`).

A reading older than `STALE_INTERVALS` intervals is ignored (`fresh_load`), as if the engine had
never been scraped; a scrape that fails or times out only leaves the old reading to go stale.
Scraping never touches a request's path.
"""

from __future__ import annotations

import logging
import time

from kvrelay.prometheus_text import parse_samples, series_labels, series_sum
from kvrelay.proxy.engines import UpstreamError
from kvrelay.proxy.fleet.cache_residence import CacheResidence
from kvrelay.proxy.fleet.load_reading import EngineLoad
from kvrelay.proxy.fleet.pools import Backend, EngineRounds, Pool

log = logging.getLogger(__name__)

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
ITL = "vllm:inter_token_latency_seconds"
CACHE_CONFIG = "vllm:cache_config_info"  # an info gauge: the cache's settings are its labels
# Readings this many intervals old describe a queue that has long moved on.
STALE_INTERVALS = 3


def load_from_metrics(
    text: str, at: float, previous: EngineLoad | None = None
) -> EngineLoad | None:
    """The load gauges of a `/metrics` page (summed over label sets), or None without them;
    with the engine's `previous` reading, also its mean inter-token gap since then and its
    recent evictions' idle times (`CacheResidence`)."""
    samples = parse_samples(text)
    names = {key.split("{", 1)[0] for key in samples}
    if RUNNING not in names and WAITING not in names:
        return None
    # vLLM labels each gauge per engine core and model; several cores share one server.
    cores = sum(1 for key in samples if key.split("{", 1)[0] == KV_USAGE) or 1
    itl_sum = itl_count = None
    if ITL + "_count" in names:
        itl_sum = series_sum(samples, ITL + "_sum")
        itl_count = series_sum(samples, ITL + "_count")
    return EngineLoad(
        running=series_sum(samples, RUNNING),
        waiting=series_sum(samples, WAITING),
        kv_usage=series_sum(samples, KV_USAGE) / cores,
        at=at,
        itl_sum=itl_sum,
        itl_count=itl_count,
        inter_token_s=_mean_gap(previous, itl_sum, itl_count),
        residence=CacheResidence.read(samples, previous.residence if previous else None),
        pool_tokens=_pool_tokens(samples),
    )


def _pool_tokens(samples: dict[str, float]) -> int | None:
    """The engine's KV pool in tokens: `num_gpu_blocks` x `block_size` of each core's
    `vllm:cache_config_info`, summed (None: no such series, or one without both numbers)."""
    total = 0
    for labels in series_labels(samples, CACHE_CONFIG):
        try:
            total += int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        except (KeyError, ValueError):
            return None  # a core whose pool is unknown: the engine's total is not known
    return total or None


def _mean_gap(
    previous: EngineLoad | None, itl_sum: float | None, itl_count: float | None
) -> float | None:
    """The mean of the inter-token gaps observed between two readings of one engine."""
    if previous is None or previous.itl_sum is None or previous.itl_count is None:
        return None
    if itl_sum is None or itl_count is None:
        return None
    tokens = itl_count - previous.itl_count
    if tokens <= 0:
        return None  # nothing decoded, or the engine restarted and its counters went back
    return max(0.0, itl_sum - previous.itl_sum) / tokens


def fresh_load(backend: Backend, interval_s: float, now: float | None = None) -> EngineLoad | None:
    """The backend's reading when it is recent enough to act on, else None."""
    load = backend.load
    if load is None or interval_s <= 0:
        return None
    now = time.monotonic() if now is None else now
    return load if now - load.at <= STALE_INTERVALS * interval_s else None


class LoadPoller(EngineRounds):
    """Scrapes every engine's `/metrics` on an interval until stopped (0: never)."""

    task_name = "kvrelay-load"

    async def scrape_all(self) -> None:
        await self.visit_all()

    async def _visit(self, pool: Pool, backend: Backend) -> None:
        try:
            status, body = await self._client.get(backend.url, "/metrics", timeout_s=self._timeout)
            if status != 200:
                return
            text = body.decode()  # the exposition format is UTF-8
        except (UpstreamError, TimeoutError, OSError, UnicodeDecodeError) as exc:
            log.debug("load scrape of %s failed: %s", backend.url, type(exc).__name__)
            return
        load = load_from_metrics(text, time.monotonic(), backend.load)
        if load is not None:
            backend.load = load
