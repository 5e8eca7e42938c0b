"""Routing policies on multi-turn and mixed load (`python -m bench.multiturn --policies`).

The same enginesim engines (2 P + 1 D, local prefix caches on, simulated prefill and decode
cost; prefill on D slows its decode steps) serve, one after another:
- kvrelay with each `routing_policy` (`always_p`, `affinity`, `conditional`);
- `D alone`: the client talks to D directly (no disaggregation; D's prefix cache keeps the
  history);
- vllm-router (P/D mode, `round_robin` and `cache_aware`) when it can be started.

Two loads, both streamed through the `openai` SDK (`AsyncOpenAI`), every turn sent the moment
the conversation's previous answer is complete (turns in lock step across conversations):
- multi-turn: N conversations x T turns (default 32 x 10);
- mixed: N/2 conversations x T turns, and with every round N/2 single-turn requests (a fresh
  prompt as long as a conversation's first turn).
Each system gets its own prompt prefix, so no engine cache carries over from the one before.
Replies are `max_tokens` long (`ignore_eos`), so every system does the same decode work.

Per system: TTFT p50/p99 per turn and overall, inter-token latency p50/p99 (gaps between
streamed chunks, i.e. D's decode steps), prompt tokens computed on P and on D
(`enginesim_prompt_tokens_computed_total`), total time; the mixed load's single-turn TTFT.
Writes the `## multiturn policies` section of bench/RESULTS.md and bench/multiturn_policies.png.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from bench import _common as c
from bench._plots import save_figure
from kvrelay.devtools import prometheus

POLICIES = ("always_p", "affinity", "conditional")
MODEL = "kvrelay-sim"
SECTION = "multiturn policies"
ITL_AIM = 1.10  # D's inter-token p99 under the default, over always_p's


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.multiturn --policies", description=__doc__)
    c.add_chat_arguments(p, system_words=150, max_tokens=32, prefill_us_per_token=60)
    p.add_argument("--decode-us-per-step", type=int, default=4000)
    p.add_argument("--conditional-max-uncached-tokens", type=int, default=256)
    p.add_argument("--conditional-max-inflight-tokens", type=int, default=4096)
    c.add_switch(p, "--vllm-router")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--json", type=Path, default=c.WORK_DIR / "multiturn_policies.json")
    p.add_argument("--plot", type=Path, default=c.BENCH_DIR / "multiturn_policies.png")
    p.add_argument("--no-results", action="store_true")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 conversations x 3 turns")
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.turns = 4, 3
    return args


@dataclass
class StreamedAnswer:
    """One streamed answer: time to first token, the gaps between later chunks, the text."""

    ttft: float
    gaps: list[float]
    text: str


async def ask(
    client: AsyncOpenAI,
    messages: list[ChatCompletionMessageParam],
    headers: dict[str, str],
    max_tokens: int,
) -> StreamedAnswer:
    start = last = time.perf_counter()
    ttft = math.nan
    gaps: list[float] = []
    parts: list[str] = []
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_headers=headers,
        # Every reply is max_tokens long: the same decode work for every system compared.
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                now = time.perf_counter()
                if math.isnan(ttft):
                    ttft = now - start
                else:
                    gaps.append(now - last)
                last = now
                parts.append(choice.delta.content)
    return StreamedAnswer(ttft, gaps, "".join(parts))


@dataclass
class Chat:
    """One conversation's history and id."""

    system: str
    rng: random.Random
    conv_id: str = field(default_factory=lambda: f"bench-{uuid.uuid4().hex[:12]}")
    messages: list[ChatCompletionMessageParam] = field(default_factory=list)

    async def turn(self, client: AsyncOpenAI, t: int, args: argparse.Namespace) -> StreamedAnswer:
        if not self.messages:
            self.messages.append({"role": "system", "content": self.system})
        self.messages.append(
            {"role": "user", "content": f"turn {t}: " + c.words(self.rng, args.user_words)}
        )
        sample = await ask(
            client, list(self.messages), {"X-Conversation-Id": self.conv_id}, args.max_tokens
        )
        self.messages.append({"role": "assistant", "content": sample.text})
        return sample


def computed(engines: list[c.Engine]) -> float:
    return sum(
        prometheus.scrape(e.url).get("enginesim_prompt_tokens_computed_total", 0.0) for e in engines
    )


