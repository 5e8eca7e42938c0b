"""Run every benchmark (`make bench`): kvmap, transfer, proxy overhead, HTTP clients, multi-turn,
and the multi-turn routing policies.

Each script measures its own comparison side by side in one run and rewrites only its own
section of bench/RESULTS.md and its own plot; this runner installs what they need first
(`vllm-router` into `.venv-router`), runs them one after another (never two at once: they
would share the machine's cores), asks each for machine-readable results where it offers
`--json`, draws the plots the scripts do not draw themselves, and prints how long each took.
A failing script does not stop the others; the exit status says whether all passed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bench import _common as c
from bench import _plots

SCRIPTS = (
    "kvmap",
    "transfer",
    "proxy_overhead",
    "http_clients",
    "multiturn",
    "multiturn_policies",
    "sim_cpu",
    "request_checks",
)
# Benchmarks that are a mode of another script: (module, its arguments).
MODES = {"multiturn_policies": ("multiturn", ("--policies",))}
# Benchmarks that compare against vllm-router (installed into .venv-router first).
NEEDS_ROUTER = {"proxy_overhead", "multiturn_policies"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Example: .venv/bin/python -m bench.run_all --only proxy_overhead multiturn",
    )
    p.add_argument("--only", nargs="+", choices=SCRIPTS, help="run just these benchmarks")
    p.add_argument("--skip", nargs="+", choices=SCRIPTS, default=[], help="leave these out")
    p.add_argument("--quick", action="store_true", help="pass --quick to every script (smoke run)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for each script")
    return p.parse_args(argv)


def module_argv(name: str) -> list[str]:
    """How to run benchmark `name`: as a module of the `bench` package (`MODES`: a module
    with the arguments that select the benchmark)."""
    module, extra = MODES.get(name, (name, ()))
    return [sys.executable, "-m", f"bench.{module}", *extra]


def script_help(name: str) -> str:
    """The script's --help text ('' when it cannot say): which options it offers."""
    try:
        proc = subprocess.run(
            [*module_argv(name), "--help"],
            cwd=c.REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env=c.bench_env(),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def script_argv(name: str, args: argparse.Namespace) -> list[str]:
    help_text = script_help(name)
    argv = module_argv(name)
    if args.quick and "--quick" in help_text:
        argv.append("--quick")
    json_path = _plots.json_path(name)
    if "--json" in help_text:
        argv += ["--json", c.relpath(json_path)]
    return argv


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n for n in (args.only or SCRIPTS) if n not in args.skip]
    c.WORK_DIR.mkdir(parents=True, exist_ok=True)
    if NEEDS_ROUTER & set(names):
        print("installing vllm-router into .venv-router (once)", flush=True)
        c.ensure_router_venv()
    timings: list[tuple[str, float, str]] = []
    started = time.monotonic()
    for name in names:
        path = c.BENCH_DIR / f"{MODES.get(name, (name, ()))[0]}.py"
        if not path.exists():
            timings.append((name, 0.0, "missing"))
            print(f"== {name}: {c.relpath(path)} not found", flush=True)
            continue
        cmd = script_argv(name, args)
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, env=c.bench_env(), timeout=args.timeout, check=False, cwd=c.REPO_ROOT
            )
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {args.timeout:.0f}s"
        timings.append((name, time.monotonic() - t0, status))
        if status == "ok":
            plotted = _plots.plot_for(name)
            if plotted is not None:
                print(f"   plot {c.relpath(plotted)}", flush=True)
    total = time.monotonic() - started
    print("\nbenchmark           seconds  status")
    for name, secs, status in timings:
        print(f"{name:19s} {secs:7.0f}  {status}")
    print(f"{'total':19s} {total:7.0f}")
    return 0 if all(s == "ok" for _, _, s in timings) else 1


if __name__ == "__main__":
    raise SystemExit(main())
