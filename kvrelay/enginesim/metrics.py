"""Prometheus `/metrics` for one engine, rendered from the engine thread's latest snapshot."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

_GAUGES = {
    "blocks_total": "KV blocks in the pool",
    "blocks_free": "KV blocks free in the pool",
    "blocks_held_for_remote": "KV blocks of finished requests held for a remote reader",
    "requests_held": "finished requests whose blocks are held for a remote reader",
    "requests_waiting": "requests waiting for admission",
    "requests_loading": "requests waiting for remote KV to arrive",
    "requests_running": "requests prefilling or decoding",
}
_COUNTERS = {
    "prompt_tokens_computed": "prompt tokens whose KV was computed locally",
    "prompt_tokens_loaded": "prompt tokens whose KV was loaded from a remote engine",
    "prompt_tokens_cached": "prompt tokens found in the engine's local prefix cache",
    "generation_tokens": "generated tokens",
    "preemptions": "running requests preempted for lack of blocks",
    "prefill_tokens_computed": "prompt tokens the engine computed in prefill chunks, "
    "recomputation after a preemption included (the GPU work; vLLM's prompt counters count "
    "each request's first admission only)",
    "prefill_chunks": "prefill chunks computed (a prompt longer than a step's token budget "
    "takes several; recomputation after a preemption included)",
    "reclaim_requests": "times the engine asked the connector to reclaim holds",
    "modelled_step_seconds": "modelled GPU time of the steps the engine waited out",
    "behind_model_seconds": "time the engine thread ran past its modelled steps and did not "
    "make up (the host's CPU, not the modelled GPU, set the pace)",
}
_OUTCOMES = ("finished", "failed", "aborted", "rejected")
_NAME_OK = re.compile(r"[^a-zA-Z0-9_]")


class _SnapshotCollector:
    def __init__(self, snapshot: Callable[[], dict[str, Any]], model: str) -> None:
        self._snapshot = snapshot
        self._model = model

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"enginesim_{name}", doc, value=snap.get(name, 0))
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"enginesim_{name}", doc, value=snap.get(name, 0))
        yield from _vllm_load_gauges(snap)
        yield from _vllm_prompt_counters(snap, self._model)
        total = CounterMetricFamily("enginesim_requests", "requests by outcome")
        # A plain total plus per-outcome series.
        requests = CounterMetricFamily(
            "enginesim_requests_by_outcome", "requests by outcome", labels=["outcome"]
        )
        count = 0
        for outcome in _OUTCOMES:
            value = snap.get(f"requests_{outcome}", 0)
            count += value
            requests.add_metric([outcome], value)
        total.add_metric([], count)
        yield total
        yield requests
        connector: dict[str, int] = snap.get("connector", {})
        yield CounterMetricFamily(
            "enginesim_kv_transfers",
            "KV transfers reported by the connector",
            value=connector.get("transfers", 0),
        )
        for key, value in sorted(connector.items()):
            if isinstance(value, int | float) and not isinstance(value, bool):
                yield GaugeMetricFamily(
                    f"enginesim_connector_{_NAME_OK.sub('_', key)}",
                    f"connector stat {key}",
                    value=value,
                )


def _vllm_load_gauges(snap: dict[str, Any]) -> Iterator[Metric]:
    """The load gauges vLLM exports, under vLLM's names, so the proxy reads both alike."""
    total = snap.get("blocks_total", 0)
    used = 1.0 - snap.get("blocks_free", 0) / total if total else 0.0
    yield GaugeMetricFamily(
        "vllm:num_requests_running",
        "requests in the running batch",
        value=snap.get("requests_running", 0),
    )
    # vLLM counts requests waiting for remote KV among the waiting ones.
    # `extra_waiting` is the busy-engine fault (`Faults.extra_waiting`).
    waiting = (
        snap.get("requests_waiting", 0)
        + snap.get("requests_loading", 0)
        + snap.get("extra_waiting", 0)
    )
    yield GaugeMetricFamily("vllm:num_requests_waiting", "requests waiting", value=waiting)
    yield GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)", value=used)
    # vLLM's cache settings as an info gauge (1, the settings in its labels): the two that size
    # the pool, which the proxy reads to turn a share of `kv_cache_usage_perc` into tokens.
    info = GaugeMetricFamily(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        labels=["block_size", "num_gpu_blocks", "engine"],
    )
    info.add_metric([str(snap.get("block_size", 0)), str(total), "0"], 1)
    yield info


# vLLM 0.32's `vllm:prompt_tokens_by_source` sources, and the engine counters behind them.
_PROMPT_SOURCES = {
    "local_compute": "vllm_prompt_local_compute",
    "local_cache_hit": "vllm_prompt_local_cache_hit",
    "external_kv_transfer": "vllm_prompt_external_kv_transfer",
}


def _vllm_prompt_counters(snap: dict[str, Any], model: str) -> Iterator[Metric]:
    """vLLM's prompt token counters under vLLM's names and labels (`engine`, `model_name`),
    counted as vLLM counts them (see `EngineCore._first_output`)."""
    labels = ["engine", "model_name"]
    values = ["0", model]

    def counter(name: str, doc: str, key: str) -> Metric:
        family = CounterMetricFamily(name, doc, labels=labels)
        family.add_metric(values, snap.get(key, 0))
        return family

    yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", "vllm_prompt_tokens")
    by_source = CounterMetricFamily(
        "vllm:prompt_tokens_by_source",
        "Number of prompt tokens by source.",
        labels=[*labels, "source"],
    )
    for source, key in _PROMPT_SOURCES.items():
        by_source.add_metric([*values, source], snap.get(key, 0))
    yield by_source
    yield counter(
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local + external).",
        "vllm_prompt_tokens_cached",
    )
    yield counter(
        "vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"
    )
    itl = HistogramMetricFamily(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        labels=labels,
    )
    itl.add_metric(values, snap.get("itl_buckets") or [("+Inf", 0)], snap.get("itl_sum", 0.0))
    yield itl
    residency = snap.get("idle_before_evict")
    if residency is not None:  # only with --kv-cache-metrics, as vLLM
        idle = HistogramMetricFamily(
            "vllm:kv_block_idle_before_evict_seconds",
            "Histogram of idle time before KV cache block eviction. Sampled metrics "
            "(controlled by --kv-cache-metrics-sample).",
            labels=labels,
        )
        idle.add_metric(values, residency[0], residency[1])
        yield idle


def render_metrics(snapshot: Callable[[], dict[str, Any]], model: str) -> Callable[[], bytes]:
    """A function producing the Prometheus text for the current snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshot, model))
    return lambda: bytes(generate_latest(registry))
