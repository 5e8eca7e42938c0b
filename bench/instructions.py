"""Instructions per request of the proxy, counted by valgrind: a measure that does not drift.

Timings on a shared machine move by 10% between runs, more than most single changes to the
hot path gain, so this script counts instead: kvrelay (`--workers 1`, in-process map) runs
under `valgrind --tool=callgrind` in front of the zero-work fake engines
(`bench/fake_engine.py`), instrumentation is switched on (`callgrind_control`) only for the
measured requests, after a warm-up, and the user-space instructions the proxy executed are
divided by the requests served. Kernel work (the socket calls) is not counted; the count
repeats within a fraction of a percent from run to run.

Sources: this checkout, and with `--baseline REV [REV ...]` the `kvrelay/` package of other
commits (`git archive`), measured with the same engines and load, so the table reads as
before/after; with `--bare-relay`, also `bench/bare_relay.py`, the relay without kvrelay's
features; with `--without FEATURE[,FEATURE...] ...`, this checkout with those features switched
off (`bench/_features_off.py`), one row per argument: what each feature costs; with
`--compiled`, a copy of this checkout whose per-turn packages mypyc compiled
(`bench/_compiled.py`): what compiling the hot path would buy. Modes are those
of the proxy-bound mode (`proxy_overhead.py --proxy-bound`): non-stream, stream, long-chat.
Needs valgrind (Debian: `apt-get install valgrind`). Rewrites the `## instructions per request`
section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import _common as c
from bench import _compiled, _loadgen, _proxybound
from bench._features_off import FEATURES, launcher
from bench._proxybound import MODES
from kvrelay.devtools import ServerProcess, free_port, http_ready

SECTION = "instructions per request"
WARMUP = 200


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--baseline", nargs="+", default=[], metavar="REV",
        help="git revisions whose kvrelay/ is measured beside this one, oldest first",
    )  # fmt: skip
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument(
        "--bare-relay", action="store_true",
        help="also count bench/bare_relay.py: what the relay costs without kvrelay's features",
    )  # fmt: skip
    p.add_argument(
        "--without", nargs="+", default=[], metavar="FEATURES",
        help="also count this checkout with these features off, one row per argument "
        f"(comma-separated; {', '.join(FEATURES)})",
    )  # fmt: skip
    p.add_argument(
        "--compiled", action="store_true",
        help="also count this checkout with kvrelay/proxy/turn and fleet compiled by mypyc "
        "(built in a temporary copy first: minutes)",
    )  # fmt: skip
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients")
    p.add_argument("--requests", type=int, default=500, help="measured requests per case")
    _proxybound.add_long_chat_arguments(p)
    p.add_argument("--json", type=Path, default=c.WORK_DIR / "instructions.json")
    p.add_argument("--no-results", action="store_true", help="do not rewrite bench/RESULTS.md")
    args = p.parse_args(argv)
    for features in args.without:
        unknown = set(features.split(",")) - set(FEATURES)
        if unknown:
            p.error(f"--without: unknown features {sorted(unknown)}; known: {', '.join(FEATURES)}")
    return args


@contextlib.contextmanager
def source_trees(baselines: list[str]) -> Iterator[list[tuple[str, Path]]]:
    """(label, directory holding `kvrelay/`) per source: the baselines' first, in order."""
    with tempfile.TemporaryDirectory(prefix="kvrelay-baseline-") as tmp:
        trees: list[tuple[str, Path]] = []
        for i, revision in enumerate(baselines):
            archive = subprocess.run(
                ["git", "archive", revision, "kvrelay"], cwd=c.REPO_ROOT, check=True,
                capture_output=True,
            ).stdout  # fmt: skip
            tree = Path(tmp) / str(i)
            tree.mkdir()
            archive_path = tree / "kvrelay.tar"
            archive_path.write_bytes(archive)
            with tarfile.open(archive_path) as tar:
                tar.extractall(tree, filter="data")
            trees.append((f"baseline {revision}", tree))
        yield [*trees, ("this checkout", c.REPO_ROOT)]


def _job(args: argparse.Namespace, mode: str, url: str, requests: int) -> dict[str, Any]:
    return {
        "concurrency": args.concurrency,
        "requests": requests,
        "warmup": args.concurrency,
        "stream": mode == "stream",
        "route": "chat" if mode == "long-chat" else "completions",
        "history_turns": args.history_turns if mode == "long-chat" else 0,
        "history_words": args.history_words,
        "model": "fake",
        "max_tokens": 16,
        "prompt_words": 32,
        "conversation_ids": True,
        "tag": f"{mode}-{time.time_ns()}",
        "mode": "single",
        "url": url,
    }


def _total_instructions(out_prefix: Path) -> int:
    """The largest `totals:`/`summary:` count among the dumps callgrind wrote."""
    total = 0
    for dump in out_prefix.parent.glob(out_prefix.name + "*"):
        for line in dump.read_text(errors="replace").splitlines():
            if line.startswith(("totals:", "summary:")):
                total = max(total, int(line.split()[1]))
    return total


