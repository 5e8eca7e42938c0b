"""Shared helpers for the benchmark scripts in `bench/`.

- `REPO_ROOT`, `BENCH_DIR`, `RESULTS_MD`, `WORK_DIR`: where things are. Scripts run as modules
  from the repository root (`python -m bench.kvmap`); servers come from `kvrelay.devtools`.
- `update_results_section()`: each script rewrites only its own `## name` section of
  `bench/RESULTS.md` (under a file lock), leaving the other scripts' sections alone.
- `run_header()`: the exact command, date and machine every section starts with.
- `percentile()`, `fmt_ms()`: small statistics and formatting helpers.
- `add_switch()`: an option on by default that `--no-<option>` turns off.
- `words()`, `add_chat_arguments()`: the multi-turn chat workload's made-up words and options
  (`multiturn` and its policies run).
- `start_engine()`, `start_fake_engine()`, `start_kvrelay()`, `start_vllm_router()`: the
  servers the benchmarks run, started and stopped by `kvrelay.devtools`' dev fleet launcher
  (`EngineSim`, `ProxyServer`: bounded readiness, process groups, `fleet_env`'s environment);
  `cpus=` pins a server (and every process it starts) with `taskset`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._features_off import launcher as features_off_launcher
from kvrelay.devtools import (
    EngineSim,
    ProxyServer,
    RedisServer,
    ServerProcess,
    fleet_env,
    free_port,
    http_ready,
    redis_server,
)
from kvrelay.devtools import pinned as pinned  # the scripts place their own processes with it

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO_ROOT / "bench"
RESULTS_MD = BENCH_DIR / "RESULTS.md"
WORK_DIR = BENCH_DIR / ".work"  # git-ignored scratch: JSON results, logs
ROUTER_VENV = REPO_ROOT / ".venv-router"
ROUTER_VERSION = "0.1.17"


# The order sections appear in when RESULTS.md is created from scratch.
SECTION_ORDER = (
    "kvmap", "kvmap at scale", "transfer", "transfer (GPU)", "proxy overhead", "proxy-bound",
    "proxy-bound tracing", "instructions per request", "http clients", "multiturn",
    "multiturn policies", "multiturn (vLLM)", "trace replay",
)  # fmt: skip

RESULTS_PREAMBLE = (
    "# Benchmark results\n\n"
    "Written by the scripts in `bench/` (`make bench` runs them all); each script rewrites only\n"
    "its own section. Every comparison is measured side by side in one run on the same backends,\n"
    "because absolute times on shared machines drift: compare ratios, not absolute numbers\n"
    "across sections or runs.\n"
)


def bench_env() -> dict[str, str]:
    """Environment for every server a benchmark starts (`kvrelay.devtools.fleet_env`): NIXL over
    loopback on CPU, one side-channel secret fresh for each run unless one is set, this
    checkout's `kvrelay` first on the path."""
    env = fleet_env(pythonpath=REPO_ROOT)
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    return env


# Short made-up words: prompts that look like text to a tokenizer, reproducible from a seed.
VOCAB = tuple(
    a + b
    for a in ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "gu")
    for b in ("n", "ro", "ve", "li", "sa", "to", "m", "del")
)


def words(rng: random.Random, n: int) -> str:
    """`n` made-up words drawn by `rng`."""
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def add_switch(p: argparse.ArgumentParser, flag: str, help: str | None = None) -> None:
    """A benchmark switch: on unless `--no-<flag>` turns it off (its help says the default)."""
    p.add_argument(flag, action=argparse.BooleanOptionalAction, default=True, help=help)


def add_chat_arguments(
    p: argparse.ArgumentParser, *, system_words: int, max_tokens: int, prefill_us_per_token: int
) -> None:
    """The multi-turn chat workload's options: how many chats of how many turns, how long
    their messages and answers, and what a prompt token costs the engines to compute."""
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--system-words", type=int, default=system_words,
                   help="words in the system prompt")  # fmt: skip
    p.add_argument("--user-words", type=int, default=20, help="words in each user message")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="reply length in tokens")
    p.add_argument(
        "--prefill-us-per-token", type=int, default=prefill_us_per_token,
        help="simulated prefill cost on the engines (microseconds per computed token)",
    )  # fmt: skip


