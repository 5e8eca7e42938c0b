"""The deterministic "model": KV depends on the whole prefix, tokens depend on the KV read back.

- Each position i gets a 64-bit prefix hash ``h_i = mix(h_{i-1}, token_i)`` (``h_{-1}`` from
  the model name), expanded into that position's K and V vectors for every layer and head.
- After prefill the request's state is a digest of *all* prompt KV as read back from the
  block pool; each decode step folds in the last few positions read back again. The next
  token is chosen from that digest.

So output computed from KV transferred over NIXL equals output computed locally, and a single
wrong or stale block anywhere in the visible KV changes the answer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
# Positions folded into the digest again at each decode step (a window of recent KV).
DECODE_WINDOW = 4

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


@dataclass(frozen=True)
class ModelGeometry:
    """Shape of one token's KV: layers x (K, V) x KV heads x head size, in `dtype`."""

    num_layers: int = 2
    num_kv_heads: int = 2
    head_size: int = 16
    dtype: str = "float16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def storage_dtype(self) -> type[np.signedinteger[Any]]:
        """Integer type of the same width: the pool is read and written as raw bit patterns."""
        return np.int32 if self.dtype == "float32" else np.int16

    @property
    def storage_torch_dtype(self) -> torch.dtype:
        return torch.int32 if self.dtype == "float32" else torch.int16

    @property
    def values_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_size


class SimModel:
    """Deterministic KV and next-token functions; stateless apart from its constants."""

    def __init__(
        self,
        name: str,
        geometry: ModelGeometry,
        output_vocab: Sequence[int],
        eos_id: int,
        eos_period: int = 64,
    ) -> None:
        self.name = name
        self.geometry = geometry
        self.output_vocab = list(output_vocab)
        self.eos_id = eos_id
        self.eos_period = eos_period
        self.seed_hash = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
        self._lane = np.arange(geometry.values_per_token, dtype=np.uint64) * np.uint64(_GOLDEN)

    def prefix_hashes(self, tokens: Sequence[int], start: int, previous: int | None) -> list[int]:
        """Prefix hashes of ``tokens[start:]`` given the hash at ``start - 1`` (None: start)."""
        h = self.seed_hash if previous is None else previous
        out: list[int] = []
        append = out.append
        # splitmix64's finaliser over (previous hash xor token): every bit of the prefix
        # matters. Inline, not a function: a prompt hashes every token, and a call per token
        # cost as much as the mixing.
        for token in tokens[start:]:
            x = (h ^ ((token + _GOLDEN) & _MASK)) & _MASK
            x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
            h = x ^ (x >> 31)
            append(h)
        return out

    def kv_for(self, hashes: Sequence[int]) -> np.ndarray[Any, Any]:
        """KV of positions with these prefix hashes: ``[N, layers, 2, heads, head_size]``,
        as the raw bit patterns of `dtype` (numpy has no bfloat16; bits are exact anyway)."""
        g = self.geometry
        x = np.asarray(hashes, dtype=np.uint64)[:, None] ^ self._lane[None, :]
        # Vectorised splitmix64 (uint64 arithmetic wraps, as intended).
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
        values = (x >> np.uint64(40)).astype(np.float32) / np.float32(1 << 23) - np.float32(1.0)
        if g.dtype == "float16":
            bits = values.astype(np.float16).view(np.int16)
        elif g.dtype == "bfloat16":
            bits = (values.view(np.uint32) >> np.uint32(16)).astype(np.uint16).view(np.int16)
        else:
            bits = values.view(np.int32)
        shaped: np.ndarray[Any, Any] = bits.reshape(
            len(hashes), g.num_layers, 2, g.num_kv_heads, g.head_size
        )
        return shaped

    @staticmethod
    def kv_bytes(kv: np.ndarray[Any, Any]) -> bytes:
        """Raw bytes of KV in canonical layout."""
        return np.ascontiguousarray(kv).tobytes()

    def prompt_digest(self, prompt_kv: np.ndarray[Any, Any]) -> bytes:
        """The request state after prefill: a digest of every prompt position's KV."""
        h = hashlib.blake2b(digest_size=16, person=b"kvrelay-sim")
        h.update(self.kv_bytes(prompt_kv))
        return h.digest()

    def step_digest(self, previous: bytes, window_kv: np.ndarray[Any, Any]) -> bytes:
        """The state after one decode step: the previous state plus recent KV read back."""
        h = hashlib.blake2b(previous, digest_size=16)
        h.update(self.kv_bytes(window_kv))
        return h.digest()

    def choose(self, digest: bytes, num_generated: int, min_tokens: int, ignore_eos: bool) -> int:
        """Greedy next token from the state (temperature has no effect: deterministic)."""
        value = int.from_bytes(digest[:8], "little")
        if (
            self.eos_period > 0
            and not ignore_eos
            and num_generated >= min_tokens
            and (value >> 40) % self.eos_period == 0
        ):
            return self.eos_id
        return self.output_vocab[value % len(self.output_vocab)]
