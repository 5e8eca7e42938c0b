"""The trace comparison (`bench/trace_compare.py`, `bench/_replay_fleet.py`): conversation
sampling, the fleets' engine flags and leases, goodput and the aims' verdicts, the engines'
prompt token counters, and one started fleet counting what its engines computed."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import Any

import pytest

from bench import _replay_fleet as rf
from bench import _trace as tr
from bench import trace_compare as tc
from bench import trace_replay
from kvrelay.enginesim.cli import build_parser, pool_from_args
from kvrelay.enginesim.metrics import render_metrics
from kvrelay.prometheus_text import parse_samples


def req(index: int, t_ms: float, length: int, out: int, ids: list[int]) -> tr.TraceRequest:
    return tr.TraceRequest(index, t_ms, length, out, tuple(ids))


def chained_plan(conversations: int, turns: int) -> tr.Plan:
    """`conversations` interleaved conversations of `turns` turns each (distinct ids)."""
    out: list[tr.TraceRequest] = []
    for t in range(turns):
        for conv in range(conversations):
            base = 1000 * (conv + 1)
            ids = [base + i for i in range(t + 2)]
            out.append(req(len(out), 1000.0 * len(out), 512 * (t + 1) + 100, 50, ids))
    return tr.reconstruct(out)


def test_sampling_keeps_whole_conversations_with_their_predecessors() -> None:
    plan = chained_plan(40, 3)
    assert plan.conversations == 40
    sample = tr.sample_conversations(plan, 0.5, seed=3)
    assert 0 < sample.conversations < 40
    assert len(sample.turns) == 3 * sample.conversations  # every turn of a kept conversation
    for i, t in enumerate(sample.turns):
        if t.turn == 1:
            assert t.predecessor is None
        else:
            assert t.predecessor is not None and t.predecessor < i
            prev = sample.turns[t.predecessor]
            assert prev.conversation == t.conversation and prev.turn == t.turn - 1
    # Deterministic for a seed, another seed draws another sample, 1 keeps everything.
    again = tr.sample_conversations(plan, 0.5, seed=3)
    assert [t.request.index for t in again.turns] == [t.request.index for t in sample.turns]
    other = tr.sample_conversations(plan, 0.5, seed=4)
    assert [t.request.index for t in other.turns] != [t.request.index for t in sample.turns]
    assert len(tr.sample_conversations(plan, 1.0).turns) == len(plan.turns)
    with pytest.raises(ValueError):
        tr.sample_conversations(plan, 0.0)


def test_sampling_spreads_over_the_slice_not_only_its_start() -> None:
    plan = chained_plan(200, 1)
    sample = tr.sample_conversations(plan, 0.1, seed=0)
    times = [t.request.timestamp_ms for t in sample.turns]
    last = plan.turns[-1].request.timestamp_ms
    assert min(times) < last / 4 and max(times) > 3 * last / 4


def hardware(**kw: Any) -> rf.Hardware:
    base: dict[str, Any] = {
        "engines": 4, "prefill_engines": 2, "profile": "llama3-8b-h100",
        "kv_link": "rdma-400g-13us", "kv_scale": 0.5, "unscaled_lease_s": 120.0,
    }  # fmt: skip
    base.update(kw)
    return rf.Hardware(**base)


def lease_of(args: list[str]) -> float:
    return float(args[args.index("--lease-seconds") + 1])


def test_d_lease_scales_with_time_p_lease_does_not_and_holds_off_cuts_d_only() -> None:
    hw = hardware(prefill_engines=3)
    kv = rf.system_by_label("kvrelay default")
    got = rf.roles(kv, hw, time_scale=10)
    assert [r for r, _ in got] == ["prefill"] * 3 + ["decode"]
    assert [lease_of(a) for _, a in got] == [120.0, 120.0, 120.0, 12.0]
    off = rf.roles(rf.system_by_label("kvrelay holds off"), hw, time_scale=10)
    assert [lease_of(a) for _, a in off] == [120.0] * 3 + [rf.HOLDS_OFF_LEASE_S]
    agg = rf.roles(rf.system_by_label("aggregated cache_aware"), hw, time_scale=4)
    assert [r for r, _ in agg] == ["both"] * 4
    assert {lease_of(a) for _, a in agg} == {30.0}
    # The proxy's TTL and safety margin shrink by the same factor; the policy is passed on.
    settings = trace_replay.scaled_settings(10, 120.0)
    env = rf.proxy_env(rf.system_by_label("kvrelay always_p"), settings)
    assert env["KVRELAY_ROUTING_POLICY"] == "always_p"
    assert float(env["KVRELAY_CONVERSATION_TTL_S"]) == 60.0
    assert "KVRELAY_ROUTING_POLICY" not in rf.proxy_env(kv, settings)


def test_a_hold_budget_trial_reaches_every_engine_and_none_otherwise() -> None:
    kv = rf.system_by_label("kvrelay default")
    flag = "--hold-budget-fraction"
    budgeted = rf.roles(kv, hardware(hold_budget=0.3), time_scale=10)
    assert all(a[a.index(flag) + 1] == "0.3" for _, a in budgeted)
    assert not any(flag in a for _, a in rf.roles(kv, hardware(), time_scale=10))


def test_lru_capacity_is_the_pool_the_engines_really_get() -> None:
    hw = hardware(kv_scale=0.34)
    args = build_parser().parse_args(rf.engine_args(hw, 5.0))
    num_blocks, block_size, max_model_len = pool_from_args(args)
    assert (num_blocks, block_size) == (hw.pool_blocks(), hw.block_size())
    assert hw.fleet_trace_blocks() == 4 * num_blocks * block_size // 512
    assert max_model_len >= 126_195  # the trace's longest prompt fits at this share
    assert args.enable_prefix_caching  # the cache is the pool: no capacity of its own


def test_goodput_interpolates_where_attainment_crosses_ninety_percent() -> None:
    rate, text = tc.goodput([(1.0, 1.0), (2.0, 0.95), (4.0, 0.55)])
    assert rate == pytest.approx(2.0 + 0.05 / 0.40 * 2.0) and text == "2.25"
    assert tc.goodput([(4.0, 0.2), (1.0, 0.8)]) == (0.0, "< 1.00")
    assert tc.goodput([(2.0, 0.99), (1.0, 0.91)]) == (2.0, ">= 2.00")


def row(rps: float, att: float, later: float, tpot: float, reuse: float) -> dict[str, Any]:
    return {
        "offered_rps": rps, "attainment": att, "ttft_later_p50": later, "tpot_p90": tpot,
        "reuse_vs_lru": reuse, "prompt_tokens_reused": 1000.0,
    }  # fmt: skip


def test_verdicts_print_each_aim_met_or_missed_with_its_ratio() -> None:
    rows = {
        tc.OURS: {1.0: row(1, 1.0, 0.1, 0.030, 0.8), 2.0: row(2, 0.95, 0.2, 0.032, 0.8)},
        tc.RIVAL: {1.0: row(1, 0.95, 0.5, 0.03, 0.5), 2.0: row(2, 0.5, 0.5, 0.03, 0.5)},
        tc.HOLDS_OFF: {1.0: row(1, 0.9, 0.4, 0.03, 0.1), 2.0: row(2, 0.5, 0.4, 0.030, 0.1)},
    }
    lines = tc.verdicts(rows, 2.0)
    assert len(lines) == 4
    assert "ratio" in lines[0] and "-> met" in lines[0]  # >= 2.00 against about 1.1
    # Later-turn TTFT at each rate both systems ran.
    assert "at 1.00 req/s" in lines[1] and "ratio 0.20 -> met" in lines[1]
    assert "at 2.00 req/s" in lines[2] and "ratio 0.40 -> met" in lines[2]
    assert "0.80 of the LRU bound" in lines[3] and "ratio 1.07 -> met" in lines[3]
    rows[tc.OURS][2.0] = row(2, 0.5, 0.3, 0.040, 0.7)
    lines = tc.verdicts(rows, 2.0)
    assert "MISSED" in lines[0]
    assert "ratio 0.60 -> MISSED" in lines[2]
    assert "ratio 1.33 -> MISSED" in lines[3]
    # A rival measured only below the middle rate is still compared where it ran.
    del rows[tc.RIVAL][2.0]
    lines = tc.verdicts(rows, 2.0)
    assert len(lines) == 3 and "at 1.00 req/s" in lines[1] and "ratio 0.20 -> met" in lines[1]


def test_prompt_counters_read_the_engines_vllm_series() -> None:
    snap = {
        "vllm_prompt_local_compute": 700,
        "vllm_prompt_local_cache_hit": 200,
        "vllm_prompt_external_kv_transfer": 100,
    }
    page = parse_samples(render_metrics(lambda: snap, "m")().decode())
    got = rf.prompt_counters(page)
    assert got == {"local_compute": 700, "local_cache_hit": 200, "external_kv_transfer": 100}
    assert rf.counter_delta(dict.fromkeys(got, 100.0), got)["local_compute"] == 600
    share = rf.pinned_share([(10, 100), (30, 100)])
    assert share == {"mean": 0.2, "max": 0.3}
    assert math.isnan(rf.pinned_share([])["mean"])


def test_aggregated_fleet_starts_and_its_engines_count_computed_prompt_tokens() -> None:
    hw = hardware(engines=2, prefill_engines=1, kv_scale=0.02)
    system = rf.system_by_label("aggregated cache_aware")
    settings = trace_replay.scaled_settings(1.0)
    with rf.fleet(system, hw, 1.0, settings, "t") as f:
        assert len(f.both) == 2 and f.holders == f.both
        sampler = rf.EngineSampler(f)

        async def computed_after_warm_up() -> float:
            before = await sampler.counters()
            await tc.warm_up(f.url, 1)  # two 64-token prompts through the router
            # Engines publish counters with their loop's next snapshot: wait for them, bounded.
            deadline = time.monotonic() + 10
            while True:
                delta = rf.counter_delta(before, await sampler.counters())["local_compute"]
                if delta >= 2 * 64 or time.monotonic() > deadline:
                    return delta
                await asyncio.sleep(0.05)

        assert asyncio.run(computed_after_warm_up()) >= 2 * 64
    assert not f.front.process.alive and not any(e.process.alive for e in f.engines)


def test_lease_race_counts_later_turns_arriving_after_the_hold_expired() -> None:
    # Three conversations of two turns; second turns 60 s, 118 s and 300 s after the first.
    reqs = [
        req(0, 0, 700, 50, [1, 2]), req(1, 1_000, 700, 50, [3, 4]),
        req(2, 2_000, 700, 50, [5, 6]), req(3, 60_000, 1300, 50, [1, 7, 8]),
        req(4, 119_000, 1300, 50, [3, 9, 10]), req(5, 302_000, 1300, 50, [5, 11, 12]),
    ]  # fmt: skip
    plan = tr.reconstruct(reqs)
    assert plan.conversations == 3
    race = tc.lease_race(plan, 120.0, 5.0)  # expired past 115 s
    assert (race["later_turns"], race["past_lease"]) == (3, 2)
    assert tc.lease_race(plan, 600.0, 5.0)["past_lease"] == 0


def test_trial_rows_are_labelled_with_what_they_changed() -> None:
    kv, agg = rf.system_by_label("kvrelay default"), rf.system_by_label("aggregated cache_aware")
    assert tc.trial_suffix(tc.parse_args([]), kv) == ""
    args = tc.parse_args(["--lease-s", "600", "--prefill-engines", "6"])
    assert tc.trial_suffix(args, kv) == " (lease 600 s, 6 P + 2 D)"
    assert tc.trial_suffix(args, agg) == " (lease 600 s)"  # no split when aggregated
    budget = tc.parse_args(["--lease-s", "600", "--hold-budget", "0.3"])
    assert tc.trial_suffix(budget, kv) == " (lease 600 s, hold budget 0.3)"
    labels = ["kvrelay holds off", "kvrelay default (lease 600 s)", "kvrelay default"]
    assert tc.ordered(labels) == [labels[2], labels[1], labels[0]]


def test_routing_counts_split_first_and_later_turns_and_skip_failed_ones() -> None:
    records = [
        {"turn": 1, "routing": "prefill_chosen", "error": None},
        {"turn": 1, "routing": "spilled", "error": None},
        {"turn": 2, "routing": "decode_only", "error": None},
        {"turn": 3, "routing": "decode_only", "error": None},
        {"turn": 2, "routing": "spilled", "error": "APIError: x"},
        {"turn": 2, "routing": None, "error": None},  # a front that reports none
    ]
    assert tc.routing_counts(records) == {
        "first": {"prefill_chosen": 1, "spilled": 1},
        "later": {"decode_only": 2},
    }


def _replayed(index: int, ttft_s: float, tpot_s: float) -> dict[str, Any]:
    rec = trace_replay.Record(
        index=index, conversation=index, turn=1, predecessor=None, conversation_id=None,
        expected_prompt_tokens=100, expected_output_tokens=10, arrival_s=0.0,
        ttft_s=ttft_s, tpot_s=tpot_s, prompt_tokens=100, routing="prefill_chosen",
    )  # fmt: skip
    return dataclasses.asdict(rec)


def _run(records: list[dict[str, Any]], computed: float, args: Any) -> dict[str, Any]:
    return {
        "summary": trace_replay.summarize([trace_replay.Record(**r) for r in records], 10.0, args),
        "fleet_prompt_tokens": {"local_compute": computed},
        "frees": {"budget": 1.0},
        "held_series": [{"held": 10, "total": 100}],
        "records": records,
    }


def test_repeats_pool_their_requests_and_hold_reuse_against_the_bound_once_per_run() -> None:
    args = tc.parse_args(["--repeats", "2"])
    assert args.repeats == 2
    # Run one: 3 of 4 requests meet the SLO (5 s TTFT, 100 ms TPOT); run two: 1 of 4.
    one = [_replayed(i, 1.0, 0.02) for i in range(3)] + [_replayed(3, 9.0, 0.02)]
    two = [_replayed(i, 1.0, 0.5) for i in range(3)] + [_replayed(3, 1.0, 0.02)]
    runs = [_run(one, 300.0, args), _run(two, 100.0, args)]
    run = tc.pooled(runs, args)
    assert run["attainments"] == [0.75, 0.25]
    assert run["summary"]["slo_attainment"] == 0.5  # 4 of the 8 requests, not a single run's
    assert run["frees"] == {"budget": 2.0}
    lru = {"reused_tokens": 200, "prompt_tokens": 400, "capacity_blocks": 1}
    row = tc.derive(run, lru, 1.0)
    # Sent 800, computed 400 over two runs: 200 reused per run against a bound of 200 a run.
    assert row["prompt_tokens_reused"] == 200 and row["reuse_vs_lru"] == 1.0
    assert row["routing"] == {"first": {"prefill_chosen": 4}, "later": {}}
    assert tc._slo_met(row) == "50% (75% / 25%)"
    # One run is its own row, unchanged.
    single = tc.derive(tc.pooled(runs[:1], args), lru, 1.0)
    assert single["attainment"] == 0.75 and single["reuse_vs_lru"] == 0.5
    assert tc._slo_met(single) == "75%"
    with pytest.raises(SystemExit):
        tc.parse_args(["--repeats", "0"])


def test_each_cost_profile_writes_its_own_results_section() -> None:
    assert tc.section_of(tc.parse_args([])) == "trace replay"
    tp4 = tc.parse_args(["--profile", "llama3-70b-h100-tp4"])
    assert tc.section_of(tp4) == "trace replay (llama3-70b-h100-tp4)"


def test_held_samples_of_repeats_are_split_where_the_replay_clock_restarts() -> None:
    series = [{"t_s": t, "held": 1, "total": 10} for t in (0.0, 1.0, 2.0, 0.5, 1.5, 0.0)]
    runs = tc._runs_of(series)
    assert [[x["t_s"] for x in run] for run in runs] == [[0.0, 1.0, 2.0], [0.5, 1.5], [0.0]]
    assert tc._runs_of([]) == []
