"""Proxy overhead: kvrelay vs vllm-router vs no router, side by side on the same engines.

One P and one D enginesim with zero simulated compute (so the routers' own cost is what
differs) serve the same closed-loop load (non-streaming and streaming chat, concurrency 1, 64,
256 by default) sent:

- `direct`: by the load generator itself to the engines, doing the two legs a P/D router does
  (P with max_tokens=1, then D with P's kv_transfer_params): the same engine work, no hop;
- `kvrelay-w1`: through `kvrelay serve --workers 1` (in-memory conversation map);
- `kvrelay-w2`: through `kvrelay serve --workers 2` (shared Redis map, real redis-server);
- `vllm-router`: through `vllm-router --vllm-pd-disaggregation` (PyPI `vllm-router`, installed
  into `.venv-router`).

Every case runs all targets back to back (order rotated per case) so drift hits all alike.
`--proxy-bound` runs the other mode instead (`bench/_proxybound.py`): zero-work fake engines,
processes pinned so the router is the bottleneck, its own `## proxy-bound` section.
Reports requests/s, latency p50/p99, added latency (target minus `direct` at the same
concurrency), streaming time to first byte, and the kvrelay/vllm-router ratios; rewrites the
`## proxy overhead` section of bench/RESULTS.md and draws bench/proxy_overhead.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

from bench import _common as c
from bench import _loadgen, _proxybound
from bench._features_off import FEATURES
from bench._plots import save_figure
from kvrelay.devtools import ServerProcess, prometheus

SECTION = "proxy overhead"
TARGETS = ("direct", "kvrelay-w1", "kvrelay-w2", "vllm-router")
MODES = ("non-stream", "stream")
AIM_ADDED_P50_S = 0.001
AIM_CONCURRENCY = 64
# Options that shape the report, saved with the raw results for --render-only.
SETTINGS = (
    "concurrency", "modes", "targets", "requests_per_client", "min_requests", "max_requests",
    "rounds", "max_tokens", "prompt_words",
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Example: .venv/bin/python -m bench.proxy_overhead --concurrency 1 64 256",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument(
        "--modes", nargs="+", choices=_proxybound.MODES, default=None,
        help=f"default: {' '.join(MODES)}; proxy-bound: {' '.join(_proxybound.MODES)}",
    )  # fmt: skip
    p.add_argument(
        "--targets", nargs="+", choices=(*TARGETS, _proxybound.BARE), default=list(TARGETS),
        help=f"proxy-bound also: {_proxybound.BARE} (bench/bare_relay.py, no features)",
    )  # fmt: skip
    p.add_argument(
        "--requests-per-client",
        type=int,
        default=3,
        help="measured requests per concurrent client; count = clamp(C x this, min, max)",
    )
    p.add_argument("--min-requests", type=int, default=80, help="lower bound per case")
    p.add_argument("--max-requests", type=int, default=384, help="upper bound per case")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds (enginesim: the requests are split over them; default 2; "
        "proxy-bound: each round runs --requests, default 3)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens generated per request (default 8; proxy-bound 16)",
    )
    p.add_argument("--prompt-words", type=int, default=32, help="words in each prompt")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="extra argument for both enginesim processes (repeatable)",
    )
    p.add_argument(
        "--json", type=Path, default=None,
        help="raw results (default: bench/.work/proxy_overhead.json; with --proxy-bound "
        "proxy_bound.json, or proxy_bound_tracing.json with --tracing on|both)",
    )  # fmt: skip
    p.add_argument("--plot", type=Path, default=c.BENCH_DIR / "proxy_overhead.png")
    p.add_argument("--no-results", action="store_true", help="do not rewrite bench/RESULTS.md")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: concurrency 1 and 8, 40 requests"
    )
    p.add_argument(
        "--render-only",
        action="store_true",
        help="measure nothing: redraw the tables and plot from the --json file of an earlier run",
    )
    _proxybound.add_arguments(p)
    args = p.parse_args(argv)
    if args.modes is None:
        args.modes = list(_proxybound.MODES if args.proxy_bound else MODES)
    elif not args.proxy_bound and not set(args.modes) <= set(MODES):
        p.error(f"--modes: the enginesim mode measures {' and '.join(MODES)} only")
    if not args.proxy_bound and _proxybound.BARE in args.targets:
        p.error(f"--targets: {_proxybound.BARE} is a target of the proxy-bound mode only")
    if args.src is not None and not args.proxy_bound:
        p.error("--src: a setting of the proxy-bound mode only")
    if args.src is not None and (args.without or args.compiled or args.tracing == "both"):
        # Those targets are variants of this checkout, to be judged beside this checkout's.
        p.error("--src: not with --without, --compiled or --tracing both")
    if args.without and not args.proxy_bound:
        p.error("--without: a target of the proxy-bound mode only")
    unknown = set(filter(None, args.without.split(","))) - set(FEATURES)
    if unknown:
        p.error(f"--without: unknown features {sorted(unknown)}; known: {', '.join(FEATURES)}")
    if args.rounds is None:
        args.rounds = 3 if args.proxy_bound else 2
    if args.max_tokens is None:
        args.max_tokens = 16 if args.proxy_bound else 8
    if args.quick and args.proxy_bound:
        _proxybound.apply_quick(args)
    elif args.quick:
        args.concurrency = [1, 8]
        args.min_requests = 40
        args.max_requests = 40
        args.requests_per_client = 5
        args.rounds = 1
    return args


def case_requests(args: argparse.Namespace, conc: int) -> int:
    """Measured requests of one case (all rounds): C x per-client, clamped to [min, max]."""
    per_client = int(args.requests_per_client) * conc
    return max(int(args.min_requests), min(int(args.max_requests), per_client))


def summarize(result: dict[str, Any]) -> dict[str, float]:
    return {**_loadgen.summarize(result), "ok": float(len(result["latencies"]))}


def _empty_acc() -> dict[str, Any]:
    return {
        "latencies": [],
        "ttfbs": [],
        "errors": 0,
        "error_samples": [],
        "wall_s": 0.0,
        "d_loaded_tokens": 0.0,
        "router_cpu_s": 0.0,
        "engine_cpu_s": 0.0,
    }


def _accumulate(acc: dict[str, Any], result: dict[str, Any]) -> None:
    """Pool one round's result into the case: latencies joined, walls and counts added."""
    acc["latencies"].extend(result["latencies"])
    acc["ttfbs"].extend(result["ttfbs"])
    acc["errors"] += result["errors"]
    acc["error_samples"].extend(result["error_samples"])
    acc["wall_s"] += result["wall_s"]
    acc["d_loaded_tokens"] += result["d_loaded_tokens"]
    acc["router_cpu_s"] += result["router_cpu_s"]
    acc["engine_cpu_s"] += result["engine_cpu_s"]


