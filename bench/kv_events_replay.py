"""What replaying the engines' KV events costs one proxy worker at fleet scale.

An engine started with vLLM's `replay_endpoint` keeps its last `buffer_steps` event batches
(10,000 by default) and resends them when asked; the proxy's feed (`KVEventsFeed`) asks every
engine for all it keeps each time it connects to that engine's events: a proxy started after the
fleet, or a fleet that restarts its proxy, learns what the engines cache at once. This measures
that moment: `--engines` enginesim publishers (the same `KVEventPublisher` the simulated
engines run, in a child process: one replay thread an engine, as vLLM serves replays from its
publisher thread), each having published `--batches` batches of `--blocks-per-batch` blocks
(prompts of `--prompt-blocks` blocks, each batch one `BlockStored` run as a scheduler step
stores it), and one feed in this process connecting to all of them at once. Reported:
- replays answered, and not answered within the feed's timeout, and the gaps found in the
  answers (batches the engine sent that never arrived: each gap forgets what the index had of
  that engine): the feed's own counter, `kvrelay_kv_events_replays_total`;
- the wall time until every engine's replay ended, and this process's CPU time meanwhile, per
  batch replayed;
- how long the event loop went without a turn (a ticker asks for a turn every millisecond),
  the longest and the 99th percentile: what a request arriving meanwhile would wait;
- the peak resident memory of this process over its size before, and the index's pairs.
The feed runs as a proxy worker's does (uvloop where installed, its collector tuning), on its
own core where the host has two, the publishers on the other; their replay sockets queue
without limit (vLLM's drops past 1000 messages for a reader: with 64 engines' senders sharing
one core here, the drops would be this host's, not the feed's). The replay's batches cross
loopback TCP; what a real network adds is not measured.
Writes the `## kv events replay` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from bench import _common as c
from kvrelay.enginesim.kv_events import KVEventPublisher, StoredBlock
from kvrelay.proxy.config import Settings
from kvrelay.proxy.fleet import BlockIndex, KVEventsFeed, Pool
from kvrelay.proxy.http import GC_YOUNG_THRESHOLD
from kvrelay.proxy.telemetry import metrics

SECTION = "kv events replay"
RESULTS = ("answered", "short", "timeout")
TICK_S = 0.001


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--batches", type=int, default=10_000, help="batches each engine keeps")
    p.add_argument("--blocks-per-batch", type=int, default=4)
    p.add_argument("--prompt-blocks", type=int, default=64, help="blocks of one prompt's chain")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--max-blocks",
        type=int,
        default=Settings.model_fields["kv_events_max_blocks"].default,
        help="the index's bound (kv_events_max_blocks; default: the setting's)",
    )
    p.add_argument("--within-s", type=float, default=300.0, help="give up on the replays after")
    p.add_argument("--no-results", action="store_true")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child's part
    return p.parse_args(argv)


def serve(args: argparse.Namespace) -> int:
    """The child: the publishers, their batches published (nobody subscribed: only the replay
    buffers keep them), their endpoints on stdout; then serve replays until stdin closes."""
    bs, per_batch = args.block_size, args.blocks_per_batch
    publishers = []
    for e in range(args.engines):
        # Their replay sockets queue without limit: 64 engines' senders share this host's two
        # cores here, where a real fleet's each have their own (vLLM's queue, 1000 messages,
        # would drop what they cannot send in time, and the gaps would be this host's).
        pub = KVEventPublisher(
            "tcp://127.0.0.1:*",
            "",
            bs,
            "tcp://127.0.0.1:*",
            buffer_steps=args.batches,
            replay_send_hwm=0,
        )
        publishers.append(pub)
        parent: tuple[int, int, int] | None = None
        for b in range(args.batches):
            blocks = []
            for i in range(per_batch):
                n = b * per_batch + i
                key = (e, n // args.prompt_blocks, n % args.prompt_blocks)
                if key[2] == 0:
                    parent = None  # a new prompt's first block
                tokens = [(n * bs + t) % 50_000 for t in range(bs)]
                blocks.append(StoredBlock(key, parent, tokens, None))
                parent = key
            pub.publish(blocks)
    endpoints = [[pub.endpoint, pub.replay_endpoint] for pub in publishers]
    print(json.dumps(endpoints), flush=True)
    sys.stdin.read()
    for pub in publishers:
        pub.close()
    return 0


def _replays() -> dict[str, float]:
    """The feed's replay counter by result, read off that one metric (a read of the whole
    registry takes the loop's turns the measure is about)."""
    counts = dict.fromkeys(RESULTS, 0.0)
    for family in metrics.KV_EVENTS_REPLAYS.metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("result") in counts:
                counts[sample.labels["result"]] = sample.value
    return counts


