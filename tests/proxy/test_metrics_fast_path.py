"""The request path's metric updates (`metrics.Labelled`) bypass prometheus-client's checks;
what they expose must be exactly what the client's own `inc`/`dec`/`observe` would expose."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvrelay.proxy.telemetry import metrics
from kvrelay.proxy.telemetry.metrics import Labelled

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 1, 10)
OBSERVED = [0.0, 0.001, 0.005, 0.0050001, 0.01, 0.07, 1.0, 9.99, 10.0, 10.5, 1e9, -3.0, math.inf]


def _metrics(registry: CollectorRegistry) -> tuple[Any, Any, Any]:
    return (
        Counter("t_requests_total", "doc", ["route"], registry=registry),
        Gauge("t_inflight", "doc", ["route"], registry=registry),
        Histogram("t_latency_seconds", "doc", ["leg"], buckets=BUCKETS, registry=registry),
    )


def _exposition(registry: CollectorRegistry) -> list[str]:
    # `_created` samples carry creation times, which differ between the two registries.
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


def _drive(
    counter: Callable[[str], Any], gauge: Callable[[str], Any], histogram: Callable[[str], Any]
) -> None:
    counter("chat").inc()
    counter("chat").inc(2.5)
    counter("completions").inc()
    gauge("chat").inc()
    gauge("chat").inc()
    gauge("chat").dec()
    gauge("completions").set(7)
    for value in OBSERVED:
        histogram("decode").observe(value)
    histogram("prefill").observe(0.02)


@pytest.mark.parametrize("direct", [True, False], ids=["in-process", "multiprocess-path"])
def test_fast_children_expose_what_the_clients_own_methods_expose(
    direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one process the wrappers add to the client's floats themselves; in multiprocess mode
    (forced here) they call the mmap-backed stores' own `inc`. Both expose the same."""
    if not direct:
        monkeypatch.setattr(metrics, "_direct", lambda store: False)
    slow, fast = CollectorRegistry(), CollectorRegistry()
    s_counter, s_gauge, s_histogram = _metrics(slow)
    f_counter, f_gauge, f_histogram = (Labelled(m) for m in _metrics(fast))
    _drive(s_counter.labels, s_gauge.labels, s_histogram.labels)
    _drive(f_counter.labels, f_gauge.labels, f_histogram.labels)
    assert _exposition(fast) == _exposition(slow)
    # The installed client has the layout the wrappers expect: the fast path is in use.
    for child in (f_counter.labels("chat"), f_gauge.labels("chat"), f_histogram.labels("decode")):
        assert type(child).__name__.startswith("_Fast")
        assert child._direct is direct


def test_a_fast_counter_still_refuses_to_go_down() -> None:
    counter = Labelled(Counter("t_down_total", "doc", ["x"], registry=CollectorRegistry()))
    with pytest.raises(ValueError):
        counter.labels("a").inc(-1)


def test_a_child_of_an_unknown_layout_is_used_as_it_is() -> None:
    class Odd:
        def labels(self, *values: str) -> object:
            return "the child itself"

    assert Labelled(Odd()).labels("a") == "the child itself"