def loaded_tokens(d_url: str) -> float:
    return prometheus.totals(prometheus.scrape(d_url)).get(
        "enginesim_prompt_tokens_loaded_total", math.nan
    )


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Start engines and routers, run every case, stop everything; return raw summaries."""
    p_eng = d_eng = None
    routers: list[c.RunningRouter] = []
    stack = contextlib.ExitStack()
    # Zero simulated compute: what differs between targets is the routers' own cost. Enough
    # sequences and blocks that the engines never queue on admission at concurrency 256.
    engine_args = [
        "--prefill-us-per-token", "0",
        "--decode-us-per-step", "0",
        "--max-num-seqs", str(max(256, max(args.concurrency))),
        "--num-blocks", "8192",
        "--log-level", "WARNING",
        *args.engine_arg,
    ]  # fmt: skip
    try:
        p_eng = c.start_engine("bench-p", engine_args)
        d_eng = c.start_engine("bench-d", engine_args)
        urls: dict[str, str] = {}
        procs: dict[str, ServerProcess] = {}
        if "kvrelay-w1" in args.targets:
            r = c.start_kvrelay("kvrelay-w1", [p_eng], [d_eng], workers=1)
            routers.append(r)
            urls["kvrelay-w1"] = r.url
            procs["kvrelay-w1"] = r.process
        if "kvrelay-w2" in args.targets:
            redis = stack.enter_context(c.redis_for_bench())
            r = c.start_kvrelay("kvrelay-w2", [p_eng], [d_eng], workers=2, map_url=redis.url)
            routers.append(r)
            urls["kvrelay-w2"] = r.url
            procs["kvrelay-w2"] = r.process
        if "vllm-router" in args.targets:
            r = c.start_vllm_router([p_eng], [d_eng])
            routers.append(r)
            urls["vllm-router"] = r.url
            procs["vllm-router"] = r.process

        # Rounds interleave all cases so slow drift of the shared machine spreads evenly.
        raw: dict[tuple[str, int, str], dict[str, Any]] = {}
        case_no = 0
        for rnd in range(args.rounds):
            for mode in args.modes:
                for conc in args.concurrency:
                    n = case_requests(args, conc) // args.rounds
                    targets = list(args.targets)
                    shift = case_no % len(targets)
                    targets = targets[shift:] + targets[:shift]
                    case_no += 1
                    for target in targets:
                        job: dict[str, Any] = {
                            "concurrency": conc,
                            "requests": n,
                            # Opens (most of) the keep-alive connections and the routers'
                            # upstream pools before the clock starts.
                            "warmup": min(max(conc, 10), 64),
                            "stream": mode == "stream",
                            "max_tokens": args.max_tokens,
                            "prompt_words": args.prompt_words,
                            "tag": f"{target}-{mode}-{conc}-{time.time_ns()}",
                        }
                        if target == "direct":
                            job.update(mode="pd", p_url=p_eng.url, d_url=d_eng.url)
                        else:
                            job.update(mode="single", url=urls[target])
                        before = loaded_tokens(d_eng.url)
                        router_proc = procs.get(target)
                        cpu0 = c.server_cpu_s(router_proc) if router_proc else 0.0
                        eng0 = c.server_cpu_s(p_eng.process) + c.server_cpu_s(d_eng.process)
                        result = _loadgen.run_in_process(job, timeout=300.0)
                        cpu1 = c.server_cpu_s(router_proc) if router_proc else 0.0
                        eng1 = c.server_cpu_s(p_eng.process) + c.server_cpu_s(d_eng.process)
                        result["d_loaded_tokens"] = loaded_tokens(d_eng.url) - before
                        result["router_cpu_s"] = cpu1 - cpu0
                        result["engine_cpu_s"] = eng1 - eng0
                        acc = raw.setdefault((mode, conc, target), _empty_acc())
                        _accumulate(acc, result)
                        s = summarize(result)
                        print(
                            f"round {rnd + 1} {mode:10s} c={conc:<4d} {target:12s} "
                            f"{s['rps']:8.1f} req/s p50 {c.fmt_ms(s['p50'])} ms "
                            f"p99 {c.fmt_ms(s['p99'])} ms ttfb {c.fmt_ms(s['ttfb_p50'])} ms "
                            f"err {int(s['errors'])}",
                            flush=True,
                        )
        cases: list[dict[str, Any]] = []
        for (mode, conc, target), acc in raw.items():
            case = {"mode": mode, "concurrency": conc, "target": target, **summarize(acc)}
            case["d_loaded_tokens"] = acc["d_loaded_tokens"]
            ok = max(len(acc["latencies"]), 1)
            case["router_cpu_us"] = acc["router_cpu_s"] / ok * 1e6
            case["engine_cpu_us"] = acc["engine_cpu_s"] / ok * 1e6
            case["error_samples"] = acc["error_samples"][:5]
            cases.append(case)
        order = {t: i for i, t in enumerate(TARGETS)}
        cases.sort(key=lambda x: (MODES.index(x["mode"]), x["concurrency"], order[x["target"]]))
        return {"cases": cases, "engine_args": engine_args}
    finally:
        c.stop_all(*(r.process for r in routers))
        stack.close()
        c.stop_all(
            p_eng.process if p_eng else None,
            d_eng.process if d_eng else None,
        )


def find(cases: list[dict[str, Any]], mode: str, conc: int, target: str) -> dict[str, Any] | None:
    for case in cases:
        if case["mode"] == mode and case["concurrency"] == conc and case["target"] == target:
            return case
    return None


def add_derived(data: dict[str, Any]) -> None:
    """Added latency vs `direct` at the same mode and concurrency; ratios vs vllm-router."""
    cases = data["cases"]
    for case in cases:
        base = find(cases, case["mode"], case["concurrency"], "direct")
        for key in ("p50", "p99", "ttfb_p50"):
            case[f"added_{key}"] = case[key] - base[key] if base else math.nan
    for case in cases:
        ref = find(cases, case["mode"], case["concurrency"], "vllm-router")
        if ref is None or not case["target"].startswith("kvrelay"):
            continue
        case["rps_ratio"] = case["rps"] / ref["rps"] if ref["rps"] else math.nan
        for key in ("added_p50", "added_p99", "ttfb_p50", "router_cpu_us"):
            case[f"{key}_ratio"] = case[key] / ref[key] if ref[key] > 0 else math.nan


def render_markdown(data: dict[str, Any], args: argparse.Namespace) -> str:
    cases = data["cases"]
    lines = [data.get("header") or c.run_header(), ""]
    lines.append(
        "1 P + 1 D enginesim with zero simulated compute "
        f"(`{' '.join(data['engine_args'])}`); chat requests with a unique {args.prompt_words}"
        f"-word prompt each (no reuse possible), `max_tokens={args.max_tokens}`; closed-loop "
        "aiohttp client in its own process; fixed request count per case "
        f"({', '.join(f'c={x}: {case_requests(args, x)}' for x in args.concurrency)}), split over "
        f"{args.rounds} interleaved rounds (target order rotated). `direct` = the "
        "client itself does the P leg then the D leg against the engines (same engine work, no "
        "router hop); added latency = target minus `direct` in the same run. vllm-router "
        f"{c.ROUTER_VERSION} runs `--vllm-pd-disaggregation --policy round_robin`. "
        "All processes share the machine's cores. 'D pulled' = prompt tokens D loaded over NIXL "
        "during the case (both routers really disaggregate). A negative added latency means "
        "the router's case met less contention from the machine's other jobs than `direct`: "
        "the difference is within this run's noise."
    )
    lines.append("")
    lines += c.case_table(
        cases,
        [
            ("added p50 ms", c.routed(lambda x: c.fmt_ms(x["added_p50"]))),
            ("added p99 ms", c.routed(lambda x: c.fmt_ms(x["added_p99"]))),
            ("TTFB p50 ms", c.streamed_ms("ttfb_p50")),
            ("router CPU us/req", c.whole("router_cpu_us")),
            ("engines CPU us/req", c.whole("engine_cpu_us")),
            ("D pulled tok", c.whole("d_loaded_tokens")),
            ("errors", c.errors_cell),
        ],
    )
    lines.append("")
    lines.append(
        "Ratios kvrelay / vllm-router (same mode and concurrency; throughput > 1 is "
        "better, latency < 1 is better):"
    )
    lines.append("")
    lines.append(
        "| mode | conc | kvrelay | req/s ratio | added p50 ratio | added p99 ratio "
        "| TTFB p50 ratio | router CPU/req ratio |"
    )
    lines.append("|---|---:|---|---:|---:|---:|---:|---:|")
    for case in cases:
        if "rps_ratio" not in case:
            continue
        stream = case["mode"] == "stream"
        lines.append(
            f"| {case['mode']} | {case['concurrency']} | {case['target']} "
            f"| {c.fmt_ratio(case['rps_ratio'])} | {c.fmt_ratio(case['added_p50_ratio'])} "
            f"| {c.fmt_ratio(case['added_p99_ratio'])} "
            f"| {c.fmt_ratio(case['ttfb_p50_ratio']) if stream else '-'} "
            f"| {c.fmt_ratio(case['router_cpu_us_ratio'])} |"
        )
    lines.append("")
    lines.extend(aim_lines(cases))
    return "\n".join(lines)


def aim_lines(cases: list[dict[str, Any]]) -> list[str]:
    """Aims: added p50 <= 1 ms at concurrency 64; throughput >= vllm-router's."""
    out = ["Aims:", ""]
    for case in cases:
        if not case["target"].startswith("kvrelay"):
            continue
        if case["concurrency"] == AIM_CONCURRENCY and not math.isnan(case["added_p50"]):
            added = case["added_p50"]
            if added < 0:
                verdict = "met, but only as noise (negative)"
            elif added <= AIM_ADDED_P50_S:
                verdict = "met"
            else:
                verdict = f"MISSED by {c.fmt_ms(added - AIM_ADDED_P50_S)} ms"
            out.append(
                f"- added p50 <= 1 ms at concurrency {AIM_CONCURRENCY}, {case['mode']}, "
                f"{case['target']}: {c.fmt_ms(added)} ms, {verdict}"
            )
        if "rps_ratio" in case and not math.isnan(case["rps_ratio"]):
            ratio = case["rps_ratio"]
            verdict = "met" if ratio >= 1.0 else f"MISSED by {(1 - ratio) * 100:.0f}%"
            out.append(
                f"- throughput >= vllm-router, {case['mode']}, c={case['concurrency']}, "
                f"{case['target']}: {ratio:.2f}x, {verdict}"
            )
    out += ["", *cost_lines(cases)]
    return out