async def run_load(
    url: str, tag: str, args: argparse.Namespace, mixed: bool, ps: list[c.Engine], d: c.Engine
) -> dict[str, Any]:
    """One load against `url`; `tag` makes every prompt of this run unique."""
    rng = random.Random(args.seed)
    n = args.conversations // 2 if mixed else args.conversations
    system = f"[{tag}] You are a helpful assistant. " + c.words(rng, args.system_words)
    chats = [Chat(system + f" (#{i})", random.Random(args.seed * 1000 + i)) for i in range(n)]
    singles: list[StreamedAnswer] = []
    per_turn: list[list[StreamedAnswer]] = []
    p_before, d_before = computed(ps), computed([d])
    client = AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=300)
    started = time.perf_counter()
    async with client:
        for t in range(1, args.turns + 1):
            jobs = [chat.turn(client, t, args) for chat in chats]
            if mixed:
                jobs += [
                    ask(
                        client,
                        [
                            {
                                "role": "system",
                                "content": f"[{tag}] single {t}.{i} "
                                + c.words(rng, args.system_words),
                            },
                            {"role": "user", "content": c.words(rng, args.user_words)},
                        ],
                        {},
                        args.max_tokens,
                    )
                    for i in range(args.conversations - n)
                ]
            results = await asyncio.gather(*jobs)
            per_turn.append(list(results[:n]))
            singles.extend(results[n:])
        total = time.perf_counter() - started
    if url != d.url:  # end the conversations: the proxy frees what D holds for them
        async with aiohttp.ClientSession() as session:
            for chat in chats:
                async with session.delete(f"{url}/v1/conversations/{chat.conv_id}") as resp:
                    await resp.read()
    await asyncio.sleep(1.0)  # engines publish their counters on their next loop poll
    per_turn = [[s for s in turn if not math.isnan(s.ttft)] for turn in per_turn]
    singles = [s for s in singles if not math.isnan(s.ttft)]
    every = [s for turn in per_turn for s in turn]
    gaps = [g for s in [*every, *singles] for g in s.gaps]
    ttfts = [s.ttft for s in every]
    return {
        "turns": [
            {
                "turn": i + 1,
                "ttft_p50": c.percentile([s.ttft for s in ss], 50),
                "ttft_p99": c.percentile([s.ttft for s in ss], 99),
            }
            for i, ss in enumerate(per_turn)
        ],
        "ttft_p50": c.percentile(ttfts, 50),
        "ttft_p99": c.percentile(ttfts, 99),
        "later_ttft_p50": c.percentile([s.ttft for ss in per_turn[1:] for s in ss], 50),
        "single_ttft_p50": c.percentile([s.ttft for s in singles], 50) if singles else math.nan,
        "single_ttft_p99": c.percentile([s.ttft for s in singles], 99) if singles else math.nan,
        "itl_p50": c.percentile(gaps, 50),
        "itl_p99": c.percentile(gaps, 99),
        "p_computed": computed(ps) - p_before,
        "d_computed": computed([d]) - d_before,
        "total_s": total,
    }


@contextmanager
def engines(args: argparse.Namespace) -> Iterator[tuple[list[c.Engine], c.Engine]]:
    engine_args = [
        "--prefill-us-per-token",
        str(args.prefill_us_per_token),
        "--decode-us-per-step",
        str(args.decode_us_per_step),
        "--num-blocks",
        "16384",
        "--max-model-len",
        "8192",
        "--enable-prefix-caching",
        "--log-level",
        "WARNING",
    ]
    started: list[c.Engine] = []
    try:
        for name in ("pol-p0", "pol-p1", "pol-d"):
            started.append(c.start_engine(name, engine_args))
        yield started[:2], started[2]
    finally:
        c.stop_all(*(e.process for e in started))


async def warm_up(ps: list[c.Engine], d: c.Engine, args: argparse.Namespace) -> None:
    """Each P meets D over NIXL both ways before the measured loads (unmeasured)."""
    for p in ps:
        router = c.start_kvrelay("warmup", [p], [d], env={"KVRELAY_ROUTING_POLICY": "always_p"})
        try:
            client = AsyncOpenAI(base_url=router.url + "/v1", api_key="b", max_retries=0)
            async with client:
                chat = Chat("warm-up " + p.engine_id, random.Random(0))
                for t in (1, 2):
                    await chat.turn(client, t, args)
        finally:
            c.stop_all(router.process)


