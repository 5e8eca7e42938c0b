"""What a READ of vLLM 0.32's KV layouts costs per descriptor: built per read, prepared once,
and block-major.

vLLM 0.32 hands a connector one tensor per layer whose block pages hold K and V together
(`(blocks, page bytes)`): a read of B blocks of an L-layer model is L·B descriptors when no
blocks lie end to end. A holder
process registers such caches with its own NIXL agent (UCX, CPU memory, loopback); this process
reads B blocks from it, scattered as a block table scatters them (`--order random`: no two
adjacent; `runs8`: runs of 8 adjacent blocks in shuffled order), three ways, interleaved:

- built: `transport.build_descs` makes the rows in Python, `NixlTransport.read` turns them into
  NIXL lists and posts (the connector's path before prepared lists, and still its path for a
  heterogeneous-TP slice of each block);
- prepared: `NixlTransport.prepare` made both sides' lists once (one strided row per strip),
  each read is two index arrays (`block_indices`) and `NixlTransport.read_prepared`;
- block-major: the same bytes in vLLM's block-outermost layout (`BLHNC`, which the connector
  asks for off the CPU): one `(blocks, layers x page)` tensor a side, so one descriptor per
  block (NIXL merges adjacent ones), read through prepared lists as the connector does;
- staged: where the layout stays per-layer, the holder gathers the blocks into a staging
  region of its own (one `index_select` per layer: one kernel on a GPU), the reader reads that
  region (one descriptor per layer) into its staging region and scatters it into its pages
  (one `index_copy_` per layer). Its time is gather + read + scatter, the gather timed in the
  holder process (asked over a pipe, whose round trip is not counted).

Reported per read: the time on the calling thread until the READ is posted (what the engine's
step pays: the connector posts inside `get_finished()`), and until NIXL says DONE; best of
`--reps`, once per `--threads` count of the reader's UCX worker threads (`nixl_threads`).
Writes the `## transfer descriptors` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from bench import _common as c
from bench.transfer import wait_done
from kvrelay.devtools import with_loopback_ucx

with_loopback_ucx()

SECTION = "transfer descriptors"


def _caches(layers: int, blocks: int, block_bytes: int, fill: bool) -> list[Any]:
    """`layers` per-layer caches of (blocks, block_bytes), then the block-major cache of the
    same bytes, (blocks, layers x block_bytes)."""
    import torch

    def make(shape: tuple[int, int]) -> Any:
        if fill:
            return torch.randint(0, 255, shape, dtype=torch.uint8)
        return torch.zeros(shape, dtype=torch.uint8)

    return [make((blocks, block_bytes)) for _ in range(layers)] + [
        make((blocks, layers * block_bytes))
    ]


def _staging(layers: int, blocks: int, block_bytes: int) -> Any:
    """A staging region: per layer, `blocks` pages end to end."""
    import torch

    return torch.zeros((layers, blocks, block_bytes), dtype=torch.uint8)


def _holder(conn: Connection, layers: int, blocks: int, block_bytes: int, staged: int) -> None:
    """Child: register both layouts' caches (`_caches`) and a staging region of `staged`
    blocks a layer, keep NIXL progressing; on ("gather", block ids) copy those blocks of each
    layer into the staging region and answer the seconds it took; on "stop", stop."""
    import torch

    from kvrelay.connector.transport import NixlTransport

    torch.set_num_threads(1)
    caches = _caches(layers, blocks, block_bytes, fill=True)
    staging = _staging(layers, staged, block_bytes)
    transport = NixlTransport(f"descs-holder-{os.getpid()}")
    transport.register([*caches, staging], "DRAM")
    conn.send((transport.metadata(), [t.data_ptr() for t in [*caches, staging]]))
    while True:
        while not conn.poll(0.0005):
            transport.notifications()
        message = conn.recv()
        if message == "stop":
            break
        ids = torch.tensor(message[1], dtype=torch.long)
        t0 = time.perf_counter()
        for layer in range(layers):
            torch.index_select(caches[layer], 0, ids, out=staging[layer, : len(ids)])
        conn.send(time.perf_counter() - t0)
    transport.close()


def _nixl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nixl")
    except PackageNotFoundError:
        return "(version unknown)"


def _geometry(ptrs: list[int], blocks: int, block_bytes: int, name: str) -> Any:
    from kvrelay.connector.layout import CacheGeometry, Strip

    strips = tuple(Strip(ptr, block_bytes, block_bytes) for ptr in ptrs)
    return CacheGeometry(strips, blocks, "DRAM", 0, "uint8", False, name)


def _block_ids(order: str, blocks: int, count: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    if order == "random":
        # Every other block, shuffled: no two adjacent, as a fragmented pool hands them out.
        return [int(b) for b in rng.permutation(np.arange(0, blocks, 2))[:count]]
    runs = [list(range(i, i + 8)) for i in range(0, blocks - 7, 8)]
    picked = [runs[i] for i in rng.permutation(len(runs))[: (count + 7) // 8]]
    return [b for run in picked for b in run][:count]


def measure(args: argparse.Namespace, threads: int) -> list[dict[str, Any]]:
    import torch

    from kvrelay.connector.tp import ReadPiece
    from kvrelay.connector.transport import NixlTransport, block_indices, build_descs

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    holder_blocks = 2 * args.pool_blocks
    staged = max(args.blocks)
    proc = ctx.Process(
        target=_holder,
        args=(child, args.layers, holder_blocks, args.block_bytes, staged),
        daemon=True,
    )
    proc.start()
    rows: list[dict[str, Any]] = []
    try:
        if not parent.poll(120):
            raise RuntimeError("holder process failed to start (see its output above)")
        metadata, remote_ptrs = parent.recv()
        caches = _caches(args.layers, args.pool_blocks, args.block_bytes, fill=False)
        staging = _staging(args.layers, staged, args.block_bytes)
        transport = NixlTransport(f"descs-reader-{os.getpid()}", threads)
        transport.register([*caches, staging], "DRAM")
        agent = transport.add_remote(metadata)
        n, bb = args.layers, args.block_bytes
        # The staging regions: per layer, one strip of `staged` pages (the last pointer).
        st_local = _geometry(
            [staging[layer].data_ptr() for layer in range(n)], staged, bb, "staging"
        )
        st_remote = _geometry(
            [remote_ptrs[n + 1] + layer * staged * bb for layer in range(n)], staged, bb, "staging"
        )
        st_lists = transport.prepare(st_local), transport.prepare(st_remote, agent)
        local = _geometry([t.data_ptr() for t in caches[:n]], args.pool_blocks, bb, "per-layer")
        remote = _geometry(remote_ptrs[:n], holder_blocks, bb, "per-layer")
        # Block-major: one strip whose block is every layer's page.
        bm_local = _geometry([caches[n].data_ptr()], args.pool_blocks, n * bb, "block-major")
        bm_remote = _geometry(remote_ptrs[n : n + 1], holder_blocks, n * bb, "block-major")
        t0 = time.perf_counter()
        local_list = transport.prepare(local)
        remote_list = transport.prepare(remote, agent)
        prepare_s = time.perf_counter() - t0
        bm_lists = transport.prepare(bm_local), transport.prepare(bm_remote, agent)
        piece = ReadPiece(0, 0, 0, args.block_bytes)
        strips = len(local.strips)
        gathered: list[float] = []  # the staged way's gather (holder) and scatter seconds
        scattered: list[float] = []
        for count in args.blocks:
            local_ids = list(range(count))
            remote_ids = _block_ids(args.order, holder_blocks, count, count)

            def built(local_ids: list[int], remote_ids: list[int]) -> tuple[float, float]:
                t0 = time.perf_counter()
                l_rows, r_rows = build_descs(local, remote, local_ids, remote_ids, piece, True)
                handle = transport.read(agent, l_rows, r_rows, b"")
                posted = time.perf_counter()
                wait_done(transport, handle)
                return posted - t0, time.perf_counter() - t0

            def prepared(local_ids: list[int], remote_ids: list[int]) -> tuple[float, float]:
                t0 = time.perf_counter()
                handle = transport.read_prepared(
                    agent,
                    local_list,
                    block_indices(strips, args.pool_blocks, local_ids),
                    remote_list,
                    block_indices(strips, holder_blocks, remote_ids),
                    b"",
                )
                posted = time.perf_counter()
                wait_done(transport, handle)
                return posted - t0, time.perf_counter() - t0

            def block_major(local_ids: list[int], remote_ids: list[int]) -> tuple[float, float]:
                t0 = time.perf_counter()
                handle = transport.read_prepared(
                    agent,
                    bm_lists[0],
                    block_indices(1, args.pool_blocks, local_ids),
                    bm_lists[1],
                    block_indices(1, holder_blocks, remote_ids),
                    b"",
                )
                posted = time.perf_counter()
                wait_done(transport, handle)
                return posted - t0, time.perf_counter() - t0

            def staged_way(local_ids: list[int], remote_ids: list[int]) -> tuple[float, float]:
                parent.send(("gather", remote_ids))
                gathered.append(parent.recv())
                t0 = time.perf_counter()
                count = len(remote_ids)
                whole = list(range(count))  # the staged pages, end to end: one run a layer
                handle = transport.read_prepared(
                    agent,
                    st_lists[0],
                    block_indices(n, staged, whole),
                    st_lists[1],
                    block_indices(n, staged, whole),
                    b"",
                )
                posted = time.perf_counter()
                wait_done(transport, handle)
                read = time.perf_counter()
                index = torch.tensor(local_ids, dtype=torch.long)
                for layer in range(n):
                    caches[layer].index_copy_(0, index, staging[layer, :count])
                scattered.append(time.perf_counter() - read)
                done = time.perf_counter() - t0 + gathered[-1]
                return posted - t0 + gathered[-1], done

            ways = {
                "built": built,
                "prepared": prepared,
                "block-major": block_major,
                "staged": staged_way,
            }
            for way in ways.values():
                way(local_ids, remote_ids)  # warm-up: first touch of the pages, UCX wire-up
            best = {name: (float("inf"), float("inf")) for name in ways}
            staged_best = (0.0, 0.0)  # (gather, scatter) of the staged way's best read
            gathered.clear()
            scattered.clear()
            for _ in range(args.reps):  # interleaved: both ways see the same background load
                for name, way in ways.items():
                    post_s, done_s = way(local_ids, remote_ids)
                    if done_s < best[name][1]:
                        best[name] = (post_s, done_s)
                        if name == "staged":
                            staged_best = (gathered[-1], scattered[-1])
            per_layer = len(build_descs(local, remote, local_ids, remote_ids, piece, True)[0])
            whole = ReadPiece(0, 0, 0, n * bb)
            runs = len(build_descs(bm_local, bm_remote, local_ids, remote_ids, whole, True)[0])
            moved = count * strips * args.block_bytes
            for name, (post_s, done_s) in best.items():
                descs = {"block-major": runs, "staged": n}.get(name, per_layer)
                rows.append({
                    "way": name, "blocks": count, "descs": descs, "bytes": moved,
                    "post_s": post_s, "done_s": done_s,
                    **({"gather_s": staged_best[0], "scatter_s": staged_best[1]}
                       if name == "staged" else {}),
                })  # fmt: skip
                print(
                    f"{name:9s} blocks {count:5d} descs {descs:6d} post {post_s * 1e3:7.2f} ms "
                    f"done {done_s * 1e3:7.2f} ms ({done_s / descs * 1e6:5.2f} us/desc, "
                    f"{moved / done_s / 1e9:5.2f} GB/s)",
                    flush=True,
                )
            # Every way read the same blocks: the last reads' bytes are the holder's.
            got = torch.stack([t[:count] for t in caches[:n]]).sum().item()
            assert got > 0 and caches[n][:count].sum().item() > 0, "nothing was read"
        for prepared_list in (local_list, remote_list, *bm_lists, *st_lists):
            transport.drop_prepared(prepared_list)
        transport.remove_remote(agent)
        transport.close()
        rows.append({"way": "prepare once", "seconds": prepare_s})
    finally:
        parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return rows


def render(args: argparse.Namespace, rows: dict[int, list[dict[str, Any]]]) -> str:
    lines = [
        c.run_header(sys.argv),
        "",
        f"Reader and holder processes on this machine, CPU memory, NIXL {_nixl_version()} over "
        f"UCX loopback; vLLM 0.32's per-layer layout: {args.layers} layers, each block's page "
        f"K and V together, {args.block_bytes} B (an 8B Llama's 16-token page is 64 KiB on a "
        "GPU; smaller here so the pools fit the machine), "
        "and the same bytes block-major (one row of every layer's page per block), "
        f"holder blocks `{args.order}`, best of {args.reps} interleaved reads, one table per "
        "count of the reader's UCX worker threads (`nixl_threads`). Post = time on the calling "
        "thread until the READ is posted (what the engine's step pays); done = until NIXL "
        "reports it DONE.",
    ]
    for threads, measured in rows.items():
        lines += [
            "",
            f"UCX worker threads: {threads}",
            "",
            "| blocks read | per-layer descriptors | built: post / done ms | prepared: post / "
            "done ms | block-major descriptors | block-major: post / done ms | us per descriptor "
            "(built / prepared / block-major) | done, prepared / block-major | staged: gather + "
            "read + scatter = done ms | done, prepared / staged |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        by = {(r["way"], r.get("blocks")): r for r in measured}
        for count in args.blocks:
            b, p, m = by[("built", count)], by[("prepared", count)], by[("block-major", count)]
            st = by[("staged", count)]
            read_s = st["done_s"] - st["gather_s"] - st["scatter_s"]
            per_desc = " / ".join(f"{r['done_s'] / r['descs'] * 1e6:.2f}" for r in (b, p, m))
            lines.append(
                f"| {count} | {b['descs']} | {b['post_s'] * 1e3:.2f} / {b['done_s'] * 1e3:.2f} "
                f"| {p['post_s'] * 1e3:.2f} / {p['done_s'] * 1e3:.2f} | {m['descs']} "
                f"| {m['post_s'] * 1e3:.2f} / {m['done_s'] * 1e3:.2f} | {per_desc} "
                f"| {p['done_s'] / m['done_s']:.1f}x | {st['gather_s'] * 1e3:.2f} + "
                f"{read_s * 1e3:.2f} + {st['scatter_s'] * 1e3:.2f} = {st['done_s'] * 1e3:.2f} "
                f"| {p['done_s'] / st['done_s']:.1f}x |"
            )
        prep = by[("prepare once", None)]["seconds"]
        lines += [
            "",
            f"Preparing both sides' lists once ({args.layers} strided rows each, "
            f"{args.pool_blocks} and {2 * args.pool_blocks} blocks a strip): {prep * 1e3:.1f} ms.",
        ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--block-bytes", type=int, default=4096)
    p.add_argument("--pool-blocks", type=int, default=1024, help="the reader's blocks a strip")
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 128, 750])
    p.add_argument("--order", choices=("random", "runs8"), default="random")
    p.add_argument(
        "--threads", type=int, nargs="+", default=[0, 2], help="reader's UCX worker threads"
    )
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--no-results", action="store_true", help="do not touch bench/RESULTS.md")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = {threads: measure(args, threads) for threads in args.threads}
    c.publish(SECTION, render(args, rows), args.no_results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
