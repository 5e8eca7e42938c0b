"""`PrefixCache`: the engine's local prefix cache (vLLM's automatic prefix caching, simplified).

Full blocks of every finished or preempted request are remembered by the prefix hash of their
last position (which covers every token before it) and the request's `cache_salt` (vLLM seeds
its block hashes with it: requests of different salts never share a block), least recently used
first out once
`capacity` blocks are kept. A new request whose prompt starts with remembered blocks (or a
preempted one resumed) gets their KV copied into its own blocks and computes only the rest. It
lives beside the block pool instead of sharing its blocks (no reference counts to get wrong); a
hit costs a copy, which the simulated clock ignores, as a real engine's hit costs nothing.

This is what P affinity relies on (turn N+1's P finds turn N's prompt here and pulls from D only
the blocks beyond it) and what conditional disaggregation relies on (the D that served turn N
finds the whole history here and prefills only the new message).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvrelay.enginesim.kvpool import BlockPool


class PrefixCache:
    """KV of full blocks by prefix hash, bounded to `capacity` blocks (0: disabled)."""

    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self._blocks: OrderedDict[tuple[str | None, int], np.ndarray[Any, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def _key(self, hashes: Sequence[int], block: int, salt: str | None) -> tuple[str | None, int]:
        return salt, hashes[(block + 1) * self.block_size - 1]

    def hit_tokens(
        self, hashes: Sequence[int], num_prompt_tokens: int, salt: str | None = None
    ) -> int:
        """Prompt tokens at the start found here under `salt`, in whole blocks; the last
        prompt token is always left to compute (its logits), as vLLM does."""
        if not self.capacity:
            return 0
        usable = (num_prompt_tokens - 1) // self.block_size
        hit = 0
        while hit < usable and self._key(hashes, hit, salt) in self._blocks:
            hit += 1
        return hit * self.block_size

    def load(
        self, pool: BlockPool, block_ids: Sequence[int], hashes: Sequence[int], n: int,
        salt: str | None = None,
    ) -> None:  # fmt: skip
        """Copy the first `n` tokens' KV (whole blocks, found by `hit_tokens`) into `block_ids`."""
        bs = self.block_size
        for block in range(n // bs):
            key = self._key(hashes, block, salt)
            kv = self._blocks[key]
            self._blocks.move_to_end(key)
            pool.write(block_ids, block * bs, kv)

    def store(
        self, pool: BlockPool, block_ids: Sequence[int], hashes: Sequence[int],
        salt: str | None = None,
    ) -> None:  # fmt: skip
        """Remember every full block of a request whose KV is written at the positions `hashes`
        covers (a finished request's, or a preempted one's computed part), under its `salt`,
        newest last in LRU order."""
        if not self.capacity:
            return
        bs = self.block_size
        full = min(len(hashes), len(block_ids) * bs) // bs
        for block in range(full):
            key = self._key(hashes, block, salt)
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            self._blocks[key] = pool.read(block_ids, block * bs, (block + 1) * bs)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
