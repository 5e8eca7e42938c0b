"""A Mooncake-format trace replayed side by side on one simulated fleet
(`python -m bench.trace_compare`): kvrelay against vllm-router P/D and aggregated engines, each
at the configuration given, in interleaved repeated rounds.

Every configuration (`--configs`: a system of `bench/_replay_fleet.py`, P/D ones at a P:D
split, `label@P:D`) gets the same simulated GPUs (`--engines` enginesim engines of one
`--profile`, KV transfers over `--kv-link`, whose every descriptor costs what it was measured or
published to cost, as many as `--kv-transfer-layout` makes: one a run of blocks block-major,
layers x runs per-layer), fresh for each run so no cache carries over, and the same requests:
a slice of the trace (by default computed from the file: its minutes 10-30, or the whole file
when it is shorter), whole conversations sampled with probability `--sample`, replayed by
`bench/trace_replay.py` (its lean chat client, streamed, each later turn carrying the answer the
engine gave) at each `--time-scales` factor. A scale of S replays S times faster: the request
rate is the sample's requests over the slice's span / S, and think times, D's hold lease and
the proxy's TTL, safety margin and brief-hold gap (`hold_brief_s`) are all divided by S, so the
think-time race is the trace's at every rate. A brief hold's lease keeps unscaled the part it
leaves the next turn before the proxy's margin (it covers the reader's queue, which runs in real
time: `trace_replay.brief_lease_s`).

Rounds (`--rounds`): at each rate every configuration runs once per round, in an order rotated
from round to round and rate to rate, so a slow minute of a shared machine falls on different
systems; each run records the machine's load average, and one that started or ended above
`--load-bound` is marked. Rows show the median over rounds and the spread (lowest-highest).

Memory: the engines' KV pools are scaled to the sample's share of the trace's traffic
(`--kv-scale auto`), so the sample meets the cache pressure the whole trace would on the whole
pool, raised where needed so the slice's longest request fits; the LRU bound (one LRU prefix
cache as large as the fleet's scaled KV memory, from the `hash_ids`) uses the same pools.

Per configuration and rate: SLO attainment (TTFT <= `--slo-ttft-ms` and TPOT <=
`--slo-tpot-ms`, TPOT as vLLM's benchmark defines it; a request without a second token is
judged on its TTFT), TTFT p50/p90 of first and later turns, TPOT p90, prompt tokens reused (the
engines' own `vllm:prompt_tokens_by_source`) against the LRU bound, prompt tokens the GPUs
computed (enginesim's `prefill_tokens_computed`, recomputation after preemption included), D's
pool pinned by holds. Goodput per round: the request rate where the attainment curve crosses
90% (linear between rates); a round whose curve never crossed within the measured rates gives
a bound instead (below the lowest rate, or at least the highest). An aim is met when the whole
interval of the ratio, bounds included, clears it, missed when the whole interval falls short,
undetermined otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import _common as c
from bench import _paired
from bench import _replay_fleet as rf
from bench import _trace as tr
from bench import trace_replay as replay_mod
from bench._plots import save_figure
from kvrelay.enginesim.costs import (
    DEFAULT_LINK,
    DEFAULT_TRANSFER_LAYOUT,
    LINKS,
    PER_LAYER,
    TRANSFER_LAYOUTS,
    get_profile,
)

SECTION = "trace replay"
DEFAULT_PROFILE = "llama3-8b-h100"
DEFAULT_PLOT = c.BENCH_DIR / "trace_replay.png"
GOODPUT_ATTAINMENT = 0.9
# The aims (the prefix-routing issue's): goodput over the best P/D router and the best
# aggregated configuration measured, never below holds off; reuse near the LRU bound at every
# rate within the SLO; little of D's pool pinned by holds that end unused.
PD_AIM = 1.3
AGGREGATED_AIM = 1.1
REUSE_AIM = 0.9
PINNED_UNUSED_AIM = 0.10
OURS = "kvrelay default"
HOLDS_OFF = "kvrelay holds off"
DEFAULT_CONFIGS = (
    "kvrelay default,kvrelay holds off,vllm-router cache_aware tuned P/D,aggregated cache_aware"
)
# What the frees' scrape reads that is a gauge, not a count: kept as read at the replay's end.
GAUGES = frozenset({"prefill_pace"})
# Per request, kept in the JSON for later analysis (the replayer's `Record` has more).
RECORD_FIELDS = (
    "index",
    "conversation",
    "turn",
    "arrival_s",
    "ready_s",
    "ttft_s",
    "tpot_s",
    "prompt_tokens",
    "cached_tokens",
    "routing",
    "prefilled_by",
    "loaded_tokens",
    "error",
)


@dataclass(frozen=True)
class Config:
    """One system at one configuration: what a row of the comparison is."""

    system: rf.System
    prefill_engines: int | None  # P/D systems' P engines (None: aggregated)

    def label(self, engines: int) -> str:
        if self.prefill_engines is None:
            return self.system.label
        return f"{self.system.label} ({self.prefill_engines}P+{engines - self.prefill_engines}D)"

    @property
    def family(self) -> str:
        """What the aims compare: kvrelay's own variants apart, every rival front by kind."""
        if self.system.front == "kvrelay":
            return self.system.label
        return "vllm-router P/D" if self.system.disaggregated else "aggregated"


