"""Wire vocabulary of the connector: `kv_transfer_params` fields and side-channel messages.

Torch-free and nixl-free so the proxy can import it. Field names follow vLLM's NixlConnector
(so params round-trip through stock engines) plus kvrelay's optional extras (CONTRACTS §1).
Side-channel endpoints, headers and message models are CONTRACTS §2.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

CONNECTOR_VERSION = "kvrelay-connector-1"

# --- kv_transfer_params field names (CONTRACTS §1) -------------------------------------------
KV_TRANSFER_PARAMS = "kv_transfer_params"  # the request/response field that carries them
DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_REQUEST_ID = "remote_request_id"
REMOTE_HOST = "remote_host"
REMOTE_PORT = "remote_port"
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_NUM_TOKENS = "remote_num_tokens"
TP_SIZE = "tp_size"
REMOTE_BLOCKS_EXPIRY_TIME = "remote_blocks_expiry_time"
REMOTE_BLOCK_HASHES = "remote_block_hashes"
REMOTE_TAIL_HASH = "remote_tail_hash"
RELEASE_TOKEN = "release_token"
HOLD_BLOCKS = "hold_blocks"
REMOTE_URL = "remote_url"

# --- reuse report: what the engine's connector did for this request (CONTRACTS §1) ---------
# Added by the connector to the params an engine returns (P's answer; D's answer or its
# published finished params). Tokens are prompt tokens; blocks are the holder's offered blocks.
KVR_PROMPT_TOKENS = "kvr_prompt_tokens"
KVR_LOCAL_HIT_TOKENS = "kvr_local_hit_tokens"  # found in this engine's own prefix cache
KVR_LOADED_TOKENS = "kvr_loaded_tokens"  # read from the remote holder, arrived intact
KVR_OFFERED_BLOCKS = "kvr_offered_blocks"  # blocks the remote holder offered (0: none)
KVR_REFUSED_BLOCKS = "kvr_refused_blocks"  # {reason: blocks} offered but not loaded
# Reasons an offered block was not loaded.
REFUSED_HASH = "hash"  # at or after the first block whose hash differs from this prompt's
REFUSED_PARTIAL = "partial"  # an unverifiable partial tail block, or beyond this prompt
REFUSED_UNVERIFIED = "unverified"  # no hashes offered and hashes are required (or >1 group)
REFUSED_LOCAL = "local"  # already in this engine's prefix cache: nothing to load
REFUSED_THRESHOLD = "threshold"  # the load would be under kv_recompute_threshold
REFUSED_FAILED = "failed"  # the read failed, or no room for it: recomputed
# vLLM's own (0.32): set by vLLM's scheduler on params that carry `do_remote_prefill` when the
# request finished at its first output: the request's cached prompt tokens (local + external).
# A D given it reports it as its own `usage.prompt_tokens_details.cached_tokens`.
REMOTE_PREFILL_CACHED_TOKENS = "remote_prefill_cached_tokens"


@dataclass(frozen=True, slots=True)
class HoldRef:
    """Where one hold lives and what frees it: the holder's side channel, the request id the
    holder knows it by, and the release token it handed out.

    Values come from engines, so they are validated once, by `from_params`, and passed around
    as this type afterwards (`Releaser.release`, `KVEntry.hold_ref`).
    """

    host: str
    port: int
    request_id: str
    release_token: str

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> HoldRef | None:
        """The hold that engine-returned params describe, or None when they name no usable one
        (no release token, as from stock vLLM, or an implausible address or id)."""
        if not params:
            return None
        host, port = params.get(REMOTE_HOST), params.get(REMOTE_PORT)
        request_id, token = params.get(REMOTE_REQUEST_ID), params.get(RELEASE_TOKEN)
        if not (isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536):
            return None
        if not all(isinstance(v, str) and v for v in (host, request_id, token)):
            return None
        assert isinstance(host, str) and isinstance(request_id, str) and isinstance(token, str)
        return cls(host, port, request_id, token)


# --- side channel (CONTRACTS §2) --------------------------------------------------------------
HEADER_TIMESTAMP = "X-KVRelay-Timestamp"
HEADER_SIGNATURE = "X-KVRelay-Signature"
HEADER_NONCE = "X-KVRelay-Nonce"
HEADER_DESTINATION = "X-KVRelay-Destination"
SECRET_ENV = "KVRELAY_CONNECTOR_SECRET"
MAX_BODY_BYTES = 64 * 1024
MAX_CLOCK_SKEW_S = 60.0

PATH_HANDSHAKE = "/v1/handshake"
PATH_CLAIM = "/v1/claim"
PATH_RELEASE = "/v1/release"
PATH_FINISHED_PREFIX = "/v1/finished/"
PATH_FINISHED_BATCH = "/v1/finished"
# Ids per `POST /v1/finished`: bounds the answer (a long conversation's params run to hundreds
# of KB of block ids and hashes) well below what a reader accepts.
MAX_FINISHED_BATCH = 32


class KVTransferParams(BaseModel):
    """`kv_transfer_params` as engines exchange them; every field optional, unknown ones kept.

    `from_dict` never raises on foreign but well-typed extras (stock vLLM adds its own), and
    `to_dict` drops unset fields so stock engines see only what was given.
    """

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_block_ids: list[list[int]] | None = None
    remote_num_tokens: int | None = None
    tp_size: int = 1
    remote_blocks_expiry_time: float | None = None
    remote_block_hashes: list[str] | None = None
    remote_tail_hash: str | None = None
    release_token: str | None = None
    hold_blocks: bool = False
    remote_url: str | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> KVTransferParams | None:
        """Parse params (None stays None). Raises pydantic.ValidationError on wrong types."""
        if params is None:
            return None
        return cls.model_validate(params)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)

    @property
    def has_remote_blocks(self) -> bool:
        """True when these params point at blocks some holder keeps for us to read."""
        return bool(
            self.remote_engine_id
            and self.remote_request_id
            and self.remote_host
            and self.remote_port
            and self.remote_block_ids
            and any(self.remote_block_ids)
        )


class RankHandshake(BaseModel):
    """One worker rank's NIXL identity and cache geometry, as served by `/v1/handshake`."""

    agent_name: str
    agent_metadata_b64: str
    layout: dict[str, Any]


