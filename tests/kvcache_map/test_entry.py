"""`KVEntry`: strict validation (its hand-written checks held against a pydantic model of the
same rules), compact stored form, kv_transfer_params conversion."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Self

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvrelay.kvcache_map import EntryDecodeError, KVEntry
from kvrelay.kvcache_map._entry import (
    MAX_BLOCK_ID,
    MAX_BLOCK_SIZE,
    MAX_BLOCKS_PER_GROUP,
    MAX_GROUPS,
    MAX_NUM_TOKENS,
    MAX_TP_SIZE,
)
from tests.kvcache_map.helpers import make_entry


def d_params(**overrides: Any) -> dict[str, Any]:
    """kv_transfer_params as a decode engine returns them when a turn finishes."""
    params: dict[str, Any] = {
        "do_remote_decode": False,
        "do_remote_prefill": False,
        "remote_engine_id": "decode-0",
        "remote_request_id": "cmpl-7",
        "remote_host": "10.0.0.5",
        "remote_port": 5600,
        "remote_block_ids": [[10, 11, 12], [4, 5]],
        "remote_num_tokens": 41,
        "tp_size": 2,
        "remote_blocks_expiry_time": 1_900_000_000.5,
        "remote_block_hashes": ["00112233445566aa", "00112233445566bb"],
        "release_token": "secret-token",
        "dcp_size": 1,
        "pp_size": 1,
    }
    params.update(overrides)
    return params


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("port", 0),
        ("port", 65536),
        ("port", "5600"),  # strict: no string → int coercion
        ("port", True),
        ("block_ids", [[1, -2]]),
        ("block_ids", []),
        ("block_ids", [[]]),
        ("block_ids", [1, 2, 3]),  # must be per KV-cache group
        ("num_tokens", 0),
        ("num_tokens", 2),  # three blocks cannot hold two tokens
        ("num_tokens", 3 * MAX_BLOCK_SIZE + 1),
        ("block_hashes", ["0123456789abcdef"] * 4),  # more hashes than blocks
        ("block_hashes", ["0123456789ABCDEF"]),
        ("block_hashes", ["0123"]),
        ("block_hashes", ["0123456789abcde", "0123456789abcdef0"]),  # 15 + 17 characters
        ("block_hashes", ["0123456789abcdeg"]),
        ("block_hashes", ["0123456789abcde\u00e9"]),  # 16 characters, one not hex
        ("block_ids", [[0, 1], [2, -1]]),
        ("block_ids", [[0, 1 << 63]]),  # beyond 64 bits: no engine has that many blocks
        # Strict like the rest of the entry: only lists of lists of ints, nothing converted.
        # Each value has two blocks at least (the sample entry has two hashes), so that it is
        # refused for what it shows and not for having fewer blocks than hashes.
        ("block_ids", None),
        ("block_ids", "12"),
        ("block_ids", ["12", [1, 2]]),
        ("block_ids", {"a": [1, 2]}),
        ("block_ids", [[1, True]]),
        ("block_ids", [[True, 1]]),
        ("block_ids", [[1.0, 2]]),
        ("block_ids", [[1, 2.5]]),
        ("block_ids", [["1", 2]]),
        ("block_ids", [[None, 1]]),
        ("block_ids", [{1, 2}]),
        ("block_ids", ((1, 2),)),  # tuples: KVTransferParams takes them, the entry never has
        ("block_ids", [(1, 2)]),
        ("block_ids", [[1, 2], (2, 3)]),
        ("block_ids", [[0, 1]] * (MAX_GROUPS + 1)),
        ("expires_at", math.nan),
        ("expires_at", math.inf),
        ("expires_at", 0.0),
        ("url", "ftp://x"),
        ("url", "127.0.0.1:8000"),
        ("engine_id", ""),
        ("request_id", "r" * 257),
        ("release_token", ""),
        ("tp_size", 0),
        ("fingerprint", ""),
    ],
)
def test_invalid_fields_rejected(field: str, value: Any) -> None:
    with pytest.raises(ValidationError):
        make_entry(**{field: value})


def test_block_ids_are_copied_not_shared() -> None:
    groups = [[1, 2, 3], [4]]
    entry = make_entry(block_ids=groups)
    groups[0].append(9)
    groups.append([5])
    assert entry.block_ids == [[1, 2, 3], [4]]
    assert type(entry.block_ids) is list and all(type(g) is list for g in entry.block_ids)


def test_block_ids_in_list_subclasses_are_taken_as_plain_lists() -> None:
    class Ids(list[int]):
        pass

    class Groups(list[list[int]]):
        pass

    entry = make_entry(block_ids=Groups([Ids([1, 2]), [3]]))
    assert entry.block_ids == [[1, 2], [3]]
    assert type(entry.block_ids) is list and all(type(g) is list for g in entry.block_ids)


def test_unknown_field_rejected() -> None:
    with pytest.raises(ValidationError):
        make_entry(colour="blue")


def test_plausible_edges_accepted() -> None:
    make_entry(block_ids=[[0]], num_tokens=1, block_hashes=[])
    make_entry(block_ids=[[1, 2, 3], []], num_tokens=3 * MAX_BLOCK_SIZE, block_hashes=None)
    make_entry(release_token=None, expires_at=1)  # int accepted for a float field


def test_bytes_roundtrip_is_compact() -> None:
    entry = make_entry()
    raw = entry.to_bytes()
    assert KVEntry.from_bytes(raw) == entry
    doc = json.loads(raw)
    assert "engine_id" not in doc and doc["v"] == 1  # one-letter keys, versioned
    assert b" " not in raw
    sparse = make_entry(block_hashes=None, release_token=None)
    assert KVEntry.from_bytes(sparse.to_bytes()) == sparse
    assert len(sparse.to_bytes()) < len(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xff\xfe",
        b"garbage",
        b"[]",
        b"null",
        b'{"v":2}',
        b'{"v":1}',
        b'{"v":1,"zz":1}',
        make_entry().to_bytes().replace(b'"p":7601', b'"p":-1'),
    ],
)
def test_corrupt_bytes_raise_decode_error(raw: bytes) -> None:
    with pytest.raises(EntryDecodeError):
        KVEntry.from_bytes(raw)


def test_from_decode_params_and_replay_to_prefill() -> None:
    params = d_params()
    entry = KVEntry.from_kv_transfer_params(params, url="http://d0:8000", fingerprint="fp")
    assert entry.engine_id == "decode-0" and entry.request_id == "cmpl-7"
    assert entry.block_ids == [[10, 11, 12], [4, 5]] and entry.num_tokens == 41
    assert entry.tp_size == 2 and entry.release_token == "secret-token"
    assert entry.url == "http://d0:8000" and entry.fingerprint == "fp"

    out = entry.to_kv_transfer_params().to_wire()
    assert out["do_remote_decode"] is True and out["do_remote_prefill"] is False
    for name in (
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "remote_block_ids",
        "remote_num_tokens",
        "tp_size",
        "remote_blocks_expiry_time",
        "remote_block_hashes",
        "release_token",
    ):
        assert out[name] == params[name], name
    assert out["remote_url"] == "http://d0:8000"
    again = KVEntry.from_kv_transfer_params(out, url=entry.url, fingerprint=entry.fingerprint)
    assert again == entry


def test_params_without_optional_extras() -> None:
    params = d_params()
    for name in ("remote_block_hashes", "release_token", "tp_size"):
        del params[name]
    entry = KVEntry.from_kv_transfer_params(params, url="http://d0:8000", fingerprint="fp")
    assert entry.block_hashes is None and entry.release_token is None and entry.tp_size == 1
    out = entry.to_kv_transfer_params().to_wire()
    assert "remote_block_hashes" not in out and "release_token" not in out


def test_params_url_is_never_taken_from_params() -> None:
    params = d_params(remote_url="http://evil:1")
    entry = KVEntry.from_kv_transfer_params(params, url="http://d0:8000", fingerprint="fp")
    assert entry.url == "http://d0:8000"


@pytest.mark.parametrize(
    "overrides",
    [
        {"remote_engine_id": None},
        {"remote_block_ids": None},
        {"remote_num_tokens": None},
        {"remote_blocks_expiry_time": None},
        {"remote_port": -5},
        {"remote_block_ids": [[1, 2, -1]]},
        {"remote_num_tokens": "41"},
    ],
)
def test_bad_params_raise_value_error(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        KVEntry.from_kv_transfer_params(
            d_params(**overrides), url="http://d0:8000", fingerprint="fp"
        )


def test_tuples_from_python_engines_are_accepted() -> None:
    params = d_params(remote_block_ids=([10, 11, 12], (4, 5)), remote_block_hashes=("ab" * 8,))
    entry = KVEntry.from_kv_transfer_params(params, url="http://d0:8000", fingerprint="fp")
    assert entry.block_ids == [[10, 11, 12], [4, 5]] and entry.block_hashes == ["ab" * 8]


def test_missing_params_are_named() -> None:
    params = d_params()
    del params["remote_host"]
    with pytest.raises(ValueError, match="remote_host"):
        KVEntry.from_kv_transfer_params(params, url="http://d0:8000", fingerprint="fp")


_blocks = st.lists(
    st.lists(st.integers(min_value=0, max_value=2**31), min_size=1, max_size=8),
    min_size=1,
    max_size=3,
)


@settings(deadline=None)
@given(
    blocks=_blocks,
    extra_tokens=st.integers(min_value=0, max_value=1000),
    hashes=st.booleans(),
    token=st.one_of(st.none(), st.text(min_size=1, max_size=40)),
    expires=st.floats(min_value=1e-3, max_value=1e12, allow_nan=False),
)
def test_any_valid_entry_roundtrips(
    blocks: list[list[int]], extra_tokens: int, hashes: bool, token: str | None, expires: float
) -> None:
    n_blocks = max(len(g) for g in blocks)
    entry = make_entry(
        block_ids=blocks,
        num_tokens=n_blocks + extra_tokens,
        block_hashes=["ab" * 8] * n_blocks if hashes else None,
        release_token=token,
        expires_at=expires,
    )
    assert KVEntry.from_bytes(entry.to_bytes()) == entry
    params = entry.to_kv_transfer_params()
    back = KVEntry.from_kv_transfer_params(params, url=entry.url, fingerprint=entry.fingerprint)
    assert back == entry


def test_entry_shares_no_list_with_the_params_it_came_from() -> None:
    params = d_params()
    entry = KVEntry.from_kv_transfer_params(params, url="http://d0:8000", fingerprint="fp")
    params["remote_block_hashes"].append("not a hash")
    params["remote_block_ids"][0].append(99)
    assert entry.block_hashes == ["00112233445566aa", "00112233445566bb"]
    assert entry.block_ids == [[10, 11, 12], [4, 5]]


# -- the rules as a pydantic model ---------------------------------------------------------------

_URL = r"^https?://[^/?#]"
_HASH = Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]


class _ReferenceEntry(BaseModel):
    """KVEntry's rules written plainly, pydantic checking every item: KVEntry's own checks
    (some in one pass over many items) must accept and reject exactly what this does."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    engine_id: str = Field(min_length=1, max_length=256)
    host: str = Field(min_length=1, max_length=256)
    port: int = Field(ge=1, le=65535)
    url: str = Field(min_length=1, max_length=2048, pattern=_URL)
    request_id: str = Field(min_length=1, max_length=256)
    block_ids: list[list[int]] = Field(min_length=1, max_length=MAX_GROUPS)
    num_tokens: int = Field(ge=1, le=MAX_NUM_TOKENS)
    block_hashes: list[_HASH] | None = None
    fingerprint: str = Field(min_length=1, max_length=256)
    expires_at: float = Field(gt=0, allow_inf_nan=False)
    release_token: str | None = Field(default=None, min_length=1, max_length=256)
    tp_size: int = Field(default=1, ge=1, le=MAX_TP_SIZE)
    prefill_url: str | None = Field(default=None, min_length=1, max_length=2048, pattern=_URL)
    chars_per_token: float | None = Field(default=None, gt=0, le=1 << 20, allow_inf_nan=False)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        for group in self.block_ids:
            if len(group) > MAX_BLOCKS_PER_GROUP or any(not 0 <= b <= MAX_BLOCK_ID for b in group):
                raise ValueError("a group too long, or a block id out of range")
        blocks = max(map(len, self.block_ids))
        if not blocks or blocks > self.num_tokens or self.num_tokens > blocks * MAX_BLOCK_SIZE:
            raise ValueError("token count and blocks disagree")
        if len(self.block_hashes or ()) > blocks:
            raise ValueError("more hashes than blocks")
        return self


