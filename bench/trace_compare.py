"""Mooncake FAST'25 conversation trace replayed side by side on one simulated fleet
(`python -m bench.trace_compare`): kvrelay against vllm-router P/D and aggregated engines.

Every system (`bench/_replay_fleet.py`) gets the same simulated GPUs (`--engines` enginesim
engines, `--profile`, `--kv-link`, `--kv-scale`), fresh for each run so no cache carries
over, and the same requests: a `--duration-s` slice of the trace from `--start-s`, whole
conversations sampled with probability `--sample` (`_trace.sample_conversations`), replayed
by `bench/trace_replay.py` (the `openai` SDK, streamed, each later turn carrying the answer
the engine gave) at each `--time-scales` factor. A scale of S replays S times faster: the
request rate is the sample's requests over the slice's length / S, and think times, D's hold
lease and the proxy's TTL and safety margin are all divided by S (`--print-scaled-settings`
of the replayer), so the think-time race is the trace's at every rate.

Per system and rate: SLO attainment (TTFT <= `--slo-ttft-ms` and TPOT <= `--slo-tpot-ms`,
the same targets for all), TTFT p50/p90 of first and later turns, TPOT p90, prompt tokens
computed across the fleet and reused (the engines' own `vllm:prompt_tokens_by_source`
counters), reuse against the offline LRU bound (one LRU cache as large as the fleet's KV
memory, from the `hash_ids`), and the share of D's KV pool pinned by holds over time.
Goodput: the request rate at which the attainment curve crosses 90% (linear between the
measured rates). Writes the `## trace replay` section of bench/RESULTS.md and
bench/trace_replay.png.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from bench import _common as c
from bench import _replay_fleet as rf
from bench import _trace as tr
from bench import trace_replay as replay_mod
from bench._plots import save_figure
from kvrelay.enginesim.costs import DEFAULT_LINK, LINKS, get_profile

SECTION = "trace replay"
DEFAULT_PROFILE = "llama3-8b-h100"
GOODPUT_ATTAINMENT = 0.9
GOODPUT_AIM = 1.3  # kvrelay default over vllm-router cache_aware P/D
LATER_TTFT_AIM = 0.5  # kvrelay default's later-turn TTFT p50 over cache_aware P/D's
REUSE_AIM = 0.75  # realized reuse over the LRU bound
TPOT_AIM = 1.1  # kvrelay default's TPOT p90 over holds off
RIVAL = "vllm-router cache_aware P/D"
OURS = "kvrelay default"
HOLDS_OFF = "kvrelay holds off"
# Per request, kept in the JSON for later analysis (the replayer's `Record` has more).
RECORD_FIELDS = (
    "index", "conversation", "turn", "arrival_s", "ready_s", "ttft_s", "tpot_s",
    "prompt_tokens", "cached_tokens", "headers", "routing", "prefilled_by", "error",
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    tr.add_slice_arguments(p, replay_mod.DEFAULT_TRACE, start_s=600.0, duration_s=1200.0)
    p.add_argument("--sample", type=float, default=0.05, help="share of conversations kept")
    p.add_argument("--seed", type=int, default=0, help="conversation sample seed")
    p.add_argument(
        "--time-scales", default="8,16,32", help="comma-separated speed-ups (request rates)"
    )
    p.add_argument("--systems", default=",".join(s.label for s in rf.SYSTEMS))
    p.add_argument("--engines", type=int, default=8, help="simulated GPUs per system")
    p.add_argument(
        "--prefill-engines", type=int, help="P engines of the P/D systems (default: half)"
    )
    p.add_argument("--profile", default=DEFAULT_PROFILE)
    p.add_argument("--kv-link", default=DEFAULT_LINK, choices=sorted(LINKS))
    p.add_argument(
        "--kv-scale",
        type=float,
        default=1.0,
        help="share of the profile's KV blocks per engine (below 0.34 the longest prompts "
        "no longer fit)",
    )
    p.add_argument("--lease-s", type=float, help="unscaled hold lease (default: connector's)")
    p.add_argument(
        "--hold-budget",
        type=float,
        help="share of each engine's KV pool holds may pin (default: connector's)",
    )
    # 5 s: a tenth of the sample's prompts need over 2 s of prefill on an idle H100.
    replay_mod.add_slo_arguments(p, ttft_ms=5000.0)
    p.add_argument("--conversation-ids", action="store_true", help="send X-Conversation-Id")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per system and rate, each on a fresh fleet; a row pools their requests "
        "(230 requests per run move the SLO share by several points from run to run)",
    )
    p.add_argument("--json", type=Path, default=c.WORK_DIR / "trace_compare.json")
    p.add_argument("--plot", type=Path, default=c.BENCH_DIR / "trace_replay.png")
    p.add_argument("--no-results", action="store_true")
    p.add_argument(
        "--merge",
        type=Path,
        action="append",
        default=[],
        help="with --render-only: add the rows of another run's JSON (e.g. a lease trial)",
    )
    p.add_argument(
        "--notes",
        type=Path,
        help="with --render-only: Markdown appended to the section (causes, trials)",
    )
    p.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite the section and plot from --json's earlier run (its own flags)",
    )
    args = p.parse_args(argv)
    try:
        args.scales = sorted({float(x) for x in args.time_scales.split(",") if x.strip()})
        args.system_list = [rf.system_by_label(x.strip()) for x in args.systems.split(",")]
    except ValueError as err:
        p.error(str(err))
    if not args.scales or min(args.scales) <= 0:
        p.error("--time-scales must be positive numbers")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.prefill_engines is None:
        args.prefill_engines = args.engines // 2
    if not 0 < args.prefill_engines < args.engines:
        p.error("--prefill-engines must leave at least one P and one D")
    if not 0 < args.sample <= 1:
        p.error("--sample must be in (0, 1]")
    return args


def hardware(args: argparse.Namespace) -> rf.Hardware:
    lease = args.lease_s if args.lease_s is not None else replay_mod._defaults()["lease_seconds"]
    return rf.Hardware(
        args.engines,
        args.prefill_engines,
        args.profile,
        args.kv_link,
        args.kv_scale,
        lease,
        args.hold_budget,
    )


# --------------------------------------------------------------------------- one run


def replayer_args(args: argparse.Namespace, url: str, scale: float) -> argparse.Namespace:
    argv = [
        "--base-url", url, "--time-scale", f"{scale:g}",
        "--slo-ttft-ms", f"{args.slo_ttft_ms:g}", "--slo-tpot-ms", f"{args.slo_tpot_ms:g}",
    ]  # fmt: skip
    if args.conversation_ids:
        argv.append("--conversation-ids")
    return replay_mod.parse_args(argv)


async def warm_up(url: str, engines: int) -> None:
    """Short requests through the front, unmeasured: NIXL handshakes happen here."""
    client = AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=120)
    async with client:
        model = (await client.models.list()).data[0].id

        async def one(i: int) -> None:
            text = tr.text_at([-1 - i], 0, 64, tr.TRACE_BLOCK_TOKENS)
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": text}],
                max_tokens=2,
                stream=True,
            )
            async for _ in stream:
                pass

        await asyncio.gather(*(one(i) for i in range(2 * engines)))


async def run_once(
    fleet: rf.Fleet, plan: tr.Plan, args: argparse.Namespace, scale: float
) -> dict[str, Any]:
    await warm_up(fleet.url, len(fleet.engines))
    sampler = rf.EngineSampler(fleet, interval_s=max(0.25, 10.0 / scale))
    before = await sampler.counters()
    frees_before = await sampler.frees()
    task = asyncio.create_task(sampler.run())
    rargs = replayer_args(args, fleet.url, scale)
    try:
        result = await replay_mod.replay(plan, rargs)
    finally:
        sampler.stop()
        await task
    await asyncio.sleep(0.5)  # engines publish counters from their loop's next snapshot
    fleet_tokens = rf.counter_delta(before, await sampler.counters())
    frees = await sampler.frees()
    return {
        "summary": result["summary"],
        "fleet_prompt_tokens": fleet_tokens,
        "frees": {k: v - frees_before.get(k, 0.0) for k, v in frees.items()},
        "held_series": sampler.series,
        "records": result["records"],
    }


def pooled(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """One run's figures from repeats of it on fresh fleets: their requests pooled (the SLO
    share and percentiles over all of them), engine counters and frees summed, held-block
    samples joined; `attainments` keeps each repeat's SLO share to show the spread."""
    if len(runs) == 1:
        return {**runs[0], "attainments": [runs[0]["summary"]["slo_attainment"]]}
    records = [r for run in runs for r in run["records"]]
    wall_s = sum(run["summary"]["wall_s"] for run in runs)
    summary = replay_mod.summarize([replay_mod.Record(**r) for r in records], wall_s, args)
    return {
        "summary": summary,
        "fleet_prompt_tokens": _summed([run["fleet_prompt_tokens"] for run in runs]),
        "frees": _summed([run["frees"] for run in runs]),
        "held_series": [x for run in runs for x in run["held_series"]],
        "records": records,
        "attainments": [run["summary"]["slo_attainment"] for run in runs],
    }


