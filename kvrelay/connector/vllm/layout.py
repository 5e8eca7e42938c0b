"""Turn vLLM's per-layer KV cache tensors into what the core registers: contiguous tensors and
a `CacheLayout` (which dimension indexes blocks, whether heads are outermost inside a block).

vLLM backends allocate a physical buffer and may hand out a permuted view of it (for example an
HND stride order under an NHD shape), so the logical shape says little about memory order. We
sort dimensions by stride to recover the physical (contiguous) view, then find the block
dimension by its size. Torch only; no vLLM import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvrelay.connector.errors import ConnectorError, ConnectorErrorKind
from kvrelay.connector.layout import CacheLayout


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
    """Physical views of `caches` (layer order kept) plus the `CacheLayout` they share."""
    if not caches:
        raise UnsupportedCacheError("vLLM registered no KV cache tensors")
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