def cost_lines(cases: list[dict[str, Any]]) -> list[str]:
    """Where the time goes: CPU per request of each router and of the engines behind it.

    On a machine whose cores the engines already saturate, every CPU microsecond a router spends
    per request is taken from the engines, so throughput and queueing latency follow CPU cost.
    """
    out = ["Cost per request at the highest concurrency (CPU is steadier than wall time here):", ""]
    top = max((int(x["concurrency"]) for x in cases), default=0)
    for mode in MODES:
        ref = find(cases, mode, top, "vllm-router")
        direct = find(cases, mode, top, "direct")
        for target in ("kvrelay-w1", "kvrelay-w2"):
            case = find(cases, mode, top, target)
            if case is None or ref is None or direct is None:
                continue
            out.append(
                f"- {mode}, c={top}, {target}: router {case['router_cpu_us']:.0f} us CPU/request "
                f"vs vllm-router {ref['router_cpu_us']:.0f} us; engines "
                f"{case['engine_cpu_us']:.0f} us/request vs {ref['engine_cpu_us']:.0f} us behind "
                f"vllm-router and {direct['engine_cpu_us']:.0f} us with no router"
            )
    return out


COLORS = {"direct": "tab:blue", "kvrelay-w1": "tab:orange", "kvrelay-w2": "tab:green",
          "vllm-router": "tab:red"}  # fmt: skip


