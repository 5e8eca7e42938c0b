"""The KV-events index at fleet scale: memory, the cost of applying events, a lookup's time.

`kvrelay.proxy.fleet.BlockIndex` keeps, for every (engine, block) an engine's `BlockStored`
events reported and no `BlockRemoved` took back, an entry in that engine's map and a bit in
the block's holder mask. This fills one index as `--engines` engines caching `--blocks` blocks
each would (prompts of `--prompt-blocks` blocks of `--block-size` tokens; `--shared` of each
engine's prompts begin with one of a few shared 2,048-token prefixes, so the fleet shares some
blocks as it would share system prompts), with `max_blocks` above the total so nothing is
trimmed, and reports:
- the process's resident memory before and after (bytes per (engine, block)),
- the time to apply one stored block (what each engine's event stream costs the proxy's loop),
- the time to look up one prompt of `--lookup-tokens` tokens against the whole index.
Writes the `## block index at scale` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time

from bench import _common as c
from kvrelay.proxy.fleet import BlockIndex

SECTION = "block index at scale"
SHARED_PREFIXES = 8


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--blocks", type=int, default=100_000, help="blocks each engine caches")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-blocks", type=int, default=250, help="blocks per prompt (4k tokens)")
    p.add_argument("--shared", type=float, default=0.5, help="share of prompts with a shared start")
    p.add_argument("--lookup-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-results", action="store_true")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    bs, per_prompt = args.block_size, args.prompt_blocks
    shared_len = min(2048 // bs, per_prompt) * bs
    prefixes = [[rng.randrange(50_000) for _ in range(shared_len)] for _ in range(SHARED_PREFIXES)]
    index = BlockIndex(args.engines * args.blocks + 1)
    gc.collect()
    before = c.rss_bytes()
    applied_s, stored = 0.0, 0
    for e in range(args.engines):
        url = f"http://p{e}:8000"
        for _ in range(args.blocks // per_prompt):
            tokens = [rng.randrange(50_000) for _ in range(per_prompt * bs)]
            if rng.random() < args.shared:
                tokens[:shared_len] = rng.choice(prefixes)
            hashes = [rng.getrandbits(64) for _ in range(per_prompt)]
            t0 = time.perf_counter()
            stored += index.stored(url, hashes, None, tokens, bs)
            applied_s += time.perf_counter() - t0
    gc.collect()
    after = c.rss_bytes()
    lookup = [*rng.choice(prefixes), *(rng.randrange(50_000) for _ in range(args.lookup_tokens))]
    lookup = lookup[: args.lookup_tokens]
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        found = index.cached_tokens(lookup, None)
        times.append(time.perf_counter() - t0)
    per_pair = (after - before) / max(1, index.pairs)
    print(
        f"pairs {index.pairs:,} ({stored:,} stored), memory {(after - before) / 2**20:,.0f} MiB "
        f"({per_pair:.0f} B/pair), apply {applied_s / stored * 1e6:.2f} us/block, lookup "
        f"{min(times) * 1e3:.2f} ms ({len(found)} engines cache its prefix)",
        flush=True,
    )
    lines = [
        c.run_header(sys.argv),
        "",
        f"{args.engines} engines x {args.blocks:,} blocks of {bs} tokens (prompts of {per_prompt} "
        f"blocks, {args.shared:.0%} of them starting with one of {SHARED_PREFIXES} shared "
        f"{shared_len}-token prefixes), one process on this machine's CPU.",
        "",
        "| (engine, block) pairs | resident memory | per pair | apply a stored block | "
        f"look up {args.lookup_tokens} tokens |",
        "|---|---|---|---|---|",
        f"| {index.pairs:,} | {(after - before) / 2**20:,.0f} MiB | {per_pair:.0f} B | "
        f"{applied_s / stored * 1e6:.2f} us | {min(times) * 1e3:.2f} ms |",
        "",
        "The default bound, `KVRELAY_KV_EVENTS_MAX_BLOCKS` = 2,000,000 pairs, is about "
        f"{2_000_000 * per_pair / 2**20:,.0f} MiB at this size per pair; over it, the oldest "
        "reported blocks of the engines holding the most are forgotten, down to 1/64 under it.",
    ]
    c.publish(SECTION, "\n".join(lines), args.no_results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
