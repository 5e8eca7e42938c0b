"""Turn vLLM's per-layer KV cache tensors into what the core registers: contiguous tensors and
a `CacheLayout` (which dimension indexes blocks, whether heads are outermost inside a block).

vLLM backends allocate a physical buffer and may hand out a permuted view of it (for example an
HND stride order under an NHD shape), so the logical shape says little about memory order. We
sort dimensions by stride to recover the physical (contiguous) view, then find the block
dimension by its size. Torch only; no vLLM import.

A *block-major* cache (vLLM's block-outermost layouts, `BLHNC`/`BHLNC`, which the connector
asks for where the attention backend accepts one: `block_major_layout`) is one buffer whose
every block holds all layers' pages side by side; vLLM hands out one strided view per layer
into it. Those views are recognised together (one storage, one block stride, the layers' pages
tiling each block) and registered as a single `(blocks, bytes per block)` byte tensor: one
descriptor per block, whatever the layer count, and one per run of adjacent blocks once runs
are merged. A reader and a holder must then both be block-major: the layout name carries it
(`BLOCK_MAJOR_SUFFIX`), and a holder whose name differs is refused before any read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvrelay.connector.errors import ConnectorError, ConnectorErrorKind
from kvrelay.connector.layout import CacheLayout

BLOCK_MAJOR_SUFFIX = "+block-major"
BLOCK_MAJOR_NAME = "blocks"  # the one registered tensor of a block-major cache


class UnsupportedCacheError(ConnectorError, ValueError):
    """The engine's KV cache tensors cannot be described to the connector."""

    kind = ConnectorErrorKind.UNSUPPORTED_CACHE


@dataclass(frozen=True)
class PreparedCaches:
    """Physical views of the caches (same storage, contiguous) and their layout."""

    tensors: dict[str, torch.Tensor]
    layout: CacheLayout


def physical_view(t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The same storage as a contiguous tensor, and the logical dim behind each physical dim."""
    # Outermost first (larger stride). Size-1 dims have arbitrary strides and never affect
    # contiguity, so they go last; ties keep the logical order (deterministic).
    strides = [int(st) for st in t.stride()]
    order = sorted(range(t.dim()), key=lambda d: (-strides[d] if t.shape[d] > 1 else 0, d))
    view = t.permute(order)
    if not view.is_contiguous():
        raise UnsupportedCacheError(
            f"KV cache tensor with shape {tuple(t.shape)} and strides {t.stride()} is not a "
            "permutation of a dense buffer (padded or shared-across-layers storage)"
        )
    return view, order


def prepare_caches(
    caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    name: str,
) -> PreparedCaches:
    """Physical views of `caches` (layer order kept) plus the `CacheLayout` they share; a
    block-major cache as its one block-row tensor (module docstring)."""
    if not caches:
        raise UnsupportedCacheError("vLLM registered no KV cache tensors")
    rows = block_rows(caches, num_blocks)
    if rows is not None:
        return PreparedCaches(
            {BLOCK_MAJOR_NAME: rows},
            CacheLayout(block_dim=0, head_major=False, name=name + BLOCK_MAJOR_SUFFIX),
        )
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    block_dim: int | None = None
    head_major = False
    for layer, t in caches.items():
        if t.data_ptr() in seen:
            # Layers that share one cache (KV sharing) are transferred once.
            continue
        seen.add(t.data_ptr())
        view, _ = physical_view(t)
        sizes = [int(s) for s in view.shape]
        if num_blocks not in sizes:
            raise UnsupportedCacheError(
                f"cannot find the block dimension ({num_blocks} blocks) in KV cache "
                f"{layer!r} of shape {tuple(t.shape)}"
            )
        bdim = sizes.index(num_blocks)
        if block_dim is None:
            block_dim = bdim
            inner = sizes[bdim + 1 :]
            # Heads outermost inside a block (HND) lets a reader take a head slice.
            if num_kv_heads in inner and block_size in inner and num_kv_heads != block_size:
                head_major = inner.index(num_kv_heads) < inner.index(block_size)
        elif bdim != block_dim:
            raise UnsupportedCacheError(f"KV cache {layer!r} has a different layout")
        tensors[layer] = view
    assert block_dim is not None
    return PreparedCaches(
        tensors, CacheLayout(block_dim=block_dim, head_major=head_major, name=name)
    )


def block_rows(caches: Mapping[str, torch.Tensor], num_blocks: int) -> torch.Tensor | None:
    """The block-major buffer behind `caches` as `(num_blocks, bytes per block)` bytes, or None
    when the layers' caches are not views into one block-outermost buffer: each view's outermost
    physical dimension indexes blocks with one common stride, the rest of it is dense, and the
    layers' pages lie side by side from the buffer's first byte, within that stride."""
    unique: dict[int, torch.Tensor] = {}
    for t in caches.values():
        unique.setdefault(t.data_ptr(), t)
    tensors = list(unique.values())
    if len(tensors) < 2:
        return None  # one layer: its per-layer view is already one row per block
    first = tensors[0]
    storage = first.untyped_storage()
    block_stride: int | None = None
    page: int | None = None
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.dtype != first.dtype:
            return None
        strides = [int(st) for st in t.stride()]
        order = sorted(range(t.dim()), key=lambda d: (-strides[d] if t.shape[d] > 1 else 0, d))
        view = t.permute(order)
        if int(view.shape[0]) != num_blocks or not view[0].is_contiguous():
            return None
        stride = int(view.stride(0)) * t.element_size()
        size = view[0].numel() * t.element_size()
        if (block_stride, page) not in ((None, None), (stride, size)):
            return None
        block_stride, page = stride, size
    assert block_stride is not None and page is not None
    base = min(t.data_ptr() for t in tensors)
    offsets = sorted(t.data_ptr() - base for t in tensors)
    if offsets != [i * page for i in range(len(tensors))] or len(tensors) * page > block_stride:
        return None
    start = base - storage.data_ptr()
    if start + num_blocks * block_stride > storage.nbytes():
        return None  # the last block's padding would lie past the buffer
    rows = torch.empty(0, dtype=torch.uint8, device=first.device)
    rows.set_(storage, start, (num_blocks, block_stride), (block_stride, 1))
    return rows
