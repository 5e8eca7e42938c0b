"""Proxy-bound mode of `proxy_overhead.py`: routers in front of zero-work fake engines.

The engines (`bench/fake_engine.py`, one P and one D) do no model work, so whatever limits
throughput is the router itself. Placement makes that so on purpose: the router under test and
both fakes are pinned to the same CPU set (`--proxy-cpus`, default CPU 0) and the closed-loop
load generator to another (`--loadgen-cpus`, default CPU 1). `kvrelay --workers 2` gets
`--w2-cpus` (default CPUs 0 and 1, so its second worker has a core to scale onto; on a
two-core machine that core is the load generator's, which the report says) and its Redis map
server runs on the same CPUs, its CPU time counted as the proxy's.

Targets: `direct` (the load generator calling D alone: the floor), `bare-relay` (on request:
`bench/bare_relay.py`, a P→D relay on aiohttp's server and kvrelay's engine client with none
of kvrelay's features, so the gap to kvrelay is the price of those), `kvrelay-w1` (memory
map), `kvrelay-w2` (real redis-server map), `vllm-router` (0.1.17, `--vllm-pd-disaggregation
--policy round_robin`). Requests are `/v1/completions` with a unique prompt and a unique
`X-Conversation-Id` each: every request is a conversation's first turn, so kvrelay asks D to
hold, stores D's params in its map (and, for streams, fetches them from D's side channel first,
since streams carry none) and releases what the map evicts: its real work on the success path.
vllm-router ignores the header. The `long-chat` mode sends chat completions instead, each with
a long history (`--history-turns`, `--history-words`): the work that grows with the body.

Each case (mode x concurrency) runs every target back to back, the order rotated per case,
and the whole set of cases is repeated in `--rounds` interleaved rounds, every router started
afresh for each round (the start order rotated: `Bench.restart_routers` says why); each
figure reported is the median over rounds. Router CPU per request is the process group's
CPU time (workers included) over the requests served. `--profile` records the kvrelay proxy
with py-spy during an extra, unmeasured case and writes a flame graph SVG beside RESULTS.md.

`--tracing on|both` measures what OpenTelemetry traces cost: kvrelay exports its spans over
OTLP/HTTP to a fake collector (`bench/otlp_sink.py`, on the load generator's CPUs) that counts
them. `on` traces every kvrelay target; `both` adds `kvrelay-w1-traced` beside an untraced
`kvrelay-w1`, measured in the same interleaved rounds, and reports the two side by side in its
own section (`## proxy-bound tracing`) so the full proxy-bound section is left alone. With
`off` (the default) kvrelay runs with `KVRELAY_TRACING=off`. `--baseline-src DIR` adds
`kvrelay-w1-base`: the same proxy from another source tree (e.g. the commit before tracing,
`git archive REF kvrelay | tar -x -C DIR`), to show what the untraced path costs against it.
`--src DIR` runs kvrelay-w1 and kvrelay-w2 from another tree instead of this checkout, so
that with `--baseline-src` two commits are compared by this checkout's bench (a change
whose own commits lie between others'). `--compiled` adds `kvrelay-w1-compiled`: this
checkout with its per-turn packages compiled by mypyc in a temporary copy
(`bench/_compiled.py`), judged against the base as kvrelay-w1 is.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import _common as c
from bench import _compiled, _loadgen, _paired
from kvrelay.devtools import RedisServer, ServerProcess, free_port, http_ready, prometheus

SECTION = "proxy-bound"
TRACING_SECTION = "proxy-bound tracing"
TRACED = "kvrelay-w1-traced"
WITHOUT = "kvrelay-w1-without"
# One worker's in-process map, small enough that a proxy started for a round fills it within
# its first case: from then on every turn's store evicts an entry and the proxy releases its
# blocks on D, as a proxy running for hours does (with the default 100,000 entries only the
# last of five rounds reached that, when one process served them all).
W1_MAP_ENTRIES = 1024
W1_MAP_URL = f"memory://?max_entries={W1_MAP_ENTRIES}"
COMPILED = "kvrelay-w1-compiled"
BASE = "kvrelay-w1-base"
BASE_W2 = "kvrelay-w2-base"
BARE = "bare-relay"
TARGETS = ("direct", BARE, BASE, "kvrelay-w1", COMPILED, TRACED, WITHOUT, BASE_W2, "kvrelay-w2",
           "vllm-router")  # fmt: skip
MODES = ("non-stream", "stream", "long-chat")
# The six cases: the aims are judged on these (long-chat is reported beside them).
AIM_MODES = ("non-stream", "stream")
METRICS = ("rps", "p50", "p99", "ttfb_p50", "ttfb_p99", "router_cpu_us", "engine_cpu_us",
           "loadgen_cpu_us")  # fmt: skip
# The "Done when" aims.
AIM_RPS_RATIO = 1.0
AIM_ADDED_P50_C1_S = 0.001
AIM_P99_RATIO_C256 = 1.5
AIM_W2_SCALING = 1.6
PROFILE_SVG = c.BENCH_DIR / "proxy_bound_flame.svg"


def add_long_chat_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The long-chat mode's history (here and in `bench/instructions.py`)."""
    p.add_argument(
        "--history-turns",
        type=int,
        default=20,
        help="long-chat: earlier user/assistant exchanges sent with each request",
    )
    p.add_argument(
        "--history-words", type=int, default=100, help="long-chat: words in each earlier message"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("proxy-bound mode (--proxy-bound)")
    g.add_argument("--proxy-bound", action="store_true",
                   help="fake zero-work engines; the router is the bottleneck")  # fmt: skip
    g.add_argument("--requests", type=int, default=3000, help="requests per case and round")
    add_long_chat_arguments(g)
    g.add_argument("--proxy-cpus", default="0", help="CPUs of the router, fakes (taskset list)")
    g.add_argument(
        "--fake-cpus", default=None,
        help="CPUs of the fake engines alone (default: the router's, --proxy-cpus): apart, "
        "the engines' CPU no longer competes with the router's",
    )  # fmt: skip
    g.add_argument("--w2-cpus", default="0,1", help="CPUs of kvrelay --workers 2 and its Redis")
    g.add_argument("--loadgen-cpus", default="1", help="CPUs of the load generator")
    g.add_argument("--profile", action="store_true",
                   help=f"py-spy flame graph of kvrelay-w1 ({c.relpath(PROFILE_SVG)})")  # fmt: skip
    g.add_argument("--profile-requests", type=int, default=3000,
                   help="requests per mode in the profiled case (c=64)")  # fmt: skip
    g.add_argument("--max-minutes", type=float, default=None,
                   help="start no case after this long; report the rounds done")  # fmt: skip
    g.add_argument(
        "--tracing", choices=("off", "on", "both"), default="off",
        help="kvrelay with OpenTelemetry traces off, on (exported over OTLP/HTTP to "
        "bench/otlp_sink.py) or both side by side (adds kvrelay-w1-traced)",
    )  # fmt: skip
    g.add_argument(
        "--baseline-src", type=Path, default=None,
        help="a directory holding another kvrelay/ package (e.g. an older commit's, from git "
        "archive), run as kvrelay-w1-base beside kvrelay-w1 (and kvrelay-w2-base beside "
        "kvrelay-w2)",
    )  # fmt: skip
    g.add_argument(
        "--judge-runs", type=Path, nargs="+", default=None, metavar="JSON",
        help="measure nothing: judge kvrelay-w1 against kvrelay-w1-base over these runs' "
        "results (--json of runs with --baseline-src), the run as the unit",
    )  # fmt: skip
    g.add_argument(
        "--src", type=Path, default=None,
        help="a directory holding another kvrelay/ package, run as kvrelay-w1 and kvrelay-w2 "
        "in place of this checkout's (with --baseline-src: two commits compared by this "
        "checkout's bench, e.g. a change's last commit against its first's parent)",
    )  # fmt: skip
    g.add_argument(
        "--without", default="", metavar="FEATURES",
        help="also run kvrelay-w1 with these features switched off (comma-separated; see "
        "bench/_features_off.py) as kvrelay-w1-without: what they cost, and the proxy "
        "on the path an older --baseline-src took",
    )  # fmt: skip
    g.add_argument(
        "--compiled", action="store_true",
        help="also run kvrelay-w1 from a copy of this checkout whose kvrelay/proxy/turn and "
        "fleet mypyc compiled (bench/_compiled.py; minutes to build) as kvrelay-w1-compiled",
    )  # fmt: skip


def apply_quick(args: argparse.Namespace) -> None:
    args.concurrency = [1, 64]
    args.requests = 300
    args.rounds = 1
    args.profile_requests = 600


def summarize(result: dict[str, Any]) -> dict[str, float]:
    """One round of one target in one case: throughput, latency and CPU per request.

    Servers' CPU is read around the whole load-generator run, warm-up included, so it is
    divided by every request served; the load generator times only its measured requests.
    """
    done = len(result["latencies"])
    ok = max(done, 1)
    served = max(done + int(result.get("warmup", 0)), 1)
    return {
        **_loadgen.summarize(result),
        "router_cpu_us": result["router_cpu_s"] / served * 1e6,
        "engine_cpu_us": result["engine_cpu_s"] / served * 1e6,
        "loadgen_cpu_us": result["cpu_s"] / ok * 1e6,
    }


class Bench:
    """The fakes and the routers of one proxy-bound run, started once for all cases."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.p: c.Engine | None = None
        self.d: c.Engine | None = None
        self.routers: dict[str, c.RunningRouter] = {}
        self.redis: RedisServer | None = None
        self.sink: ServerProcess | None = None
        self.sink_url = ""
        self._built = contextlib.ExitStack()  # the compiled copy's temporary directory
        self._compiled_tree: Path | None = None
        # Work counters of the router processes stopped between rounds (`restart_routers`).
        self._work_before: dict[str, dict[str, float]] = {}
        # How each router target starts, made once the engines run (`_starters`): each tree's
        # import check runs once, not at every round's restart.
        self._starters: dict[str, Callable[[], c.RunningRouter]] = {}

    def targets(self) -> list[str]:
        """The targets measured: the chosen ones, and the traced kvrelay with --tracing both."""
        targets = list(self.args.targets)
        if self.args.tracing == "both" and "kvrelay-w1" in targets:
            targets.insert(targets.index("kvrelay-w1") + 1, TRACED)
        if getattr(self.args, "without", "") and "kvrelay-w1" in targets:
            targets.insert(targets.index("kvrelay-w1") + 1, WITHOUT)
        if getattr(self.args, "compiled", False) and "kvrelay-w1" in targets:
            targets.insert(targets.index("kvrelay-w1") + 1, COMPILED)
        if getattr(self.args, "baseline_src", None):
            for ours, base in (("kvrelay-w1", BASE), ("kvrelay-w2", BASE_W2)):
                if ours in targets:
                    targets.insert(targets.index(ours), base)
        return targets

    def _start_sink(self) -> None:
        port = free_port()
        self.sink_url = f"http://127.0.0.1:{port}"
        self.sink = ServerProcess(
            c.pinned([sys.executable, "-m", "bench.otlp_sink", "--port", str(port)],
                     self.args.loadgen_cpus),
            http_ready(self.sink_url + "/health"), env=c.bench_env(), ready_timeout=30,
            name="otlp-sink",
        ).start()  # fmt: skip

    def _env(self, traced: bool) -> dict[str, str]:
        env = {"KVRELAY_LOG_LEVEL": "warning", "KVRELAY_TRACING": "on" if traced else "off"}
        if traced:
            env.update({
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self.sink_url + "/v1/traces",
                "OTEL_SERVICE_NAME": "kvrelay-bench",
            })  # fmt: skip
        return env

    def _env_of_tree(self, src: Path, option: str, traced: bool = False) -> dict[str, str]:
        """The environment of a proxy run from the source tree `src` (`option` names where it
        came from), checked, not assumed, to import that tree's `kvrelay`: started from this
        checkout it would import this one's."""
        env = {**self._env(traced), "PYTHONPATH": str(src)}
        imported = c.kvrelay_source(env, src)
        if not imported.is_relative_to(src):
            raise SystemExit(f"{option}: the proxy from {src} would import {imported}")
        return env

    def spans_exported(self) -> dict[str, int] | None:
        """What the fake collector received (None without tracing)."""
        if self.sink is None:
            return None
        with urllib.request.urlopen(self.sink_url + "/stats", timeout=5) as resp:
            counts: dict[str, int] = json.loads(resp.read())
        return counts

    def start(self) -> None:
        """The fakes (and the span sink, the compiled copy, Redis where asked), then every
        router."""
        a = self.args
        targets = self.targets()
        if COMPILED in targets:  # built first: it takes minutes, and needs no engine
            tmp = self._built.enter_context(tempfile.TemporaryDirectory(prefix="kvrelay-mypyc-"))
            self._compiled_tree = _compiled.build(Path(tmp))
        fake_cpus = a.fake_cpus or a.proxy_cpus
        self.p = c.start_fake_engine("prefill", "fake-p", fake_cpus)
        self.d = c.start_fake_engine("decode", "fake-d", fake_cpus)
        if a.tracing != "off":
            self._start_sink()
        if "kvrelay-w2" in targets:
            self.redis = RedisServer().start()
            assert self.redis.process is not None and self.redis.process.proc is not None
            c.pin_pid(self.redis.process.proc.pid, a.w2_cpus)
        self._starters = self._make_starters()
        self.start_routers(self.router_targets())

    def router_targets(self) -> list[str]:
        """The targets that are routers this bench starts (not `direct`)."""
        return [t for t in self.targets() if t in self._starters]

    def start_routers(self, order: list[str]) -> None:
        """Start the routers of `order`, in that order (which one starts first can place it
        better in memory: the order is rotated when they start again, `restart_routers`)."""
        for target in order:
            self.routers[target] = self._starters[target]()

    def restart_routers(self, shift: int) -> None:
        """Stop every router and start each again, the start order rotated by `shift`, their
        work counters kept. A process keeps its luck (its memory layout, its hash seed) for
        its whole life, which every round it serves shares: paired rounds of the same two
        processes differ by that luck in every round, so it reads as a difference between
        the proxies. Started afresh each round, it varies between rounds as it does between
        runs, and the rounds' spread includes it."""
        self._work_before = self.work_done()
        c.stop_all(*(r.process for r in self.routers.values()))
        self.routers.clear()
        order = self.router_targets()
        shift %= max(len(order), 1)
        self.start_routers(order[shift:] + order[:shift])

    def _make_starters(self) -> dict[str, Callable[[], c.RunningRouter]]:
        """How each router target of this run starts."""
        a = self.args
        targets = self.targets()
        assert self.p is not None and self.d is not None
        engines: tuple[list[c.Engine], list[c.Engine]] = ([self.p], [self.d])
        trace_all = a.tracing == "on"
        # kvrelay-w1 and -w2 from this checkout, or from the tree --src names.
        ours_src = a.src.resolve() if getattr(a, "src", None) else None
        ours_env = (
            self._env_of_tree(ours_src, "--src", trace_all)
            if ours_src is not None
            else self._env(trace_all)
        )
        starters: dict[str, Callable[[], c.RunningRouter]] = {}

        def kvrelay(name: str, **kw: Any) -> None:
            kw.setdefault("cpus", a.proxy_cpus)
            kw.setdefault("map_url", W1_MAP_URL)
            starters[name] = functools.partial(c.start_kvrelay, name, *engines, **kw)

        if "kvrelay-w1" in targets:
            kvrelay("kvrelay-w1", workers=1, env=ours_env, cwd=ours_src)
        if BASE in targets or BASE_W2 in targets:
            base_src = a.baseline_src.resolve()
            base_env = self._env_of_tree(base_src, "--baseline-src")
            if BASE in targets:
                kvrelay(BASE, workers=1, env=base_env, cwd=base_src)
        compiled = self._compiled_tree
        if compiled is not None:
            env = self._env_of_tree(compiled, "--compiled")
            kvrelay(COMPILED, workers=1, env=env, cwd=compiled)
        if WITHOUT in targets:
            kvrelay(WITHOUT, workers=1, env=self._env(False), without=a.without)
        if TRACED in targets:
            kvrelay(TRACED, workers=1, env=self._env(True))
        if self.redis is not None:
            w2 = {"workers": 2, "cpus": a.w2_cpus}
            if "kvrelay-w2" in targets:
                kvrelay("kvrelay-w2", map_url=self.redis.url, env=ours_env, cwd=ours_src, **w2)
            if BASE_W2 in targets:
                # The same Redis server, under its own key prefix.
                url = f"{self.redis.url}?prefix=kvrelay-base"
                kvrelay(BASE_W2, map_url=url, env=base_env, cwd=base_src, **w2)
        if "vllm-router" in a.targets:
            starters["vllm-router"] = functools.partial(c.start_vllm_router, *engines, a.proxy_cpus)
        if BARE in a.targets:
            starters[BARE] = self._start_bare
        return starters

    def _start_bare(self) -> c.RunningRouter:
        assert self.p is not None and self.d is not None
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "bench.bare_relay", "--port", str(port),
                "--prefill", self.p.url, "--decode", self.d.url]  # fmt: skip
        process = ServerProcess(
            c.pinned(argv, self.args.proxy_cpus), http_ready(url + "/ready"),
            env=c.bench_env(), ready_timeout=60, name="bare-relay",
        ).start()  # fmt: skip
        return c.RunningRouter(name=BARE, url=url, process=process)

    def work_done(self) -> dict[str, dict[str, float]]:
        """What each kvrelay did besides relaying (params stored, side-channel fetches and the
        calls they took, releases, map errors), from its own metrics, summed over the
        processes each target ran as: evidence the success path ran in full."""
        out = {name: dict(counts) for name, counts in self._work_before.items()}
        for name, counts in self._work_now().items():
            kept = out.setdefault(name, {})
            for key, value in counts.items():
                kept[key] = kept.get(key, 0.0) + value
        return out

    def _work_now(self) -> dict[str, dict[str, float]]:
        """`work_done`'s counters of the routers running now."""
        out: dict[str, dict[str, float]] = {}
        for name, router in self.routers.items():
            if not name.startswith("kvrelay"):
                continue
            with contextlib.suppress(OSError):
                samples = prometheus.scrape(router.url)
                out[name] = {
                    k.removeprefix("kvrelay_"): v
                    for k, v in samples.items()
                    if k.startswith(("kvrelay_finished_params_total", "kvrelay_releases_total",
                                     "kvrelay_map_unavailable_total", "kvrelay_reuse_total",
                                     "kvrelay_finished_calls_total",
                                     "kvrelay_finished_batch_ids_sum",
                                     "kvrelay_finished_batch_ids_count"))
                }  # fmt: skip
        return out

    def stop(self) -> None:
        c.stop_all(*(r.process for r in self.routers.values()))
        if self.redis is not None:
            with contextlib.suppress(Exception):
                self.redis.stop()
        c.stop_all(self.p.process if self.p else None, self.d.process if self.d else None)
        c.stop_all(self.sink)
        self._built.close()

    def _router_procs(self, target: str) -> list[ServerProcess]:
        procs = [self.routers[target].process] if target in self.routers else []
        if (
            target in ("kvrelay-w2", BASE_W2)
            and self.redis is not None
            and self.redis.process is not None
        ):
            procs.append(self.redis.process)  # the map is part of what the proxy costs
        return procs

    def _engines_cpu(self) -> float:
        assert self.p is not None and self.d is not None
        return c.server_cpu_s(self.p.process) + c.server_cpu_s(self.d.process)

    def job(self, target: str, mode: str, conc: int, requests: int) -> dict[str, Any]:
        assert self.d is not None
        job: dict[str, Any] = {
            "concurrency": conc,
            "requests": requests,
            "warmup": max(conc, 32),
            "stream": mode == "stream",
            "route": "chat" if mode == "long-chat" else "completions",
            "model": "fake",
            "max_tokens": self.args.max_tokens,
            "prompt_words": self.args.prompt_words,
            "conversation_ids": True,
            "tag": f"{target}-{mode}-{conc}-{time.time_ns()}",
            "mode": "single",
            "url": self.d.url if target == "direct" else self.routers[target].url,
        }
        if mode == "long-chat":
            job["history_turns"] = self.args.history_turns
            job["history_words"] = self.args.history_words
        return job

    def run_case(
        self, target: str, mode: str, conc: int, requests: int
    ) -> tuple[dict[str, float], list[str]]:
        """One target on one case: its summary and a few error messages."""
        procs = self._router_procs(target)
        cpu0 = sum(c.server_cpu_s(p) for p in procs)
        eng0 = self._engines_cpu()
        result = _loadgen.run_in_process(
            self.job(target, mode, conc, requests), self.args.loadgen_cpus
        )
        result["router_cpu_s"] = sum(c.server_cpu_s(p) for p in procs) - cpu0
        result["engine_cpu_s"] = self._engines_cpu() - eng0
        return summarize(result), list(result["error_samples"])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every case in every round; per (mode, concurrency, target) the medians over rounds."""
    bench = Bench(args)
    rounds: dict[tuple[str, int, str], list[dict[str, float]]] = collections.defaultdict(list)
    errors: dict[tuple[str, int, str], list[str]] = collections.defaultdict(list)
    profile: dict[str, Any] | None = None
    work: dict[str, dict[str, float]] = {}
    spans: dict[str, int] | None = None
    stopped = False
    try:
        bench.start()
        case_no = 0
        deadline = (
            time.monotonic() + args.max_minutes * 60 if args.max_minutes is not None else math.inf
        )
        for rnd in range(args.rounds):
            if rnd > 0 and time.monotonic() <= deadline:
                bench.restart_routers(shift=rnd)  # each round its own processes
            for mode in args.modes:
                for conc in args.concurrency:
                    targets = bench.targets()
                    shift = case_no % len(targets)
                    case_no += 1
                    # A case is measured for every target or not at all, so ratios stay fair.
                    if time.monotonic() > deadline:
                        stopped = True
                        continue
                    for target in targets[shift:] + targets[:shift]:
                        s, samples = bench.run_case(target, mode, conc, args.requests)
                        errors[(mode, conc, target)].extend(samples)
                        rounds[(mode, conc, target)].append(s)
                        print(
                            f"round {rnd + 1} {mode:10s} c={conc:<4d} {target:12s} "
                            f"{s['rps']:8.1f} req/s p50 {c.fmt_ms(s['p50'])} ms "
                            f"p99 {c.fmt_ms(s['p99'])} ms ttfb {c.fmt_ms(s['ttfb_p50'])} ms "
                            f"router {s['router_cpu_us']:.0f} us/req err {int(s['errors'])}",
                            flush=True,
                        )
        work = bench.work_done()
        spans = bench.spans_exported()
        if args.profile and "kvrelay-w1" in bench.routers:
            try:
                profile = record_profile(bench, args)
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                # The measurements stand without it; say why there is no profile.
                print(f"profile not recorded: {exc}", file=sys.stderr, flush=True)
                profile = {"error": str(exc)[:500]}
    finally:
        bench.stop()
    cases = []
    for (mode, conc, target), runs in rounds.items():
        case: dict[str, Any] = {"mode": mode, "concurrency": conc, "target": target}
        for key in METRICS:
            case[key] = statistics.median(r[key] for r in runs)
        case["errors"] = sum(r["errors"] for r in runs)
        case["rounds_done"] = len(runs)
        case["rounds"] = runs
        case["error_samples"] = errors[(mode, conc, target)][:5]
        cases.append(case)
    order = {t: i for i, t in enumerate(TARGETS)}
    cases.sort(key=lambda x: (MODES.index(x["mode"]), x["concurrency"], order[x["target"]]))
    return {"cases": cases, "profile": profile, "placement": placement(args), "work": work,
            "stopped_early": stopped, "spans_exported": spans}  # fmt: skip


def placement(args: argparse.Namespace) -> str:
    fakes = getattr(args, "fake_cpus", None)
    routers = "kvrelay-w1 and vllm-router" if fakes else "fakes, kvrelay-w1 and vllm-router"
    return (
        f"{routers} pinned to CPU {args.proxy_cpus}; "
        + (f"the fakes to CPU {fakes}; " if fakes else "")
        + f"kvrelay-w2 (both workers and its redis-server) to CPUs {args.w2_cpus}; the load "
        f"generator to CPU {args.loadgen_cpus} (`taskset`); machine has {os.cpu_count()} CPUs"
    )


# --------------------------------------------------------------------------- profile


def record_profile(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """py-spy on kvrelay-w1 during non-stream then stream c=64 (unmeasured): SVG and top costs.

    Recorded twice, once as a flame graph and once as raw stacks (the text summary), since
    py-spy writes one format per recording. py-spy runs on the load generator's CPUs and stops
    the proxy for each sample (its default), so stacks are consistent.
    """
    proc = bench.routers["kvrelay-w1"].process.proc
    assert proc is not None
    raw_path = c.WORK_DIR / "proxy_bound_profile.txt"
    c.WORK_DIR.mkdir(parents=True, exist_ok=True)
    for fmt, out in (("flamegraph", PROFILE_SVG), ("raw", raw_path)):
        spy = subprocess.Popen(
            c.pinned(
                [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(proc.pid),
                 "--rate", "250", "--format", fmt, "--output", str(out)],
                args.loadgen_cpus,
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            time.sleep(1.0)  # py-spy attaches; nothing to poll for but its first sample
            for mode in args.modes:
                bench.run_case("kvrelay-w1", mode, 64, args.profile_requests)
        finally:
            spy.send_signal(signal.SIGINT)
            try:
                _, err = spy.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
                _, err = spy.communicate()
        if spy.returncode not in (0, -signal.SIGINT) or not out.exists():
            raise RuntimeError(f"py-spy failed ({spy.returncode}): {err.decode()[-2000:]}")
    return summarize_stacks(raw_path.read_text())


# Where the time goes, by area: (label, substrings of a frame's file). A stack counts once per
# area it passes through, so the shares are inclusive and may add up to more than 100%.
AREAS = (
    ("aiohttp client (session, connector, response parsing)",
     ("aiohttp/client", "aiohttp/connector")),
    ("aiohttp server (protocol, request, response, routing)", ("aiohttp/web_",)),
    ("aiohttp socket writes (http_writer)", ("aiohttp/http_writer",)),
    ("stdlib json", ("json/",)),
    ("prometheus_client", ("prometheus_client/",)),
    ("logging", ("logging/",)),
    ("uuid", ("uuid.py",)),
    ("pydantic", ("pydantic",)),
    ("side-channel client (finished params, releases)", ("kvrelay/connector/sidechannel_",)),
    ("conversation map", ("kvrelay/kvcache_map/",)),
    ("SSE filter", ("kvrelay/proxy/turn/streaming.py",)),
    ("conversation ids and fingerprints", ("kvrelay/proxy/turn/conversation.py",)),
)  # fmt: skip


def summarize_stacks(text: str, top: int = 15) -> dict[str, Any]:
    """Self and inclusive sample shares per function, and inclusive shares per area, from
    py-spy's raw (collapsed) stacks. The entry chain every sample shares (cli, server) is left
    out of the inclusive list: it says nothing about the hot path."""
    self_counts: collections.Counter[str] = collections.Counter()
    incl_counts: collections.Counter[str] = collections.Counter()
    area_counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        count = int(count_s)
        total += count
        frames = [_function(f) for f in stack.split(";") if f]
        if not frames:
            continue
        self_counts[frames[-1]] += count
        for name in set(frames):
            incl_counts[name] += count
        for label, needles in AREAS:
            if any(n in f for f in frames for n in needles):
                area_counts[label] += count
    share = 100.0 / total if total else 0.0
    entry = max(incl_counts.values(), default=0) * 0.98
    return {
        "samples": total,
        "self": [(name, n * share) for name, n in self_counts.most_common(top)],
        "inclusive_kvrelay": [
            (name, n * share)
            for name, n in incl_counts.most_common()
            if "(kvrelay/" in name and n < entry
        ][:top],
        "areas": [(label, n * share) for label, n in area_counts.most_common()],
    }


def _function(frame: str) -> str:
    """`func (path/file.py:123)` as `func (pkg/file.py)`: lines folded together."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rpartition(":")[0] or where.rstrip(")")
    parts = Path(path).parts
    if "kvrelay" in parts:  # the project's own code, from its package root
        start = len(parts) - 1 - parts[::-1].index("kvrelay")
        short = "/".join(parts[start:])
    else:
        short = "/".join(parts[-2:]) if len(parts) >= 2 else path
    return f"{name} ({short})"