async def measure(args: argparse.Namespace, endpoints: list[list[str]]) -> dict[str, Any]:
    """One feed connecting to every publisher at once, until each replay ended."""
    pool = Pool("prefill", 3, 2)
    urls = [f"http://engine-{e}:8000" for e in range(len(endpoints))]
    for url in urls:
        pool.add(url)
    by_url = dict(zip(urls, endpoints, strict=True))
    total = args.engines * args.batches * args.blocks_per_batch
    index = BlockIndex(args.max_blocks)
    feed = KVEventsFeed((pool,), index, lambda url: by_url[url][0], 1.0, lambda url: by_url[url][1])
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(TICK_S)
            lags.append(time.monotonic() - t0 - TICK_S)

    # What the feed's first subscription imports (a one-off at start-up), imported before
    # the clock starts: the measure is of the replay.
    import zmq.asyncio
    import zmq.utils.monitor  # noqa: F401

    before = _replays()
    rss_before = c.rss_bytes()
    tick = asyncio.get_running_loop().create_task(ticker())
    cpu0, t0 = time.process_time(), time.monotonic()
    feed.start()
    ended: dict[str, float] = {}
    try:
        while time.monotonic() - t0 < args.within_s:
            ended = {r: v - before[r] for r, v in _replays().items()}
            if ended["answered"] + ended["timeout"] >= args.engines:  # "short" counts gaps
                break
            await asyncio.sleep(0.05)
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    finally:
        await feed.stop()
        tick.cancel()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "replays": ended,
        "wall_s": wall,
        "cpu_s": cpu,
        "longest_stall_s": max(lags, default=0.0),
        "p99_stall_s": sorted(lags)[int(0.99 * (len(lags) - 1))] if lags else 0.0,
        "rss_before_kib": rss_before // 1024,
        "peak_rss_kib": peak_kib,
        "pairs": index.pairs,
        "expected_pairs": total,
    }


@contextlib.contextmanager
def publishers(args: argparse.Namespace, cores: list[int] | None) -> Iterator[list[list[str]]]:
    """The publishers' child process (on `cores`, None: any), until the block ends: each
    engine's [events endpoint, replay endpoint]."""
    sizes = ("--engines", "--batches", "--blocks-per-batch", "--prompt-blocks", "--block-size")
    argv = [f"{name}={getattr(args, name[2:].replace('-', '_'))}" for name in sizes]
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.kv_events_replay", "--serve", *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=c.REPO_ROOT,
        preexec_fn=None if cores is None else lambda: os.sched_setaffinity(0, cores),
    )
    assert child.stdout is not None and child.stdin is not None
    try:
        line = child.stdout.readline()
        if not line:
            raise SystemExit("the publishers' process ended before it was ready")
        yield json.loads(line)
    finally:
        child.stdin.close()  # the child serves until its stdin closes
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve(args)
    # The publishers on one core and the feed on another where there are two: a real fleet's
    # engines run on hosts of their own, and their sending must not take the feed's CPU here.
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        os.sched_setaffinity(0, cores[1:])
    with publishers(args, cores[:1] if len(cores) >= 2 else None) as endpoints:
        # As a proxy worker runs: uvloop where installed, and its collector tuning (what
        # start-up made frozen, young collections every `GC_YOUNG_THRESHOLD` allocations).
        with contextlib.suppress(ImportError):
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        gc.collect()
        gc.freeze()
        out = asyncio.run(measure(args, endpoints))
    batches = args.engines * args.batches
    r = out["replays"]
    growth_mib = (out["peak_rss_kib"] - out["rss_before_kib"]) / 1024
    print(json.dumps(out), flush=True)
    lines = [
        c.run_header(sys.argv),
        "",
        f"{args.engines} enginesim publishers (one child process) each keeping {args.batches:,} "
        f"batches of {args.blocks_per_batch} blocks of {args.block_size} tokens; one feed "
        "(this process) connecting to all at once and asking each for every batch it keeps.",
        "",
        "| replays answered / timed out (gaps in them) | until all ended | CPU per batch | "
        "loop stall: longest / p99 | peak memory over before | index pairs (of the batches') |",
        "|---|---:|---:|---:|---:|---:|",
        f"| {r['answered']:.0f} / {r['timeout']:.0f} ({r['short']:.0f}) | {out['wall_s']:.1f} s "
        f"| {out['cpu_s'] / batches * 1e6:.1f} us | {out['longest_stall_s'] * 1e3:.0f} / "
        f"{out['p99_stall_s'] * 1e3:.0f} ms "
        f"| {growth_mib:,.0f} MiB | {out['pairs']:,} ({out['expected_pairs']:,}) |",
        "",
        f"The index keeps at most {args.max_blocks:,} (engine, block) pairs "
        "(`kv_events_max_blocks`): past it, the oldest of the engines holding the most go, "
        "down to 1/64 under it.",
    ]
    c.publish(SECTION, "\n".join(lines), args.no_results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