def parse_configs(text: str, engines: int) -> list[Config]:
    """`label[@P:D],...`; a P/D system without a split gets half the engines as P."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        label, _, split = item.partition("@")
        system = rf.system_by_label(label.strip())
        if not system.disaggregated:
            if split:
                raise ValueError(f"{label}: an aggregated system takes no P:D split")
            out.append(Config(system, None))
            continue
        n_p = engines // 2
        if split:
            p_text, _, d_text = split.partition(":")
            n_p = int(p_text)
            if not d_text or n_p + int(d_text) != engines:
                raise ValueError(f"{item}: the split must add up to --engines {engines}")
        if not 0 < n_p < engines:
            raise ValueError(f"{item}: the split must leave at least one P and one D")
        out.append(Config(system, n_p))
    if not out:
        raise ValueError("no configuration given")
    return out


def _slo_pair(text: str) -> tuple[float, float]:
    """`--rejudge-slo`'s TTFT_MS,TPOT_MS, both positive."""
    try:
        ttft, tpot = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("TTFT_MS,TPOT_MS, e.g. 5000,25") from None
    if min(ttft, tpot) <= 0:
        raise argparse.ArgumentTypeError("both bounds must be positive")
    return ttft, tpot


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    tr.add_slice_arguments(p, replay_mod.DEFAULT_TRACE, start_s=None, duration_s=None)
    p.add_argument("--sample", type=float, default=0.05, help="share of conversations kept")
    p.add_argument("--seed", type=int, default=0, help="conversation sample seed")
    p.add_argument(
        "--time-scales", default="8,16,32", help="comma-separated speed-ups (request rates)"
    )
    p.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help="comma-separated `system label[@P:D]` (systems: "
        + "; ".join(s.label for s in rf.SYSTEMS)
        + ")",
    )
    p.add_argument("--engines", type=int, default=8, help="simulated GPUs per system")
    p.add_argument("--profile", default=DEFAULT_PROFILE)
    p.add_argument("--kv-link", default=DEFAULT_LINK, choices=sorted(LINKS))
    p.add_argument(
        "--kv-transfer-layout",
        default=DEFAULT_TRANSFER_LAYOUT,
        choices=TRANSFER_LAYOUTS,
        help="how every engine's modelled cache is registered: a READ's descriptors are its "
        "runs of blocks (block-major) or layers x runs (per-layer)",
    )
    p.add_argument(
        "--kv-scale",
        default="auto",
        help="share of the profile's KV blocks per engine, or auto: the sample's share of the "
        "trace's traffic, raised so the slice's longest request fits",
    )
    p.add_argument("--lease-s", type=float, help="unscaled hold lease (default: connector's)")
    p.add_argument(
        "--hold-budget",
        type=float,
        help="share of each engine's KV pool holds may pin (default: connector's)",
    )
    p.add_argument(
        "--hold-max",
        type=float,
        help="share of each engine's KV pool one hold may pin (default: connector's)",
    )
    # 5 s: a tenth of the sample's prompts need over 2 s of prefill on an idle H100.
    replay_mod.add_slo_arguments(p, ttft_ms=5000.0)
    p.add_argument("--conversation-ids", action="store_true", help="send X-Conversation-Id")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (runs per row)")
    p.add_argument(
        "--prime-holds",
        type=int,
        default=1,
        metavar="WAVES",
        help="warm-up waves of one-off requests, each followed by the proxy's scaled hold "
        "patience, so that kvrelay has judged whether the tenant's holds pay before the replay "
        "(1: one wave, no wait, the replay starting with the learning period)",
    )
    p.add_argument(
        "--load-bound",
        type=float,
        default=float(os.cpu_count() or 2),
        help="1-minute load average above which a run is marked as measured on a busy machine",
    )
    p.add_argument("--section", help="RESULTS.md section (default: by trace and profile)")
    p.add_argument("--json", type=Path, default=c.WORK_DIR / "trace_compare.json")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help=f"the plot's path (default: {DEFAULT_PLOT.name} beside RESULTS.md; none with "
        "--no-results, which leaves the repository's files alone)",
    )
    p.add_argument("--no-results", action="store_true")
    p.add_argument(
        "--merge",
        type=Path,
        action="append",
        default=[],
        help="with --render-only: add the rows of another run's JSON",
    )
    p.add_argument("--notes", type=Path, help="with --render-only: Markdown appended")
    p.add_argument(
        "--ours",
        default=OURS,
        help="the system the aims judge (its best split), e.g. 'kvrelay kv events'",
    )
    p.add_argument(
        "--holds-off",
        default=HOLDS_OFF,
        help="the holds-off variant --ours is held against, e.g. 'kvrelay kv events holds off'",
    )
    p.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite the section and plot from --json's earlier run (its own flags)",
    )
    p.add_argument(
        "--rejudge-slo",
        type=_slo_pair,
        metavar="TTFT_MS,TPOT_MS",
        help="with --render-only: judge the earlier run's requests against this SLO instead "
        "(from each request's record; the JSON is left as it was)",
    )
    args = p.parse_args(argv)
    try:
        args.scales = sorted({float(x) for x in args.time_scales.split(",") if x.strip()})
        args.config_list = parse_configs(args.configs, args.engines)
    except ValueError as err:
        p.error(str(err))
    if args.rejudge_slo is not None and not args.render_only:
        p.error("--rejudge-slo judges an earlier run: it needs --render-only")
    if not args.scales or min(args.scales) <= 0:
        p.error("--time-scales must be positive numbers")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if not 0 < args.sample <= 1:
        p.error("--sample must be in (0, 1]")
    if args.kv_scale != "auto":
        try:
            if float(args.kv_scale) <= 0:
                raise ValueError
        except ValueError:
            p.error("--kv-scale must be auto or a positive number")
    return args


# --------------------------------------------------------------------------- the workload


@dataclass
class Workload:
    """The requests a run replays and what they are measured against."""

    path: Path
    slice_start_s: float
    slice_span_s: float  # the slice's length in trace time (what the request rate divides)
    slice_requests: int
    plan: tr.Plan
    sample: list[tr.TraceRequest]

    def rate(self, scale: float) -> float:
        return len(self.sample) / (self.slice_span_s / scale)


def default_slice(requests: list[tr.TraceRequest]) -> tuple[float, float]:
    """The file's own default slice: trace minutes 10-30 when it lasts past 30 minutes (past
    the warm-up of its first minutes), else the whole file."""
    last_s = requests[-1].timestamp_ms / 1000 if requests else 0.0
    if last_s > 1800:
        return 600.0, 1200.0
    return 0.0, last_s + 1.0  # the last arrival falls inside the slice


def load_workload(args: argparse.Namespace) -> Workload:
    requests = tr.load_trace(args.trace)
    start, span = default_slice(requests)
    start = args.start_s if args.start_s is not None else start
    span = args.duration_s if args.duration_s is not None else span
    chosen = tr.select(requests, start, span)
    plan = tr.sample_conversations(tr.reconstruct(chosen), args.sample, args.seed)
    kept = {t.request.index for t in plan.turns}
    return Workload(
        args.trace, start, span, len(chosen), plan, [r for r in chosen if r.index in kept]
    )


def kv_scale(args: argparse.Namespace, work: Workload) -> dict[str, float]:
    """The engines' pool share (`--kv-scale`): given, or the sample's share of the trace's
    traffic (its requests over the whole file's in the same span) raised so the slice's
    longest request (prompt and answer) fits one engine."""
    profile = get_profile(args.profile)
    tokens = profile.num_blocks() * profile.block_size
    longest = max((r.input_length + r.output_length for r in work.sample), default=1)
    floor = math.ceil(1.05 * longest / tokens * 1000) / 1000
    share = args.sample
    if args.kv_scale != "auto":
        return {"scale": float(args.kv_scale), "share": share, "floor": floor}
    return {"scale": max(share, floor), "share": share, "floor": floor}


