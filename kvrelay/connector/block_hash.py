"""Chained block hashes of token ids (CONTRACTS §1). Torch-free.

h_{-1} = sha256(b"kvrelay-v1" || compat_hash); h_i = sha256(h_{i-1} || tokens of block i as
little-endian int64); each published as its first 16 hex chars. Only FULL blocks are hashed:
a partial block's KV cannot be matched by content and is never pulled on the strength of a hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_HEX_CHARS = 16


def block_hashes(token_ids: Sequence[int], block_size: int, compat_hash: str) -> list[str]:
    """One truncated hex hash per full block of `token_ids`."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    digest = hashlib.sha256(b"kvrelay-v1" + compat_hash.encode()).digest()
    out: list[str] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        # Chaining on the full digest (not the truncated one) keeps collisions independent.
        digest = hashlib.sha256(digest + struct.pack(f"<{block_size}q", *block)).digest()
        out.append(digest.hex()[:HASH_HEX_CHARS])
    return out


def matching_prefix_blocks(local: Sequence[str], remote: Sequence[str]) -> int:
    """How many leading blocks agree; the chain makes block i match only if all before did."""
    n = 0
    for a, b in zip(local, remote, strict=False):
        if a != b:
            break
        n += 1
    return n
