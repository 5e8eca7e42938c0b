"""The connector's counters in vLLM's own reporting: `KVConnectorStats` and Prometheus.

Each side (scheduler, every worker rank) reports the change of its core counters since its last
report; vLLM aggregates them per step, logs them every log interval ("KV Transfer metrics:
tokens_loaded=…, freed_by_read=…") and feeds them to `KVRelayPromMetrics`, which exposes them on
the engine's `/metrics` as `vllm:kvrelay_<counter>_total` and `vllm:kvrelay_<gauge>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

# Current values rather than event counts (the rest of the core's stats are counters).
GAUGES = frozenset(
    {
        "held",
        "held_blocks",
        "loads_in_flight",
        "reads_in_flight",
        "reads_cancelling",
        "quarantined_blocks",
        "holders_down",
        "holding",
    }
)
_METRIC_PREFIX = "vllm:kvrelay_"


class StatsDelta:
    """Turns a side's cumulative core counters into per-report changes."""

    def __init__(self, suffix: str = "") -> None:
        # Worker gauges get a rank suffix so ranks do not overwrite each other.
        self._suffix = suffix
        self._last: dict[str, int] = {}

    def take(self, snapshot: dict[str, int]) -> dict[str, Any] | None:
        counters: dict[str, int] = {}
        gauges: dict[str, int] = {}
        changed = False
        for name, value in snapshot.items():
            previous = self._last.get(name, 0)
            if name in GAUGES:
                gauges[name + self._suffix] = value
                changed = changed or value != previous or name not in self._last
            elif value != previous:
                counters[name] = value - previous
                changed = True
        self._last = dict(snapshot)
        if not changed:
            return None
        return {"counters": counters, "gauges": gauges}


@dataclass
class KVRelayStats(KVConnectorStats):
    """vLLM stats container: `data = {"counters": {name: delta}, "gauges": {name: value}}`."""

    def __post_init__(self) -> None:
        self.data.setdefault("counters", {})
        self.data.setdefault("gauges", {})

    def reset(self) -> None:
        empty: dict[str, Any] = {"counters": {}, "gauges": {}}
        self.data = empty

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        other_data: dict[str, Any] = other.data
        counters: dict[str, int] = dict(self.data["counters"])
        for name, value in other_data.get("counters", {}).items():
            counters[name] = counters.get(name, 0) + int(value)
        # Later observations of a gauge replace earlier ones.
        gauges = {**self.data["gauges"], **other_data.get("gauges", {})}
        return KVRelayStats(data={"counters": counters, "gauges": gauges})

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            name: value for name, value in sorted(self.data["counters"].items()) if value
        }
        out.update(sorted(self.data["gauges"].items()))
        return out

    def is_empty(self) -> bool:
        return not any(self.data["counters"].values()) and not self.data["gauges"]


class KVRelayPromMetrics(KVConnectorPromMetrics):
    """Prometheus series for the connector's counters and gauges, created on first sight."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._counters: dict[str, dict[int, Any]] = {}
        self._gauges: dict[str, dict[int, Any]] = {}

    def _series(self, kind: str, name: str) -> dict[int, Any]:
        table = self._counters if kind == "counter" else self._gauges
        if name not in table:
            cls = self._counter_cls if kind == "counter" else self._gauge_cls
            metric = cls(
                name=_METRIC_PREFIX + name,
                documentation=f"kvrelay connector {kind}: {name.replace('_', ' ')}",
                labelnames=self._labelnames,
            )
            table[name] = create_metric_per_engine(metric, self.per_engine_labelvalues)
        return table[name]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.get("counters", {}).items():
            if value > 0:
                self._series("counter", name)[engine_idx].inc(value)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            self._series("gauge", name)[engine_idx].set(value)