def _valid_fields() -> dict[str, Any]:
    return {
        "engine_id": "decode-0",
        "host": "10.0.0.5",
        "port": 5600,
        "url": "http://d0:8000",
        "request_id": "cmpl-7",
        "block_ids": [[1, 2, 3], [4]],
        "num_tokens": 40,
        "block_hashes": ["0123456789abcdef", "fedcba9876543210"],
        "fingerprint": "fp",
        "expires_at": 1_900_000_000.5,
        "release_token": "tok",
        "tp_size": 1,
        "prefill_url": "https://p0:8000",
        "chars_per_token": 4.0,
    }


_H = "0123456789abcdef"
# Boundaries and wrong types; each is tried on every field.
_ODD_VALUES: list[Any] = [
    None, True, False, -1, 0, 1, 2, 3, 16, 255, 256, 257, 1024, 1025, 65535, 65536,
    MAX_NUM_TOKENS, MAX_NUM_TOKENS + 1, MAX_BLOCK_ID, MAX_BLOCK_ID + 1, 1 << 20, (1 << 20) + 1,
    0.0, -1.0, 1e-9, 2.5, 5.0, math.nan, math.inf, -math.inf,
    "", "x", "5600", "x" * 256, "x" * 257, "http://d1:1", "https://d", "ftp://d", "http://",
    "http://" + "d" * 2041, "http://" + "d" * 2042, _H, _H.upper(),
    [], [[]], [[0]], [[-1]], [1, 2], [[1, True]], [[1.0]], [[0, MAX_BLOCK_ID]],
    [[0, MAX_BLOCK_ID + 1]], [[0]] * MAX_GROUPS, [[0]] * (MAX_GROUPS + 1), [[0, 1, 2], []],
    [_H] * 3, [_H] * 4, [_H[:-1] + "g"], [_H[:-1] + "\u00e9"], [_H[:-1] + "-"], ["-" * 16],
    [_H[:-1], _H + "0"], [_H, _H[1:] + "-"], [_H + "-" + _H], [_H, ""], [_H[:8]], [_H, 7],
    [_H.encode()], [None], (_H,), ((1, 2),), {"a": 1},
]  # fmt: skip


def _agree(changes: dict[str, Any]) -> None:
    fields = {**_valid_fields(), **changes}
    try:
        reference: _ReferenceEntry | None = _ReferenceEntry(**fields)
    except ValidationError:
        reference = None
    try:
        entry: KVEntry | None = KVEntry(**fields)
    except ValidationError:
        entry = None
    assert (entry is None) == (reference is None), (changes, reference, entry)
    if entry is not None and reference is not None:
        assert entry.model_dump() == reference.model_dump()


def test_checks_agree_with_the_plain_rules_field_by_field() -> None:
    for name in _valid_fields():
        for value in _ODD_VALUES:
            _agree({name: value})


@settings(deadline=None, max_examples=300)
@given(
    changes=st.dictionaries(
        st.sampled_from(sorted(_valid_fields())),
        st.one_of(
            st.sampled_from(_ODD_VALUES),
            st.lists(st.sampled_from([_H, _H.upper(), _H[:15], _H + "0", "-" * 16, "g" * 16])),
            st.text(max_size=9),
        ),
        max_size=3,
    )
)
def test_checks_agree_with_the_plain_rules(changes: dict[str, Any]) -> None:
    _agree(changes)
