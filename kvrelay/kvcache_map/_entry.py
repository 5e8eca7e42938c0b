"""What the map stores: `KVEntry` (where D's KV blocks for a conversation live), the
`ConversationKey` it is stored under, and the collision-free encoding of keys for Redis.

`KVEntry` is validated strictly because it comes from engines over the network and goes back
out to engines (as `kv_transfer_params`): an entry that passes validation is safe to replay.
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, NamedTuple, Self
from urllib.parse import urlsplit

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SkipValidation,
    ValidationError,
    model_validator,
)

from kvrelay.connector.protocol import (
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    RELEASE_TOKEN,
    REMOTE_BLOCK_HASHES,
    REMOTE_BLOCK_IDS,
    REMOTE_BLOCKS_EXPIRY_TIME,
    REMOTE_ENGINE_ID,
    REMOTE_HOST,
    REMOTE_NUM_TOKENS,
    REMOTE_PORT,
    REMOTE_REQUEST_ID,
    REMOTE_URL,
    TP_SIZE,
    HoldRef,
    KVTransferParams,
)
from kvrelay.kvcache_map._errors import EntryDecodeError, InvalidKeyError, KeyTooLongError

# Limits on key parts, in UTF-8 bytes. Generous for UUIDs, hashes and API-key digests, small
# enough that a hostile client cannot make the proxy store megabyte keys.
MAX_TENANT_BYTES = 256
MAX_CONVERSATION_ID_BYTES = 256

# Upper bound on tokens per block used for the "token count vs blocks" plausibility check.
# Real engines use 16..1024; hybrid (mamba) models may use a few thousand.
MAX_BLOCK_SIZE = 1 << 16
MAX_NUM_TOKENS = 1 << 24
MAX_GROUPS = 64
MAX_BLOCKS_PER_GROUP = 1 << 20
MAX_TP_SIZE = 1024
_MAX_TEXT = 256
_MAX_URL = 2048
# Block ids index an engine's KV cache; the bound keeps them 64-bit (what orjson writes).
MAX_BLOCK_ID = (1 << 63) - 1
_HASH_CHARS = 16
# Deleting every lower-case hex digit and the separator leaves nothing of valid block hashes.
_HASH_BYTES = b"0123456789abcdef-"

# Short field names for the stored form: entries are written on every turn, keep them small.
_SHORT = {
    "engine_id": "e",
    "host": "h",
    "port": "p",
    "url": "u",
    "request_id": "r",
    "block_ids": "b",
    "num_tokens": "n",
    "block_hashes": "x",
    "fingerprint": "f",
    "expires_at": "t",
    "release_token": "k",
    "tp_size": "s",
    "prefill_url": "q",
    "chars_per_token": "c",
}
_LONG = {short: long for long, short in _SHORT.items()}
# The entry's fields as `kv_transfer_params` name them (the url is the proxy's, never taken
# from params), and those an entry cannot be without.
_WIRE = {
    "engine_id": REMOTE_ENGINE_ID,
    "request_id": REMOTE_REQUEST_ID,
    "host": REMOTE_HOST,
    "port": REMOTE_PORT,
    "block_ids": REMOTE_BLOCK_IDS,
    "num_tokens": REMOTE_NUM_TOKENS,
    "expires_at": REMOTE_BLOCKS_EXPIRY_TIME,
    "block_hashes": REMOTE_BLOCK_HASHES,
    "release_token": RELEASE_TOKEN,
    "tp_size": TP_SIZE,
}
_REQUIRED = ("engine_id", "request_id", "host", "port", "block_ids", "num_tokens", "expires_at")
_FORMAT_VERSION = 1


class KVEntry(BaseModel):
    """One conversation's reusable KV: which engine holds which blocks until when.

    Built from the `kv_transfer_params` D returned for the previous turn; replayed to P (as
    `do_remote_decode` params) so P pulls those blocks instead of recomputing the prefix.
    """

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    engine_id: str = Field(min_length=1, max_length=_MAX_TEXT)
    host: str = Field(min_length=1, max_length=_MAX_TEXT)
    port: int = Field(ge=1, le=65535)
    url: str = Field(min_length=1, max_length=_MAX_URL)
    request_id: str = Field(min_length=1, max_length=_MAX_TEXT)
    block_ids: list[list[int]] = Field(min_length=1, max_length=MAX_GROUPS)
    num_tokens: int = Field(ge=1, le=MAX_NUM_TOKENS)
    # Checked in `_consistent` (one pass over them all) rather than by pydantic item by item:
    # a long conversation's entry has hundreds of hashes, and it is built on every turn.
    block_hashes: Annotated[list[str] | None, SkipValidation] = None
    fingerprint: str = Field(min_length=1, max_length=_MAX_TEXT)
    expires_at: float = Field(gt=0)
    release_token: str | None = Field(default=None, min_length=1, max_length=_MAX_TEXT)
    tp_size: int = Field(default=1, ge=1, le=MAX_TP_SIZE)
    # Routing hints (kvrelay.proxy.fleet.routing), never sent to engines: the P that prefilled the
    # turn (P affinity) and the turn's prompt characters per token (decode-only estimate).
    prefill_url: str | None = Field(default=None, min_length=1, max_length=_MAX_URL)
    chars_per_token: float | None = Field(default=None, gt=0, le=1 << 20)

    # One validator for every check beyond the field types and bounds: each validator is a
    # call from pydantic's core back into Python, and entries are built on every turn.
    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if not _is_http_url(self.url) or (
            self.prefill_url is not None and not _is_http_url(self.prefill_url)
        ):
            raise ValueError("url must be an absolute http(s) URL")
        if not math.isfinite(self.expires_at) or (
            self.chars_per_token is not None and not math.isfinite(self.chars_per_token)
        ):
            raise ValueError("expires_at and chars_per_token must be finite")
        for group in self.block_ids:
            if len(group) > MAX_BLOCKS_PER_GROUP:
                raise ValueError(f"a KV-cache group has more than {MAX_BLOCKS_PER_GROUP} blocks")
            # Passes in C: groups run to thousands of blocks.
            if group and (min(group) < 0 or max(group) > MAX_BLOCK_ID):
                raise ValueError(f"block ids must be between 0 and {MAX_BLOCK_ID}")
        blocks = max(map(len, self.block_ids))
        if not blocks:
            raise ValueError("block_ids holds no block")
        hashes = self.block_hashes
        if hashes is not None and (type(hashes) is not list or not _are_block_hashes(hashes)):
            raise ValueError("block hashes must be 16 lower-case hex characters")
        # Every block holds at least one token and at most MAX_BLOCK_SIZE tokens.
        if blocks > self.num_tokens:
            raise ValueError(f"{blocks} blocks cannot hold only {self.num_tokens} tokens")
        if self.num_tokens > blocks * MAX_BLOCK_SIZE:
            raise ValueError(f"{blocks} blocks cannot hold {self.num_tokens} tokens")
        if hashes is not None and len(hashes) > blocks:
            raise ValueError("more block hashes than blocks")
        return self

    # -- stored form ---------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """Compact JSON with one-letter keys and no optional fields that are unset."""
        doc: dict[str, Any] = {"v": _FORMAT_VERSION}
        values = self.__dict__  # a dict read, not a model attribute read (see `to_wire`)
        for name, short in _SHORT.items():
            value = values[name]
            if value is not None:
                doc[short] = value
        return orjson.dumps(doc)  # compact; floats are finite (validated)

    @classmethod
    def from_bytes(cls, data: bytes) -> KVEntry:
        """Parse `to_bytes` output; anything else raises `EntryDecodeError`."""
        try:
            doc = orjson.loads(data)
        except ValueError as exc:  # orjson's JSONDecodeError, invalid UTF-8 included
            raise EntryDecodeError("stored entry is not JSON") from exc
        if not isinstance(doc, dict) or doc.get("v") != _FORMAT_VERSION:
            raise EntryDecodeError("stored entry has an unknown format")
        fields: dict[str, Any] = {}
        for short, value in doc.items():
            if short == "v":
                continue
            name = _LONG.get(short)
            if name is None:
                raise EntryDecodeError("stored entry has an unknown field")
            fields[name] = value
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            raise EntryDecodeError(f"stored entry is invalid: {exc.error_count()} errors") from exc

    @property
    def has_full_block(self) -> bool:
        """The held tokens fill at least one whole block, the least a prefix cache can reuse:
        the holder hashed one, or it holds two blocks or more (all but the last are full). A
        single block whose fill is unknown (no hashes, no block size here) counts as not."""
        return bool(self.block_hashes) or max(map(len, self.block_ids)) >= 2

    # -- kv_transfer_params ----------------------------------------------------------------------

    @property
    def hold_ref(self) -> HoldRef | None:
        """The hold on D that this entry names (None without a release token: stock vLLM)."""
        if self.release_token is None:
            return None
        return HoldRef.from_params(
            {
                REMOTE_HOST: self.host,
                REMOTE_PORT: self.port,
                REMOTE_REQUEST_ID: self.request_id,
                RELEASE_TOKEN: self.release_token,
            }
        )

    def to_kv_transfer_params(self) -> KVTransferParams:
        """The params to send to P on a cache hit: pull these blocks, then hold for D."""
        params: dict[str, Any] = {
            DO_REMOTE_DECODE: True,
            DO_REMOTE_PREFILL: False,
            REMOTE_URL: self.url,
        }
        values = self.__dict__  # a dict read, not a model attribute read (see `to_bytes`)
        for name, wire in _WIRE.items():
            value = values[name]
            if value is not None:
                params[wire] = value
        return KVTransferParams.model_validate(params)

    @classmethod
    def from_kv_transfer_params(
        cls,
        params: KVTransferParams | Mapping[str, Any],
        *,
        url: str,
        fingerprint: str,
        prefill_url: str | None = None,
        chars_per_token: float | None = None,
    ) -> KVEntry:
        """Build an entry from the params D returned when it finished a turn.

        `url` is the holder's HTTP base URL as the proxy knows it (never taken from params);
        unknown extra fields (`dcp_size`, `pp_size`, ...) are ignored. Params not parsed yet
        are parsed here (`KVTransferParams.from_wire`). Raises `ValueError` (pydantic's
        `ValidationError` included) when the params are incomplete or invalid.
        """
        parsed = params if type(params) is KVTransferParams else KVTransferParams.from_wire(params)
        if parsed is None:
            raise ValueError("kv_transfer_params must be an object")
        fields: dict[str, Any] = {
            "url": url,
            "fingerprint": fingerprint,
            "prefill_url": prefill_url,
            "chars_per_token": chars_per_token,
        }
        values = parsed.__dict__  # a dict read, not a model attribute read (see `to_bytes`)
        # Picked by zip/map (no Python step per field); only params lacking some go slower.
        picked = dict(zip(_WIRE, map(values.__getitem__, _WIRE.values()), strict=True))
        if None in picked.values():
            missing = [_WIRE[name] for name in _REQUIRED if picked[name] is None]
            if missing:
                raise ValueError(f"kv_transfer_params lacks {', '.join(missing)}")
            picked = {name: value for name, value in picked.items() if value is not None}
        fields.update(picked)
        hashes = picked.get("block_hashes")
        if hashes is not None:
            # Not copied by validation (see `block_hashes`): the entry shares no list.
            fields["block_hashes"] = list(hashes)
        return cls.model_validate(fields)


def _are_block_hashes(hashes: list[Any]) -> bool:
    """Every item a string of 16 lower-case hex digits, checked in passes over the hashes
    joined by "-" (each in C) rather than an item at a time: a long prompt has hundreds."""
    if not hashes:
        return True
    try:
        joined = "-".join(hashes)
    except TypeError:  # an item that is not a string
        return False
    count = len(hashes)
    # Separators exactly every 17th character and nowhere else: every item has 16 characters.
    if (
        len(joined) != (_HASH_CHARS + 1) * count - 1
        or joined.count("-") != count - 1
        or joined[_HASH_CHARS :: _HASH_CHARS + 1] != "-" * (count - 1)
    ):
        return False
    try:
        raw = joined.encode("ascii")
    except UnicodeEncodeError:
        return False
    return not raw.translate(None, _HASH_BYTES)


@functools.lru_cache(maxsize=1024)
def _is_http_url(value: str) -> bool:
    """Absolute http(s) URL? Cached: entries name the fleet's few engine URLs over and over."""
    parts = urlsplit(value)
    return parts.scheme in ("http", "https") and bool(parts.netloc)


