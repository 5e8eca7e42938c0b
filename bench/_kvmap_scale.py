"""`kvmap.py --scale`: the conversation map's cost per put+take pair as it fills up.

The map is filled to each size in turn (1k, 100k, 1M live conversations by default; each entry
distinct, `--blocks` blocks with their hashes, a long TTL so none expires), and at each size
`--scale-clients` concurrent clients in one event loop repeat put+take pairs on their own keys
for `--duration` seconds (after `--warmup` seconds not counted), so the map holds
`size + clients` entries while it is measured. Reported
per backend and size: pairs/s, pair p50/p99 latency, CPU per pair (the client process, plus
redis-server's for Redis), and bytes per live entry: the process's RSS growth over the fill
for the memory map (the entries are held by the map alone), `INFO memory` `used_memory` growth
for Redis. Aim: the pair's cost flat within 20% from the smallest size to the largest (judged
on CPU per pair, steadier than wall time on a shared machine). Rewrites `## kvmap at scale`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import time
from pathlib import Path
from typing import Any

from bench import _common as c
from kvrelay.devtools.redis import RedisServer
from kvrelay.kvcache_map import ConversationKey, KVEntry, KVMap, MemoryMap, RedisMap
from kvrelay.kvcache_map._redis import make_client

SECTION = "kvmap at scale"
AIM_FLAT = 1.2
FILL_TTL_S = 24 * 3600.0
FILL_CONCURRENCY = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scale mode (--scale)")
    g.add_argument("--scale", action="store_true", help="cost per pair as the map fills up")
    g.add_argument("--sizes", type=int, nargs="+", default=[1000, 100_000, 1_000_000])
    g.add_argument(
        "--blocks", type=int, default=32, help="blocks (+ hashes) per entry: 32 = 512 tokens"
    )
    g.add_argument("--scale-clients", type=int, default=1, help="clients measuring pairs")


def apply_quick(args: argparse.Namespace) -> None:
    args.sizes = [1000, 10_000]


def make_entry(i: int, blocks: int) -> KVEntry:
    """A distinct entry, shaped like one D returns (no field shared with any other entry)."""
    base = (i * blocks) % 1_000_000
    return KVEntry.model_construct(
        engine_id="decode-0",
        host="10.0.0.5",
        port=5600,
        url="http://10.0.0.5:8000",
        request_id=f"cmpl-{i:016x}",
        block_ids=[list(range(base, base + blocks))],
        num_tokens=blocks * 16,
        block_hashes=[f"{(i << 20 | b) & 0xFFFF_FFFF_FFFF_FFFF:016x}" for b in range(blocks)],
        fingerprint=f"m:3:{i:032x}",
        expires_at=time.time() + FILL_TTL_S,
        release_token=f"{i:032x}",
        tp_size=1,
    )


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def fill(m: KVMap, start: int, stop: int, blocks: int) -> None:
    """Put entries start..stop-1 under keys of their own (concurrently for Redis)."""
    it = iter(range(start, stop))

    async def filler() -> None:
        for i in it:
            await m.put(ConversationKey("bench-tenant", f"live-{i}"), make_entry(i, blocks),
                        FILL_TTL_S)  # fmt: skip

    await asyncio.gather(*(filler() for _ in range(FILL_CONCURRENCY)))


async def pairs(m: KVMap, clients: int, duration: float, blocks: int) -> dict[str, float]:
    """Clients put then take an entry under their own key, for `duration` seconds."""
    perf = time.perf_counter
    lat: list[float] = []
    entry = make_entry(10**9, blocks)

    async def client(n: int) -> None:
        key = ConversationKey("bench-tenant", f"pair-{n}")
        k = 0
        while perf() < end:
            t0 = perf()
            await m.put(key, entry, 60)
            if await m.take(key) is None:
                raise RuntimeError("take lost an entry this client just stored")
            lat.append(perf() - t0)
            k += 1
            if k % 64 == 0:
                await asyncio.sleep(0)

    gc.collect()
    cpu0, t0 = time.process_time(), perf()
    end = t0 + duration
    await asyncio.gather(*(client(n) for n in range(clients)))
    cpu, wall = time.process_time() - cpu0, perf() - t0
    return {
        "pairs": float(len(lat)),
        "pairs_per_s": len(lat) / wall,
        "p50": c.percentile(lat, 50),
        "p99": c.percentile(lat, 99),
        "client_cpu_us": cpu / max(len(lat), 1) * 1e6,
    }


async def run_backend(
    backend: str, args: argparse.Namespace, redis: RedisServer | None
) -> list[dict[str, Any]]:
    m: KVMap
    info: Any = None
    if backend == "memory":
        m = MemoryMap(max_entries=max(args.sizes) + 1024, report_on_close=False)
    else:
        assert redis is not None
        m = RedisMap.from_url(redis.url, timeout=5.0)  # the fill must not count as an outage
        info = make_client(redis.url, timeout=5.0)
    out: list[dict[str, Any]] = []
    try:
        size = 0
        gc.collect()
        mem0 = rss_bytes() if info is None else int((await info.info("memory"))["used_memory"])
        for target in sorted(args.sizes):
            t0 = time.monotonic()
            await fill(m, size, target, args.blocks)
            size = target
            fill_s = time.monotonic() - t0
            gc.collect()
            if info is None:
                grown = rss_bytes() - mem0
            else:
                grown = int((await info.info("memory"))["used_memory"]) - mem0
            server = redis.process if redis is not None else None
            server_cpu0 = c.server_cpu_s(server) if server else 0.0
            await pairs(m, args.scale_clients, args.warmup, args.blocks)  # warm-up, discarded
            r: dict[str, Any] = await pairs(m, args.scale_clients, args.duration, args.blocks)
            server_cpu = c.server_cpu_s(server) - server_cpu0 if server else 0.0
            r["server_cpu_us"] = server_cpu / max(r["pairs"], 1) * 1e6
            r["cpu_us"] = r["client_cpu_us"] + r["server_cpu_us"]
            r.update(backend=backend, size=size, bytes_per_entry=grown / size, fill_s=fill_s)
            out.append(r)
            print(
                f"{backend:6s} size={size:>9,d} {r['pairs_per_s']:9.0f} pairs/s "
                f"p50 {c.fmt_ms(r['p50'], 3)} ms CPU {r['cpu_us']:.0f} us/pair "
                f"{r['bytes_per_entry']:.0f} B/entry (fill {fill_s:.0f}s)",
                flush=True,
            )
    finally:
        await m.close()
        if info is not None:
            await info.aclose()
    return out


def render(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [c.run_header(), ""]
    lines.append(
        f"Map filled to each size with distinct entries of {args.blocks} blocks (+ hashes); at "
        f"each size {args.scale_clients} client(s) in one event loop repeat put+take pairs on "
        f"their own keys for {args.duration:g} s. CPU per pair = the client process's CPU "
        "(+ redis-server's for Redis). Bytes per entry = RSS growth of the process over the "
        "fill (memory) or `INFO memory` `used_memory` growth (Redis), over the entries."
    )
    lines += ["", "| backend | live entries | pairs/s | pair p50 ms | pair p99 ms "
              "| CPU us/pair | bytes/entry | fill s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        lines.append(
            f"| {r['backend']} | {r['size']:,} | {r['pairs_per_s']:,.0f} | {c.fmt_ms(r['p50'], 3)} "
            f"| {c.fmt_ms(r['p99'], 3)} | {r['cpu_us']:.1f} | {r['bytes_per_entry']:,.0f} "
            f"| {r['fill_s']:.0f} |"
        )
    lines += ["", "Aim: cost per pair flat within 20% across sizes (CPU per pair, largest size "
              "over smallest):", ""]  # fmt: skip
    for backend in ("memory", "redis"):
        rs = sorted((r for r in results if r["backend"] == backend), key=lambda r: r["size"])
        if len(rs) < 2:
            continue
        ratio = rs[-1]["cpu_us"] / rs[0]["cpu_us"] if rs[0]["cpu_us"] else math.nan
        p50 = rs[-1]["p50"] / rs[0]["p50"] if rs[0]["p50"] else math.nan
        verdict = "met" if ratio <= AIM_FLAT else "MISSED"
        lines.append(
            f"- {backend}: {rs[-1]['size']:,} vs {rs[0]['size']:,} entries: CPU/pair "
            f"{c.fmt_ratio(ratio)}x (p50 {c.fmt_ratio(p50)}x), {verdict}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace, loop_factory: Any) -> int:
    results: list[dict[str, Any]] = []
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        if "memory" in args.backends:
            results += runner.run(run_backend("memory", args, None))
        if "redis" in args.backends:
            with c.redis_for_bench() as redis:
                results += runner.run(run_backend("redis", args, redis))
    text = render(results, args)
    if args.json:
        c.write_json(Path(args.json), {"scale": results})
    if not args.no_results:
        c.update_results_section(SECTION, text)
    print(text)
    return 0