def _summed(counters: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for one in counters:
        for k, v in one.items():
            out[k] = out.get(k, 0.0) + v
    return out


def derive(run: dict[str, Any], lru: dict[str, int], offered_rps: float) -> dict[str, Any]:
    """The figures a row shows, from a run's summary, counters and the LRU bound (a pooled
    run of n repeats is held against n times the bound; its routing counts are per run)."""
    s = run["summary"]
    n = len(run.get("attainments") or [None])
    sent = float(s["prompt_tokens"])
    computed = run["fleet_prompt_tokens"]["local_compute"]
    reused = max(0.0, sent - computed)
    held = [(x["held"], x["total"]) for x in run["held_series"]]
    bound = lru["reused_tokens"] * n
    return {
        "offered_rps": offered_rps,
        "repeats": n,
        "attainment": s["slo_attainment"],
        "attainments": run.get("attainments") or [s["slo_attainment"]],
        "errors": s["errors"],
        "ttft_first_p50": s["ttft_s_first_turns_p50"],
        "ttft_first_p90": s["ttft_s_first_turns_p90"],
        "ttft_later_p50": s["ttft_s_later_turns_p50"],
        "ttft_later_p90": s["ttft_s_later_turns_p90"],
        "tpot_p90": s["tpot_s_p90"],
        "prompt_tokens_sent": sent / n,
        "prompt_tokens_computed": computed / n,
        "prompt_tokens_reused": reused / n,
        "reuse_vs_lru": reused / bound if bound else math.nan,
        "d_pinned": rf.pinned_share(held),
        "wall_s": s["wall_s"],
        "routing": routing_counts(run["records"], n),
    }


def routing_counts(records: list[dict[str, Any]], repeats: int = 1) -> dict[str, dict[str, int]]:
    """kvrelay's routing decision per answered turn (`usage.kvrelay.routing` of the stream),
    counted for first and for later turns (per run: the mean over `repeats`); empty for
    fronts that report none."""
    out: dict[str, dict[str, int]] = {"first": {}, "later": {}}
    for r in records:
        decision = r.get("routing")
        if decision is None or r.get("error") is not None:
            continue
        by = out["first" if r["turn"] == 1 else "later"]
        by[decision] = by.get(decision, 0) + 1
    for by in out.values():
        for k, v in by.items():
            by[k] = round(v / repeats)
    return out


def _routing_table(rows: dict[str, dict[float, dict[str, Any]]]) -> list[str]:
    """Where kvrelay's turns went (rows of runs that recorded it)."""
    lines: list[str] = []
    for label, by in rows.items():
        for scale in sorted(by):
            r = by[scale]
            counts = r.get("routing") or {}
            first, later = counts.get("first", {}), counts.get("later", {})
            if not first and not later:
                continue
            through_p = ("prefill_affinity", "prefill_chosen")
            lines.append(
                f"| {label} | {r['offered_rps']:.2f} | "
                f"{sum(first.get(k, 0) for k in through_p)} / {first.get('spilled', 0)} | "
                f"{sum(later.get(k, 0) for k in through_p)} / {later.get('decode_only', 0)} / "
                f"{later.get('spilled', 0)} |"
            )
    if not lines:
        return []
    return [
        "",
        "Routing per turn (kvrelay's `usage.kvrelay.routing` in each stream's last event): "
        "spilled = sent to a D off a backed-up P (`prefill_spill_factor`), decode-only = a "
        "short follow-up on the D holding it.",
        "",
        "| system | req/s | first turns: through P / spilled | later turns: through P / "
        "decode-only / spilled |",
        "|---|---:|---:|---:|",
        *lines,
    ]


def goodput(points: list[tuple[float, float]]) -> tuple[float, str]:
    """Rate where attainment crosses `GOODPUT_ATTAINMENT` from (rate, attainment) points,
    linear between neighbours; ('>=', highest rate) when every rate meets it, ('<', lowest)
    when none does (value 0)."""
    pts = sorted(points)
    if not pts:
        return math.nan, ""
    if pts[0][1] < GOODPUT_ATTAINMENT:
        return 0.0, f"< {pts[0][0]:.2f}"
    for (r0, a0), (r1, a1) in itertools.pairwise(pts):
        if a1 < GOODPUT_ATTAINMENT:
            rate = r0 + (a0 - GOODPUT_ATTAINMENT) / (a0 - a1) * (r1 - r0)
            return rate, f"{rate:.2f}"
    return pts[-1][0], f">= {pts[-1][0]:.2f}"


def lease_race(plan: tr.Plan, lease_s: float, margin_s: float) -> dict[str, float]:
    """Later turns whose predecessor's hold has expired by their arrival (trace time): the
    gap from the predecessor's arrival past the lease less the proxy's safety margin. The
    hold starts when the answer ends, so this slightly overcounts for long answers."""
    gaps = [
        (t.request.timestamp_ms - plan.turns[t.predecessor].request.timestamp_ms) / 1000
        for t in plan.turns
        if t.predecessor is not None
    ]
    late = [g for g in gaps if g > lease_s - margin_s]
    return {
        "later_turns": len(gaps),
        "past_lease": len(late),
        "share_past_lease": len(late) / len(gaps) if gaps else math.nan,
        "lease_s": lease_s,
        "margin_s": margin_s,
    }


# --------------------------------------------------------------------------- report


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def verdicts(rows: dict[str, dict[float, dict[str, Any]]], mid: float) -> list[str]:
    """The issue's three aims, each met or missed with its ratio."""
    lines: list[str] = []
    gp = {label: goodput([(r["offered_rps"], r["attainment"]) for r in by.values()])
          for label, by in rows.items()}  # fmt: skip
    if OURS in gp and RIVAL in gp:
        ours, rival = gp[OURS][0], gp[RIVAL][0]
        ratio = _ratio(ours, rival)
        # Trials (labels with what they changed) are not systems of the comparison.
        others = [k for k in gp if k != OURS and " (" not in k]
        top = max(others, key=lambda k: gp[k][0], default=OURS)
        best = gp[top][0] if others else 0.0
        ok = (not math.isnan(ratio) and ratio >= GOODPUT_AIM) and ours > best
        if rival == 0 and ours > best:
            ok = True
        lines.append(
            f"- goodput: {OURS} {gp[OURS][1]} req/s vs {RIVAL} {gp[RIVAL][1]} req/s: ratio "
            f"{c.fmt_ratio(ratio)}; highest of the others {top} {gp[top][1]} req/s -> {_met(ok)} "
            f"(aim: >= {GOODPUT_AIM}x {RIVAL} and the highest of all)"
        )
    # At every rate both ran (the rival is often measured only at lower rates than ours).
    common = sorted(set(rows.get(OURS, {})) & set(rows.get(RIVAL, {})))
    for scale in common:
        a, b = rows[OURS][scale], rows[RIVAL][scale]
        ratio = _ratio(a["ttft_later_p50"], b["ttft_later_p50"])
        lines.append(
            f"- later-turn TTFT p50 at {a['offered_rps']:.2f} req/s: {OURS} "
            f"{c.fmt_ms(a['ttft_later_p50'], 0)} ms vs {RIVAL} "
            f"{c.fmt_ms(b['ttft_later_p50'], 0)} ms: ratio {c.fmt_ratio(ratio)} -> "
            f"{_met(not math.isnan(ratio) and ratio <= LATER_TTFT_AIM)} "
            f"(aim: <= {LATER_TTFT_AIM})"
        )
    if OURS in rows and HOLDS_OFF in rows and mid in rows[OURS] and mid in rows[HOLDS_OFF]:
        a, h = rows[OURS][mid], rows[HOLDS_OFF][mid]
        reuse = a["reuse_vs_lru"]
        tpot = _ratio(a["tpot_p90"], h["tpot_p90"])
        ok = reuse >= REUSE_AIM and not math.isnan(tpot) and tpot <= TPOT_AIM
        lines.append(
            f"- realized reuse at {a['offered_rps']:.2f} req/s: {OURS} "
            f"{a['prompt_tokens_reused']:.0f} tokens = {c.fmt_ratio(reuse)} of the LRU bound, "
            f"TPOT p90 {c.fmt_ms(a['tpot_p90'], 1)} ms vs holds off "
            f"{c.fmt_ms(h['tpot_p90'], 1)} ms: ratio {c.fmt_ratio(tpot)} -> {_met(ok)} "
            f"(aim: reuse >= {REUSE_AIM} of the bound with TPOT p90 <= {TPOT_AIM}x holds off)"
        )
    return lines


def _tp_groups(profile: str) -> str:
    """What one engine of a tensor-parallel profile stands for."""
    tp = get_profile(profile).tp
    return f" (each a TP group of {tp} GPUs)" if tp > 1 else ""


def _slo_met(row: dict[str, Any]) -> str:
    """The SLO share of a row, with each repeat's when there were several."""
    runs = row.get("attainments") or []
    if len(runs) < 2:
        return _pct(row["attainment"])
    return f"{_pct(row['attainment'])} ({' / '.join(_pct(x) for x in runs)})"


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0%}"


