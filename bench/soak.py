"""Soak: the chaos load for a long time, reporting proxy memory and latency over time.

Runs the same fleet, load and faults as the chaos test (`kvrelay/devtools/chaos_load.py`:
Redis, 2 P and 2 D enginesim behind fault relays, a two-worker proxy on the Redis map, seeded
multi-turn conversations, engine kills, Redis restarts, delays, resets, refusals, client
disconnects) for `--minutes` (default 10), then checks the same invariants (every completed
answer equals the reference, every failure OpenAI-shaped, no block held after the leases) and
draws `bench/soak.png`: proxy RSS (all workers), p50/p95 turn latency and turns completed over
time, with the injected faults marked. Not part of CI and does not touch RESULTS.md; a short
smoke run is `--minutes 1`.

    .venv/bin/python -m bench.soak --minutes 10 [--seed N] [--clients 4] [--no-faults]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvrelay.devtools import chaos_load, with_loopback_ucx

BENCH = Path(__file__).resolve().parent
# NIXL over loopback on CPU, for the engines this process starts.
with_loopback_ucx()
UNCLEAR = ("unshaped", "client_saw", "stream_truncated")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="load duration (default 10)")
    p.add_argument("--seed", type=int, default=20261122, help="seed of load and faults")
    p.add_argument("--clients", type=int, default=4, help="concurrent conversations")
    p.add_argument("--turns", type=int, default=5, help="turns per conversation")
    p.add_argument("--fault-period", type=float, default=4.0, help="mean seconds between faults")
    p.add_argument("--no-faults", action="store_true", help="load only, no fault injection")
    p.add_argument("--lease-seconds", type=float, default=6.0, help="engines' hold lease")
    p.add_argument("--sample-every", type=float, default=2.0, help="seconds between samples")
    p.add_argument("--no-check", action="store_true", help="skip the reference comparison")
    p.add_argument("--png", type=Path, default=BENCH / "soak.png", help="plot path")
    p.add_argument("--json", type=Path, default=BENCH / ".work" / "soak.json", help="raw data")
    return p.parse_args(argv)


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    t = [s["t"] / 60 for s in samples]
    fig, (mem, lat, done) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    mem.plot(t, [s["rss_bytes"] / 2**20 for s in samples], color="tab:blue")
    mem.set_ylabel("proxy RSS (MiB)")
    mem.set_ylim(0, max(s["rss_bytes"] for s in samples) / 2**20 * 1.25)
    lat.plot(t, [s["p50_latency_s"] for s in samples], label="p50", color="tab:green")
    lat.plot(t, [s["p95_latency_s"] for s in samples], label="p95", color="tab:orange")
    lat.set_ylabel("turn latency (s)")
    lat.legend(loc="upper left")
    done.plot(t, [s["requests"] for s in samples], color="tab:purple")
    done.set_ylabel("turns sent")
    done.set_xlabel("minutes")
    for at, _kind in report["fault_events"]:
        for ax in (mem, lat, done):
            ax.axvline(at / 60, color="tab:red", alpha=0.15, linewidth=1)
    s = report["summary"]
    fig.suptitle(
        f"kvrelay soak: {report['minutes']:g} min, {s['turns']} turns, "
        f"{len(report['fault_events'])} faults (red), reuse {report['reuse_rate']:.0%}"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seconds = args.minutes * 60
    with chaos_load.ChaosFleet(lease_seconds=args.lease_seconds) as fleet:
        assert fleet.proxy is not None
        fleet.wait_ready()
        load = chaos_load.LoadRunner(
            fleet.proxy.url, seed=args.seed, clients=args.clients, turns=args.turns
        )
        sampler = chaos_load.Sampler(fleet, load, period_s=args.sample_every)
        chaos = chaos_load.Chaos(fleet, seed=args.seed, period_s=args.fault_period)
        load.start()
        sampler.start()
        if not args.no_faults:
            chaos.start()
        print(f"soak: {args.minutes:g} min of load on {fleet.proxy.url}", flush=True)
        try:
            load.run_for(seconds)
        finally:
            chaos.stop()
            load.stop()
            sampler.stop()
        fleet.heal()
        fleet.wait_ready()
        reuse = chaos_load.proxy_reuse(fleet.proxy)
        stranded = fleet.stranded_blocks(args.lease_seconds * 3 + 30)
        records = load.snapshot()
    summary = chaos_load.summarize(records)
    mismatches = [] if args.no_check else list(chaos_load.iter_mismatches(records))
    looked_up = sum(reuse.values())
    report: dict[str, Any] = {
        "minutes": args.minutes,
        "seed": args.seed,
        "summary": summary,
        "conversations": load.conversations,
        "faults_injected": dict(chaos.injected),
        "fault_events": [(at - sampler.t0, kind) for at, kind in chaos.events],
        "reuse": reuse,
        "reuse_rate": reuse.get("hit", 0.0) / looked_up if looked_up else 0.0,
        "answers_checked": 0 if args.no_check else summary["outcomes"].get("ok", 0),
        "answers_wrong": len(mismatches),
        "unclear_errors": {k: v for k, v in summary["errors"].items() if k.startswith(UNCLEAR)},
        "stranded_blocks": stranded,
        "samples": [vars(s) for s in sampler.samples],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    plot(report, args.png)
    rss = [s["rss_bytes"] for s in report["samples"]]
    brief = {k: v for k, v in report.items() if k not in ("samples", "fault_events")}
    brief["proxy_rss_mib"] = {"first": round(rss[0] / 2**20, 1), "last": round(rss[-1] / 2**20, 1),
                              "max": round(max(rss) / 2**20, 1)} if rss else {}  # fmt: skip
    print(json.dumps(brief, indent=1, sort_keys=True))
    print(f"plot: {args.png}  data: {args.json}")
    ok = not mismatches and not report["unclear_errors"] and not stranded
    return 0 if ok else 1


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"soak finished in {time.monotonic() - started:.0f}s, exit {code}")
    sys.exit(code)