# --------------------------------------------------------------------------- report


def find(cases: list[dict[str, Any]], mode: str, conc: int, target: str) -> dict[str, Any] | None:
    for case in cases:
        if (case["mode"], case["concurrency"], case["target"]) == (mode, conc, target):
            return case
    return None


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def render(data: dict[str, Any], args: argparse.Namespace) -> str:
    cases = data["cases"]
    lines = [data.get("header") or c.run_header(), ""]
    lines.append(
        f"Zero-work fake engines (`bench/fake_engine.py`: 1 P + 1 D, vLLM 0.32-shaped answers, "
        f"D streams {args.max_tokens} SSE chunks without params); `/v1/completions`, a unique "
        f"{args.prompt_words}-word prompt and `X-Conversation-Id` per request (first turns: "
        "kvrelay holds, stores and, for streams, fetches D's params from its side channel; "
        f"kvrelay-w1's map holds {W1_MAP_ENTRIES} entries, so each store evicts one and "
        "releases its "
        "blocks on D); "
        f"{args.requests} requests per case and round, {args.rounds} interleaved rounds "
        "(target order rotated per case; routers started afresh each round), medians over "
        "rounds. `direct` = the load generator "
        "calling D alone. Placement: " + data["placement"] + ". Router CPU = process-group CPU "
        "time (user + system) per request, warm-up requests included in the count. Load "
        f"average (1 min) before / after: {data.get('load', 'not recorded')}; run took "
        f"{data.get('elapsed_s', 0) / 60:.0f} min."
    )
    if data.get("stopped_early"):
        rounds_done = sorted({int(x["rounds_done"]) for x in cases})
        lines += ["", f"**Stopped early by `--max-minutes`**: rounds done per case "
                  f"{rounds_done[0]}-{rounds_done[-1]} of {args.rounds} (medians over those); "
                  "cases never reached are missing from the tables."]  # fmt: skip
    if data.get("src"):
        lines += ["", f"kvrelay-w1 and kvrelay-w2 ran the proxy from {data['src']} (`--src`), "
                  "not this checkout's."]  # fmt: skip
    lines += ["", *summary_table(cases, "kvrelay-w1"), "", *summary_table(cases, "kvrelay-w2")]
    lines += ["", "All targets (medians over rounds):", ""]
    lines += c.case_table(
        cases,
        [
            ("TTFB p50 ms", c.streamed_ms("ttfb_p50")),
            ("TTFB p99 ms", c.streamed_ms("ttfb_p99")),
            ("router CPU us/req", c.routed(c.whole("router_cpu_us"))),
            ("fakes CPU us/req", c.whole("engine_cpu_us")),
            ("load gen CPU us/req", c.whole("loadgen_cpu_us")),
            ("errors", c.errors_cell),
        ],
    )
    for name, counts in sorted(data.get("work", {}).items()):
        # Workers' metrics are aggregated by kvrelay (prometheus multiprocess mode).
        counted = ", ".join(f"`{k}` {v:.0f}" for k, v in sorted(counts.items()))
        lines += ["", f"{name} work counters at the end (all cases): {counted or 'none'}"]
    if any(x["target"] == BASE for x in cases):
        lines += ["", *baseline_lines(data)]
    lines += ["", *aim_lines(cases)]
    profile = data.get("profile")
    if profile and "error" in profile:
        lines += ["", f"Profile not recorded: {profile['error']}"]
    elif profile:
        lines += ["", *profile_lines(profile)]
    return "\n".join(lines)


