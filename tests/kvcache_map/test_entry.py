"""`KVEntry`: strict validation, compact stored form, kv_transfer_params conversion."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvrelay.kvcache_map import EntryDecodeError, KVEntry
from kvrelay.kvcache_map._entry import MAX_BLOCK_SIZE
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

    out = entry.to_kv_transfer_params()
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
    out = entry.to_kv_transfer_params()
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