def run_system(
    label: str,
    args: argparse.Namespace,
    ps: list[c.Engine],
    d: c.Engine,
    policy: str | None = None,
    router_policy: str | None = None,
) -> dict[str, Any]:
    router = None
    try:
        if policy is not None:
            router = c.start_kvrelay(
                label,
                ps,
                [d],
                env={
                    "KVRELAY_ROUTING_POLICY": policy,
                    "KVRELAY_CONDITIONAL_MAX_UNCACHED_TOKENS": str(
                        args.conditional_max_uncached_tokens
                    ),
                    "KVRELAY_CONDITIONAL_MAX_INFLIGHT_TOKENS": str(
                        args.conditional_max_inflight_tokens
                    ),
                },
            )
            url = router.url
        elif router_policy is not None:
            router = c.start_vllm_router(ps, [d], policy=router_policy)
            url = router.url
        else:
            url = d.url
        out: dict[str, Any] = {"label": label}
        for load in ("multiturn", "mixed"):
            out[load] = asyncio.run(run_load(url, f"{label}-{load}", args, load == "mixed", ps, d))
            r = out[load]
            print(
                f"{label:22s} {load:9s} TTFT p50 {c.fmt_ms(r['ttft_p50'])} ms p99 "
                f"{c.fmt_ms(r['ttft_p99'])} ms ITL p99 {c.fmt_ms(r['itl_p99'])} ms "
                f"P computed {r['p_computed']:.0f} D computed {r['d_computed']:.0f} "
                f"total {r['total_s']:.1f}s",
                flush=True,
            )
        return out
    finally:
        if router is not None:
            c.stop_all(router.process)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with engines(args) as (ps, d):
        asyncio.run(warm_up(ps, d, args))
        systems = [run_system(f"kvrelay {p}", args, ps, d, policy=p) for p in POLICIES]
        systems.append(run_system("D alone", args, ps, d))
        skipped = ""
        if args.vllm_router:
            for rp in ("round_robin", "cache_aware"):
                try:
                    systems.append(run_system(f"vllm-router {rp}", args, ps, d, router_policy=rp))
                except Exception as exc:  # reported in RESULTS.md, not fatal to the comparison
                    skipped += f"vllm-router {rp}: {type(exc).__name__}: {exc}. "
        return {"systems": systems, "skipped": skipped}


def verdicts(data: dict[str, Any], default: str) -> tuple[list[str], str]:
    """The issue's aims, each met or missed with its ratio; and the best measured policy."""
    by = {s["label"]: s for s in data["systems"]}
    kv = {p: by[f"kvrelay {p}"] for p in POLICIES}
    best = min(POLICIES, key=lambda p: kv[p]["multiturn"]["ttft_p50"])
    me = by[f"kvrelay {default}"]
    others = [s for s in data["systems"] if s is not me]
    rival = min(others, key=lambda s: s["multiturn"]["ttft_p50"])
    lines = []
    ratio = me["multiturn"]["ttft_p50"] / rival["multiturn"]["ttft_p50"]
    lines.append(
        f"- multi-turn TTFT p50: `{default}` {c.fmt_ms(me['multiturn']['ttft_p50'], 1)} "
        f"ms vs best other ({rival['label']}) "
        f"{c.fmt_ms(rival['multiturn']['ttft_p50'], 1)} ms: ratio {ratio:.2f} "
        f"-> {'met' if ratio < 1 else 'MISSED'} (aim: lowest of all)"
    )
    base = kv["always_p"]
    itl = me["multiturn"]["itl_p99"] / base["multiturn"]["itl_p99"]
    lines.append(
        f"- D inter-token p99 (multi-turn): `{default}` "
        f"{c.fmt_ms(me['multiturn']['itl_p99'], 1)} ms vs always_p "
        f"{c.fmt_ms(base['multiturn']['itl_p99'], 1)} ms: ratio {itl:.2f} -> "
        f"{'met' if itl <= ITL_AIM else 'MISSED'} (aim: at most {ITL_AIM:.2f})"
    )
    # always_p and affinity route single-turn requests the same way: their difference is
    # this run's noise on that number.
    single = me["mixed"]["single_ttft_p50"] / base["mixed"]["single_ttft_p50"]
    noise = abs(kv["affinity"]["mixed"]["single_ttft_p50"] / base["mixed"]["single_ttft_p50"] - 1)
    lines.append(
        f"- single-turn TTFT p50 (mixed load): `{default}` "
        f"{c.fmt_ms(me['mixed']['single_ttft_p50'], 1)} ms vs always_p "
        f"{c.fmt_ms(base['mixed']['single_ttft_p50'], 1)} ms: ratio {single:.2f}, noise "
        f"±{noise:.2f} (affinity vs always_p, same routing for these) -> "
        f"{'met' if single <= 1 + max(noise, 0.05) else 'MISSED'} "
        "(aim: no worse than always_p within noise, at least ±0.05)"
    )
    return lines, best