def rss_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def machine_description() -> str:
    """One line naming the machine: CPU model, cores, memory, OS and Python."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f", {int(line.split()[1]) / 1024 / 1024:.0f} GiB RAM"
                break
    return (
        f"{cpu}, {os.cpu_count()} cores{mem}, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()} (host `{platform.node()}`, shared with other jobs)"
    )


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed from the repository root: `python -m bench.<script> ...`."""
    args = list(sys.argv if argv is None else argv)
    script = Path(args[0])
    with contextlib.suppress(ValueError):
        script = script.resolve().relative_to(REPO_ROOT)
    if script.suffix == ".py" and not script.is_absolute():
        return shlex.join(
            [".venv/bin/python", "-m", ".".join(script.with_suffix("").parts), *args[1:]]
        )
    return shlex.join([".venv/bin/python", str(script), *args[1:]])


def run_header(argv: Sequence[str] | None = None) -> str:
    """Markdown lines: command, date (UTC) and machine."""
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"Command: `{command_line(argv)}`  \nDate: {date}  \nMachine: {machine_description()}\n"


Case = dict[str, Any]  # one mode, concurrency and target, with its measured figures


def case_table(
    cases: Sequence[Case], columns: Sequence[tuple[str, Callable[[Case], str]]]
) -> list[str]:
    """A Markdown table, a row per case: mode, conc, target, req/s, p50 and p99, then
    `columns` (heading, cell of a case), all right-aligned."""
    head = "| mode | conc | target | req/s | p50 ms | p99 ms " + "".join(
        f"| {h} " for h, _ in columns
    )
    rows = [
        f"| {x['mode']} | {x['concurrency']} | {x['target']} | {x['rps']:.0f} "
        f"| {fmt_ms(x['p50'])} | {fmt_ms(x['p99'])} "
        + "".join(f"| {cell(x)} " for _, cell in columns)
        + "|"
        for x in cases
    ]
    return [head + "|", "|---|---:|---|---:|---:|---:" + "|---:" * len(columns) + "|", *rows]


def streamed_ms(key: str) -> Callable[[Case], str]:
    """A cell of milliseconds that only streamed cases have (time to first byte)."""
    return lambda x: fmt_ms(x[key]) if x["mode"] == "stream" else "-"


def routed(cell: Callable[[Case], str]) -> Callable[[Case], str]:
    """A cell that only cases through a router have (not `direct`)."""
    return lambda x: cell(x) if x["target"] != "direct" else "-"


def whole(key: str) -> Callable[[Case], str]:
    return lambda x: f"{x[key]:.0f}"


def errors_cell(x: Case) -> str:
    return str(int(x["errors"]))


def publish(section: str, text: str, no_results: bool, *, plot: str = "", wrote: str = "") -> None:
    """End of a benchmark run: `text` (and the `plot` link) into RESULTS.md's `section` unless
    `--no-results`, `text` on stdout, then `wrote` (what files, in how long) when given."""
    if not no_results:
        update_results_section(section, text + plot)
    print(text)
    if wrote:
        print(f"\nwrote {wrote}")


