"""Wire vocabulary of the connector: `kv_transfer_params` fields and side-channel messages.

Torch-free and nixl-free so the proxy can import it. Field names follow vLLM's NixlConnector
(so params round-trip through stock engines) plus kvrelay's optional extras (CONTRACTS §1).
Side-channel endpoints, headers and message models are CONTRACTS §2.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    Strict,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)

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
# Whose hold it is (the proxy's tenant id): the holder shares its hold budget fairly by owner.
HOLD_OWNER = "hold_owner"
# Asked by the proxy with `hold_blocks` where the conversation's next turn is expected within
# seconds (an agent's loop answering at once): a hold over `hold_max_fraction` of the pool is
# then kept for `hold_brief_lease_s` instead of declined, up to `hold_brief_max_fraction`.
HOLD_BRIEF = "hold_brief"
# Set by a holder on the params of a turn it was asked to hold and did not: the turn alone is
# over its `hold_max_fraction` of the pool (its blocks stay in the prefix cache, unpinned).
HOLD_DECLINED = "hold_declined"
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
REFUSED_REASONS = frozenset(
    {
        REFUSED_HASH,
        REFUSED_PARTIAL,
        REFUSED_UNVERIFIED,
        REFUSED_LOCAL,
        REFUSED_THRESHOLD,
        REFUSED_FAILED,
    }
)
# vLLM's own (0.32): set by vLLM's scheduler on params that carry `do_remote_prefill` when the
# request finished at its first output: the request's cached prompt tokens (local + external).
# A D given it reports it as its own `usage.prompt_tokens_details.cached_tokens`.
REMOTE_PREFILL_CACHED_TOKENS = "remote_prefill_cached_tokens"


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


_INT_ONLY = {int}
_STR_ONLY = {str}
_SEQUENCES = (list, tuple)  # JSON gives lists; Python callers (engines in-process) tuples


def _ints(values: object) -> list[int]:
    """A list or tuple of integers (no bools, no floats) as a new list; checked in C (`map`,
    `set`) rather than item by item: a long prompt's params list hundreds of block ids."""
    if not isinstance(values, _SEQUENCES) or (values and set(map(type, values)) != _INT_ONLY):
        raise ValueError("must be a list of integers")
    return list(values)


def _block_id_groups(value: object) -> list[list[int]]:
    """`remote_block_ids` given as tuples: one list of block ids per KV-cache group."""
    if not isinstance(value, _SEQUENCES):
        raise ValueError("remote_block_ids must be a list of lists of integers")
    return [_ints(group) for group in value]


def _strs(value: object) -> list[str]:
    """`remote_block_hashes` given as a tuple: a list of strings, checked as `_ints` is."""
    if not isinstance(value, _SEQUENCES) or (value and set(map(type, value)) != _STR_ONLY):
        raise ValueError("must be a list of strings")
    return list(value)


# The lists engines send are checked and copied by pydantic's compiled strict list validators:
# no call back into Python, which is what makes them cheaper than `_ints` on every turn. Those
# refuse tuples, so a tuple (an engine in the same process) falls through, left to right, to
# the Python check, which takes lists and tuples and nothing else (no sets, no generators).
_StrictIds = Annotated[list[Annotated[list[StrictInt], Strict()]], Strict()]
_StrictStrs = Annotated[list[StrictStr], Strict()]
_BlockIds = _StrictIds | Annotated[list[list[int]], PlainValidator(_block_id_groups)] | None
_Hashes = _StrictStrs | Annotated[list[str], PlainValidator(_strs)] | None


