"""vLLM's KV cache events on the wire: the message shapes the proxy reads and enginesim writes.

vLLM started with `--kv-events-config` publishes on a ZMQ PUB socket one message per scheduler
step that changed its prefix cache, in three frames: the topic, an 8-byte big-endian sequence
number counting from 0, and a msgpack `KVEventBatch`: `[ts, [event, ...], data_parallel_rank]`,
each event a map tagged `type` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), as
`vllm/distributed/kv_events.py` defines them (msgspec structs; these decode its messages and
encode the same ones). Fields a reader here does not use are still listed so that enginesim's
messages carry what vLLM's do; unknown fields in vLLM's are ignored, so newer engines decode.

Needs `msgspec` (the `kv-events` extra): imported only where events are on.
"""

from __future__ import annotations

from typing import Any

import msgspec

GPU_MEDIUM = "GPU"


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    """Blocks an engine just cached: their hashes, the hash of the block before the first
    (None: they start the prompt), their tokens, and per block the extra keys its hash covered
    (the request's `cache_salt` on the first block, a LoRA name, image digests)."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    """Blocks an engine evicted from its cache."""

    block_hashes: list[bytes | int]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    """The engine emptied its prefix cache (a reset)."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """One message's payload: the events of one scheduler step, stamped with wall time."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
ENCODER = msgspec.msgpack.Encoder()
DecodeError = msgspec.DecodeError


def frames(topic: bytes, seq: int, batch: KVEventBatch) -> tuple[bytes, bytes, bytes]:
    """One message as a publisher sends it."""
    return topic, seq.to_bytes(8, "big", signed=True), ENCODER.encode(batch)