def round_spread(case: dict[str, Any]) -> float:
    """The fastest round's req/s over the slowest's: how much one target moves by itself."""
    rps = [r["rps"] for r in case.get("rounds") or () if r.get("rps")]
    return max(rps) / min(rps) if len(rps) > 1 else math.nan


def within_noise(ratio: float, spread: float) -> bool:
    """A ratio to the baseline no further from 1 than the baseline's own round spread."""
    return not math.isnan(spread) and 1 / spread <= ratio <= spread


# The bootstrap of the paired rounds' ratios: resamples, and a fixed seed so that the same
# run always prints the same interval.
PAIRED_RESAMPLES = 10_000
PAIRED_SEED = 0


def paired_ratio(
    cases: list[dict[str, Any]], target: str, other: str = BASE
) -> tuple[float, float, float, int] | None:
    """`target`'s req/s over `other`'s, round by round (in each round of a case the two ran
    back to back, so a round's ratio leaves out what the shared host did between rounds),
    pooled over every case both ran in two rounds or more: (geometric mean, its 95% interval
    low and high, paired rounds), bootstrapping each case's rounds among themselves. A case of
    one round is left out: resampled among itself it has no spread, and would narrow the
    interval to nothing. None when no case has two paired rounds.

    Case by case (`within_noise`) a ratio is only told from noise when it moves more than the
    base's slowest round from its fastest, and one case has few rounds: a cost of a few percent
    in every case passes each case's test. Pooled, the rounds say whether it is there."""
    strata: list[list[float]] = []
    for mode in MODES:
        for conc in sorted({int(x["concurrency"]) for x in cases}):
            mine, theirs = find(cases, mode, conc, target), find(cases, mode, conc, other)
            if mine is None or theirs is None:
                continue
            logs = [
                math.log(a["rps"] / b["rps"])
                for a, b in zip(mine.get("rounds") or (), theirs.get("rounds") or (), strict=False)
                if a.get("rps") and b.get("rps")
            ]
            if len(logs) >= 2:
                strata.append(logs)
    if not strata:
        return None
    paired = sum(map(len, strata))
    rng = random.Random(PAIRED_SEED)
    means = sorted(
        statistics.fmean([rng.choice(logs) for logs in strata for _ in logs])
        for _ in range(PAIRED_RESAMPLES)
    )
    tail = int(0.025 * PAIRED_RESAMPLES)
    mean = statistics.fmean([x for logs in strata for x in logs])
    return (
        math.exp(mean),
        math.exp(means[tail]),
        math.exp(means[PAIRED_RESAMPLES - 1 - tail]),
        paired,
    )


