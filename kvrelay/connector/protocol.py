"""Wire vocabulary of the connector: `kv_transfer_params` fields and side-channel messages.

Torch-free and nixl-free so the proxy can import it. Field names follow vLLM's NixlConnector
(so params round-trip through stock engines) plus kvrelay's optional extras (CONTRACTS §1).
Side-channel endpoints, headers and message models are CONTRACTS §2.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

CONNECTOR_VERSION = "kvrelay-connector-1"

# --- kv_transfer_params field names (CONTRACTS §1) -------------------------------------------
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
RELEASE_TOKEN = "release_token"
HOLD_BLOCKS = "hold_blocks"
REMOTE_URL = "remote_url"

# --- side channel (CONTRACTS §2) --------------------------------------------------------------
HEADER_TIMESTAMP = "X-KVRelay-Timestamp"
HEADER_SIGNATURE = "X-KVRelay-Signature"
SECRET_ENV = "KVRELAY_CONNECTOR_SECRET"
MAX_BODY_BYTES = 64 * 1024
MAX_CLOCK_SKEW_S = 60.0

PATH_HANDSHAKE = "/v1/handshake"
PATH_CLAIM = "/v1/claim"
PATH_RELEASE = "/v1/release"
PATH_FINISHED_PREFIX = "/v1/finished/"


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
    """`POST /v1/claim`: confirm the blocks are still held and pin them for the read."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=512)
    reader_engine_id: str = Field(min_length=1, max_length=512)


class ClaimResponse(BaseModel):
    """Answer to a claim: `held` with the pinned blocks, or `gone` (HTTP 410)."""

    status: Literal["held", "gone"]
    block_ids: list[list[int]] = Field(default_factory=list)
    num_tokens: int = 0
    instance_id: str = ""
    # How long the claim pins the blocks (additive); a reader must finish well within it.
    pinned_for_s: float = 0.0


class ReleaseRequest(BaseModel):
    """`POST /v1/release`: free the blocks now; needs the hold's release token."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=512)
    release_token: str = Field(min_length=1, max_length=512)
    # Set by a reader giving up after its own claim: ends that claim's pin, frees at once.
    reader_engine_id: str | None = Field(default=None, max_length=512)


class ReleaseResponse(BaseModel):
    """`released` is false when the hold was unknown or already freed."""

    released: bool


class ErrorResponse(BaseModel):
    """Body of every side-channel 4xx."""

    error: str
