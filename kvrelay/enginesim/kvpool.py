"""The paged KV block pool: per-layer CPU tensors plus a free list.

Layouts (per layer tensor):
- ``kv_first`` (K/V split first, vLLM's FlashAttention shape):
  ``[2, blocks, block_size, heads, head]``
- ``blocks_first``: ``[blocks, 2, block_size, heads, head]``

The engine reads and writes canonical ``[N, layers, 2, heads, head]`` arrays of raw bit
patterns through numpy views of the same memory (cheap per token, any dtype), so the model's
results do not depend on the layout or the block size; NIXL moves the torch tensors' bytes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

import numpy as np
import torch

from kvrelay.enginesim.model import ModelGeometry


class KVLayout(StrEnum):
    """Memory layout of each layer's KV tensor."""

    KV_FIRST = "kv_first"
    BLOCKS_FIRST = "blocks_first"


class BlockPoolError(RuntimeError):
    """An engine bug: freeing a free block, or an unknown block id."""


class BlockPool:
    """Fixed-size pool of KV blocks; allocation is all-or-nothing, freed blocks go last."""

    def __init__(
        self, num_blocks: int, block_size: int, geometry: ModelGeometry,
        layout: KVLayout = KVLayout.KV_FIRST,
    ) -> None:  # fmt: skip
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.geometry = geometry
        self.layout = layout
        g = geometry
        if layout is KVLayout.KV_FIRST:
            shape = (2, num_blocks, block_size, g.num_kv_heads, g.head_size)
        else:
            shape = (num_blocks, 2, block_size, g.num_kv_heads, g.head_size)
        self.caches: dict[str, torch.Tensor] = {
            f"model.layers.{i}.self_attn": torch.zeros(shape, dtype=g.torch_dtype)
            for i in range(g.num_layers)
        }
        # Integer views sharing the tensors' memory: what the engine reads and writes.
        self._layers = [t.view(g.storage_torch_dtype).numpy() for t in self.caches.values()]
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` positions."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """`n` free blocks, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for block in out:
            self._is_free[block] = False
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        for block in block_ids:
            if not 0 <= block < self.num_blocks:
                raise BlockPoolError(f"unknown block id {block}")
            if self._is_free[block]:
                raise BlockPoolError(f"block {block} freed twice")
            self._is_free[block] = True
            self._free.append(block)

    def _slots(
        self, block_ids: Sequence[int], start: int, end: int
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        pos = np.arange(start, end)
        table = np.asarray(block_ids, dtype=np.int64)
        return table[pos // self.block_size], pos % self.block_size

    def write(self, block_ids: Sequence[int], start: int, kv: np.ndarray[Any, Any]) -> None:
        """Store canonical KV ``[N, layers, 2, heads, head]`` at positions start..start+N-1."""
        blocks, offsets = self._slots(block_ids, start, start + kv.shape[0])
        for layer, cache in enumerate(self._layers):
            values = kv[:, layer]  # [N, 2, heads, head]
            if self.layout is KVLayout.KV_FIRST:
                cache[:, blocks, offsets] = values.transpose(1, 0, 2, 3)
            else:
                cache[blocks, :, offsets] = values

    def read(self, block_ids: Sequence[int], start: int, end: int) -> np.ndarray[Any, Any]:
        """Canonical KV of positions start..end-1 as stored in the pool."""
        blocks, offsets = self._slots(block_ids, start, end)
        per_layer = []
        for cache in self._layers:
            if self.layout is KVLayout.KV_FIRST:
                per_layer.append(cache[:, blocks, offsets].transpose(1, 0, 2, 3))
            else:
                per_layer.append(cache[blocks, :, offsets])
        return np.stack(per_layer, axis=1)

    def corrupt(self, block_id: int) -> None:
        """Flip bits in one block (tests prove the output depends on KV)."""
        for cache in self._layers:
            target = cache[:, block_id] if self.layout is KVLayout.KV_FIRST else cache[block_id]
            target ^= 0x5A5A