def paired_line(cases: list[dict[str, Any]], target: str) -> str | None:
    """The pooled judgement of `paired_ratio`: within noise (met) unless the whole interval
    lies below 1 (slower than the base beyond noise: MISSED)."""
    pooled = paired_ratio(cases, target)
    if pooled is None:
        return None
    mean, low, high, paired = pooled
    judged = "slower beyond noise" if high < 1 else "faster beyond noise" if low > 1 else "level"
    return (
        f"- {target} req/s over kvrelay-w1-base's in the same round, pooled over {paired} paired "
        f"rounds of every case: {mean:.3f}x (95%: {low:.3f}x to {high:.3f}x, bootstrap over "
        f"each case's rounds), {judged}: {_verdict(high >= 1)} (aim: not slower than the base "
        "beyond noise)"
    )


def runs_ratio(
    runs: list[list[dict[str, Any]]], target: str = "kvrelay-w1"
) -> tuple[float, float, float, list[float]] | None:
    """`target`'s pooled ratio to the base (`paired_ratio`) in each of several runs' cases,
    and their geometric mean with its 95% interval over the runs (Student's t on the runs'
    logs): (mean, low, high, each run's ratio). None with fewer than two runs that pooled.

    A run's own interval covers what moves its rounds, not what moves a whole run: runs of the
    same two proxies on this host came out 0.95x and 1.00x, each interval about 2% wide and
    neither holding the other's figure. The run is the unit for a verdict."""
    ratios = [pooled[0] for cases in runs if (pooled := paired_ratio(cases, target))]
    if len(ratios) < 2:
        return None
    mean, low, high = _paired.mean_interval([math.log(r) for r in ratios])
    return math.exp(mean), math.exp(low), math.exp(high), ratios