def hardware(args: argparse.Namespace, scale: float) -> rf.Hardware:
    lease = args.lease_s if args.lease_s is not None else replay_mod._defaults()["lease_seconds"]
    return rf.Hardware(
        args.engines,
        args.engines // 2,
        args.profile,
        args.kv_link,
        scale,
        lease,
        args.hold_budget,
        args.hold_max,
        args.kv_transfer_layout,
    )


def _layout_text(layout: str, profile: str) -> str:
    """What a modelled READ's descriptors are in `layout`."""
    if layout == PER_LAYER:
        layers = get_profile(profile).model.num_layers
        return f"vLLM 0.32's per-layer pages: {layers} per run of blocks"
    return "block-major, as the connector asks vLLM for on a GPU: one per run of blocks"


def citation(path: Path) -> str:
    """How a section names the file it replayed."""
    if path.resolve() == replay_mod.DEFAULT_TRACE.resolve():
        return f"{tr.CITATION} (`{path.name}`)"
    return f"`{c.relpath(path)}`"


# --------------------------------------------------------------------------- one run


def replayer_args(args: argparse.Namespace, url: str, scale: float) -> argparse.Namespace:
    argv = [
        "--base-url",
        url,
        "--time-scale",
        f"{scale:g}",
        "--slo-ttft-ms",
        f"{args.slo_ttft_ms:g}",
        "--slo-tpot-ms",
        f"{args.slo_tpot_ms:g}",
    ]
    if args.conversation_ids:
        argv.append("--conversation-ids")
    return replay_mod.parse_args(argv)


async def warm_up(url: str, engines: int, waves: int = 1, settle_s: float = 0.0) -> None:
    """Short requests through the front, unmeasured: NIXL handshakes happen here. With
    `waves` over 1, that many waves of them, each followed by `settle_s` (the proxy's scaled
    hold patience, `--prime-holds`): one-off requests whose holds no turn takes, so that a
    proxy that judges its tenants' holds has judged this one's before the replay starts, as a
    proxy serving this tenant for more than its patience would have."""
    async with replay_mod.ChatStreams(url, "bench", timeout_s=120) as client:
        model = await client.first_model()

        async def one(i: int) -> None:
            # Distinct texts, none of the trace's (its block ids are not negative).
            text = tr.text_at([-1 - i], 0, 64, tr.TRACE_BLOCK_TOKENS)
            body = {
                "model": model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 2,
                "stream": True,
            }
            await client.stream(body, {}, time.perf_counter)

        n = 2 * engines
        for wave in range(waves):
            await asyncio.gather(*(one(wave * n + i) for i in range(n)))
            if waves > 1:
                await asyncio.sleep(settle_s)  # the holds' patience, a modelled wait
        if waves > 1:
            await one(waves * n)  # a turn after the last patience: the judgement is made


async def run_once(
    fleet: rf.Fleet,
    plan: tr.Plan,
    args: argparse.Namespace,
    scale: float,
    settings: dict[str, Any],
) -> dict[str, Any]:
    """One replay on a started fleet, whose proxy got `settings` (`scaled_settings`)."""
    # The hold patience the fleet's proxy was given (its system's own settings included).
    patience_s = float(rf.proxy_env(fleet.system, settings)["KVRELAY_HOLD_JUDGE_S"])
    await warm_up(fleet.url, len(fleet.engines), args.prime_holds, patience_s * 1.2)
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
        # Counts over the replay; a gauge (the prefill pace) as it stood at its end.
        "frees": {k: v if k in GAUGES else v - frees_before.get(k, 0.0) for k, v in frees.items()},
        # Turns of the warm-up that did not ask D to hold: with --prime-holds, whether kvrelay
        # had judged the tenant's holds before the replay.
        "warm_up_holds_declined": frees_before.get("holds_declined", 0.0),
        "held_series": sampler.series,
        "records": [{k: r.get(k) for k in RECORD_FIELDS} for r in result["records"]],
    }


def derive(run: dict[str, Any], lru: dict[str, int], rate: float) -> dict[str, Any]:
    """The figures a run contributes to its row."""
    s = run["summary"]
    tokens = run["fleet_prompt_tokens"]
    sent = float(s["prompt_tokens"])
    # What the clients sent less what the engines computed at first admission (a P/D turn's
    # transfer from P to D is not reuse: D's "external" tokens are P's computed ones).
    reused = max(0.0, sent - tokens["local_compute"])
    held = [(x["held"], x["total"]) for x in run["held_series"]]
    pinned = rf.pinned_share(held)
    return {
        "rate": rate,
        "attainment": s["slo_attainment"],
        "errors": s["errors"],
        "ttft_first_p50": s["ttft_s_first_turns_p50"],
        "ttft_first_p90": s["ttft_s_first_turns_p90"],
        "ttft_later_p50": s["ttft_s_later_turns_p50"],
        "ttft_later_p90": s["ttft_s_later_turns_p90"],
        "tpot_p90": s["tpot_s_p90"],
        "prompt_tokens_sent": sent,
        "prompt_tokens_reused": reused,
        "gpu_prefill_tokens": tokens.get("prefill_tokens_computed", math.nan),
        "behind_model": behind_model(tokens),
        "reuse_vs_lru": reused / lru["reused_tokens"] if lru["reused_tokens"] else math.nan,
        "d_pinned": pinned,
        "d_pinned_unused": pinned["mean"] * unused_share(run["frees"]),
        "wall_s": s["wall_s"],
        "load": run.get("load", {}),
        "routing": routing_counts(run["records"]),
    }


def behind_model(tokens: dict[str, float]) -> float:
    """The time the engines' threads fell behind their modelled steps and never made up, over
    the modelled step time, summed over the fleet (NaN for runs before it was counted)."""
    modelled = tokens.get(rf.MODELLED_STEP, 0.0)
    return tokens.get(rf.BEHIND_MODEL, math.nan) / modelled if modelled > 0 else math.nan