class HandshakeResponse(BaseModel):
    """`GET /v1/handshake`. `instance_id` changes whenever the holder restarts (additive)."""

    engine_id: str
    compat_hash: str
    tp_size: int
    ranks: dict[int, RankHandshake]
    instance_id: str = ""
    connector_version: str = CONNECTOR_VERSION


class ClaimRequest(BaseModel):
    """`POST /v1/claim`: confirm the blocks are still held and pin them for ONE reader request.

    The claim belongs to (`reader_engine_id`, `reader_request_id`): the same pair asking again
    (a retried call, another TP rank of the reader) gets the same claim; anyone else is refused.
    """

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=512)
    reader_engine_id: str = Field(min_length=1, max_length=512)
    reader_request_id: str = Field(min_length=1, max_length=512)


class ClaimResponse(BaseModel):
    """Answer to a claim: `held` with the pinned blocks, `gone` (HTTP 410) or `claimed` (409:
    another reader request holds the claim)."""

    status: Literal["held", "gone", "claimed"]
    block_ids: list[list[int]] = Field(default_factory=list)
    num_tokens: int = 0
    instance_id: str = ""
    # How long the claim pins the blocks (additive); a reader must finish well within it.
    pinned_for_s: float = 0.0


class FinishedBatchRequest(BaseModel):
    """`POST /v1/finished`: the published params of several finished requests in one call."""

    model_config = ConfigDict(extra="forbid")

    request_ids: list[str] = Field(min_length=1, max_length=MAX_FINISHED_BATCH)


class FinishedBatchResponse(BaseModel):
    """Answer to `POST /v1/finished`: params by request id, for the ids published now; the
    batch does not wait, so an id missing here may still be asked for alone (which waits)."""

    finished: dict[str, dict[str, Any]]


class ReleaseRequest(BaseModel):
    """`POST /v1/release`: free the blocks now; needs the hold's release token."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=512)
    release_token: str = Field(min_length=1, max_length=512)
    # Set by a reader giving up after its own claim: ends that claim's pin, frees at once.
    # Both must name the claim's owner; anything else is an ordinary (pin-respecting) release.
    reader_engine_id: str | None = Field(default=None, max_length=512)
    reader_request_id: str | None = Field(default=None, max_length=512)


class ReleaseResponse(BaseModel):
    """`released` is false when the hold was unknown or already freed."""

    released: bool


class ErrorResponse(BaseModel):
    """Body of every side-channel 4xx."""

    error: str