def runs_lines(paths: list[Path], target: str = "kvrelay-w1") -> list[str]:
    """`runs_ratio` over the runs whose JSON `paths` name, with its verdict: not slower than
    the base unless the whole interval lies below 1."""
    runs = [json.loads(path.read_text())["cases"] for path in paths]
    judged = runs_ratio(runs, target)
    if judged is None:
        return [f"- fewer than two of the {len(paths)} runs paired {target} with the base"]
    mean, low, high, ratios = judged
    each = ", ".join(f"{c.relpath(path)} {r:.3f}x" for path, r in zip(paths, ratios, strict=False))
    verdict = "slower beyond noise" if high < 1 else "faster beyond noise" if low > 1 else "level"
    return [
        f"- {target} req/s over kvrelay-w1-base's, each run pooled over its paired rounds: {each}",
        f"- over the {len(ratios)} runs: {mean:.3f}x (95%: {low:.3f}x to {high:.3f}x, Student's "
        f"t over the runs), {verdict}: {_verdict(high >= 1)} (aim: not slower than the base "
        "beyond noise)",
    ]


def baseline_lines(data: dict[str, Any]) -> list[str]:
    """kvrelay-w1 (and kvrelay-w1-compiled, kvrelay-w1-without) against the baseline tree: case
    by case, each judged against the baseline's own round-to-round spread in the same case,
    then over every case's paired rounds (`paired_ratio`)."""
    cases = data["cases"]
    ours = [t for t in ("kvrelay-w1", COMPILED, WITHOUT) if any(x["target"] == t for x in cases)]
    lines = [
        f"Against `kvrelay-w1-base` (the proxy from {data.get('baseline', 'the baseline tree')}, "
        "same rounds): req/s and router CPU per request as ratios of the base's medians; "
        '"spread" is the base\'s fastest round over its slowest in the same case, and a ratio '
        "within it (between 1/spread and spread) is within noise.",
        "",
        "| case | base spread | "
        + " | ".join(f"{t} req/s | {t} CPU | {t} noise" for t in ours)
        + " |",
        "|---|---:|" + "---:|---:|:---:|" * len(ours),
    ]
    verdicts: dict[str, list[bool]] = {t: [] for t in ours}
    for mode in MODES:
        for conc in sorted({int(x["concurrency"]) for x in cases}):
            base = find(cases, mode, conc, BASE)
            if base is None:
                continue
            spread = round_spread(base)
            cells = [f"{mode} c={conc}", f"{spread:.2f}"]
            for t in ours:
                case = find(cases, mode, conc, t)
                if case is None:
                    cells += ["-", "-", "-"]
                    continue
                rps = _ratio(case["rps"], base["rps"])
                ok = within_noise(rps, spread)
                verdicts[t].append(ok)
                cpu = _ratio(case["router_cpu_us"], base["router_cpu_us"])
                cells += [f"{rps:.2f}x", f"{cpu:.2f}x", "within" if ok else "OUTSIDE"]
            lines.append("| " + " | ".join(cells) + " |")
    for t, oks in verdicts.items():
        lines += [
            "",
            f"- {t} req/s within noise of kvrelay-w1-base in {sum(oks)} of {len(oks)} cases: "
            + _verdict(bool(oks) and all(oks)),
        ]
        pooled = paired_line(cases, t)
        if pooled is not None:
            lines.append(pooled)
    return lines