def update_results_section(name: str, body: str, path: Path = RESULTS_MD) -> None:
    """Replace the `## name` section of RESULTS.md with `body` (created when missing).

    A section runs from its heading to the next `## ` heading. Other sections are kept byte for
    byte; a file lock serialises scripts that finish at the same time.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_suffix(".lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            text = path.read_text() if path.exists() else RESULTS_PREAMBLE
            new_section = f"## {name}\n\n{body.strip()}\n"
            sections = _split_sections(text)
            if name in sections[1]:
                sections[1][name] = new_section
            else:
                sections[1][name] = new_section
                order = [s for s in SECTION_ORDER if s in sections[1]]
                order += [s for s in sections[1] if s not in order]
                sections = (sections[0], {k: sections[1][k] for k in order})
            preamble, parts = sections
            out = preamble.rstrip("\n") + "\n\n" + "\n".join(parts.values())
            tmp = path.with_suffix(".tmp")
            tmp.write_text(out)
            tmp.replace(path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    with contextlib.suppress(OSError):
        lock_path.unlink()


def _split_sections(text: str) -> tuple[str, dict[str, str]]:
    """Split markdown into the text before the first `## ` heading and the sections by name."""
    matches = list(re.finditer(r"^## (.+?)\s*$", text, flags=re.MULTILINE))
    if not matches:
        return text, {}
    preamble = text[: matches[0].start()]
    parts: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        parts[m.group(1).strip()] = text[m.start() : end].rstrip("\n") + "\n"
    return preamble, parts


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def fmt_ms(seconds: float, digits: int = 2) -> str:
    """Seconds as milliseconds text, `-` for NaN."""
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.{digits}f}"


def fmt_ratio(value: float) -> str:
    return "-" if math.isnan(value) or math.isinf(value) else f"{value:.2f}"


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def relpath(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(REPO_ROOT))
    return str(path)


# --------------------------------------------------------------------------- servers


def pin_pid(pid: int, cpus: str) -> None:
    """Pin a running process and all its threads to `cpus`."""
    subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(pid)], check=True, capture_output=True)


@dataclass
class Engine:
    """A running enginesim: its HTTP URL and its process."""

    url: str
    engine_id: str
    side_channel_port: int
    process: ServerProcess

    @property
    def side_channel(self) -> str:
        return f"127.0.0.1:{self.side_channel_port}"


def _started(engine: EngineSim) -> Engine:
    engine.start()
    assert engine.process is not None
    return Engine(engine.url, engine.name, engine.side_channel_port, engine.process)


def start_engine(engine_id: str, extra: Sequence[str] = (), ready_timeout: float = 60.0) -> Engine:
    """Start `python -m kvrelay.enginesim` on free ports and wait for `GET /health`."""
    return _started(
        EngineSim(engine_id, extra, base_args=(), env=bench_env(), ready_timeout=ready_timeout)
    )


def start_fake_engine(role: str, engine_id: str, cpus: str | None = None) -> Engine:
    """Start `bench/fake_engine.py` (zero-work, vLLM-shaped answers) and wait for `/health`."""
    return _started(
        EngineSim(
            engine_id,
            ("--role", role),
            base_args=(),
            env=bench_env(),
            module="bench.fake_engine",
            cpus=cpus,
            process_name=f"fake-{engine_id}",
        )
    )


@dataclass
class RunningRouter:
    """A running router (kvrelay or vllm-router) in front of the engines."""

    name: str
    url: str
    process: ServerProcess


def start_kvrelay(
    name: str,
    prefill: Sequence[Engine],
    decode: Sequence[Engine],
    workers: int = 1,
    map_url: str | None = None,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    cpus: str | None = None,
    cwd: Path | None = None,
    without: str = "",
) -> RunningRouter:
    """Start `python -m kvrelay.proxy.cli serve` on a free port and wait for `GET /ready`;
    with `without` (comma-separated features), through `bench._features_off`, which switches
    them off first.

    `cwd` is where the proxy runs; `python -m` imports `kvrelay` from there first, so a proxy
    from another source tree runs with that tree as `cwd` (and on `PYTHONPATH`).

    The engines' side channels are configured (`--side-channels`) as an operator would: that
    is how the proxy fetches D's params after a stream, so streamed turns can be reused too.
    """
    args = ["--workers", str(workers), *(["--map-url", map_url] if map_url is not None else [])]
    full_env = bench_env()
    full_env.setdefault("KVRELAY_LOG_LEVEL", "warning")
    if env:
        full_env.update(env)
    proxy = ProxyServer(
        prefill, decode, flags=True, args=[*args, *extra], env_base=full_env, cpus=cpus,
        cwd=cwd, name=name, ready_timeout=60, launcher=features_off_launcher(without),
    ).start("/ready")  # fmt: skip
    assert proxy.process is not None
    return RunningRouter(name=name, url=proxy.url, process=proxy.process)


def kvrelay_source(env: dict[str, str], cwd: Path) -> Path:
    """The `kvrelay` package directory a proxy started with `env` in `cwd` imports."""
    code = "import kvrelay, pathlib; print(pathlib.Path(kvrelay.__file__).parent)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**bench_env(), **env}, cwd=cwd, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return Path(out.stdout.strip())


def ensure_router_venv(quiet: bool = True) -> Path:
    """Install `vllm-router` into its own environment `.venv-router`; return its launcher.

    Kept out of `.venv` so its dependencies never touch the project's pins.
    """
    launcher = ROUTER_VENV / "bin" / "vllm-router"
    stamp = ROUTER_VENV / f".vllm-router-{ROUTER_VERSION}"
    if launcher.exists() and stamp.exists():
        return launcher
    python = shutil.which("python3.11") or sys.executable
    if not (ROUTER_VENV / "bin" / "python").exists():
        subprocess.run([python, "-m", "venv", str(ROUTER_VENV)], check=True)
    pip = [str(ROUTER_VENV / "bin" / "python"), "-m", "pip", "install"]
    if quiet:
        pip.append("-q")
    subprocess.run([*pip, f"vllm-router=={ROUTER_VERSION}"], check=True)
    stamp.touch()
    return launcher


def start_vllm_router(
    prefill: Sequence[Engine],
    decode: Sequence[Engine],
    cpus: str | None = None,
    policy: str = "round_robin",
    extra: Sequence[str] = (),
) -> RunningRouter:
    """Start `vllm-router --vllm-pd-disaggregation` (NIXL mode) in front of the engines
    (`extra`: more flags, e.g. a policy's thresholds).

    `round_robin` (the default here) keeps it from calling the engines' `/render` endpoint for
    every request (its `cache_aware` policy tokenizes each prompt on P and D first); with one P
    and one D the policy choice does not change where requests go.
    """
    launcher = ensure_router_venv()
    port = free_port()
    metrics_port = free_port()
    argv = [
        str(launcher),
        "--vllm-pd-disaggregation",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port),
        "--policy", policy,
        "--kv-connector", "nixl",
        "--log-level", "warning",
        "--max-concurrent-requests", "4096",
        "--queue-size", "4096",
        "--worker-startup-check-interval", "1",
        "--disable-retries",
        *extra,
    ]  # fmt: skip
    for engine in prefill:
        argv += ["--prefill", engine.url]
    for engine in decode:
        argv += ["--decode", engine.url]
    url = f"http://127.0.0.1:{port}"
    proc = ServerProcess(
        argv, http_ready(f"{url}/health"), env=bench_env(), ready_timeout=90, name="vllm-router",
        cpus=cpus,
    ).start()  # fmt: skip
    return RunningRouter(name="vllm-router", url=url, process=proc)


def redis_for_bench() -> contextlib.AbstractContextManager[RedisServer]:
    """A real redis-server on a free loopback port for the multi-worker proxy."""
    return redis_server()


def process_group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group `pgid`.

    Every server here starts in its own session (`ServerProcess`), so its group holds it and its
    workers. CPU time per request is far steadier on a shared machine than wall time.
    """
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        # fields: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
        if len(fields) > 12 and int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / ticks


def server_cpu_s(proc: ServerProcess) -> float:
    """CPU seconds used so far by a started server and its children."""
    return process_group_cpu_s(proc.proc.pid) if proc.proc is not None else math.nan


def stop_all(*procs: ServerProcess | None) -> None:
    """Stop every given server; one failing to stop does not keep the others running."""
    for proc in procs:
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.stop()