def plot(data: dict[str, Any], path: Path) -> None:
    """Per mode: added p50 latency, throughput and router CPU per request by concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = data["cases"]
    modes = [m for m in MODES if any(x["mode"] == m for x in cases)]
    targets = [t for t in TARGETS if any(x["target"] == t for x in cases)]
    concs_all = sorted({int(x["concurrency"]) for x in cases})
    rows = (
        ("added_p50", 1000.0, "added latency p50 vs direct", "ms"),
        ("rps", 1.0, "throughput", "requests/s"),
        ("router_cpu_us", 1.0, "router CPU per request", "CPU us / request"),
    )
    fig, axes = plt.subplots(
        len(rows), len(modes), figsize=(5.5 * len(modes), 3.6 * len(rows)), squeeze=False
    )
    for col, mode in enumerate(modes):
        for target in targets:
            pts = sorted(
                (x["concurrency"], x) for x in cases if x["mode"] == mode and x["target"] == target
            )
            concs = [p[0] for p in pts]
            for row, (key, scale, _, _) in enumerate(rows):
                if target == "direct" and key != "rps":
                    continue  # the baseline adds nothing and has no router
                axes[row][col].plot(
                    concs,
                    [p[1][key] * scale for p in pts],
                    marker="o",
                    color=COLORS[target],
                    label=target,
                )
        axes[0][col].axhline(AIM_ADDED_P50_S * 1000, color="grey", ls="--", lw=1, label="aim 1 ms")
        for row, (_, _, title, unit) in enumerate(rows):
            ax = axes[row][col]
            ax.set_title(f"{mode}: {title}")
            ax.set_ylabel(unit)
            ax.set_xscale("log", base=2)
            ax.set_xticks(concs_all, [str(x) for x in concs_all])
            ax.set_xlabel("concurrency")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    title = "Proxy overhead on the same zero-compute P/D enginesim pair (one run)"
    save_figure(fig, path, title, dpi=80)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.proxy_bound:
        return _proxybound.main(args)
    args.json = args.json or c.WORK_DIR / "proxy_overhead.json"
    if args.render_only:
        # Tables and plot again from saved raw results (the header keeps the measuring command).
        data = json.loads(args.json.read_text())
        for key, value in data.get("settings", {}).items():
            setattr(args, key, value)
    else:
        header = c.run_header()
        started = time.monotonic()
        data = measure(args)
        data["elapsed_s"] = time.monotonic() - started
        data["header"] = header
        data["settings"] = {k: getattr(args, k) for k in SETTINGS}
    add_derived(data)
    c.write_json(args.json, data)
    plot(data, args.plot)
    text = render_markdown(data, args)
    c.publish(
        SECTION,
        text,
        args.no_results,
        plot=f"\n\nPlot: [{args.plot.name}]({args.plot.name})\n",
        wrote=f"{c.relpath(args.json)}, {c.relpath(args.plot)} in {data['elapsed_s']:.0f}s",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