def summary_table(cases: list[dict[str, Any]], kv: str) -> list[str]:
    """The issue's table for one kvrelay target."""
    out = [
        f"| case | {kv} req/s | vllm-router req/s | ratio | p50 {kv} / router / direct ms "
        f"| p99 {kv} / router ms | TTFB p50 {kv} / router ms | CPU us/req {kv} / router |",
        "|---|---:|---:|---:|---|---|---|---|",
    ]
    concs = sorted({int(x["concurrency"]) for x in cases})
    for mode in MODES:
        for conc in concs:
            k, r, d = (find(cases, mode, conc, t) for t in (kv, "vllm-router", "direct"))
            if k is None:
                continue
            nan = {key: math.nan for key in METRICS}
            r, d = r or nan, d or nan
            ttfb = (
                f"{c.fmt_ms(k['ttfb_p50'])} / {c.fmt_ms(r['ttfb_p50'])}"
                if mode == "stream"
                else "-"
            )
            out.append(
                f"| {mode} c={conc} | {k['rps']:.0f} | {r['rps']:.0f} "
                f"| {c.fmt_ratio(_ratio(k['rps'], r['rps']))} "
                f"| {c.fmt_ms(k['p50'])} / {c.fmt_ms(r['p50'])} / {c.fmt_ms(d['p50'])} "
                f"| {c.fmt_ms(k['p99'])} / {c.fmt_ms(r['p99'])} | {ttfb} "
                f"| {k['router_cpu_us']:.0f} / {r['router_cpu_us']:.0f} |"
            )
    return out


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _both(
    cases: list[dict[str, Any]], concs: list[int], target: str, other: str
) -> Iterator[tuple[str, int, dict[str, Any], dict[str, Any]]]:
    """(mode, concurrency, target's case, other's case) for each aim case both of them ran."""
    for mode in AIM_MODES:
        for conc in concs:
            a, b = find(cases, mode, conc, target), find(cases, mode, conc, other)
            if a is not None and b is not None:
                yield mode, conc, a, b