class ConversationKey(NamedTuple):
    """Where an entry is stored: a conversation id inside a tenant's namespace.

    `tenant` should be a stable tenant id (e.g. a digest of the API key), not a secret itself:
    the Redis backend stores it, base64url-encoded, in the key name. A named tuple, so that
    hashing and comparing it (several times per turn in the map) run in C.
    """

    tenant: str
    conversation_id: str


def _part(value: object, what: str, limit: int) -> bytes:
    if not isinstance(value, str):
        raise InvalidKeyError(f"{what} must be a string")
    # Lone surrogates cannot be strict UTF-8; surrogatepass keeps the mapping total and
    # injective (distinct strings give distinct bytes).
    raw = _raw(value)
    if len(raw) > limit:
        raise KeyTooLongError(f"{what} is {len(raw)} bytes; the limit is {limit}")
    return raw


def validate_key(key: ConversationKey) -> None:
    """Raise `KeyTooLongError` / `InvalidKeyError` for keys no backend accepts."""
    if not isinstance(key, ConversationKey):
        raise InvalidKeyError("key must be a ConversationKey")
    tenant, conv = key.tenant, key.conversation_id
    # Fast path: a str of n code points is at most 4n UTF-8 bytes.
    if (
        isinstance(tenant, str)
        and isinstance(conv, str)
        and 4 * len(tenant) <= MAX_TENANT_BYTES
        and 4 * len(conv) <= MAX_CONVERSATION_ID_BYTES
    ):
        if not conv:
            raise InvalidKeyError("conversation id must not be empty")
        return
    _part(tenant, "tenant", MAX_TENANT_BYTES)
    if not _part(conv, "conversation id", MAX_CONVERSATION_ID_BYTES):
        raise InvalidKeyError("conversation id must not be empty")


