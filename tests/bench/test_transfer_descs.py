"""`bench/transfer_descs.py` on this machine's CPU, small: every way reads real blocks over NIXL
between two processes, the block-major way with one descriptor per run of blocks, and the
verdict line compares it with a copy of the same bytes. The GPU run (`--device cuda`, the
models' shapes) is `scripts/gpu-check.sh`'s; its arguments are checked here."""

from __future__ import annotations

import pytest

from bench import _ipc_gather, transfer_descs

pytestmark = pytest.mark.nixl


def test_model_shapes_set_layers_and_page_bytes_and_name_the_gpu_section() -> None:
    args = transfer_descs.parse_args(["--model", "8b", "--device", "cuda"])
    # Llama 3.1 8B's 16-token page, K and V together in 2-byte elements: 64 KiB.
    assert (args.layers, args.block_bytes) == (32, 64 * 1024)
    assert args.section == "transfer descriptors (GPU, 8b)"
    tp4 = transfer_descs.parse_args(["--model", "70b-tp4", "--device", "cuda:0"])
    assert (tp4.layers, tp4.block_bytes) == (80, 16 * 1024)
    cpu = transfer_descs.parse_args([])
    assert cpu.section == "transfer descriptors"


def test_each_way_reads_the_blocks_and_the_verdict_compares_block_major_with_a_copy() -> None:
    args = transfer_descs.parse_args(
        ["--layers", "4", "--block-bytes", "1024", "--pool-blocks", "64", "--blocks", "4", "16",
         "--threads", "0", "--reps", "1", "--no-results"]
    )  # fmt: skip
    rows = transfer_descs.measure(args, 0)
    by = {(r["way"], r.get("blocks")): r for r in rows}
    for count in (4, 16):
        ways = {way for way, blocks in by if blocks == count}
        assert ways == {"built", "prepared", "block-major", "staged", "copy"}
        # Blocks scattered with none adjacent: one descriptor a block a layer, one a block
        # block-major, one a layer staged.
        assert by[("built", count)]["descs"] == 4 * count
        assert by[("block-major", count)]["descs"] == count
        assert by[("staged", count)]["descs"] == 4
        assert all(by[(way, count)]["done_s"] > 0 for way in ways)
    text = transfer_descs.render(args, {0: rows})
    verdict = [line for line in text.splitlines() if "block-major READ of 16 blocks" in line]
    assert len(verdict) == 1
    assert verdict[0].endswith(("-> MET", "-> MISSED"))
    # On a GPU with Triton a sixth way runs, one kernel over the holder's cache mapped by CUDA
    # IPC: its line gives the whole and the kernel alone against the copy.
    copy_16 = by[("copy", 16)]["done_s"]
    ipc = [
        {"way": "ipc-gather", "blocks": count, "descs": 1, "post_s": 0.0, "done_s": 2 * copy_16,
         "kernel_s": copy_16}
        for count in (4, 16)
    ]  # fmt: skip
    lines = transfer_descs.render(args, {0: [*rows, *ipc]}).splitlines()
    gather = [line for line in lines if line.startswith("One kernel over the holder's")]
    assert len(gather) == 1
    assert "16 blocks" in gather[0] and "(50% of the copy; the kernel alone" in gather[0]
    assert any("not a NIXL read" in line and "at 50% of it" in line for line in lines)


@pytest.mark.gpu
@pytest.mark.skipif(not _ipc_gather.available(), reason="needs Triton and a CUDA device")
def test_the_ipc_gather_kernel_copies_exactly_the_named_blocks() -> None:
    import torch

    src = torch.randint(0, 255, (64, 4096), dtype=torch.uint8, device="cuda")
    dst = torch.zeros((32, 4096), dtype=torch.uint8, device="cuda")
    src_ids = torch.tensor([5, 9, 1, 63], device="cuda")
    dst_ids = torch.tensor([0, 31, 7, 2], device="cuda")
    _ipc_gather.copy_blocks(src, src_ids, dst, dst_ids)
    torch.cuda.synchronize()
    assert torch.equal(dst[dst_ids], src[src_ids])
    untouched = torch.ones(32, dtype=torch.bool, device="cuda")
    untouched[dst_ids] = False
    assert int(dst[untouched].sum()) == 0
