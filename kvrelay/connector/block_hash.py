"""Chained block hashes of token ids (CONTRACTS §1). Torch-free.

h_{-1} = sha256(b"kvrelay-v1" || compat_hash [|| b"\nlora:" || adapter name] [|| b"\nsalt:" ||
cache salt]); h_i = sha256(h_{i-1} || tokens of block i as little-endian int64); each published as
its first 16 hex chars. The LoRA adapter a request ran with changes its KV, so it seeds the chain:
blocks computed under one adapter (or none) never match a prompt run under another. So does the
request's `cache_salt` (vLLM's per-tenant cache isolation, which seeds vLLM's own block hashes
the same way): blocks held for one salt never verify for a prompt under another, so a reader
can pull only KV its own tenant's requests computed. Only FULL blocks are hashed:
a partial block's KV cannot be matched by content and is never pulled on the strength of a hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable, Sequence

HASH_HEX_CHARS = 16


def _chain(
    token_ids: Sequence[int],
    block_size: int,
    compat_hash: str,
    lora_name: str | None,
    cache_salt: str | None,
) -> tuple[list[str], bytes]:
    """(truncated hashes of the full blocks, full digest after the last full block)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    seed = b"kvrelay-v1" + compat_hash.encode()
    if lora_name:
        seed += b"\nlora:" + lora_name.encode()
    if cache_salt:
        seed += b"\nsalt:" + cache_salt.encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(seed).digest()
    out: list[str] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        # Chaining on the full digest (not the truncated one) keeps collisions independent.
        digest = hashlib.sha256(digest + struct.pack(f"<{block_size}q", *block)).digest()
        out.append(digest.hex()[:HASH_HEX_CHARS])
    return out, digest


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    compat_hash: str,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[str]:
    """One truncated hex hash per full block of `token_ids` (computed under `lora_name` and
    `cache_salt`)."""
    return _chain(token_ids, block_size, compat_hash, lora_name, cache_salt)[0]


def tail_hash(
    token_ids: Sequence[int],
    block_size: int,
    compat_hash: str,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> str | None:
    """Hash of the partial last block (chained after the full ones); None when there is none.

    Lets a reader verify the holder's partial tail block token by token before pulling it.
    """
    _, digest = _chain(token_ids, block_size, compat_hash, lora_name, cache_salt)
    tail = token_ids[len(token_ids) - len(token_ids) % block_size :]
    if not tail:
        return None
    packed = struct.pack(f"<{len(tail)}q", *tail)
    return hashlib.sha256(digest + b"tail" + packed).hexdigest()[:HASH_HEX_CHARS]


def matching_prefix_blocks(local: Sequence[Hashable], remote: Sequence[Hashable]) -> int:
    """How many leading blocks agree; the chain makes block i match only if all before did."""
    n = 0
    for a, b in zip(local, remote, strict=False):
        if a != b:
            break
        n += 1
    return n
