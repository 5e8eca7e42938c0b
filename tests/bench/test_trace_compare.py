"""The trace comparison (`bench/trace_compare.py`, `bench/_replay_fleet.py`): conversation
sampling, the fleets' engine flags and leases, goodput and the aims' verdicts, the engines'
prompt token counters, and one started fleet counting what its engines computed."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench import _common as c
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


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_every_engine_models_transfers_in_the_layout_given() -> None:
    kv = rf.system_by_label("kvrelay default")
    agg = rf.system_by_label("aggregated cache_aware")
    for system in (kv, agg):
        engines = rf.roles(system, hardware(), time_scale=1)
        assert {flag(a, "--kv-transfer-layout") for _, a in engines} == {"block-major"}
        per_layer = rf.roles(system, hardware(kv_transfer_layout="per-layer"), time_scale=1)
        assert {flag(a, "--kv-transfer-layout") for _, a in per_layer} == {"per-layer"}


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


def test_a_systems_hold_max_reaches_its_ds_only_and_parses_as_the_engines_flag() -> None:
    """`d_hold_max` bounds one hold on each D (P's holds serve the turn's own pull); the flag
    reaches enginesim's parser as the connector's `hold_max_fraction`."""
    capped = rf.system_by_label("kvrelay kv events prefix wait spill 1 hold max 0.1")
    flag = "--hold-max-fraction"
    got = rf.roles(capped, hardware(prefill_engines=2), time_scale=10)
    assert [a[a.index(flag) + 1] for r, a in got if r == "decode"] == ["0.1", "0.1"]
    assert not any(flag in a for r, a in got if r == "prefill")
    assert build_parser().parse_args(got[-1][1]).hold_max_fraction == 0.1
    # The defaults' system leaves the connector's default; a step from the previous defaults
    # keeps their uncapped hold on D.
    plain = rf.system_by_label("kvrelay kv events")
    assert not any(flag in a for _, a in rf.roles(plain, hardware(), time_scale=10))
    step = rf.system_by_label("kvrelay kv events prefix wait spill 1")
    got = rf.roles(step, hardware(prefill_engines=2), time_scale=10)
    assert [a[a.index(flag) + 1] for r, a in got if r == "decode"] == ["1", "1"]
    # A trial's hardware-wide share still reaches every engine of a system without its own.
    trial = rf.roles(plain, hardware(hold_max=0.25), time_scale=10)
    assert all(a[a.index(flag) + 1] == "0.25" for _, a in trial)


def test_the_steps_from_the_previous_defaults_pin_them_and_add_their_labels_setting() -> None:
    """A system named for a step from the previous defaults measures that step whatever the
    defaults now are: the previous values first, its own after (the later pair wins)."""
    step = dict(rf.system_by_label("kvrelay kv events prefix wait").proxy_settings)
    assert step == {
        "KVRELAY_DECODE_ONLY_CACHED": "true",
        "KVRELAY_PREFIX_WAIT_MAX_S": "2",
        "KVRELAY_PREFILL_SPILL_FACTOR": "2",
    }
    before = rf.system_by_label("kvrelay previous default")
    assert dict(before.proxy_settings)["KVRELAY_DECODE_ONLY_CACHED"] == "false"
    assert before.d_hold_max == 1.0
    assert rf.system_by_label("kvrelay default").proxy_settings == ()


def test_kv_events_systems_publish_from_every_engine_each_on_its_own_port() -> None:
    """P and D publish (a P pulls a history from a D's cache), each on its own endpoint, each
    admitting pins ahead of its queue; the proxy is told every engine's endpoint."""
    got = rf.roles(rf.system_by_label("kvrelay kv events"), hardware(prefill_engines=2), 10)
    flag = "--kv-events-config"
    assert [r for r, _ in got] == ["prefill", "prefill", "decode", "decode"]
    assert all(flag in a and "priority" in a for _, a in got)
    assert len({a[a.index(flag) + 1] for _, a in got}) == 4
    engines = [
        c.Engine(f"http://127.0.0.1:{9000 + i}", f"e{i}", 0, None)  # type: ignore[arg-type]
        for i in range(4)
    ]
    pairs = rf.events_endpoints(engines, [a for _, a in got]).split(",")
    assert [p.split("=")[0] for p in pairs] == [e.url for e in engines]
    assert not any(
        flag in a for _, a in rf.roles(rf.system_by_label("kvrelay default"), hardware(), 10)
    )


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


def _gp(*values: float, crossed: bool = True) -> tc.Goodput:
    labels = tuple(f"{v:.2f}" if crossed else f">= {v:.2f}" for v in values)
    return tc.Goodput(values, labels)


def _below(*lowest_rates: float) -> tc.Goodput:
    """Rounds whose curve was under the attainment target at every rate (`goodput`'s 0)."""
    return tc.Goodput(tuple(0.0 for _ in lowest_rates), tuple(f"< {r:.2f}" for r in lowest_rates))


def test_a_ratio_aim_is_met_only_when_its_whole_interval_clears_it() -> None:
    # Goodput per round on each side: the interval is the worst and best pairing.
    assert tc.ratio_verdict(_gp(3.0, 3.3), _gp(2.0, 2.2), 1.3)[0] == "met"  # 1.36-1.65
    assert tc.ratio_verdict(_gp(2.0, 2.2), _gp(2.0, 2.2), 1.3)[0] == "MISSED"  # 0.91-1.10
    verdict, interval = tc.ratio_verdict(_gp(2.6, 3.0), _gp(2.0, 2.2), 1.3)
    assert verdict == "undetermined" and interval.startswith("1.18-1.50")  # straddles 1.3
    assert tc.ratio_verdict(_gp(3.0, 3.0), _gp(), 1.3)[0] == "undetermined"


def test_a_goodput_outside_the_measured_rates_judges_an_aim_only_as_the_bound_it_is() -> None:
    # At least the highest rate: a lower bound, enough when it alone clears the aim...
    verdict, interval = tc.ratio_verdict(_gp(5.0, 5.0, crossed=False), _gp(1.0, 1.2), 1.3)
    assert verdict == "met" and interval.startswith("4.17-inf")
    # ...and never a miss, however close: the true goodput may lie anywhere above it.
    assert tc.ratio_verdict(_gp(2.0, 2.0, crossed=False), _gp(2.0, 2.0), 1.3)[0] == "undetermined"
    # Below the lowest rate: an upper bound on the rival, so ours over it is a lower bound.
    verdict, interval = tc.ratio_verdict(_gp(3.71, 4.09), _below(3.07, 3.07), 1.3)
    assert verdict == "undetermined" and interval.startswith("1.21-inf")
    assert tc.ratio_verdict(_gp(4.1, 4.3), _below(3.07, 3.07), 1.3)[0] == "met"  # 1.34-inf
    # Ours below the lowest rate against a rival that crossed: an upper bound, a miss if short.
    assert tc.ratio_verdict(_below(1.0, 1.0), _gp(2.0, 2.2), 1.1)[0] == "MISSED"  # 0.00-0.50
    # Both below every rate: nothing known about the ratio.
    verdict, interval = tc.ratio_verdict(_below(1.0), _below(1.0), 1.0)
    assert verdict == "undetermined" and interval.startswith("0.00-inf")


def _cfgs(*labels: str) -> dict[str, tc.Config]:
    return {label: tc._config_of(label, 8) for label in labels}


def _row(rate: float, attainment: float, reuse: float, unused: float) -> dict[str, Any]:
    return {"rate": rate, "attainment": attainment, "reuse_vs_lru": reuse,
            "d_pinned_unused": unused}  # fmt: skip


def test_verdicts_judge_each_aim_against_the_best_of_each_family() -> None:
    ours, pd1, pd2, agg = (
        "kvrelay default (4P+4D)", "vllm-router power_of_two P/D (6P+2D)",
        "vllm-router cache_aware P/D (4P+4D)", "aggregated cache_aware",
    )  # fmt: skip
    configs = _cfgs(ours, pd1, pd2, agg, "kvrelay holds off (4P+4D)")
    gps = {ours: _gp(3.0, 3.2), pd1: _gp(2.0, 2.1), pd2: _gp(1.0, 1.1), agg: _gp(2.9, 3.0),
           "kvrelay holds off (4P+4D)": _gp(2.0, 2.0)}  # fmt: skip
    rows = {ours: {1.0: _row(1.0, 0.95, 0.95, 0.02), 2.0: _row(2.0, 0.5, 0.4, 0.12)}}
    lines = tc.verdicts(rows, gps, configs)
    # Against the best P/D router (power_of_two at 6+2), not the worst: 1.43-1.60 -> met.
    assert pd1 in lines[0] and "-> met" in lines[0]
    assert agg in lines[1] and "-> undetermined" in lines[1]  # 1.00-1.10 straddles 1.1
    assert "-> met" in lines[2]  # never below holds off
    # Reuse is judged at the rates within the SLO only; pinned-unused at the worst rate.
    assert "(1 of 2)" in lines[3] and "0.95" in lines[3] and "-> met" in lines[3]
    assert "12%" in lines[4] and "-> MISSED" in lines[4]


def test_engine_counters_read_the_engines_vllm_series_and_modelled_time() -> None:
    snap = {
        "vllm_prompt_local_compute": 700,
        "vllm_prompt_local_cache_hit": 200,
        "vllm_prompt_external_kv_transfer": 100,
        "prefill_tokens_computed": 750,  # 50 recomputed after a preemption
        "modelled_step_seconds": 4.0,
        "behind_model_seconds": 0.5,
    }
    page = parse_samples(render_metrics(lambda: snap, "m")().decode())
    got = rf.engine_counters(page)
    assert got == {"local_compute": 700, "local_cache_hit": 200, "external_kv_transfer": 100,
                   rf.GPU_PREFILL: 750, rf.MODELLED_STEP: 4.0, rf.BEHIND_MODEL: 0.5}  # fmt: skip
    assert tc.behind_model(got) == 0.125
    assert math.isnan(tc.behind_model({}))
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

        async def one_sample() -> dict[str, object]:
            async with aiohttp.ClientSession() as http:
                page = await sampler.scrape(http, f.holders[0].url)
            # Every queue gauge the sampler reads is one the engine exports.
            assert {k.split("{", 1)[0] for k in page} >= set(rf.D_QUEUE)
            task = asyncio.create_task(sampler.run())
            for _ in range(200):  # the first sample, waited on for at most 10 s
                if sampler.series:
                    break
                await asyncio.sleep(0.05)
            sampler.stop()
            await task
            return sampler.series[0]

        sample = asyncio.run(one_sample())
        per_d = sample["d"]
        assert isinstance(per_d, list) and len(per_d) == len(f.holders)
        assert all(len(d) == len(rf.D_QUEUE) + 1 for d in per_d)
    assert not f.front.process.alive and not any(e.process.alive for e in f.engines)


def test_priming_the_holds_has_kvrelay_judge_the_tenant_before_the_replay() -> None:
    # One P and one D: a warm-up wave is four one-off requests, each leaving a hold no turn
    # takes. One wave leaves the tenant unjudged (every turn still holds); waves that each wait
    # out the scaled patience give kvrelay enough decided holds to stop asking.
    hw = hardware(engines=2, prefill_engines=1, kv_scale=0.02)
    system = rf.system_by_label("kvrelay default")
    scale = 120.0
    settings = trace_replay.scaled_settings(scale)
    patience_s = float(settings["proxy_env"]["KVRELAY_HOLD_JUDGE_S"])
    declined = rf.HOLDS_TAKEN["holds_declined"]
    with rf.fleet(system, hw, scale, settings, "t") as f:
        sampler = rf.EngineSampler(f)

        async def declined_after(waves: int) -> float:
            await tc.warm_up(f.url, len(f.engines), waves, patience_s * 1.2)
            async with aiohttp.ClientSession() as http:
                return (await sampler.scrape(http, f.url)).get(declined, 0.0)

        assert asyncio.run(declined_after(1)) == 0
        assert asyncio.run(declined_after(6)) >= 1
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


def test_configs_name_their_split_and_refuse_one_that_does_not_add_up() -> None:
    configs = tc.parse_configs(
        "kvrelay default@6:2,vllm-router power_of_two P/D,aggregated cache_aware", 8
    )
    assert [c.label(8) for c in configs] == [
        "kvrelay default (6P+2D)", "vllm-router power_of_two P/D (4P+4D)",
        "aggregated cache_aware",
    ]  # fmt: skip
    assert [c.family for c in configs] == ["kvrelay default", "vllm-router P/D", "aggregated"]
    for bad in ("kvrelay default@5:4", "aggregated cache_aware@4:4", "kvrelay default@8:0"):
        with pytest.raises(ValueError):
            tc.parse_configs(bad, 8)
    assert tc._config_of("kvrelay default (6P+2D)", 8) == configs[0]


def test_rounds_rotate_the_order_so_no_configuration_always_runs_first() -> None:
    configs = tc.parse_configs("kvrelay default,kvrelay holds off,aggregated cache_aware", 8)
    firsts = {tc.run_order(configs, r, s)[0] for r in range(3) for s in range(2)}
    assert firsts == set(configs)
    assert sorted(tc.run_order(configs, 1, 1), key=configs.index) == configs


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


def _replayed(index: int, ttft_s: float, tpot_s: float) -> trace_replay.Record:
    return trace_replay.Record(
        index=index, conversation=index, turn=1, predecessor=None, conversation_id=None,
        expected_prompt_tokens=100, expected_output_tokens=10, arrival_s=0.0,
        ttft_s=ttft_s, tpot_s=tpot_s, prompt_tokens=100, routing="prefill_chosen",
    )  # fmt: skip


def test_a_request_without_a_second_token_is_judged_on_its_ttft_and_left_out_of_tpot() -> None:
    args = trace_replay.parse_args([])
    records = [_replayed(0, 1.0, 0.02), _replayed(1, 1.0, math.nan), _replayed(2, 9.0, math.nan),
               _replayed(3, 1.0, 0.5)]  # fmt: skip
    summary = trace_replay.summarize(records, 10.0, args)
    # Two requests have no TPOT (one output token): out of the TPOT percentile, and judged on
    # TTFT alone: the first meets the SLO, the second misses it (9 s > 2 s).
    assert summary["without_tpot"] == 2
    assert summary["tpot_s_p90"] == 0.5
    assert summary["slo_attainment"] == 0.5


def test_rows_take_the_median_of_their_rounds_and_goodput_is_per_round() -> None:
    def run(rate: float, attainment: float, busy: bool = False) -> dict[str, Any]:
        return {"rate": rate, "attainment": attainment, "errors": 0, "ttft_first_p50": 1.0,
                "ttft_first_p90": 1.0, "ttft_later_p50": 0.5, "ttft_later_p90": 0.5,
                "tpot_p90": 0.02, "prompt_tokens_reused": 10.0, "gpu_prefill_tokens": 90.0,
                "reuse_vs_lru": 0.5, "d_pinned": {"mean": 0.2}, "d_pinned_unused": 0.1,
                "load": {"busy": busy}}  # fmt: skip

    runs = {1.0: [run(1.0, 0.99), run(1.0, 0.95), run(1.0, 0.97, busy=True)],
            2.0: [run(2.0, 0.50), run(2.0, 0.85), run(2.0, 0.70)]}  # fmt: skip
    r = tc.row(runs[1.0])
    assert r["attainment"] == 0.97 and r["busy_runs"] == 1
    assert tc._slo_cell(r) == "97% (95%-99%) [1 busy]"
    gp = tc.goodputs(runs)
    assert len(gp.values) == 3 and gp.crossed
    assert gp.values[0] == pytest.approx(1.0 + 0.09 / 0.49)


def test_the_default_slice_and_the_rate_come_from_the_file(tmp_path: Any) -> None:
    short = [req(i, 1000 * i, 600, 10, [i]) for i in range(100)]  # 99 s of trace
    assert tc.default_slice(short) == (0.0, 100.0)
    long = [req(i, 20_000 * i, 600, 10, [i]) for i in range(200)]  # 3980 s
    assert tc.default_slice(long) == (600.0, 1200.0)
    path = tmp_path / "gen.jsonl"
    path.write_text("".join(
        f'{{"timestamp": {1000 * i}, "input_length": 600, "output_length": 10, '
        f'"hash_ids": [{i}, {1000 + i}]}}\n' for i in range(100)
    ))  # fmt: skip
    args = tc.parse_args(["--trace", str(path), "--sample", "1"])
    work = tc.load_workload(args)
    assert (work.slice_start_s, work.slice_span_s, len(work.sample)) == (0.0, 100.0, 100)
    assert work.rate(10.0) == pytest.approx(10.0)  # 100 requests over 100 s, 10x faster
    assert tc.citation(path).startswith("`") and tr.CITATION in tc.citation(
        trace_replay.DEFAULT_TRACE
    )


def test_pools_are_scaled_to_the_samples_share_unless_a_request_would_not_fit() -> None:
    args = tc.parse_args(["--sample", "0.5"])
    work = tc.Workload(Path("x"), 0.0, 10.0, 10, tr.Plan([], 512), [req(0, 0, 1000, 10, [1, 2])])
    assert tc.kv_scale(args, work)["scale"] == 0.5  # 1010 tokens fit in half an H100
    huge = dataclasses.replace(work, sample=[req(0, 0, 300_000, 10, list(range(586)))])
    got = tc.kv_scale(args, huge)
    assert got["scale"] == got["floor"] > 0.5 and got["share"] == 0.5
    assert tc.kv_scale(tc.parse_args(["--kv-scale", "0.3"]), work)["scale"] == 0.3


def test_each_trace_and_cost_profile_writes_its_own_results_section(tmp_path: Any) -> None:
    assert tc.section_of(tc.parse_args([])) == "trace replay"
    tp4 = tc.parse_args(["--profile", "llama3-70b-h100-tp4"])
    assert tc.section_of(tp4) == "trace replay (llama3-70b-h100-tp4)"
    other = tc.parse_args(["--trace", str(tmp_path / "shared_prefix.jsonl")])
    assert tc.section_of(other) == "trace replay (shared_prefix)"


def test_the_routing_table_shows_the_pulls_and_those_into_d() -> None:
    runs = {
        "kvrelay": {
            "1.0": [
                {
                    "routing": {"first": {"prefill_chosen": 3, "spilled": 2}, "later": {}},
                    "frees": {
                        "pulls_pulled": 4,
                        "pulls_not_pulled": 1,
                        "pulls_pin_timeout": 1,
                        "pulls_pin_failed": 1,
                        "pulled_tokens": 512,
                        "pulls_d_pulled": 2,
                    },
                }
            ]
        },
        "vllm-router": {"1.0": [{"routing": {}}]},  # a front that reports no routing
    }
    rows = {"kvrelay": {1.0: {"rate": 16.0}}, "vllm-router": {1.0: {"rate": 16.0}}}
    lines = tc._routing_table(rows, runs)
    body = [line for line in lines if line.startswith("| kvrelay |")]
    assert body == ["| kvrelay | 16.00 | 3 / 2 | 0 / 0 / 0 | 4 / 1 / 2 (512); into D 2 | - |"]
    assert not any(line.startswith("| vllm-router |") for line in lines)
    # A run that counted the pins made on a D says so.
    runs["kvrelay"]["1.0"][0]["frees"]["pins_on_d"] = 3
    body = [line for line in tc._routing_table(rows, runs) if line.startswith("| kvrelay |")]
    assert body == [
        "| kvrelay | 16.00 | 3 / 2 | 0 / 0 / 0 | 4 / 1 / 2 (512); into D 2; from D 3 | - |"
    ]
    # A run that counted the holds its next turns read and did not read says so.
    runs["kvrelay"]["1.0"][0]["frees"] |= {"holds_read": 5, "holds_unread": 7}
    body = [line for line in tc._routing_table(rows, runs) if line.startswith("| kvrelay |")]
    assert body[0].endswith("| 5 / 7 |")


def test_ttft_by_route_groups_p_s_two_decisions_and_skips_failed_and_unrouted_turns() -> None:
    records = [
        {"turn": 1, "routing": "prefill_chosen", "ttft_s": 4.0, "error": None},
        {"turn": 2, "routing": "prefill_affinity", "ttft_s": 2.0, "error": None},
        {"turn": 2, "routing": "prefill_chosen", "ttft_s": 6.0, "error": None},
        {"turn": 3, "routing": "spilled", "ttft_s": 0.5, "error": None},
        {"turn": 2, "routing": "decode_only", "ttft_s": 0.1, "error": None},
        {"turn": 2, "routing": "spilled", "ttft_s": None, "error": "HTTP 500"},
        {"turn": 2, "routing": None, "ttft_s": 1.0, "error": None},  # a front that reports none
        {"turn": 2, "routing": "spilled", "ttft_s": math.nan, "error": None},  # no token came
    ]
    assert tc.ttft_by_route(records) == {
        "first": {"through P": [4.0]},
        "later": {"through P": [2.0, 6.0], "spilled": [0.5], "decode-only": [0.1]},
    }


def test_the_ttft_table_pools_the_rounds_of_each_rate() -> None:
    def run(*ttfts: float) -> dict[str, object]:
        turns = [{"turn": 2, "routing": "spilled", "ttft_s": t, "error": None} for t in ttfts]
        return {"records": turns}

    runs = {
        "kvrelay": {"1.0": [run(1.0, 2.0), run(3.0)]},
        "vllm-router": {"1.0": [{"records": []}]},
    }
    rows = {"kvrelay": {1.0: {"rate": 16.0}}, "vllm-router": {1.0: {"rate": 16.0}}}
    lines = tc._ttft_route_table(rows, runs)
    body = [line for line in lines if line.startswith("| kvrelay |")]
    assert body == ["| kvrelay | 16.00 | - | - | - | - | - | 2.00 / 2.80 (3) |"]
    assert not any(line.startswith("| vllm-router |") for line in lines)


def test_rejudging_a_run_counts_its_requests_against_the_other_slo() -> None:
    records = [
        {"ttft_s": 1.0, "tpot_s": 0.020, "error": None},
        {"ttft_s": 1.0, "tpot_s": 0.030, "error": None},  # too slow a decode at 25 ms
        {"ttft_s": 6.0, "tpot_s": 0.010, "error": None},  # too late a first token at 5 s
        {"ttft_s": 2.0, "tpot_s": math.nan, "error": None},  # one token: judged on TTFT
        {"ttft_s": None, "tpot_s": None, "error": "HTTP 500"},
    ]
    data = {"runs": {"a": {"16": [{"attainment": 0.0, "records": records}]}}}
    tc.rejudge(data, 5000, 25)
    assert data["runs"]["a"]["16"][0]["attainment"] == pytest.approx(2 / 5)
    tc.rejudge(data, 10_000, 100)
    assert data["runs"]["a"]["16"][0]["attainment"] == pytest.approx(4 / 5)


def test_rejudge_slo_needs_an_earlier_run_and_two_positive_bounds() -> None:
    with pytest.raises(SystemExit):
        tc.parse_args(["--rejudge-slo", "5000,25"])
    for bad in ("5000", "5000,0", "a,b"):
        with pytest.raises(SystemExit):
            tc.parse_args(["--render-only", "--rejudge-slo", bad])
    assert tc.parse_args(["--render-only", "--rejudge-slo", "5000,25"]).rejudge_slo == (5000, 25)


def test_the_plot_goes_beside_results_only_when_results_are_written(tmp_path: Path) -> None:
    # --no-results leaves the repository's files alone, the plot included.
    assert tc.plot_path_of(tc.parse_args(["--no-results"])) is None
    assert tc.plot_path_of(tc.parse_args([])) == tc.DEFAULT_PLOT
    given = tmp_path / "p.png"
    assert tc.plot_path_of(tc.parse_args(["--no-results", "--plot", str(given)])) == given
