"""One kernel that copies KV blocks between two caches of one node's GPUs, the holder's mapped
into the reader over CUDA IPC (`bench/transfer_descs.py`'s `ipc-gather` way).

What a pull could cost without a transfer per descriptor: `cuda_ipc` already maps the holder's
memory into the reader and then queues one device copy per NIXL descriptor; here the reader
maps the holder's cache (PyTorch's CUDA IPC sharing) and one Triton kernel copies every named
block, a program per block and slice of its bytes. Not a NIXL read (no notification, claim or
verification), and only between GPUs one process can address: a measurement of what a
same-node copy path would reach, not a path the connector has.
"""

from __future__ import annotations

from typing import Any

SLICE_WORDS = 8192  # 64 KiB of each block per program


def available() -> bool:
    """Whether the kernel can run here (Triton and a CUDA device)."""
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def copy_blocks(src, dst, src_ids, dst_ids, row_words, SLICE: tl.constexpr):  # type: ignore[no-untyped-def]
        block = tl.program_id(0)
        part = tl.program_id(1)
        s = tl.load(src_ids + block).to(tl.int64)
        d = tl.load(dst_ids + block).to(tl.int64)
        offs = part * SLICE + tl.arange(0, SLICE)
        mask = offs < row_words
        words = tl.load(src + s * row_words + offs, mask=mask)
        tl.store(dst + d * row_words + offs, words, mask=mask)

    return copy_blocks


_COPY: Any = None


def copy_blocks(src: Any, src_ids: Any, dst: Any, dst_ids: Any) -> None:
    """Copy row `src_ids[i]` of `src` to row `dst_ids[i]` of `dst` (2-D uint8 caches whose rows
    are whole 8-byte words; the id tensors on the GPU), in one launch."""
    import triton

    global _COPY
    if _COPY is None:
        _COPY = _kernel()
    import torch

    s, d = src.view(torch.int64), dst.view(torch.int64)
    row_words = s.shape[1]
    grid = (len(src_ids), triton.cdiv(row_words, SLICE_WORDS))
    _COPY[grid](s, d, src_ids, dst_ids, row_words, SLICE=SLICE_WORDS)