def render(data: dict[str, Any], args: argparse.Namespace, default: str) -> str:
    lines = [c.run_header(), ""]
    lines.append(
        f"2 P + 1 D enginesim (`--prefill-us-per-token {args.prefill_us_per_token} "
        f"--decode-us-per-step {args.decode_us_per_step} --enable-prefix-caching`), one "
        "kvrelay worker (`conditional_max_uncached_tokens="
        f"{args.conditional_max_uncached_tokens}`, `conditional_max_inflight_tokens="
        f"{args.conditional_max_inflight_tokens}`). Multi-turn: {args.conversations} "
        f"conversations x {args.turns} turns; mixed: "
        f"{args.conversations // 2} conversations x {args.turns} turns plus "
        f"{args.conversations - args.conversations // 2} single-turn requests per round. System "
        f"prompt {args.system_words} words, user messages {args.user_words} words, "
        f"`max_tokens={args.max_tokens}`, streamed via the `openai` SDK. ITL = gaps between "
        "streamed chunks as the client reads them (client, proxy and engines share the "
        "machine's 2 cores, so chunks often arrive in bursts: ITL p50 near 0, p99 = stalls). "
        "Tokens = `enginesim_prompt_tokens_computed_total` deltas."
    )
    lines += [
        "",
        "| system | load | TTFT p50 ms | TTFT p99 ms | turns 2+ TTFT p50 ms "
        "| single-turn TTFT p50 / p99 ms | ITL p50 ms | ITL p99 ms | P computed "
        "| D computed | total s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in data["systems"]:
        for load in ("multiturn", "mixed"):
            r = s[load]
            single = (
                f"{c.fmt_ms(r['single_ttft_p50'], 1)} / {c.fmt_ms(r['single_ttft_p99'], 1)}"
                if not math.isnan(r["single_ttft_p50"])
                else "-"
            )
            lines.append(
                f"| {s['label']} | {load} | {c.fmt_ms(r['ttft_p50'], 1)} | "
                f"{c.fmt_ms(r['ttft_p99'], 1)} | {c.fmt_ms(r['later_ttft_p50'], 1)} | {single} | "
                f"{c.fmt_ms(r['itl_p50'], 2)} | {c.fmt_ms(r['itl_p99'], 2)} | "
                f"{r['p_computed']:.0f} | {r['d_computed']:.0f} | {r['total_s']:.1f} |"
            )
    if data["skipped"]:
        lines += ["", "Not compared: " + data["skipped"]]
    lines += ["", "TTFT p50 / p99 ms per turn (multi-turn load):", ""]
    names = [s["label"] for s in data["systems"]]
    lines.append("| turn | " + " | ".join(names) + " |")
    lines.append("|---:|" + "---:|" * len(names))
    for i in range(args.turns):
        cells = [
            f"{c.fmt_ms(s['multiturn']['turns'][i]['ttft_p50'], 1)} / "
            f"{c.fmt_ms(s['multiturn']['turns'][i]['ttft_p99'], 1)}"
            for s in data["systems"]
        ]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    aims, best = verdicts(data, default)
    lines += [
        "",
        f"Default policy (`routing_policy` default): `{default}`; lowest multi-turn "
        f"TTFT p50 among kvrelay's policies in this run: `{best}`.",
        "",
        *aims,
    ]
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for s in data["systems"]:
        turns = s["multiturn"]["turns"]
        ax.plot(
            [t["turn"] for t in turns],
            [t["ttft_p50"] * 1000 for t in turns],
            marker="o",
            label=s["label"],
        )
    ax.set_title("TTFT p50 by turn (multi-turn load), per routing policy")
    ax.set_xlabel("turn")
    ax.set_ylabel("ms")
    ax.grid(True, alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    from kvrelay.proxy.config import Settings

    args = parse_args(argv)
    started = time.monotonic()
    data = measure(args)
    data["elapsed_s"] = time.monotonic() - started
    c.write_json(args.json, data)
    default = Settings.model_fields["routing_policy"].default
    text = render(data, args, default)
    plot(data, args.plot)
    text += f"\n\nPlot: [{args.plot.name}]({args.plot.name})\n"
    c.publish(
        SECTION, text, args.no_results, wrote=f"{c.relpath(args.json)} in {data['elapsed_s']:.0f}s"
    )
    return 0