def _server_argv(
    src: Path | None, port: int, p: c.Engine, d: c.Engine, without: str = ""
) -> list[str]:
    """kvrelay from the source tree `src` (with the features in `without` off), or with None
    the featureless relay of the proxy-bound mode (`bench/bare_relay.py`): the floor
    kvrelay's features sit on."""
    engines = ["--prefill", p.url, "--decode", d.url]
    if src is None:
        return ["-m", "bench.bare_relay", "--host", "127.0.0.1", "--port", str(port), *engines]
    return [
        *launcher(without), "serve", "--host", "127.0.0.1", "--port", str(port), *engines,
        "--side-channels", *(f"{e.url}=127.0.0.1:{e.side_channel_port}" for e in (p, d)),
    ]  # fmt: skip


def count(
    args: argparse.Namespace,
    src: Path | None,
    mode: str,
    p: c.Engine,
    d: c.Engine,
    work: Path,
    without: str = "",
) -> float:
    """Instructions per request of the proxy from `src` (None: the bare relay) on one mode,
    with the features in `without` (comma-separated) switched off."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out_prefix = work / f"callgrind-{mode}-{time.time_ns()}.out"
    argv = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no",
        f"--callgrind-out-file={out_prefix}", sys.executable,
        *_server_argv(src, port, p, d, without),
    ]  # fmt: skip
    src = src or c.REPO_ROOT  # the bare relay is this checkout's
    env = {**c.bench_env(), "KVRELAY_LOG_LEVEL": "warning", "KVRELAY_TRACING": "off"}
    env["PYTHONPATH"] = str(src)  # `python -m` from `src` imports that tree's kvrelay
    proxy = ServerProcess(
        argv, http_ready(url + "/ready"), env=env, ready_timeout=600, name="kvrelay-callgrind",
        cwd=src,
    ).start()  # fmt: skip
    try:
        assert proxy.proc is not None
        pid = str(proxy.proc.pid)
        _loadgen.run_in_process(_job(args, mode, url, WARMUP))
        subprocess.run(["callgrind_control", "--instr=on", pid], check=True, capture_output=True)
        result = _loadgen.run_in_process(_job(args, mode, url, args.requests))
        subprocess.run(["callgrind_control", "--instr=off", pid], check=True, capture_output=True)
        subprocess.run(["callgrind_control", "--dump", pid], check=True, capture_output=True)
    finally:
        c.stop_all(proxy)
    served = len(result["latencies"]) + args.concurrency  # the job's own warm-up ran measured
    if result["errors"]:
        raise RuntimeError(f"{result['errors']} requests failed: {result['error_samples'][:3]}")
    return float(_total_instructions(out_prefix) / served)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        compiled = None
        if args.compiled:  # built before the engines start: it takes minutes
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvrelay-mypyc-"))
            compiled = _compiled.build(Path(tmp))
        p = c.start_fake_engine("prefill", "fake-p")
        d = c.start_fake_engine("decode", "fake-d")
        try:
            return _measure_all(args, p, d, compiled)
        finally:
            c.stop_all(p.process, d.process)


def _measure_all(
    args: argparse.Namespace, p: c.Engine, d: c.Engine, compiled: Path | None
) -> list[dict[str, Any]]:
    """Every source's count on every mode, with the fake engines `p` and `d` running."""
    rows: list[dict[str, Any]] = []
    with (
        source_trees(args.baseline) as trees,
        tempfile.TemporaryDirectory(prefix="kvrelay-callgrind-") as tmp,
    ):
        sources: list[tuple[str, Path | None, str]] = [(name, tree, "") for name, tree in trees]
        if compiled is not None:
            sources.append(("this checkout, turn/ and fleet/ compiled (mypyc)", compiled, ""))
        for without in args.without:
            sources.append((f"without {without.replace(',', ', ')}", c.REPO_ROOT, without))
        if args.bare_relay:
            sources.append(("bare-relay (no features)", None, ""))
        for mode in args.modes:
            for label, src, off in sources:
                per_request = count(args, src, mode, p, d, Path(tmp), off)
                rows.append({"mode": mode, "source": label, "instructions": per_request})
                print(f"{mode:10s} {label:24s} {per_request / 1e3:8.1f} k", flush=True)
    return rows


def render(rows: list[dict[str, Any]], args: argparse.Namespace, header: str) -> str:
    lines = [
        header,
        "",
        f"kvrelay `--workers 1` (in-process map) under callgrind in front of the zero-work fake "
        f"engines; {args.requests} measured requests per case after {WARMUP} warm-up ones, "
        f"{args.concurrency} concurrent clients, each request a conversation's first turn "
        "(`X-Conversation-Id`); user-space instructions of the proxy process per request "
        "(the kernel's socket work is not counted). Long-chat: "
        f"{args.history_turns} earlier exchanges of {args.history_words} words per message.",
        "",
        "| mode | source | instructions per request | vs first |",
        "|---|---|---:|---:|",
    ]
    first: dict[str, float] = {}
    for row in rows:
        base = first.setdefault(row["mode"], row["instructions"])
        lines.append(
            f"| {row['mode']} | {row['source']} | {row['instructions'] / 1e3:.0f} k "
            f"| {c.fmt_ratio(row['instructions'] / base)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
    header = c.run_header()
    rows = measure(args)
    c.write_json(args.json, {"rows": rows, "header": header})
    text = render(rows, args, header)
    c.publish(SECTION, text, args.no_results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
