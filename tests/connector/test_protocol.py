"""Torch-free pieces: HMAC auth, chained block hashes, params parsing, TP mapping."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from kvrelay.connector.auth import AuthFailure, sign_headers, verify
from kvrelay.connector.block_hash import block_hashes, matching_prefix_blocks
from kvrelay.connector.protocol import HEADER_SIGNATURE, HEADER_TIMESTAMP, KVTransferParams
from kvrelay.connector.tp import FinishedAggregator, ReadPiece, TPMismatchError, plan_reads
from tests.harness import REPO_ROOT

SECRET = b"s3cret"


def test_signed_request_verifies() -> None:
    headers = sign_headers(SECRET, "POST", "/v1/release", b'{"a":1}', now=1000.0)
    assert verify(SECRET, headers, "POST", "/v1/release", b'{"a":1}', now=1000.5) is None


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda h: {}, AuthFailure.MISSING),
        (lambda h: {**h, HEADER_TIMESTAMP: "abc"}, AuthFailure.BAD_TIMESTAMP),
        (lambda h: {**h, HEADER_TIMESTAMP: "nan"}, AuthFailure.BAD_TIMESTAMP),
        (lambda h: {**h, HEADER_SIGNATURE: "00" * 32}, AuthFailure.BAD_SIGNATURE),
    ],
)
def test_tampered_headers_refused(mutate, reason) -> None:  # type: ignore[no-untyped-def]
    headers = sign_headers(SECRET, "POST", "/v1/claim", b"x", now=1000.0)
    assert verify(SECRET, mutate(headers), "POST", "/v1/claim", b"x", now=1000.0) == reason


def test_signature_binds_body_path_method_and_time() -> None:
    headers = sign_headers(SECRET, "POST", "/v1/claim", b"x", now=1000.0)
    assert verify(SECRET, headers, "POST", "/v1/claim", b"y", now=1000.0)
    assert verify(SECRET, headers, "POST", "/v1/release", b"x", now=1000.0)
    assert verify(SECRET, headers, "GET", "/v1/claim", b"x", now=1000.0)
    assert verify(b"other", headers, "POST", "/v1/claim", b"x", now=1000.0)
    assert verify(SECRET, headers, "POST", "/v1/claim", b"x", now=1061.0) == AuthFailure.SKEW


def test_block_hashes_chain_and_cover_full_blocks_only() -> None:
    tokens = list(range(10))
    hashes = block_hashes(tokens, 4, "c")
    assert len(hashes) == 2 and all(len(h) == 16 for h in hashes)
    # Same second block after a different first block hashes differently (chained).
    other = block_hashes([99, 1, 2, 3, 4, 5, 6, 7], 4, "c")
    assert other[1] != hashes[1]
    # The compat hash seeds the chain.
    assert block_hashes(tokens, 4, "d")[0] != hashes[0]
    assert matching_prefix_blocks(hashes, other) == 0
    assert matching_prefix_blocks(hashes, hashes[:1]) == 1


def test_params_keep_unknown_fields_and_reject_wrong_types() -> None:
    p = KVTransferParams.from_dict({"do_remote_decode": True, "vendor_x": 1})
    assert p is not None and p.to_dict() == {"do_remote_decode": True, "vendor_x": 1}
    assert not p.has_remote_blocks
    with pytest.raises(ValidationError):
        KVTransferParams.from_dict({"remote_block_ids": "nope"})


def test_tp_plans() -> None:
    same = plan_reads(0, 1, 1, False, 100, 100, False)
    assert same.pieces == (ReadPiece(0, 0, 0, 100),) and same.expected_per_holder_rank == 1
    # Reader TP 2 over holder TP 1: each reader rank reads its half of the heads.
    up = plan_reads(1, 2, 1, False, 50, 100, True)
    assert up.pieces == (ReadPiece(0, 0, 50, 50),) and up.expected_per_holder_rank == 2
    # Reader TP 1 over holder TP 2: both holder ranks read into the two halves.
    down = plan_reads(0, 1, 2, False, 100, 50, True)
    assert down.pieces == (ReadPiece(0, 0, 0, 50), ReadPiece(1, 50, 0, 50))
    # MLA, reader TP 1 over holder TP 4: one read, three free-notifications.
    mla = plan_reads(0, 1, 4, True, 64, 64, False)
    assert [p.remote_rank for p in mla.pieces] == [0] and mla.notify_only_ranks == (1, 2, 3)
    with pytest.raises(TPMismatchError):
        plan_reads(0, 1, 2, False, 100, 50, False)  # heads not outermost: no slicing
    with pytest.raises(TPMismatchError):
        plan_reads(0, 3, 2, False, 100, 50, True)


def test_finished_aggregator_waits_for_every_rank() -> None:
    agg = FinishedAggregator(2)
    assert agg.add(0, {"a", "b"}) == set()
    assert agg.add(1, {"a"}) == {"a"}
    assert agg.add(1, {"b"}) == {"b"}


def test_proxy_facing_modules_import_without_torch() -> None:
    code = (
        "import sys, kvrelay.connector, kvrelay.connector.protocol, kvrelay.connector.auth, "
        "kvrelay.connector.sidechannel_client, kvrelay.connector.block_hash, kvrelay.proxy\n"
        "assert 'torch' not in sys.modules and 'nixl' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=60)