def aim_lines(cases: list[dict[str, Any]]) -> list[str]:
    """Each aim of the issue's "Done when", met or missed, with its ratio."""
    out = ["Aims (kvrelay `--workers 1` unless said):", ""]
    concs = sorted({int(x["concurrency"]) for x in cases})
    for mode, conc, k, r in _both(cases, concs, "kvrelay-w1", "vllm-router"):
        ratio = _ratio(k["rps"], r["rps"])
        out.append(
            f"- req/s >= {AIM_RPS_RATIO:.1f}x vllm-router, {mode} c={conc}: "
            f"{c.fmt_ratio(ratio)}x, {_verdict(ratio >= AIM_RPS_RATIO)}"
        )
    for mode, _, k, d in _both(cases, [1], "kvrelay-w1", "direct"):
        added = k["p50"] - d["p50"]
        out.append(
            f"- added p50 at c=1 <= {AIM_ADDED_P50_C1_S * 1000:.1f} ms over direct, {mode}: "
            f"{c.fmt_ms(added)} ms ({c.fmt_ratio(added / AIM_ADDED_P50_C1_S)}x the aim), "
            f"{_verdict(added <= AIM_ADDED_P50_C1_S)}"
        )
    top = max(concs, default=0)
    for mode, _, k, r in _both(cases, [top], "kvrelay-w1", "vllm-router"):
        ratio = _ratio(k["p99"], r["p99"])
        out.append(
            f"- p99 at c={top} <= {AIM_P99_RATIO_C256}x vllm-router's, {mode}: "
            f"{c.fmt_ratio(ratio)}x, {_verdict(ratio <= AIM_P99_RATIO_C256)}"
        )
    # One client in a closed loop cannot use a second worker: c=1 is left out.
    for mode, conc, w1, w2 in _both(
        cases, [n for n in concs if n != 1], "kvrelay-w1", "kvrelay-w2"
    ):
        ratio = _ratio(w2["rps"], w1["rps"])
        out.append(
            f"- `--workers 2` >= {AIM_W2_SCALING}x `--workers 1` req/s, {mode} c={conc}: "
            f"{c.fmt_ratio(ratio)}x, {_verdict(ratio >= AIM_W2_SCALING)}"
        )
    for mode, conc, k, r in _both(cases, concs, "kvrelay-w1", "vllm-router"):
        ratio = _ratio(k["router_cpu_us"], r["router_cpu_us"])
        out.append(
            f"- proxy CPU/request <= vllm-router's, {mode} c={conc}: "
            f"{k['router_cpu_us']:.0f} vs {r['router_cpu_us']:.0f} us "
            f"({c.fmt_ratio(ratio)}x), {_verdict(ratio <= 1.0)}"
        )
    return out