class KVTransferParams(BaseModel):
    """`kv_transfer_params` as engines exchange them: the one type for them in kvrelay.

    Parsed once where they enter (`from_wire`: an engine's answer reaching the proxy, vLLM
    handing a request's params to the connector) and passed around as this type; `to_wire`
    gives them back as sent. Every field is optional; unknown ones (stock vLLM adds its own)
    are kept and forwarded. Scalars are strict (no "41" for 41, no true for 1): params come
    from engines over the network and go back out to engines. Lists are copied, so a parsed
    value shares nothing with what it was parsed from.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    do_remote_decode: StrictBool = False
    do_remote_prefill: StrictBool = False
    remote_engine_id: StrictStr | None = None
    remote_request_id: StrictStr | None = None
    remote_host: StrictStr | None = None
    remote_port: StrictInt | None = None
    remote_block_ids: _BlockIds = Field(default=None, union_mode="left_to_right")
    remote_num_tokens: StrictInt | None = None
    tp_size: StrictInt | None = None  # None: 1
    remote_blocks_expiry_time: StrictFloat | None = None
    remote_block_hashes: _Hashes = Field(default=None, union_mode="left_to_right")
    remote_tail_hash: StrictStr | None = None
    release_token: StrictStr | None = None
    hold_blocks: StrictBool = False
    hold_owner: StrictStr | None = None
    hold_brief: StrictBool = False
    hold_declined: StrictBool = False
    remote_url: StrictStr | None = None
    remote_prefill_cached_tokens: StrictInt | None = None
    # The connector's reuse report (ACCOUNTING.md).
    kvr_prompt_tokens: StrictInt | None = None
    kvr_local_hit_tokens: StrictInt | None = None
    kvr_loaded_tokens: StrictInt | None = None
    kvr_offered_blocks: StrictInt | None = None
    kvr_refused_blocks: dict[StrictStr, StrictInt] | None = None

    @classmethod
    def from_wire(cls, params: object) -> KVTransferParams | None:
        """Parse params as they came over the wire (None stays None; parsed ones are returned
        as they are). Raises `ValueError` (pydantic's `ValidationError`) on a wrong type."""
        if params is None or isinstance(params, KVTransferParams):
            return params
        if type(params) is not dict and not isinstance(params, Mapping):  # dict: no ABC check
            raise ValueError("kv_transfer_params must be an object")
        return cls.model_validate(params)

    @classmethod
    def from_wire_or_none(cls, params: object) -> KVTransferParams | None:
        """`from_wire`, with params that do not parse taken as none: an engine's answer."""
        if params is None or isinstance(params, KVTransferParams):
            return params
        if type(params) is not dict and not isinstance(params, Mapping):
            return None
        try:
            return cls.model_validate(params)
        except ValueError:
            return None

    def to_wire(self) -> dict[str, Any]:
        """The params as given (fields never set stay out, so stock engines see only what was
        given), for serialising at once: the lists are this value's own, not copies."""
        # Read from the instance's dict: an attribute read on a model costs several times a
        # dict read, and this runs for both legs' params on every turn (layout pinned in
        # tests/test_private_apis.py).
        values, given, extra = self.__dict__, self.__pydantic_fields_set__, self.__pydantic_extra__
        # zip/map over the set (iterated twice in the same order): no Python step per field.
        if not extra:
            return dict(zip(given, map(values.__getitem__, given), strict=True))
        declared = given.difference(extra)  # extras are in the fields set too
        out = dict(zip(declared, map(values.__getitem__, declared), strict=True))
        out.update(extra)
        return out

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

    @property
    def hold_ref(self) -> HoldRef | None:
        """The hold these params name, or None when they name no usable one."""
        return HoldRef.from_params(self)


class HoldRef(KVTransferParams):
    """Params that name one usable hold: the holder's side channel, the request id the holder
    knows it by, and the release token it handed out (required and plausible here).

    Derived from engine-returned params (`KVTransferParams.hold_ref`, `from_params`), carrying
    only those four fields, and passed around as this type (`Releaser.release`, `Release`,
    `KVEntry.hold_ref`).
    """

    remote_host: StrictStr = Field(min_length=1)
    remote_port: StrictInt = Field(gt=0, lt=65536)
    remote_request_id: StrictStr = Field(min_length=1)
    release_token: StrictStr = Field(min_length=1)

    @classmethod
    def from_params(cls, params: KVTransferParams | Mapping[str, Any] | None) -> HoldRef | None:
        """The hold that params describe, or None when they name no usable one (no release
        token, as from stock vLLM, or an implausible address or id). Only the four fields are
        read: the rest of the params may be anything."""
        if params is None:
            return None
        # A parsed value's fields are read from its dict (see `to_wire`).
        source = params.__dict__ if isinstance(params, KVTransferParams) else params
        fields = {name: source.get(name) for name in _HOLD_FIELDS}
        try:
            return cls.model_validate(fields)
        except ValueError:
            return None


_HOLD_FIELDS = (REMOTE_HOST, REMOTE_PORT, REMOTE_REQUEST_ID, RELEASE_TOKEN)


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
    batch does not wait, so an id missing here may still be asked for alone (which waits).
    Only keys go to the JSON reader's string cache: the params' hashes are new every time."""

    model_config = ConfigDict(cache_strings="keys")

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
