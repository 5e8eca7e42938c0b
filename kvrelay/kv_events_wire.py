"""vLLM's KV cache events on the wire: the message shapes the proxy reads and enginesim writes.

vLLM started with `--kv-events-config` publishes on a ZMQ PUB socket one message per scheduler
step that changed its prefix cache, in three frames: the topic, an 8-byte big-endian sequence
number counting from 0, and a msgpack `KVEventBatch`: `[ts, [event, ...], data_parallel_rank]`,
each event a map tagged `type` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), as
`vllm/distributed/kv_events.py` defines them (msgspec structs; these decode its messages and
encode the same ones). Fields a reader here does not use are still listed so that enginesim's
messages carry what vLLM's do; unknown fields in vLLM's are ignored, so newer engines decode.

With a `replay_endpoint` the engine also answers replay requests on a ZMQ ROUTER socket: a
subscriber's DEALER sends `[b"", first seq]` (8 bytes, big-endian) and receives each batch it
still keeps from there as `[b"", topic, seq, payload]`, then the end mark `[b"", b"", -1,
b""]` (vLLM 0.32's `ZmqEventPublisher._service_replay`; earlier vLLM sent no topic frame,
which `replayed_batch` reads too).

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


# The sequence number that ends a replay's answer.
REPLAY_END = -1


def replay_request(first: int) -> list[bytes]:
    """What a subscriber's DEALER sends to ask for every kept batch from `first` on."""
    return [b"", first.to_bytes(8, "big")]


def replay_answer(topic: bytes, seq: int, payload: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    """One frame set of a replay's answer as the ROUTER sends it, less the client's identity
    (`seq` `REPLAY_END` with an empty topic and payload: the end mark)."""
    return b"", topic, seq.to_bytes(8, "big", signed=True), payload


def replayed_batch(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one frame set a DEALER received in a replay's answer (seq
    `REPLAY_END`: the end), None for one of another shape."""
    if len(frames) == 4:  # vLLM 0.32: [b"", topic, seq, payload]
        return int.from_bytes(frames[2], "big", signed=True), frames[3]
    if len(frames) == 3:  # earlier vLLM: [b"", seq, payload]
        return int.from_bytes(frames[1], "big", signed=True), frames[2]
    return None