def unused_share(frees: dict[str, float]) -> float:
    """Of the holds D's engines ended, the share no turn used: lease over, hold budget, block
    pressure, or given back unused by kvrelay (`d_given_back`, its own count; D counts those
    among its releases). Read and other released holds served a pull or a decode-only turn,
    or were superseded by the turn that took them."""
    given_back = frees.get("d_given_back", 0.0)
    unused = given_back + sum(frees.get(f"d_{k}", 0.0) for k in ("expiry", "budget", "reclaim"))
    used = sum(frees.get(f"d_{k}", 0.0) for k in ("read", "release")) - given_back
    return unused / (unused + used) if unused + used > 0 else 0.0


def routing_counts(records: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """kvrelay's routing decision per answered turn (`usage.kvrelay.routing` of the stream),
    counted for first and for later turns; empty for fronts that report none."""
    out: dict[str, dict[str, int]] = {"first": {}, "later": {}}
    for r in records:
        decision = r.get("routing")
        if decision is None or r.get("error") is not None:
            continue
        by = out["first" if r["turn"] == 1 else "later"]
        by[decision] = by.get(decision, 0) + 1
    return out


# The routing decisions as the TTFT table groups them: P's two (by affinity, or by load) as one.
_ROUTE_GROUPS = {
    "prefill_affinity": "through P",
    "prefill_chosen": "through P",
    "decode_only": "decode-only",
    "spilled": "spilled",
}
_ROUTE_COLUMNS = ("through P", "decode-only", "spilled")


def ttft_by_route(records: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """The TTFTs (seconds) of the answered turns of each routing decision (`_ROUTE_GROUPS`),
    first and later turns apart; empty for fronts that report no routing. Where a rate's
    TTFT is lost is where the route its turns took says."""
    out: dict[str, dict[str, list[float]]] = {"first": {}, "later": {}}
    for r in records:
        group = _ROUTE_GROUPS.get(r.get("routing") or "")
        ttft = r.get("ttft_s")
        if group is None or r.get("error") is not None or ttft is None or math.isnan(ttft):
            continue
        out["first" if r["turn"] == 1 else "later"].setdefault(group, []).append(ttft)
    return out


def _ttft_cell(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{c.percentile(values, 50):.2f} / {c.percentile(values, 90):.2f} ({len(values)})"


def _ttft_route_table(
    rows: dict[str, dict[float, dict[str, Any]]], runs: dict[str, Any]
) -> list[str]:
    lines: list[str] = []
    for label, by in rows.items():
        for scale in sorted(by):
            records = [r for run in runs[label][str(scale)] for r in run.get("records") or []]
            pooled = ttft_by_route(records)
            if not pooled["first"] and not pooled["later"]:
                continue
            cells = [
                _ttft_cell(pooled[t].get(g, [])) for t in ("first", "later") for g in _ROUTE_COLUMNS
            ]
            lines.append(f"| {label} | {by[scale]['rate']:.2f} | " + " | ".join(cells) + " |")
    if not lines:
        return []
    heads = [f"{t} {g}" for t in ("first:", "later:") for g in _ROUTE_COLUMNS]
    return [
        "",
        "TTFT by route, every round's turns together (kvrelay's `usage.kvrelay.routing`): "
        "p50 / p90 in seconds (turns).",
        "",
        "| configuration | req/s | " + " | ".join(heads) + " |",
        "|---|---:|" + "---:|" * len(heads),
        *lines,
    ]


# --------------------------------------------------------------------------- rows and aims


def median(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A configuration at one rate over its rounds: medians, and the attainment's spread."""
    out: dict[str, Any] = {"rate": runs[0]["rate"], "rounds": len(runs)}
    for key in (
        "attainment",
        "ttft_first_p50",
        "ttft_first_p90",
        "ttft_later_p50",
        "ttft_later_p90",
        "tpot_p90",
        "prompt_tokens_reused",
        "gpu_prefill_tokens",
        "reuse_vs_lru",
        "d_pinned_unused",
    ):
        out[key] = median([float(r[key]) for r in runs])
    out["attainments"] = [r["attainment"] for r in runs]
    out["d_pinned"] = median([r["d_pinned"]["mean"] for r in runs])
    out["behind_model"] = median([float(r.get("behind_model", math.nan)) for r in runs])
    out["errors"] = sum(r["errors"] for r in runs)
    out["busy_runs"] = sum(1 for r in runs if r.get("load", {}).get("busy"))
    return out


@dataclass(frozen=True)
class Goodput:
    """One configuration's goodput per round; `crossed` when every round's curve crossed
    the attainment target within the measured rates."""

    values: tuple[float, ...]
    labels: tuple[str, ...]

    @property
    def crossed(self) -> bool:
        return bool(self.labels) and all(not x.startswith(("<", ">=")) for x in self.labels)

    def bounds(self) -> list[tuple[float, float]]:
        """Per round, the interval the goodput lies in: the value itself where the curve
        crossed, (0, lowest rate) below every rate, (highest rate, inf) above every rate."""
        out = []
        for value, label in zip(self.values, self.labels, strict=True):
            if label.startswith("<"):
                out.append((0.0, float(label[1:])))
            elif label.startswith(">="):
                out.append((value, math.inf))
            else:
                out.append((value, value))
        return out

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else math.nan

    def text(self) -> str:
        if not self.values:
            return "-"
        if len(self.values) == 1:
            return self.labels[0]
        return f"{statistics.median(self.values):.2f} ({' / '.join(self.labels)})"


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


def goodputs(runs_by_scale: dict[float, list[dict[str, Any]]]) -> Goodput:
    """Goodput of each round, from that round's run at every rate."""
    rounds = min((len(v) for v in runs_by_scale.values()), default=0)
    values, labels = [], []
    for i in range(rounds):
        value, label = goodput(
            [(runs[i]["rate"], runs[i]["attainment"]) for runs in runs_by_scale.values()]
        )
        values.append(value)
        labels.append(label)
    return Goodput(tuple(values), tuple(labels))


def ratio_verdict(ours: Goodput, theirs: Goodput, aim: float) -> tuple[str, str]:
    """(met | MISSED | undetermined, the ratio's interval) for `ours >= aim x theirs`."""
    if not ours.values or not theirs.values:
        return "undetermined", "-"
    # The worst and best pairing of the rounds, each side's bounds where its curve did not
    # cross: a goodput above the highest rate is still at least that rate (and one below the
    # lowest at most it), so a ratio with a bound on one side is a bound too, sound as far
    # as it goes.
    ours_b, theirs_b = ours.bounds(), theirs.bounds()
    low = _divide(min(lo for lo, _ in ours_b), max(hi for _, hi in theirs_b))
    high = _divide(max(hi for _, hi in ours_b), min(lo for lo, _ in theirs_b))
    interval = f"{_ratio_text(low)}-{_ratio_text(high)}"
    if not ours.crossed or not theirs.crossed:
        interval += " (a goodput outside the measured rates: a bound)"
    if low >= aim:
        return "met", interval
    if high < aim:
        return "MISSED", interval
    return "undetermined", interval


def _divide(a: float, b: float) -> float:
    """a / b for goodputs and their bounds: a bound of inf over inf or 0 over 0 says
    nothing (nan, which clears no aim and misses none)."""
    if math.isinf(b):
        return 0.0 if not math.isinf(a) else math.nan
    if b <= 0:
        return math.inf if a > 0 else math.nan
    return a / b


def _ratio_text(value: float) -> str:
    return "inf" if math.isinf(value) else c.fmt_ratio(value)


def best_of(family: str, configs: dict[str, Config], gps: dict[str, Goodput]) -> str | None:
    """The configuration of `family` with the highest median goodput."""
    labels = [label for label, cfg in configs.items() if cfg.family == family]
    return max(labels, key=lambda label: gps[label].median, default=None)


def paired_line(runs: dict[str, Any], ours: str, rival: str) -> list[str]:
    """The SLO attainments of `ours` and `rival` paired round by round (`bench/_paired.py`):
    where both meet the SLO at every rate measured, goodput cannot tell them apart, and the
    rounds' differences still can."""
    pairs = _paired.pairs_of("", {"runs": runs}, [ours], [rival])
    if len({p.round for p in pairs}) < 2:
        return []  # one round: no spread to judge a difference by
    diffs = {rate: _paired.differences(group) for rate, group in _paired.by_rate(pairs).items()}
    cells = [f"{rate:.2f} req/s {_paired.points_cell(d)}" for rate, d in sorted(diffs.items())]
    return [
        f"- SLO met, {ours} - {rival}, paired round by round (points, mean and 95% interval): "
        f"{'; '.join(cells)} -> {_paired.attainment_verdict(diffs)}"
    ]


def verdicts(
    rows: dict[str, dict[float, dict[str, Any]]],
    gps: dict[str, Goodput],
    configs: dict[str, Config],
    ours_family: str = OURS,
    holds_off: str = HOLDS_OFF,
    runs: dict[str, Any] | None = None,
) -> list[str]:
    """Each aim met, missed or undetermined, with its interval over the rounds, for the best
    configuration of `ours_family` (against `holds_off` for the holds aim; with the rounds'
    `runs`, also their SLO attainments paired round by round: `paired_line`)."""
    ours = best_of(ours_family, configs, gps)
    if ours is None:
        return []
    lines = []
    for family, aim in (
        ("vllm-router P/D", PD_AIM),
        ("aggregated", AGGREGATED_AIM),
        (holds_off, 1.0),
    ):
        rival = best_of(family, configs, gps)
        if rival is None:
            lines.append(f"- goodput vs {family}: not measured in this run -> undetermined")
            continue
        verdict, interval = ratio_verdict(gps[ours], gps[rival], aim)
        lines.append(
            f"- goodput: {ours} {gps[ours].text()} req/s vs {rival} {gps[rival].text()} req/s: "
            f"ratio {interval} -> {verdict} (aim: >= {aim:g}x)"
        )
        if family == holds_off and runs is not None:
            lines += paired_line(runs, ours, rival)
    within = [r for r in rows[ours].values() if r["attainment"] >= GOODPUT_ATTAINMENT]
    if within:
        worst = min(r["reuse_vs_lru"] for r in within)
        lines.append(
            f"- realized reuse at every rate within the SLO ({len(within)} of "
            f"{len(rows[ours])}): lowest {c.fmt_ratio(worst)} of the LRU bound -> "
            f"{'met' if worst >= REUSE_AIM else 'MISSED'} (aim: >= {REUSE_AIM:g})"
        )
    else:
        lines.append("- realized reuse within the SLO: no rate met the SLO -> undetermined")
    pinned = max(r["d_pinned_unused"] for r in rows[ours].values())
    lines.append(
        f"- D's pool pinned by holds that end unused (mean pinned share x share of D's ended "
        f"holds no turn used): highest over the rates {_pct(pinned)} -> "
        f"{'met' if pinned < PINNED_UNUSED_AIM else 'MISSED'} (aim: < {PINNED_UNUSED_AIM:.0%})"
    )
    return lines


# --------------------------------------------------------------------------- report


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0%}"


def _slo_cell(r: dict[str, Any]) -> str:
    runs = r.get("attainments") or []
    text = _pct(r["attainment"])
    if len(runs) > 1:
        text += f" ({_pct(min(runs))}-{_pct(max(runs))})"
    if r.get("busy_runs"):
        text += f" [{r['busy_runs']} busy]"
    return text


def _routing_table(rows: dict[str, dict[float, dict[str, Any]]], runs: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for label, by in rows.items():
        for scale in sorted(by):
            counts = runs[label][str(scale)][0].get("routing") or {}
            first, later = counts.get("first", {}), counts.get("later", {})
            if not first and not later:
                continue
            through_p = ("prefill_affinity", "prefill_chosen")
            frees = runs[label][str(scale)][0].get("frees") or {}
            late = frees.get("pulls_pin_timeout", 0) + frees.get("pulls_pin_failed", 0)
            pulls = (
                f"{frees.get('pulls_pulled', 0):.0f} / {frees.get('pulls_not_pulled', 0):.0f} / "
                f"{late:.0f} ({frees.get('pulled_tokens', 0):.0f}); "
                f"into D {frees.get('pulls_d_pulled', 0):.0f}"
            )
            if "pins_on_d" in frees:  # runs before D's events were followed have none
                pulls += f"; from D {frees['pins_on_d']:.0f}"
            holds = (  # runs before the reads were counted have none
                f"{frees['holds_read']:.0f} / {frees['holds_unread']:.0f}"
                if "holds_read" in frees
                else "-"
            )
            if "holds_cache_kept" in frees:  # runs before D's residency was weighed have none
                holds += f" / {frees['holds_cache_kept']:.0f} cache-kept"
            if "held_gone" in frees:  # runs before the readers' outcomes were counted have none
                holds += f" ({frees['held_found']:.0f} / {frees['held_gone']:.0f})"
            lines.append(
                f"| {label} | {by[scale]['rate']:.2f} | "
                f"{sum(first.get(k, 0) for k in through_p)} / {first.get('spilled', 0)} | "
                f"{sum(later.get(k, 0) for k in through_p)} / {later.get('decode_only', 0)} / "
                f"{later.get('spilled', 0)} | {pulls} | {holds} |"
            )
    if not lines:
        return []
    return [
        "",
        "Routing per turn in each configuration's first round (kvrelay's "
        "`usage.kvrelay.routing`): spilled = sent to a D off a backed-up P, decode-only = a "
        "short follow-up on the D holding it. Prefix pulls (kvrelay's "
        "`kvrelay_prefix_pulls_total`): pulled / pinned but not loaded / pin late or failed, "
        "and the tokens the engines reported loading from the pins; into D: pulled by a spilled "
        'turn\'s D (`leg="decode"`); from D: pinned on a D (`kvrelay_prefix_pins_total'
        '{holder="decode"}`, a history or prefix in D\'s cache). Holds taken: the holds a '
        "next turn took that an engine then read (P loaded the history, or the holder served "
        'the turn from it) / read none of (`kvrelay_hold_decisions_total{decision="read"|'
        '"unread"}`); in brackets, the reads of a held history by another engine (P, or a '
        "spilled turn's D) that found the blocks / found the hold gone "
        "(`kvrelay_held_reads_total`); cache-kept: read, but sooner than the holder's cache "
        "keeps an unused block, by its residency histogram (counted unused).",
        "",
        "| configuration | req/s | first turns: through P / spilled | later turns: through P / "
        "decode-only / spilled | prefix pulls (tokens) | holds taken: read / unread |",
        "|---|---:|---:|---:|---:|---:|",
        *lines,
    ]


def meets_slo(record: dict[str, Any], ttft_s: float, tpot_s: float) -> bool:
    """A request's record within the SLO: answered, and within it as the replayer judges
    (`trace_replay.within_slo`)."""
    if record.get("error") is not None or record.get("ttft_s") is None:
        return False
    return replay_mod.within_slo(record["ttft_s"], record.get("tpot_s"), ttft_s, tpot_s)


def rejudge(data: dict[str, Any], ttft_ms: float, tpot_ms: float) -> None:
    """Every run's SLO attainment recomputed from its requests' records under another SLO
    (`--rejudge-slo`): what the same runs would have scored had the SLO asked for that."""
    ttft_s, tpot_s = ttft_ms / 1000, tpot_ms / 1000
    for by in data["runs"].values():
        for runs in by.values():
            for run in runs:
                records = run["records"]
                met = sum(1 for r in records if meets_slo(r, ttft_s, tpot_s))
                run["attainment"] = met / len(records) if records else math.nan


def rows_of(data: dict[str, Any]) -> dict[str, dict[float, dict[str, Any]]]:
    out: dict[str, dict[float, dict[str, Any]]] = {}
    for label, by in data["runs"].items():
        out[label] = {float(scale): row(runs) for scale, runs in by.items() if runs}
    return out


def goodputs_of(data: dict[str, Any]) -> dict[str, Goodput]:
    return {
        label: goodputs({float(s): runs for s, runs in by.items() if runs})
        for label, by in data["runs"].items()
    }


def render(data: dict[str, Any], args: argparse.Namespace) -> str:
    hw, lru, mem = data["hardware"], data["lru_bound"], data["kv_scale"]
    configs = {cfg.label(args.engines): cfg for cfg in args.config_list}
    for label in data["runs"]:  # merged runs' configurations too
        configs.setdefault(label, _config_of(label, args.engines))
    rows, gps = rows_of(data), goodputs_of(data)
    st = data["reconstruction"]
    link = LINKS[hw["kv_link"]]
    layout = hw.get("kv_transfer_layout", PER_LAYER)  # runs before it was a setting: per-layer
    lines = [c.run_header(data.get("argv")), ""]
    lines.append(
        f"Input: {citation(Path(data['trace']))}, trace seconds {data['slice_start_s']:g}-"
        f"{data['slice_start_s'] + data['slice_span_s']:g} ({data['slice_requests']} requests); "
        f"whole conversations sampled with probability {args.sample:g} (seed {args.seed}): "
        f"{st['requests']} requests in {st['conversations']} conversations, "
        f"{st['later_turns']} later turns. Replayed at time scales "
        + ", ".join(f"{s:g}x" for s in data["scales"])
        + " (request rates "
        + ", ".join(f"{data['rates'][str(s)]:.2f}" for s in data["scales"])
        + " req/s: the sample's requests over the slice's span / S); think times, D's hold "
        f"lease ({hw['unscaled_lease_s']:g} s / S) and the proxy's conversation TTL, safety "
        "margin and brief-hold gap are divided by S together (P's lease, which covers only the "
        "P -> D pull of the same turn, stays unscaled; a brief hold's lease keeps unscaled the "
        "part it leaves the next turn before the margin, the reader's queue running in real "
        "time)."
    )
    lines += [
        "",
        f"Simulated hardware, the same for every configuration: {hw['engines']} enginesim "
        f"engines `--cost-profile {hw['profile']} --kv-link {hw['kv_link']} "
        f"--kv-transfer-layout {layout} --kv-scale "
        f"{hw['kv_scale']:g} --enable-prefix-caching` ({hw['pool_blocks']} KV blocks of "
        f"{hw['block_size']} tokens each; the prefix cache is the pool's free blocks, as in "
        f"vLLM). KV transfers: {link.per_descriptor_s * 1e6:.1f} us per descriptor ("
        + _layout_text(layout, hw["profile"])
        + "), "
        f"{link.line_rate * link.efficiency / 1e9:.0f} GB/s, {link.latency_s * 1e6:.0f} us per "
        "transfer, an engine's loads queued on its link. Pools: "
        + (
            f"the sample's share of the trace's traffic ({mem['share']:g}) would be "
            f"{mem['share']:g} of the profile's; raised to {mem['scale']:g} so the slice's "
            f"longest request fits one engine, so the sample meets "
            f"{mem['share'] / mem['scale']:.2f}x the cache pressure the whole trace would"
            if mem["scale"] > mem["share"]
            else f"{mem['scale']:g} of the profile's, the sample's share of the trace's traffic: "
            "the cache pressure the whole trace would meet on the whole pool"
        )
        + ". kvrelay with one worker, "
        + (
            "conversation ids sent"
            if args.conversation_ids
            else "no conversation ids (history matching)"
        )
        + f"; holds off = D's lease {rf.HOLDS_OFF_LEASE_S:g} s. LRU bound: one LRU prefix "
        f"cache of the fleet's {lru['capacity_blocks']} trace blocks (512 tokens, the same "
        f"pools) reuses {lru['reused_tokens']} of {lru['prompt_tokens']} prompt tokens "
        f"({_pct(lru['reused_tokens'] / max(1, lru['prompt_tokens']))}) of the sample.",
        "",
        f"SLO for every configuration: TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= "
        f"{args.slo_tpot_ms:g} ms (vLLM's benchmark's TPOT; a request without a second token "
        f"is judged on TTFT). {data['rounds']} interleaved rounds: each cell is the median over "
        "rounds, SLO met with its lowest-highest, `[n busy]` = runs that started or ended with "
        f"a 1-minute load average above {args.load_bound:g}. Reused = prompt tokens sent less "
        'those the engines computed at first admission (`source="local_compute"`); '
        "GPU prefill = every token the engines "
        "computed in prefill, recomputation included; D pinned = blocks held over D's pool, "
        "mean; unused = that times the share of D's holds that ended unused (expiry, budget, "
        "reclaim, or given back by kvrelay because its tenant's holds did not pay). Behind = "
        "the time the engines' threads ran past their modelled steps and never made up, over "
        "the modelled step time, summed over the fleet: where it is not near 0% the host's "
        "CPU, not the modelled GPUs, set the pace.",
        "",
        "| configuration | req/s | SLO met | TTFT p50/p90 first ms | TTFT p50/p90 later ms "
        "| TPOT p90 ms | GPU prefill tokens | reused | vs LRU | D pinned / unused | errors "
        "| behind |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label in _ordered(rows):
        for scale in sorted(rows[label]):
            r = rows[label][scale]
            lines.append(
                f"| {label} | {r['rate']:.2f} | {_slo_cell(r)} | "
                f"{c.fmt_ms(r['ttft_first_p50'], 0)} / {c.fmt_ms(r['ttft_first_p90'], 0)} | "
                f"{c.fmt_ms(r['ttft_later_p50'], 0)} / {c.fmt_ms(r['ttft_later_p90'], 0)} | "
                f"{c.fmt_ms(r['tpot_p90'], 1)} | {r['gpu_prefill_tokens']:.0f} | "
                f"{r['prompt_tokens_reused']:.0f} | {c.fmt_ratio(r['reuse_vs_lru'])} | "
                f"{_pct(r['d_pinned'])} / {_pct(r['d_pinned_unused'])} | {r['errors']} | "
                f"{_pct(r.get('behind_model', math.nan))} |"
            )
    lines += ["", "| configuration | goodput req/s: median (per round) |", "|---|---:|"]
    lines += [f"| {label} | {gps[label].text()} |" for label in _ordered(rows)]
    lines += _routing_table({k: rows[k] for k in _ordered(rows)}, data["runs"])
    lines += _ttft_route_table({k: rows[k] for k in _ordered(rows)}, data["runs"])
    families = sorted({cfg.family for cfg in configs.values()})
    best = [f"{family}: {best_of(family, configs, gps)}" for family in families]
    lines += ["", "Best configuration of each family in this run: " + "; ".join(best) + "."]
    lines += ["", *verdicts(rows, gps, configs, args.ours, args.holds_off, data["runs"]), ""]
    load = data.get("load", {})
    # A comparison stopped before its end kept its runs but has no "after" nor duration.
    ended = (
        f"{load['after'][0]:.2f} after; it took {data['elapsed_s'] / 60:.0f} min"
        if "after" in load and "elapsed_s" in data
        else "it was stopped before its end (the runs it finished are shown)"
    )
    lines.append(
        f"Machine: load average (1 min) {load.get('before', [math.nan])[0]:.2f} before the "
        f"comparison, {ended}. Engines wait out their modelled step "
        "times, laid end to end; what a CPU-starved engine cannot make up shows in `behind` "
        "and as longer TTFT; the rounds interleave the configurations so such a minute falls "
        "on different ones."
    )
    if data.get("notes"):
        lines += ["", data["notes"].strip()]
    if data.get("merged"):
        lines += ["", "Rows added from other runs: " + "; ".join(f"`{m}`" for m in data["merged"])]
    if data.get("skipped"):
        lines += ["", "Not run: " + data["skipped"]]
    return "\n".join(lines)


def _config_of(label: str, engines: int) -> Config:
    """The configuration a row's label names (a merged run's)."""
    name, _, split = label.partition(" (")
    system = rf.system_by_label(name)
    if not system.disaggregated:
        return Config(system, None)
    return Config(system, int(split.split("P")[0]) if split else engines // 2)


def _ordered(labels: Any) -> list[str]:
    rank = {s.label: i for i, s in enumerate(rf.SYSTEMS)}
    return sorted(labels, key=lambda x: (rank.get(x.split(" (")[0], len(rank)), x))


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = rows_of(data)
    # A workload of single turns (shared prefix) has no later turn: its first turns' p90 then.
    later = any(not math.isnan(r["ttft_later_p50"]) for by in rows.values() for r in by.values())
    ttft_key, ttft_title = (
        ("ttft_later_p50", "later-turn TTFT p50") if later else ("ttft_first_p90", "TTFT p90")
    )
    for label in _ordered(rows):
        pts = [rows[label][s] for s in sorted(rows[label])]
        xs = [r["rate"] for r in pts]
        ax1.plot(xs, [r["attainment"] * 100 for r in pts], "o-", label=label)
        ax2.plot(xs, [r[ttft_key] * 1000 for r in pts], "o-", label=label)
    ax1.axhline(GOODPUT_ATTAINMENT * 100, color="grey", lw=0.8, ls="--")
    ax1.set_title("SLO met (median over rounds)")
    ax1.set_xlabel("request rate (req/s, replay time)")
    ax1.set_ylabel("% of requests")
    ax2.set_title(ttft_title)
    ax2.set_xlabel("request rate (req/s, replay time)")
    ax2.set_ylabel("ms")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(
        fig, path, title=f"{Path(data['trace']).name} on simulated {data['hardware']['profile']}"
    )


def section_of(args: argparse.Namespace) -> str:
    """RESULTS.md's section for a run: one per trace and cost profile."""
    if args.section:
        return str(args.section)
    name = SECTION
    if args.trace.resolve() != replay_mod.DEFAULT_TRACE.resolve():
        name += f" ({args.trace.stem})"
    if args.profile != DEFAULT_PROFILE:
        name += f" ({args.profile})"
    return name


def lease_race(plan: tr.Plan, lease_s: float, margin_s: float) -> dict[str, float]:
    """Later turns whose predecessor's hold has expired by their arrival (trace time)."""
    gaps = [
        (t.request.timestamp_ms - plan.turns[t.predecessor].request.timestamp_ms) / 1000
        for t in plan.turns
        if t.predecessor is not None
    ]
    late = [g for g in gaps if g > lease_s - margin_s]
    return {"later_turns": len(gaps), "past_lease": len(late), "lease_s": lease_s}


# --------------------------------------------------------------------------- the measurement


def run_order(configs: list[Config], round_index: int, scale_index: int) -> list[Config]:
    """The configurations in this round and rate's order: rotated, so no one always runs
    first (on a warm machine) or last."""
    k = (round_index + scale_index) % len(configs)
    return configs[k:] + configs[:k]


def measure(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    work = load_workload(args)
    mem = kv_scale(args, work)
    hw = hardware(args, mem["scale"])
    lru = tr.lru_bound(work.sample, hw.fleet_trace_blocks())
    rates = {str(s): work.rate(s) for s in args.scales}
    data: dict[str, Any] = {
        "argv": argv,
        "trace": str(args.trace),
        "slice_start_s": work.slice_start_s,
        "slice_span_s": work.slice_span_s,
        "slice_requests": work.slice_requests,
        "hardware": {**vars(hw), "pool_blocks": hw.pool_blocks(), "block_size": hw.block_size()},
        "kv_scale": mem,
        "reconstruction": work.plan.stats,
        "lru_bound": lru,
        "lease_race": lease_race(
            work.plan, hw.unscaled_lease_s, replay_mod._defaults()["entry_safety_margin_s"]
        ),
        "scales": args.scales,
        "rates": rates,
        "rounds": args.rounds,
        "runs": {
            cfg.label(args.engines): {str(s): [] for s in args.scales} for cfg in args.config_list
        },
        "held_series": {},
        "skipped": "",
        "load": {"before": list(os.getloadavg())},
    }
    print(f"{len(work.sample)} requests sampled; pools {mem}; LRU bound {lru}", flush=True)
    for rnd in range(args.rounds):
        for si, scale in enumerate(args.scales):
            settings = replay_mod.scaled_settings(scale, hw.unscaled_lease_s)
            for cfg in run_order(args.config_list, rnd, si):
                label = cfg.label(args.engines)
                run_hw = dataclasses.replace(hw, prefill_engines=cfg.prefill_engines or 1)
                tag = f"{cfg.system.label.split()[0][:4]}{int(scale)}"
                load_before = os.getloadavg()[0]
                try:
                    with rf.fleet(cfg.system, run_hw, scale, settings, tag) as f:
                        run = asyncio.run(run_once(f, work.plan, args, scale, settings))
                except Exception as exc:  # a run that fails is reported, not fatal
                    data["skipped"] += f"{label} at {scale:g}x round {rnd + 1}: {exc}. "
                    print(f"{label} {scale:g}x failed: {exc}", flush=True)
                    continue
                load_after = os.getloadavg()[0]
                run["load"] = {
                    "before": load_before,
                    "after": load_after,
                    "busy": max(load_before, load_after) > args.load_bound,
                }
                derived = derive(run, lru, rates[str(scale)])
                data["runs"][label][str(scale)].append(
                    {
                        **derived,
                        "records": run["records"],
                        "frees": run["frees"],
                        "fleet_prompt_tokens": run["fleet_prompt_tokens"],
                        # D's held blocks, queue and KV usage over the run (`EngineSampler`).
                        "engine_series": run["held_series"],
                        "warm_up_holds_declined": run["warm_up_holds_declined"],
                    }
                )
                if rnd == 0 and si == len(args.scales) // 2:
                    data["held_series"][label] = run["held_series"]
                c.write_json(args.json, data)  # a run cut short keeps what it measured
                print(
                    f"round {rnd + 1} {label:44s} {derived['rate']:5.2f} req/s SLO "
                    f"{_pct(derived['attainment'])} TTFT later p50 "
                    f"{c.fmt_ms(derived['ttft_later_p50'], 0)} ms reuse/LRU "
                    f"{c.fmt_ratio(derived['reuse_vs_lru'])} load {load_before:.1f}/"
                    f"{load_after:.1f}",
                    flush=True,
                )
    data["load"]["after"] = list(os.getloadavg())
    return data


def plot_path_of(args: argparse.Namespace) -> Path | None:
    """Where the plot goes: `--plot`, else beside RESULTS.md unless `--no-results`."""
    if args.plot is not None:
        return Path(args.plot)
    return None if args.no_results else DEFAULT_PLOT


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else [sys.argv[0], *argv])
    # SIGTERM unwinds like an exception, so every fleet's processes are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args(argv[1:])
    if args.render_only:
        data = json.loads(args.json.read_text())
        for extra in args.merge:
            more = json.loads(extra.read_text())
            for label, by in more["runs"].items():
                for scale, runs in by.items():
                    data["runs"].setdefault(label, {}).setdefault(scale, []).extend(runs)
            merged = data.setdefault("merged", [])
            if c.command_line(more["argv"]) not in merged:
                merged.append(c.command_line(more["argv"]))
        if args.notes is not None:
            data["notes"] = args.notes.read_text()
        kept = {
            k: getattr(args, k)
            for k in ("no_results", "plot", "json", "section", "ours", "holds_off", "rejudge_slo")
        }
        args = parse_args(data["argv"][1:])
        for k, v in kept.items():
            setattr(args, k, v)
        if args.rejudge_slo:
            args.slo_ttft_ms, args.slo_tpot_ms = args.rejudge_slo
            rejudge(data, args.slo_ttft_ms, args.slo_tpot_ms)
    else:
        started = time.monotonic()
        data = measure(args, argv)
        data["elapsed_s"] = time.monotonic() - started
    if not args.rejudge_slo:  # a rejudged run is still the run its JSON says
        c.write_json(args.json, data)
    text = render(data, args)
    plot_path = plot_path_of(args)
    if plot_path is not None:
        plot(data, plot_path)
        text += f"\n\nPlot: [{plot_path.name}]({plot_path.name})\n"
    c.publish(section_of(args), text, args.no_results, wrote=f"{c.relpath(args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