_B64_RE = re.compile(r"[A-Za-z0-9_-]*")


def _raw(value: str) -> bytes:
    return value.encode("utf-8", "surrogatepass")


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> str:
    padded = text + "=" * (-len(text) % 4)
    return base64.urlsafe_b64decode(padded.encode("ascii")).decode("utf-8", "surrogatepass")


def encode_key(key: ConversationKey) -> str:
    """`base64url(tenant) "." base64url(conversation_id)`, both unpadded.

    The base64url alphabet has no ".", so the split is unambiguous and the mapping is
    injective; the result only ever contains `[A-Za-z0-9_.-]`, so no user byte reaches a Redis
    key (or a glob pattern, or a cluster hash tag) unescaped.
    """
    validate_key(key)
    tenant = _part(key.tenant, "tenant", MAX_TENANT_BYTES)
    conv = _part(key.conversation_id, "conversation id", MAX_CONVERSATION_ID_BYTES)
    return f"{_b64(tenant)}.{_b64(conv)}"


def decode_key(encoded: str) -> ConversationKey:
    """Inverse of `encode_key`; raises `InvalidKeyError` for text it did not produce."""
    tenant, sep, conv = encoded.partition(".")
    if not sep or not _B64_RE.fullmatch(tenant) or not _B64_RE.fullmatch(conv):
        raise InvalidKeyError("not an encoded conversation key")
    try:
        key = ConversationKey(_unb64(tenant), _unb64(conv))
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise InvalidKeyError("not an encoded conversation key") from exc
    # Only canonical encodings count (no stray padding bits, no empty conversation id).
    if (
        not key.conversation_id
        or f"{_b64(_raw(key.tenant))}.{_b64(_raw(key.conversation_id))}" != encoded
    ):
        raise InvalidKeyError("not an encoded conversation key")
    return key