def ordered(labels: Any) -> list[str]:
    """Systems in the comparison's order (JSON sorts them), trials after their system."""
    rank = {s.label: i for i, s in enumerate(rf.SYSTEMS)}
    return sorted(labels, key=lambda x: (rank.get(x.split(" (")[0], len(rank)), x))


def render(data: dict[str, Any], args: argparse.Namespace) -> str:
    hw = data["hardware"]
    lru = data["lru_bound"]
    rows: dict[str, dict[float, dict[str, Any]]] = {
        label: {float(k): v for k, v in data["rows"][label].items()}
        for label in ordered(data["rows"])
    }
    scales = data["scales"]
    mid = float(scales[len(scales) // 2])
    st = data["reconstruction"]
    lines = [c.run_header(data.get("argv")), ""]
    lines.append(
        f"Input: {tr.CITATION}, trace seconds {args.start_s:g}-{args.start_s + args.duration_s:g} "
        f"({data['slice_requests']} requests); whole conversations sampled with probability "
        f"{args.sample:g} (seed {args.seed}): {st['requests']} requests in "
        f"{st['conversations']} conversations, {st['later_turns']} later turns, think time "
        f"(arrival gap) p50 {st['think_time_arrival_gap_s_p50']:.0f} s / p90 "
        f"{st['think_time_arrival_gap_s_p90']:.0f} s of trace time. Replayed at time scales "
        + ", ".join(f"{s:g}x" for s in scales)
        + " (request rates "
        + ", ".join(f"{data['offered_rps'][str(s)]:.2f}" for s in scales)
        + " req/s); at each scale S, think times, D's hold lease "
        f"({hw['unscaled_lease_s']:g} s / S) and the proxy's conversation TTL and entry "
        "safety margin are divided by S together (P's lease, which only covers the P -> D pull "
        "of the same turn, stays unscaled)."
    )
    lines += [
        "",
        f"Simulated hardware, the same for every system: {hw['engines']} enginesim engines"
        f"{_tp_groups(hw['profile'])} `--cost-profile {hw['profile']} --kv-link "
        f"{hw['kv_link']} --kv-scale {hw['kv_scale']:g}` ({hw['pool_blocks']} KV blocks of "
        f"{hw['block_size']} tokens each, "
        f"a prefix cache of as many blocks; KV tensors of 1 layer x 1 head x 8 so NIXL moves "
        f"small real tensors); P/D systems split them {hw['prefill_engines']} P + "
        f"{hw['engines'] - hw['prefill_engines']} D. kvrelay with one worker, "
        + (
            "conversation ids sent"
            if args.conversation_ids
            else "no conversation ids (history matching)"
        )
        + "; holds off = D's lease "
        f"{rf.HOLDS_OFF_LEASE_S:g} s. LRU bound: one LRU prefix cache of the fleet's "
        f"{lru['capacity_blocks']} trace blocks (512 tokens) reuses {lru['reused_tokens']} of "
        f"{lru['prompt_tokens']} prompt tokens "
        f"({_pct(lru['reused_tokens'] / lru['prompt_tokens'])}) on the sample.",
        "",
        f"SLO for every system: TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= "
        f"{args.slo_tpot_ms:g} ms; goodput = the request rate where the share of requests "
        f"meeting both crosses {GOODPUT_ATTAINMENT:.0%} (linear between measured rates; `>=` "
        "when every measured rate met it, `<` when none did). Reuse = prompt tokens sent minus "
        'those computed (`vllm:prompt_tokens_by_source{source="local_compute"}` summed over '
        "the fleet's engines). D pinned = blocks held for remote readers over D's pool "
        "(sampled), mean / peak. A row that pooled several runs (`--repeats`, each on a fresh "
        "fleet) shows its SLO share over all their requests and each run's in brackets; its "
        "token counts are per run.",
        "",
        "| system | req/s | SLO met | TTFT p50/p90 first ms | TTFT p50/p90 later ms "
        "| TPOT p90 ms | computed tokens | reused | vs LRU bound | D pinned mean/peak | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, by in rows.items():
        for scale in sorted(by):
            r = by[scale]
            lines.append(
                f"| {label} | {r['offered_rps']:.2f} | {_slo_met(r)} | "
                f"{c.fmt_ms(r['ttft_first_p50'], 0)} / {c.fmt_ms(r['ttft_first_p90'], 0)} | "
                f"{c.fmt_ms(r['ttft_later_p50'], 0)} / {c.fmt_ms(r['ttft_later_p90'], 0)} | "
                f"{c.fmt_ms(r['tpot_p90'], 1)} | {r['prompt_tokens_computed']:.0f} | "
                f"{r['prompt_tokens_reused']:.0f} | {c.fmt_ratio(r['reuse_vs_lru'])} | "
                f"{_pct(r['d_pinned']['mean'])} / {_pct(r['d_pinned']['max'])} | "
                f"{r['errors']} |"
            )
    lines += ["", "| system | goodput req/s |", "|---|---:|"]
    for label, by in rows.items():
        lines.append(
            f"| {label} | "
            f"{goodput([(r['offered_rps'], r['attainment']) for r in by.values()])[1]} |"
        )
    lines += _routing_table(rows)
    lines += ["", *verdicts(rows, mid), ""]
    race = data.get("lease_race")
    if race:
        lines += [
            f"Think time against the lease: {race['past_lease']} of the sample's "
            f"{race['later_turns']} later turns ({_pct(race['share_past_lease'])}) arrive more "
            f"than the lease less the safety margin ({race['lease_s']:g} - "
            f"{race['margin_s']:g} s, trace time) after their previous turn, so D's hold for "
            "them has expired whatever the rate (leases scale with time); only a prefix cache "
            "can still serve them.",
            "",
        ]
    load = {"before": [math.nan] * 3, "after": [math.nan] * 3, **data["load"]}
    lines.append(
        f"CPU headroom: this 2-core machine was shared with other engineers' test runs during "
        f"the measurement; load average (1 min) {load['before'][0]:.2f} before, "
        f"{load['after'][0]:.2f} after ({load['before'][2]:.2f} / {load['after'][2]:.2f} over "
        f"15 min); the whole comparison took {data.get('elapsed_s', math.nan) / 60:.1f} min. "
        "Engines wait "
        "out their modelled step times, so a CPU-starved run shows up as longer TTFT for every "
        "system alike; compare systems within this run."
    )
    if data.get("notes"):
        lines += ["", data["notes"].strip()]
    if data.get("merged"):
        lines += ["", "Rows added from other runs: " + "; ".join(f"`{m}`" for m in data["merged"])]
    if data.get("skipped"):
        lines += ["", "Not run: " + data["skipped"]]
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label in ordered(data["rows"]):
        pts = sorted(data["rows"][label].values(), key=lambda r: r["offered_rps"])
        xs = [r["offered_rps"] for r in pts]
        line = ax1.plot(xs, [r["ttft_later_p50"] * 1000 for r in pts], "o-", label=f"{label}")
        ax1.plot(
            xs, [r["ttft_first_p50"] * 1000 for r in pts], "s--", color=line[0].get_color(),
            alpha=0.6,
        )  # fmt: skip
    ax1.set_title("TTFT p50 vs request rate (solid: later turns, dashed: first turns)")
    ax1.set_xlabel("request rate (req/s, replay time)")
    ax1.set_ylabel("ms")
    ax1.set_yscale("log")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    for label in ordered(data["held_series"]):
        # Repeats of a run are joined one after another: each is drawn from its own start.
        colour = None
        for i, series in enumerate(_runs_of(data["held_series"][label])):
            line = ax2.plot(
                [x["t_s"] for x in series],
                [x["held"] / x["total"] * 100 if x["total"] else 0 for x in series],
                label=label if i == 0 else None, color=colour, alpha=1.0 if i == 0 else 0.5,
            )  # fmt: skip
            colour = line[0].get_color()
    ax2.set_title(f"D KV pool pinned by holds at {data['scales'][len(data['scales']) // 2]:g}x")
    ax2.set_xlabel("replay time (s)")
    ax2.set_ylabel("% of D's blocks")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=8)
    save_figure(
        fig, path, title=tr.CITATION + " replayed on simulated " + data["hardware"]["profile"]
    )


def section_of(args: argparse.Namespace) -> str:
    """RESULTS.md's section for a run: one per cost profile, so each profile's comparison
    stands beside the others instead of replacing them."""
    if args.profile == DEFAULT_PROFILE:
        return SECTION
    return f"{SECTION} ({args.profile})"


def _runs_of(series: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Split held-block samples where the replay clock starts again (the next repeat)."""
    runs: list[list[dict[str, Any]]] = []
    last = -math.inf
    for x in series:
        if not runs or x["t_s"] < last:
            runs.append([])
        runs[-1].append(x)
        last = x["t_s"]
    return runs


def mid_scale(data: dict[str, Any]) -> float:
    """The middle time scale of a run: the rate its held-blocks series and aims are read at."""
    return float(data["scales"][len(data["scales"]) // 2])


def trial_suffix(args: argparse.Namespace, system: rf.System) -> str:
    """What a trial changed from the comparison's settings (a lease, a P:D split), so its
    rows never pass for the system's own."""
    parts = []
    if args.lease_s is not None:
        parts.append(f"lease {args.lease_s:g} s")
    if args.hold_budget is not None:
        parts.append(f"hold budget {args.hold_budget:g}")
    if system.front != "vllm-router" and args.prefill_engines != args.engines // 2:
        parts.append(f"{args.prefill_engines} P + {args.engines - args.prefill_engines} D")
    return f" ({', '.join(parts)})" if parts else ""


def measure(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    hw = hardware(args)
    requests = tr.select(tr.load_trace(args.trace), args.start_s, args.duration_s)
    plan = tr.sample_conversations(tr.reconstruct(requests), args.sample, args.seed)
    kept = {t.request.index for t in plan.turns}
    sample = [r for r in requests if r.index in kept]
    lru = tr.lru_bound(sample, hw.fleet_trace_blocks())
    offered = {str(s): len(sample) / (args.duration_s / s) for s in args.scales}
    data: dict[str, Any] = {
        "argv": argv,
        "hardware": {
            **vars(hw),
            "pool_blocks": hw.pool_blocks(),
            "block_size": hw.block_size(),
        },
        "slice_requests": len(requests),
        "reconstruction": plan.stats,
        "lru_bound": lru,
        "scales": args.scales,
        "offered_rps": offered,
        "rows": {},
        "held_series": {},
        "runs": {},
        "skipped": "",
        "load": {"before": list(os.getloadavg())},
    }
    mid = args.scales[len(args.scales) // 2]
    print(f"{len(sample)} requests sampled; LRU bound {lru}", flush=True)
    for system in args.system_list:
        label = system.label + trial_suffix(args, system)
        data["rows"][label] = {}
        for scale in args.scales:
            settings = replay_mod.scaled_settings(scale, hw.unscaled_lease_s)
            tag = f"{system.label.split()[0][:4]}{int(scale)}"
            repeats: list[dict[str, Any]] = []
            try:
                for _ in range(args.repeats):  # each on a fresh fleet: no state carried over
                    with rf.fleet(system, hw, scale, settings, tag) as f:
                        repeats.append(asyncio.run(run_once(f, plan, args, scale)))
            except Exception as exc:  # a system that cannot start is reported, not fatal
                data["skipped"] += f"{label} at {scale:g}x: {type(exc).__name__}: {exc}. "
                print(f"{label} {scale:g}x failed: {exc}", flush=True)
                continue
            run = pooled(repeats, args)
            row = derive(run, lru, offered[str(scale)])
            data["rows"][label][str(scale)] = row
            data["runs"][f"{label} {scale:g}"] = {
                "summary": run["summary"],
                "fleet_prompt_tokens": run["fleet_prompt_tokens"],
                "frees": run["frees"],
                "records": [{k: r.get(k) for k in RECORD_FIELDS} for r in run["records"]],
            }
            if scale == mid:
                data["held_series"][label] = run["held_series"]
            c.write_json(args.json, data)  # a run cut short keeps what it measured
            print(
                f"{label:28s} {row['offered_rps']:5.2f} req/s SLO "
                f"{_pct(row['attainment'])} TTFT later p50 {c.fmt_ms(row['ttft_later_p50'], 0)} "
                f"ms TPOT p90 {c.fmt_ms(row['tpot_p90'], 1)} ms reuse/LRU "
                f"{c.fmt_ratio(row['reuse_vs_lru'])} errors {row['errors']}",
                flush=True,
            )
    data["load"]["after"] = list(os.getloadavg())
    return data


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else [sys.argv[0], *argv])
    # SIGTERM unwinds like an exception, so every fleet's processes are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args(argv[1:])
    if args.render_only:
        data = json.loads(args.json.read_text())
        for extra in args.merge:
            more = json.loads(extra.read_text())
            for label, by in more["rows"].items():  # one trial's rates may span runs
                data["rows"].setdefault(label, {}).update(by)
            data["runs"].update(more["runs"])
            if mid_scale(more) == mid_scale(data):  # the plot shows one rate's holds
                data["held_series"].update(more["held_series"])
            merged = data.setdefault("merged", [])
            if c.command_line(more["argv"]) not in merged:
                merged.append(c.command_line(more["argv"]))
        if args.notes is not None:
            data["notes"] = args.notes.read_text()
        kept = {k: getattr(args, k) for k in ("no_results", "plot", "json")}
        args = parse_args(data["argv"][1:])
        for k, v in kept.items():
            setattr(args, k, v)
    else:
        started = time.monotonic()
        data = measure(args, argv)
        data["elapsed_s"] = time.monotonic() - started
    if "lease_race" not in data:
        requests = tr.select(tr.load_trace(args.trace), args.start_s, args.duration_s)
        plan = tr.sample_conversations(tr.reconstruct(requests), args.sample, args.seed)
        margin = replay_mod._defaults()["entry_safety_margin_s"]
        data["lease_race"] = lease_race(plan, hardware(args).unscaled_lease_s, margin)
    c.write_json(args.json, data)
    text = render(data, args)
    plot(data, args.plot)
    text += f"\n\nPlot: [{args.plot.name}]({args.plot.name})\n"
    c.publish(section_of(args), text, args.no_results, wrote=f"{c.relpath(args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