def profile_lines(profile: dict[str, Any]) -> list[str]:
    out = [
        f"Profile of kvrelay-w1 (py-spy, {profile['samples']} samples over non-stream and "
        f"stream c=64; flame graph [{PROFILE_SVG.name}]({PROFILE_SVG.name})). Top self time:",
        "",
    ]
    out += [f"- {share:.1f}% {name}" for name, share in profile["self"]]
    out += ["", "Inclusive time in kvrelay's own functions (below the server's entry chain):", ""]
    out += [f"- {share:.1f}% {name}" for name, share in profile["inclusive_kvrelay"]]
    out += ["", "Inclusive time by area (a sample counts in every area on its stack):", ""]
    out += [f"- {share:.1f}% {name}" for name, share in profile.get("areas", [])]
    out += ["", "`run_app (aiohttp/web.py)` self time is the event loop itself (uvloop, in C): "
            "polling and the socket system calls it makes."]  # fmt: skip
    return out


def tracing_lines(data: dict[str, Any]) -> list[str]:
    """kvrelay-w1 with traces off and on (and the baseline tree), case by case."""
    cases = data["cases"]
    names = {BASE: "base", "kvrelay-w1": "off", TRACED: "on"}
    present = [t for t in names if any(x["target"] == t for x in cases)]
    heads = " / ".join(names[t] for t in present)
    ratios = [(t, "kvrelay-w1") for t in (TRACED,) if t in present]
    ratios += [("kvrelay-w1", BASE)] if BASE in present else []
    out = [
        f"| case | req/s {heads} | "
        + " | ".join(f"req/s {names[a]} / {names[b]}" for a, b in ratios)
        + f" | p50 {heads} ms | p99 {heads} ms | router CPU us/req {heads} |",
        "|---|---|" + "---:|" * len(ratios) + "---|---|---|",
    ]
    for mode in MODES:
        for conc in sorted({int(x["concurrency"]) for x in cases}):
            row = {t: find(cases, mode, conc, t) for t in present}
            if any(v is None for v in row.values()):
                continue
            got = {t: v for t, v in row.items() if v is not None}

            def joined(key: str, fmt: Any, got: dict[str, dict[str, Any]] = got) -> str:
                return " / ".join(fmt(got[t][key]) for t in present)

            out.append(
                f"| {mode} c={conc} | {joined('rps', lambda v: f'{v:.0f}')} | "
                + " | ".join(c.fmt_ratio(_ratio(got[a]["rps"], got[b]["rps"])) for a, b in ratios)
                + f" | {joined('p50', c.fmt_ms)} | {joined('p99', c.fmt_ms)} "
                f"| {joined('router_cpu_us', lambda v: f'{v:.0f}')} |"
            )
    spans = data.get("spans_exported")
    if spans:
        out += [
            "",
            f"Spans the fake collector received from the traced proxy: {spans['spans']} in "
            f"{spans['exports']} OTLP/HTTP exports ({spans['bytes'] / 1e6:.1f} MB).",
        ]
    return out


def render_tracing(data: dict[str, Any], args: argparse.Namespace) -> str:
    """The `## proxy-bound tracing` section: traces off against on, same rounds."""
    base = ""
    if any(x["target"] == BASE for x in data["cases"]):
        base = (
            "`kvrelay-w1-base` (base): the same proxy from the source tree in `--baseline-src` "
            f"({data.get('baseline', 'unnamed')}), which has no tracing code. "
        )
    lines = [data.get("header") or c.run_header(), ""]
    lines.append(
        "What OpenTelemetry traces cost kvrelay `--workers 1` in front of the zero-work fakes "
        f"(setup as in `## proxy-bound`: `/v1/completions`, unique {args.prompt_words}-word "
        f"prompt and `X-Conversation-Id` per request, D answers {args.max_tokens} tokens). "
        "`kvrelay-w1` (off): `KVRELAY_TRACING=off`, the default path; `kvrelay-w1-traced` "
        "(on): every span exported over OTLP/HTTP (batch processor defaults, which drop spans "
        "beyond a 2048-span queue) to `bench/otlp_sink.py`, a fake collector on the load "
        f"generator's CPU. {base}{args.requests} requests per case and round, {args.rounds} "
        "interleaved rounds (order rotated per case), medians. Placement: "
        + data["placement"]
        + f". Load average (1 min) before / after: {data.get('load', 'not recorded')}; run took "
        f"{data.get('elapsed_s', 0) / 60:.1f} min."
    )
    lines += ["", *tracing_lines(data), "", "All targets (medians over rounds):", ""]
    lines += c.case_table(
        data["cases"],
        [("router CPU us/req", c.routed(c.whole("router_cpu_us"))), ("errors", c.errors_cell)],
    )
    return "\n".join(lines)


def results_path(args: argparse.Namespace) -> Path:
    """The JSON of raw results: `--json` as given, else the mode's own file in bench/.work/
    (`proxy_bound.json`; `proxy_bound_tracing.json` with `--tracing on|both`)."""
    if args.json is not None:
        return Path(args.json)
    tracing = getattr(args, "tracing", "off") != "off"
    return c.WORK_DIR / ("proxy_bound_tracing.json" if tracing else "proxy_bound.json")


def main(args: argparse.Namespace) -> int:
    """Measure (or reload with --render-only), write JSON, print and record the section."""
    if getattr(args, "judge_runs", None):
        print("\n".join(runs_lines(args.judge_runs)))
        return 0
    tracing = getattr(args, "tracing", "off") != "off"
    json_path = results_path(args)
    if args.render_only:
        data = json.loads(json_path.read_text())
        for key, value in data.get("settings", {}).items():
            setattr(args, key, value)
    else:
        header = c.run_header()
        started, load_before = time.monotonic(), os.getloadavg()[0]
        data = measure(args)
        data["elapsed_s"] = time.monotonic() - started
        # Other jobs on a shared machine take CPU from every target alike; this says how many.
        data["load"] = f"{load_before:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        data["header"] = header
        data["settings"] = {
            k: getattr(args, k)
            for k in ("concurrency", "modes", "targets", "requests", "rounds", "max_tokens",
                      "prompt_words", "history_turns", "history_words", "proxy_cpus",
                      "w2_cpus", "loadgen_cpus", "tracing")
        }  # fmt: skip
        if args.baseline_src is not None:
            data["baseline"] = c.relpath(args.baseline_src)
        if getattr(args, "src", None) is not None:
            data["src"] = c.relpath(args.src)
    c.write_json(json_path, data)
    text = render_tracing(data, args) if tracing else render(data, args)
    c.publish(
        TRACING_SECTION if tracing else SECTION,
        text,
        args.no_results,
        wrote=f"{c.relpath(json_path)} in {data.get('elapsed_s', 0):.0f}s",
    )
    return 0
