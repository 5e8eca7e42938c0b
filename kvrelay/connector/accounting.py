"""`ReuseReport`: what the connector did for one request, returned in the params it hands back.

One per request, kept by `ConnectorScheduler` from the first admission attempt to
`request_finished`, which adds it to the params the engine returns (CONTRACTS §1, "reuse
report"). Every figure is the engine's own or the connector's own: the local prefix hit is the
one the engine told the connector at admission (vLLM: its block-aligned local hit), loaded
tokens are those whose read completed intact. Nothing here is derived from what a proxy sent.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvrelay.connector.protocol import (
    KVR_LOADED_TOKENS,
    KVR_LOCAL_HIT_TOKENS,
    KVR_OFFERED_BLOCKS,
    KVR_PROMPT_TOKENS,
    KVR_REFUSED_BLOCKS,
)


@dataclass
class ReuseReport:
    """Per-request reuse accounting (see module docstring)."""

    prompt_tokens: int
    local_hit_tokens: int = 0
    loaded_tokens: int = 0
    # Blocks the remote holder offered (len of its one group of block ids; 0 when none).
    offered_blocks: int = 0
    # Offered blocks not loaded, by reason (`REFUSED_*` in protocol.py).
    refused: Counter[str] = field(default_factory=Counter)
    # Blocks of the offer verified as this prompt's (before the local hit and the plan).
    verified_blocks: int = 0
    # Set at the first allocation: the local hit then is the one the prefill used (a retry
    # after preemption does not change what the first prefill reused, as in vLLM's stats).
    admitted: bool = False

    def to_params(self) -> dict[str, Any]:
        return {
            KVR_PROMPT_TOKENS: self.prompt_tokens,
            KVR_LOCAL_HIT_TOKENS: self.local_hit_tokens,
            KVR_LOADED_TOKENS: self.loaded_tokens,
            KVR_OFFERED_BLOCKS: self.offered_blocks,
            KVR_REFUSED_BLOCKS: {k: v for k, v in sorted(self.refused.items()) if v > 0},
        }
