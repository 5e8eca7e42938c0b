"""How long a D's prefix cache keeps an unused block, read from its residency histogram
(`CacheResidence`), and what a hold taken sooner than that counts for (`HoldPayoff`)."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from kvrelay.enginesim.histogram import RESIDENCY_BUCKETS, Histogram
from kvrelay.enginesim.metrics import render_metrics
from kvrelay.prometheus_text import parse_samples
from kvrelay.proxy.fleet.cache_residence import CacheResidence
from kvrelay.proxy.fleet.engine_load import load_from_metrics
from kvrelay.proxy.fleet.hold_payoff import HoldPayoff

NAME = "vllm:kv_block_idle_before_evict_seconds"


def _vllm_page(cores: list[list[float]]) -> str:
    """A page as vLLM serves it with `--kv-cache-metrics`: one histogram per engine core."""
    lines = ['vllm:num_requests_running{engine="0",model_name="m"} 0.0']
    for core, idles in enumerate(cores):
        labels = f'engine="{core}",model_name="m"'
        for bound in (*RESIDENCY_BUCKETS, float("inf")):
            le = "+Inf" if bound == float("inf") else repr(bound)
            count = sum(1 for i in idles if i <= bound)
            lines.append(f'{NAME}_bucket{{{labels},le="{le}"}} {float(count)}')
        lines.append(f"{NAME}_count{{{labels}}} {float(len(idles))}")
        lines.append(f"{NAME}_sum{{{labels}}} {float(sum(idles))}")
    return "\n".join(lines) + "\n"


def _read(pages: list[str]) -> CacheResidence | None:
    previous = None
    for page in pages:
        previous = CacheResidence.read(parse_samples(page), previous)
    return previous


def test_the_median_of_the_evictions_since_the_first_reading_summed_over_engine_cores() -> None:
    before = [[1.0] * 50, [1.0] * 50]  # evicted before the proxy's first reading: not counted
    after = [[1.0] * 50 + [3.0] * 6, [1.0] * 50 + [3.0] * 4 + [40.0] * 2]
    residence = _read([_vllm_page(before), _vllm_page(after)])
    assert residence is not None
    # 12 evictions since: ten at 3 s (bucket 2-5 s), two at 40 s; the median lies in 2-5 s.
    assert residence.keeps_s() == pytest.approx(2.0 + 3.0 * 6 / 10)
    assert _read([_vllm_page(before)]) is not None and _read([_vllm_page(before)]).keeps_s() is None  # type: ignore[union-attr]


def test_too_few_evictions_or_no_histogram_is_no_figure() -> None:
    assert _read([_vllm_page([[]]), _vllm_page([[2.0] * 7])]).keeps_s() is None  # type: ignore[union-attr]
    assert (
        CacheResidence.read(parse_samples('vllm:num_requests_running{engine="0"} 1\n'), None)
        is None
    )


def test_recent_evictions_outweigh_old_ones_and_a_restart_starts_over() -> None:
    idles: list[float] = []
    pages = [_vllm_page([idles])]
    idles += [50.0] * 200  # a quiet cache: blocks survived 30-60 s
    pages.append(_vllm_page([idles]))
    idles += [0.3] * 200  # then pressure: 0.2-0.5 s
    pages.append(_vllm_page([idles]))
    residence = _read(pages)
    assert residence is not None and residence.keeps_s() is not None
    assert residence.keeps_s() < 0.5  # type: ignore[operator]
    restarted = CacheResidence.read(parse_samples(_vllm_page([[10.0] * 3])), residence)
    assert restarted is not None and restarted.keeps_s() is None


def test_the_load_reading_carries_it_from_an_enginesim_page() -> None:
    # enginesim serves the histogram under vLLM's name, labels and buckets.
    histogram = Histogram(RESIDENCY_BUCKETS)
    page = render_metrics(
        lambda: {"idle_before_evict": (histogram.cumulative(), histogram.sum)}, "m"
    )
    first = load_from_metrics(page().decode(), 0.0)
    for _ in range(20):
        histogram.observe(12.0)
    second = load_from_metrics(page().decode(), 1.0, first)
    assert second is not None and second.residence is not None
    assert 10.0 < second.residence.keeps_s() < 20.0  # type: ignore[operator]
    no_metrics = render_metrics(lambda: {}, "m")().decode()
    assert NAME not in no_metrics  # off unless --kv-cache-metrics, as in vLLM
    assert load_from_metrics(no_metrics, 0.0).residence is None  # type: ignore[union-attr]


def test_holds_taken_sooner_than_the_cache_keeps_a_block_stop_holding_but_for_probes() -> None:
    """Every hold is taken and read, but within the time D's cache would have kept the history
    anyway: they pinned D for nothing, so the tenant stops holding (probes aside)."""
    now = [0.0]
    holds = HoldPayoff(min_use=0.1, patience_s=60, ttl_s=600, clock=lambda: now[0])
    labels = {"decision": "cache_kept"}
    kept_before = REGISTRY.get_sample_value("kvrelay_hold_decisions_total", labels) or 0.0
    decisions = []
    for i in range(200):
        hold = holds.worth_holding("t")
        decisions.append(hold)
        if hold:
            holds.made("t", ("t", i))
        now[0] += 1
        if i >= 2 and decisions[i - 2]:
            age = holds.taken("t", ("t", i - 2))
            assert age == 3.0  # made at i - 2, taken once the clock passed i
            holds.used("t", read=True, cache_kept=age < 30.0)
    assert all(decisions[:16]) and sum(decisions[100:]) <= 15
    kept_after = REGISTRY.get_sample_value("kvrelay_hold_decisions_total", labels) or 0.0
    assert kept_after - kept_before >= 16
    # The same takes where the cache keeps blocks only a second: the holds pay.
    paying = HoldPayoff(min_use=0.1, patience_s=60, ttl_s=600, clock=lambda: now[0])
    for i in range(100):
        assert paying.worth_holding("t")
        paying.made("t", ("t", i))
        now[0] += 2
        age = paying.taken("t", ("t", i))
        assert age is not None
        paying.used("t", read=True, cache_kept=age < 1.0)
    assert paying.taken("t", ("t", "never made")) is None


def test_a_conversation_that_came_back_sooner_than_the_cache_keeps_does_not_hold() -> None:
    """The per-conversation rule: a turn whose conversation came back sooner than its D's
    cache keeps an unused block asks for no hold (`cache_keeps`), from the first such turn, with
    no tenant-wide evidence. The turn that ended unheld leaves its gap and its D for the next
    turn (`unheld`, read back once by `missed`); past the TTL it is forgotten."""
    now = [0.0]
    holds = HoldPayoff(min_use=0.05, patience_s=60, ttl_s=600, clock=lambda: now[0])
    labels = {"decision": "cache_keeps"}
    before = REGISTRY.get_sample_value("kvrelay_hold_decisions_total", labels) or 0.0
    assert holds.worth_holding("t")  # a first turn: nothing known, it holds
    assert not holds.worth_holding("t", sooner_than_cache=True)
    after = REGISTRY.get_sample_value("kvrelay_hold_decisions_total", labels) or 0.0
    assert after == before + 1
    # Every turn holds where hold_min_use is 0: the rule does not apply, nothing is followed.
    always = HoldPayoff(min_use=0, patience_s=60, ttl_s=600, clock=lambda: now[0])
    assert always.worth_holding("t", sooner_than_cache=True)
    always.unheld("t", ("t", "c"), "http://d1")
    assert always.missed("t", ("t", "c")) is None
    # The gap of a conversation whose last turn ended unheld, and the D that served it.
    holds.unheld("t", ("t", "c"), "http://d1")
    now[0] += 7.5
    assert holds.missed("t", ("t", "c")) == (7.5, "http://d1")
    assert holds.missed("t", ("t", "c")) is None  # read back once
    assert holds.missed("other", ("t", "c")) is None  # another tenant's conversation
    holds.unheld("t", ("t", "late"), "http://d2")
    now[0] += 601
    holds.worth_holding("t")  # the tenant's bookkeeping runs; the TTL has passed
    assert holds.missed("t", ("t", "late")) is None
