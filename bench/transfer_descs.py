"""What a READ of vLLM 0.32's KV layouts costs per descriptor: built per read, prepared once,
and block-major.

vLLM 0.32 hands a connector one tensor per layer whose block pages hold K and V together
(`(blocks, page bytes)`): a read of B blocks of an L-layer model is L·B descriptors when no
blocks lie end to end. A holder
process registers such caches with its own NIXL agent (UCX over loopback; CPU memory, or with
`--device cuda` the one GPU's memory, both processes on it); this process reads B blocks from
it, scattered as a block table scatters them (`--order random`: no two adjacent; `runs8`: runs
of 8 adjacent blocks in shuffled order), these ways, interleaved:

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

- copy: the reference, one contiguous copy of the same bytes on the same device
  (`Tensor.copy_` on a GPU, a memory copy on the CPU): what a pull at link speed would match.
  The last line says whether the block-major read of the most blocks reaches 80% of it.

`--model 8b` / `70b-tp4` take the layers and page bytes of those models on a GPU (Llama 3.1
8B: 32 layers of 64 KiB pages; 70B at TP 4: 80 layers of 16 KiB a rank); `scripts/gpu-check.sh`
runs both on a GPU, 750 blocks being a 12k-token pull.

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
from bench import _ipc_gather
from bench.transfer import Copy, gpu_description, mem_type, on_gpu, wait_done
from kvrelay.devtools import with_loopback_ucx

with_loopback_ucx()

SECTION = "transfer descriptors"
# Model shapes a pull is measured on (`--model`): layers and one layer's page of a 16-token
# block, K and V together, 2-byte elements, as vLLM 0.32 hands them over on a GPU. Llama 3.1
# 8B: 32 layers, 8 KV heads of 128; Llama 3.1 70B at tensor parallelism 4: 80 layers, each rank
# holding 2 of the 8 KV heads.
MODELS = {
    "8b": (32, 2 * 8 * 128 * 16 * 2),
    "70b-tp4": (80, 2 * 2 * 128 * 16 * 2),
}
AIM_SHARE = 0.8  # a block-major pull reads at least this share of a device copy's speed


def _caches(layers: int, blocks: int, block_bytes: int, fill: bool, device: str) -> list[Any]:
    """`layers` per-layer caches of (blocks, block_bytes), then the block-major cache of the
    same bytes, (blocks, layers x block_bytes), on `device`."""
    import torch

    def make(shape: tuple[int, int]) -> Any:
        if fill:
            return torch.randint(0, 255, shape, dtype=torch.uint8, device=device)
        return torch.zeros(shape, dtype=torch.uint8, device=device)

    return [make((blocks, block_bytes)) for _ in range(layers)] + [
        make((blocks, layers * block_bytes))
    ]


def _staging(layers: int, blocks: int, block_bytes: int, device: str) -> Any:
    """A staging region: per layer, `blocks` pages end to end."""
    import torch

    return torch.zeros((layers, blocks, block_bytes), dtype=torch.uint8, device=device)


def _words(rows: Any) -> Any:
    """`rows` (uint8, a page a row) seen as 8-byte words where a page is whole words: the
    indexed copy kernels move one element per thread step, a byte each on uint8 (on an H200
    `index_copy_` of 64 KiB uint8 rows ran at about 330 GB/s)."""
    import torch

    return rows.view(torch.int64) if rows.shape[-1] % 8 == 0 else rows


def _synchronize(device: str) -> None:
    """Wait for `device`'s queued kernels (a GPU copy is timed until its bytes are there)."""
    if on_gpu(device):
        import torch

        torch.cuda.synchronize()


def _holder(
    conn: Connection, layers: int, blocks: int, block_bytes: int, staged: int, device: str
) -> None:
    """Child: register both layouts' caches (`_caches`) and a staging region of `staged`
    blocks a layer, keep NIXL progressing; on ("gather", block ids) copy those blocks of each
    layer into the staging region and answer the seconds it took; on "stop", stop."""
    import torch

    from kvrelay.connector.transport import NixlTransport

    torch.set_num_threads(1)
    caches = _caches(layers, blocks, block_bytes, fill=True, device=device)
    staging = _staging(layers, staged, block_bytes, device)
    transport = NixlTransport(f"descs-holder-{os.getpid()}")
    transport.register([*caches, staging], mem_type(device))
    conn.send((transport.metadata(), [t.data_ptr() for t in [*caches, staging]]))
    while True:
        while not conn.poll(0.0005):
            transport.notifications()
        message = conn.recv()
        if message == "stop":
            break
        if message == "share":  # the block-major cache, for the reader to map over CUDA IPC
            import torch.multiprocessing  # pickles CUDA tensors as IPC handles

            conn.send(caches[layers])
            continue
        ids = torch.tensor(message[1], dtype=torch.long, device=device)
        _synchronize(device)
        t0 = time.perf_counter()
        for layer in range(layers):
            torch.index_select(
                _words(caches[layer]), 0, ids, out=_words(staging[layer, : len(ids)])
            )
        _synchronize(device)
        conn.send(time.perf_counter() - t0)
    transport.close()


