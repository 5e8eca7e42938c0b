"""`EngineLoad`: one reading of an engine's load, kept on its `Backend` (`pools.py`) and taken
by the poller (`engine_load.py`); here, below both, so neither imports the other to name it."""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.proxy.fleet.cache_residence import CacheResidence


@dataclass(frozen=True)
class EngineLoad:
    """One scrape of one engine: its queue and KV usage (0..1), when it was read, and its
    decode pace: the mean gap between output tokens since the previous scrape."""

    running: float
    waiting: float
    kv_usage: float
    at: float  # time.monotonic() of the scrape
    # `vllm:inter_token_latency_seconds`' sum and count as read (None: the page has none),
    # and the mean gap of the tokens between the previous reading and this one (None: no
    # tokens in between, no earlier reading, or the counters went back: a restarted engine).
    itl_sum: float | None = None
    itl_count: float | None = None
    inter_token_s: float | None = None
    # How long its prefix cache keeps an unused block, from vLLM's residency histogram (None:
    # the engine serves none, `--kv-cache-metrics` off).
    residence: CacheResidence | None = None
    # Its KV pool in tokens (`vllm:cache_config_info`: num_gpu_blocks x block_size, summed over
    # its cores; None: the page does not say), what a share of `kv_usage` is worth in tokens.
    pool_tokens: int | None = None
