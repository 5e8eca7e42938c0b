"""The paged KV block pool: per-layer CPU tensors plus a free list.

Layouts (per layer tensor):
- ``kv_first`` (K/V split first, vLLM's FlashAttention shape):
  ``[2, blocks, block_size, heads, head]``
- ``blocks_first``: ``[blocks, 2, block_size, heads, head]``

The engine reads and writes canonical ``[N, layers, 2, heads, head]`` arrays of raw bit
patterns through numpy views of the same memory (cheap per token, any dtype), so the model's
results do not depend on the layout or the block size; NIXL moves the torch tensors' bytes.

The prefix cache lives in the pool, as vLLM's does (its `BlockPool` with
`enable_prefix_caching`): a full block whose KV is computed (or loaded intact) is registered
under its cache key, and stays findable while it is in use *and* after it is freed, until an
allocation takes it. Blocks are reference-counted: a request that hits cached blocks shares
them (no copy); a freed block goes to the end of the free queue and allocation takes from the
front, so the least recently freed cached block is evicted first. A held block (the connector
keeps it for a remote reader or a later turn) is not free, so it is never evicted, and a
request that hits it shares it. Free blocks, cached or not, are what `num_free` counts (vLLM
counts them alike): caching costs the pool nothing until the blocks are wanted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from enum import StrEnum
from typing import Any

import numpy as np
import torch

from kvrelay.enginesim.model import ModelGeometry
from kvrelay.enginesim.residency import BlockResidency


class KVLayout(StrEnum):
    """Memory layout of each layer's KV tensor."""

    KV_FIRST = "kv_first"
    BLOCKS_FIRST = "blocks_first"


class BlockPoolError(RuntimeError):
    """An engine bug: freeing a free block, or an unknown block id."""


class BlockPool:
    """Fixed-size pool of KV blocks with the prefix cache in it (see the module docstring);
    allocation is all-or-nothing, freed blocks go last."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        geometry: ModelGeometry,
        layout: KVLayout = KVLayout.KV_FIRST,
        prefix_caching: bool = False,
    ) -> None:
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
        # Free blocks in eviction order (front first); an OrderedDict so that a cached free
        # block a request hits leaves the queue in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self.prefix_caching = prefix_caching
        self._key_of: list[Hashable | None] = [None] * num_blocks
        self._cached: dict[Hashable, int] = {}  # cache key -> the block holding it
        self.evictions = 0  # cached blocks an allocation took (their KV lost)
        # The keys of evicted blocks, for KV cache events (None: nobody follows them); the
        # engine hands its own list of changes here, so evictions and stores keep their order.
        self.evicted_keys: list[Hashable] | None = None
        # vLLM's residency metrics (`--kv-cache-metrics`); None: not kept.
        self.residency: BlockResidency | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks findable in the prefix cache (in use or free)."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` positions."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """`n` free blocks, or None (nothing taken) when fewer are free. A cached block taken
        is evicted from the prefix cache."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            key = self._key_of[block]
            if key is not None:
                del self._cached[key]
                self._key_of[block] = None
                self.evictions += 1
                if self.evicted_keys is not None:
                    self.evicted_keys.append(key)
            self._refs[block] = 1
            if self.residency is not None:
                self.residency.allocated(block)
            out.append(block)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """One reference fewer on each block; a block nobody uses any more goes to the end of
        the free queue (still cached if it was), the request's last block first: a request's
        tail is evicted before its head, whose prefix more requests share."""
        for block in reversed(block_ids):
            if not 0 <= block < self.num_blocks:
                raise BlockPoolError(f"unknown block id {block}")
            if self._refs[block] <= 0:
                raise BlockPoolError(f"block {block} freed twice")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    # ----- the prefix cache -------------------------------------------------------------------
    def cached_prefix(self, keys: Iterable[Hashable]) -> list[int]:
        """The blocks holding the leading run of `keys` (one key per full block), in order."""
        if not self.prefix_caching:
            return []
        out: list[int] = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def free_among(self, block_ids: Sequence[int]) -> int:
        """How many of `block_ids` are free now (a hit on them takes them out of the queue)."""
        return sum(1 for b in block_ids if self._refs[b] == 0)

    def share(self, block_ids: Sequence[int]) -> None:
        """A request takes a reference on cached blocks it hit (a free one leaves the queue)."""
        for block in block_ids:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
            if self.residency is not None:
                self.residency.hit(block)

    def cache(self, block: int, key: Hashable) -> bool:
        """Register a full block whose KV is final under `key` (a block already cached under
        another key, or a key another block holds, stays as it is: the first one wins); True
        when `key` is newly cached."""
        if not self.prefix_caching or self._key_of[block] is not None or key in self._cached:
            return False
        self._key_of[block] = key
        self._cached[key] = block
        return True

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def _slots(
        self, block_ids: Sequence[int], start: int, end: int
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        bs = self.block_size
        first = start // bs
        pos = np.arange(start - first * bs, end - first * bs)
        # Only the blocks the positions fall in: a decode step touches one or two of a
        # request's blocks, and converting its whole table every token cost more than the rest.
        table = np.asarray(block_ids[first : -(-end // bs)], dtype=np.int64)
        return table[pos // bs], pos % bs

    def write(self, block_ids: Sequence[int], start: int, kv: np.ndarray[Any, Any]) -> None:
        """Store canonical KV ``[N, layers, 2, heads, head]`` at positions start..start+N-1."""
        if kv.shape[0] == 1:  # a decode step's one position: plain indexing, no index arrays
            block, offset = block_ids[start // self.block_size], start % self.block_size
            for layer, cache in enumerate(self._layers):
                if self.layout is KVLayout.KV_FIRST:
                    cache[:, block, offset] = kv[0, layer]
                else:
                    cache[block, :, offset] = kv[0, layer]
            return
        blocks, offsets = self._slots(block_ids, start, start + kv.shape[0])
        for layer, cache in enumerate(self._layers):
            values = kv[:, layer]  # [N, 2, heads, head]
            if self.layout is KVLayout.KV_FIRST:
                cache[:, blocks, offsets] = values.transpose(1, 0, 2, 3)
            else:
                cache[blocks, :, offsets] = values

    def read(self, block_ids: Sequence[int], start: int, end: int) -> np.ndarray[Any, Any]:
        """Canonical KV of positions start..end-1 as stored in the pool."""
        bs = self.block_size
        per_layer = []
        if start // bs == (end - 1) // bs:
            # Within one block (a decode step's window, mostly): slices, no index arrays.
            block, lo = block_ids[start // bs], start % bs
            hi = lo + end - start
            for cache in self._layers:
                if self.layout is KVLayout.KV_FIRST:
                    per_layer.append(cache[:, block, lo:hi].transpose(1, 0, 2, 3))
                else:
                    per_layer.append(cache[block, :, lo:hi].transpose(1, 0, 2, 3))
        else:
            blocks, offsets = self._slots(block_ids, start, end)
            for cache in self._layers:
                if self.layout is KVLayout.KV_FIRST:
                    per_layer.append(cache[:, blocks, offsets].transpose(1, 0, 2, 3))
                else:
                    per_layer.append(cache[blocks, :, offsets])
        if len(per_layer) == 1:
            return per_layer[0][:, None]
        return np.stack(per_layer, axis=1)

    def corrupt(self, block_id: int) -> None:
        """Flip bits in one block (tests prove the output depends on KV)."""
        for cache in self._layers:
            target = cache[:, block_id] if self.layout is KVLayout.KV_FIRST else cache[block_id]
            target ^= 0x5A5A