def _nixl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nixl")
    except PackageNotFoundError:
        return "(version unknown)"


def _geometry(ptrs: list[int], blocks: int, block_bytes: int, name: str, device: str) -> Any:
    from kvrelay.connector.layout import CacheGeometry, Strip

    strips = tuple(Strip(ptr, block_bytes, block_bytes) for ptr in ptrs)
    device_id = 0
    if on_gpu(device):
        import torch

        device_id = torch.device(device).index or 0
    return CacheGeometry(strips, blocks, mem_type(device), device_id, "uint8", False, name)


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
        args=(child, args.layers, holder_blocks, args.block_bytes, staged, args.device),
        daemon=True,
    )
    proc.start()
    rows: list[dict[str, Any]] = []
    try:
        if not parent.poll(120):
            raise RuntimeError("holder process failed to start (see its output above)")
        metadata, remote_ptrs = parent.recv()
        dev = args.device
        caches = _caches(args.layers, args.pool_blocks, args.block_bytes, fill=False, device=dev)
        staging = _staging(args.layers, staged, args.block_bytes, dev)
        transport = NixlTransport(f"descs-reader-{os.getpid()}", threads)
        transport.register([*caches, staging], mem_type(dev))
        agent = transport.add_remote(metadata)
        n, bb = args.layers, args.block_bytes
        # The staging regions: per layer, one strip of `staged` pages (the last pointer).
        st_local = _geometry(
            [staging[layer].data_ptr() for layer in range(n)], staged, bb, "staging", dev
        )
        st_remote = _geometry(
            [remote_ptrs[n + 1] + layer * staged * bb for layer in range(n)],
            staged,
            bb,
            "staging",
            dev,
        )
        st_lists = transport.prepare(st_local), transport.prepare(st_remote, agent)
        local = _geometry(
            [t.data_ptr() for t in caches[:n]], args.pool_blocks, bb, "per-layer", dev
        )
        remote = _geometry(remote_ptrs[:n], holder_blocks, bb, "per-layer", dev)
        # Block-major: one strip whose block is every layer's page.
        bm_local = _geometry([caches[n].data_ptr()], args.pool_blocks, n * bb, "block-major", dev)
        bm_remote = _geometry(remote_ptrs[n : n + 1], holder_blocks, n * bb, "block-major", dev)
        t0 = time.perf_counter()
        local_list = transport.prepare(local)
        remote_list = transport.prepare(remote, agent)
        prepare_s = time.perf_counter() - t0
        bm_lists = transport.prepare(bm_local), transport.prepare(bm_remote, agent)
        # On a GPU with Triton: the holder's block-major cache mapped here (`ipc-gather`).
        mapped = None
        if on_gpu(dev) and _ipc_gather.available():
            import torch.multiprocessing  # unpickles CUDA IPC handles

            parent.send("share")
            mapped = parent.recv()
        piece = ReadPiece(0, 0, 0, args.block_bytes)
        strips = len(local.strips)
        gathered: list[float] = []  # the staged way's gather (holder) and scatter seconds
        scattered: list[float] = []
        kernels: list[float] = []  # the ipc-gather way's kernel seconds
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
                index = torch.tensor(local_ids, dtype=torch.long, device=dev)
                for layer in range(n):
                    _words(caches[layer]).index_copy_(0, index, _words(staging[layer, :count]))
                _synchronize(dev)
                scattered.append(time.perf_counter() - read)
                done = time.perf_counter() - t0 + gathered[-1]
                return posted - t0 + gathered[-1], done

            # The reference: one contiguous copy of the same bytes on the same device (on a
            # GPU a device-to-device copy, what a pull at link speed within one GPU would match).
            copy = Copy(count * len(local.strips) * args.block_bytes, dev)

            def copied(
                local_ids: list[int], remote_ids: list[int], copy: Copy = copy
            ) -> tuple[float, float]:
                seconds = copy.seconds()
                return seconds, seconds

            def ipc_gather(local_ids: list[int], remote_ids: list[int]) -> tuple[float, float]:
                t0 = time.perf_counter()
                ids = torch.tensor([remote_ids, local_ids], dtype=torch.long).to(dev)
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
                _ipc_gather.copy_blocks(mapped, ids[0], caches[n], ids[1])
                end.record()
                launched = time.perf_counter()
                _synchronize(dev)
                kernels.append(start.elapsed_time(end) / 1e3)  # the kernel alone (CUDA events)
                return launched - t0, time.perf_counter() - t0

            ways = {
                "built": built,
                "prepared": prepared,
                "block-major": block_major,
                "staged": staged_way,
                **({"ipc-gather": ipc_gather} if mapped is not None else {}),
                "copy": copied,
            }
            for way in ways.values():
                way(local_ids, remote_ids)  # warm-up: first touch of the pages, UCX wire-up
            best = {name: (float("inf"), float("inf")) for name in ways}
            staged_best = (0.0, 0.0)  # (gather, scatter) of the staged way's best read
            kernel_best = 0.0  # the ipc-gather way's kernel in its best copy
            gathered.clear()
            scattered.clear()
            for _ in range(args.reps):  # interleaved: both ways see the same background load
                for name, way in ways.items():
                    post_s, done_s = way(local_ids, remote_ids)
                    if done_s < best[name][1]:
                        best[name] = (post_s, done_s)
                        if name == "staged":
                            staged_best = (gathered[-1], scattered[-1])
                        if name == "ipc-gather":
                            kernel_best = kernels[-1]
            per_layer = len(build_descs(local, remote, local_ids, remote_ids, piece, True)[0])
            whole = ReadPiece(0, 0, 0, n * bb)
            runs = len(build_descs(bm_local, bm_remote, local_ids, remote_ids, whole, True)[0])
            moved = count * strips * args.block_bytes
            for name, (post_s, done_s) in best.items():
                descs = {"block-major": runs, "staged": n, "ipc-gather": 1, "copy": 1}.get(
                    name, per_layer
                )
                rows.append({
                    "way": name, "blocks": count, "descs": descs, "bytes": moved,
                    "post_s": post_s, "done_s": done_s,
                    **({"gather_s": staged_best[0], "scatter_s": staged_best[1]}
                       if name == "staged" else {}),
                    **({"kernel_s": kernel_best} if name == "ipc-gather" else {}),
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
        mapped = None  # the holder's memory unmapped before it stops
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


def _where(args: argparse.Namespace) -> str:
    """Where the caches lived, and the shape's name."""
    if on_gpu(args.device):
        memory = f"both in one GPU's memory ({gpu_description()}), UCX's CUDA transports"
    else:
        memory = "CPU memory"
    if args.model:
        shape = f"the {args.model} shape's"
    else:
        shape = "(an 8B Llama's 16-token page is 64 KiB on a GPU; smaller here so the pools fit)"
    return (
        f"Reader and holder processes on this machine, {memory}, NIXL {_nixl_version()} over UCX "
        f"loopback; vLLM 0.32's per-layer layout: {args.layers} layers, each block's page K and "
        f"V together, {args.block_bytes} B {shape}"
    )


def _aim(args: argparse.Namespace, measured: list[dict[str, Any]]) -> list[str]:
    """The block-major pull of the most blocks against a copy of the same bytes."""
    by = {(r["way"], r.get("blocks")): r for r in measured}
    count = max(args.blocks)
    share = by[("copy", count)]["done_s"] / by[("block-major", count)]["done_s"]
    verdict = "met" if share >= AIM_SHARE else "missed"
    where = "a device-to-device copy" if on_gpu(args.device) else "a memory copy (CPU)"
    lines = [
        "",
        f"- block-major READ of {count} blocks at {share:.0%} of {where} of the same bytes "
        f"(aim: at least {AIM_SHARE:.0%}) -> {verdict.upper()}",
    ]
    if ("ipc-gather", count) in by:
        ipc = by[("copy", count)]["done_s"] / by[("ipc-gather", count)]["done_s"]
        lines.append(
            f"- not a NIXL read: one kernel copying the {count} blocks out of the holder's "
            f"cache mapped over CUDA IPC at {ipc:.0%} of it (what a same-node copy path "
            "would reach)"
        )
    return lines


def render(args: argparse.Namespace, rows: dict[int, list[dict[str, Any]]]) -> str:
    lines = [
        c.run_header(sys.argv),
        "",
        f"{_where(args)}, "
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
            "read + scatter = done ms | done, prepared / staged | copy ms | block-major "
            "speed / copy |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        by = {(r["way"], r.get("blocks")): r for r in measured}
        for count in args.blocks:
            b, p, m = by[("built", count)], by[("prepared", count)], by[("block-major", count)]
            st, cp = by[("staged", count)], by[("copy", count)]
            read_s = st["done_s"] - st["gather_s"] - st["scatter_s"]
            per_desc = " / ".join(f"{r['done_s'] / r['descs'] * 1e6:.2f}" for r in (b, p, m))
            lines.append(
                f"| {count} | {b['descs']} | {b['post_s'] * 1e3:.2f} / {b['done_s'] * 1e3:.2f} "
                f"| {p['post_s'] * 1e3:.2f} / {p['done_s'] * 1e3:.2f} | {m['descs']} "
                f"| {m['post_s'] * 1e3:.2f} / {m['done_s'] * 1e3:.2f} | {per_desc} "
                f"| {p['done_s'] / m['done_s']:.1f}x | {st['gather_s'] * 1e3:.2f} + "
                f"{read_s * 1e3:.2f} + {st['scatter_s'] * 1e3:.2f} = {st['done_s'] * 1e3:.2f} "
                f"| {p['done_s'] / st['done_s']:.1f}x | {cp['done_s'] * 1e3:.2f} "
                f"| {cp['done_s'] / m['done_s']:.0%} |"
            )
        ipc = [
            (count, by[("ipc-gather", count)], by[("copy", count)])
            for count in args.blocks
            if ("ipc-gather", count) in by
        ]
        if ipc:
            lines += [
                "",
                "One kernel over the holder's block-major cache mapped by CUDA IPC "
                "(`bench/_ipc_gather.py`, not a NIXL read), the block ids uploaded, the kernel "
                "run and waited for (the kernel alone by CUDA events): "
                + ", ".join(
                    f"{count} blocks {g['done_s'] * 1e3:.2f} ms ({cp['done_s'] / g['done_s']:.0%} "
                    f"of the copy; the kernel alone {g['kernel_s'] * 1e3:.2f} ms)"
                    for count, g, cp in ipc
                )
                + ".",
            ]
        prep = by[("prepare once", None)]["seconds"]
        lines += [
            "",
            f"Preparing both sides' lists once ({args.layers} strided rows each, "
            f"{args.pool_blocks} and {2 * args.pool_blocks} blocks a strip): {prep * 1e3:.1f} ms.",
            *_aim(args, measured),
        ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--block-bytes", type=int, default=4096)
    p.add_argument(
        "--model", choices=sorted(MODELS), default=None,
        help="a model's shape (its layers and page bytes, in place of --layers/--block-bytes)",
    )  # fmt: skip
    p.add_argument(
        "--device", default="cpu",
        help="where both sides' caches live: cpu, or a CUDA device (cuda, cuda:0)",
    )  # fmt: skip
    p.add_argument(
        "--section", default=None,
        help=f"the RESULTS section to write ({SECTION!r}; on a GPU, with the model's name)",
    )  # fmt: skip
    p.add_argument("--pool-blocks", type=int, default=1024, help="the reader's blocks a strip")
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 128, 750])
    p.add_argument("--order", choices=("random", "runs8"), default="random")
    p.add_argument(
        "--threads", type=int, nargs="+", default=[0, 2], help="reader's UCX worker threads"
    )
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--no-results", action="store_true", help="do not touch bench/RESULTS.md")
    args = p.parse_args(argv)
    if args.model:
        args.layers, args.block_bytes = MODELS[args.model]
    if args.section is None:
        args.section = SECTION
        if on_gpu(args.device):
            args.section += f" (GPU{', ' + args.model if args.model else ''})"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with_loopback_ucx(cuda=on_gpu(args.device))  # before the holder is spawned
    rows = {threads: measure(args, threads) for threads in args.threads}
    c.publish(args.section, render(args, rows), args.no_results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
