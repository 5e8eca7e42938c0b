"""Torch-free pieces: HMAC auth, chained block hashes, params parsing, TP mapping."""

from __future__ import annotations

import hmac
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvrelay.connector.allowlist import DEFAULT_ALLOWED_HOLDERS, HolderAllowlist
from kvrelay.connector.auth import (
    AuthFailure,
    NonceCache,
    _hmac_sha256_hex,
    response_signature,
    sign_headers,
    signature,
    verify,
    verify_response,
)
from kvrelay.connector.block_hash import block_hashes, matching_prefix_blocks
from kvrelay.connector.config import ConnectorConfig
from kvrelay.connector.protocol import (
    HEADER_DESTINATION,
    HEADER_NONCE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    HoldRef,
    KVTransferParams,
)
from kvrelay.connector.tp import FinishedAggregator, ReadPiece, TPMismatchError, plan_reads
from tests.harness import REPO_ROOT

SECRET = b"s3cret"


DEST = "10.0.0.7:5600"
OWN = frozenset({DEST})


def _sign(body: bytes = b"x", path: str = "/v1/claim", now: float = 1000.0) -> dict[str, str]:
    return sign_headers(SECRET, "POST", path, body, now=now, dest=DEST)


def test_signed_request_verifies() -> None:
    headers = _sign(b'{"a":1}', "/v1/release")
    assert (
        verify(SECRET, headers, "POST", "/v1/release", b'{"a":1}', destinations=OWN, now=1000.5)
        is None
    )


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda h: {}, AuthFailure.MISSING),
        (lambda h: {k: v for k, v in h.items() if k != HEADER_NONCE}, AuthFailure.MISSING),
        (lambda h: {k: v for k, v in h.items() if k != HEADER_DESTINATION}, AuthFailure.MISSING),
        (lambda h: {**h, HEADER_TIMESTAMP: "abc"}, AuthFailure.BAD_TIMESTAMP),
        (lambda h: {**h, HEADER_TIMESTAMP: "nan"}, AuthFailure.BAD_TIMESTAMP),
        (lambda h: {**h, HEADER_SIGNATURE: "00" * 32}, AuthFailure.BAD_SIGNATURE),
        (lambda h: {**h, HEADER_NONCE: "other-nonce"}, AuthFailure.BAD_SIGNATURE),
        (lambda h: {**h, HEADER_DESTINATION: "10.0.0.8:5600"}, AuthFailure.BAD_SIGNATURE),
        (lambda h: {**h, HEADER_NONCE: "n" * 500}, AuthFailure.BAD_NONCE),
    ],
)
def test_tampered_headers_refused(mutate, reason) -> None:  # type: ignore[no-untyped-def]
    headers = _sign()
    got = verify(SECRET, mutate(headers), "POST", "/v1/claim", b"x", destinations=OWN, now=1000.0)
    assert got == reason


def test_signature_binds_body_path_method_time_and_destination() -> None:
    headers = _sign()

    def check(
        method: str = "POST",
        path: str = "/v1/claim",
        body: bytes = b"x",
        secret: bytes = SECRET,
        own: frozenset[str] = OWN,
        now: float = 1000.0,
    ) -> object:
        return verify(secret, headers, method, path, body, destinations=own, now=now)

    assert check() is None
    assert check(body=b"y") == check(path="/v1/release") == AuthFailure.BAD_SIGNATURE
    assert check(method="GET") == check(secret=b"other") == AuthFailure.BAD_SIGNATURE
    assert check(now=1061.0) == AuthFailure.SKEW
    # Signed for another engine's address: refused even though the secret is right.
    assert check(own=frozenset({"10.0.0.8:5600"})) == AuthFailure.WRONG_DESTINATION


def test_nonce_is_accepted_once_within_the_window() -> None:
    cache = NonceCache(max_skew_s=60, max_entries=3)
    assert cache.first_use("a", now=0.0) and not cache.first_use("a", now=1.0)
    assert cache.first_use("b", now=1.0) and cache.first_use("c", now=1.0)
    # Full of nonces that could still be replayed: refuse rather than forget one.
    assert not cache.first_use("d", now=2.0)
    # Past twice the skew window a nonce cannot verify any more and is forgotten.
    assert cache.first_use("d", now=121.5)
    assert not cache.first_use("d", now=121.6)


def test_answers_are_signed_for_one_request() -> None:
    sig = response_signature(SECRET, "nonce-1", 200, b'{"ok":1}')
    assert verify_response(SECRET, "nonce-1", 200, b'{"ok":1}', sig)
    assert not verify_response(SECRET, "nonce-2", 200, b'{"ok":1}', sig)  # another request
    assert not verify_response(SECRET, "nonce-1", 410, b'{"ok":1}', sig)
    assert not verify_response(SECRET, "nonce-1", 200, b'{"ok":2}', sig)
    assert not verify_response(b"other", "nonce-1", 200, b'{"ok":1}', sig)
    assert not verify_response(SECRET, "nonce-1", 200, b'{"ok":1}', None)


@settings(max_examples=300, deadline=None)
@given(secret=st.binary(max_size=200), message=st.binary(max_size=300))
def test_signatures_are_standard_hmac_sha256(secret: bytes, message: bytes) -> None:
    """The cached-key HMAC writes what `hmac.new` writes, for keys shorter and longer than
    SHA-256's block: engines and proxies of other versions must keep verifying each other."""
    assert _hmac_sha256_hex(secret, message) == hmac.new(secret, message, "sha256").hexdigest()


def test_signature_golden_value() -> None:
    """The signature of one fixed request, as the previous release wrote it (wire format)."""
    expected = "0dcf961495403f8f38265c74331914226899159c3097a98defaed32ffbadc34f"
    assert signature(SECRET, "1000.000000", "n", DEST, "POST", "/v1/claim", b"x") == expected


def test_holder_allowlist() -> None:
    default = HolderAllowlist(DEFAULT_ALLOWED_HOLDERS)
    for host in ("127.0.0.1", "10.1.2.3", "192.168.0.9", "172.20.0.1", "::1", "[::1]", "localhost"):
        assert default.allows(host), host
    for host in ("203.0.113.5", "169.254.169.254", "8.8.8.8", "evil.example.com", "2001:db8::1"):
        assert not default.allows(host), host
    assert default.allows("::ffff:10.0.0.1") and not default.allows("::ffff:8.8.8.8")
    fleet = HolderAllowlist(["10.4.0.0/16", "Engine-0.kvrelay.svc"])
    assert fleet.allows("10.4.9.9") and fleet.allows("engine-0.kvrelay.svc.")
    assert not fleet.allows("10.5.0.1") and not fleet.allows("127.0.0.1")


def test_compat_hash_covers_everything_that_changes_the_bytes() -> None:
    base = ConnectorConfig(engine_id="e", num_kv_heads=8, head_dim=128)
    assert (
        base.compat_hash()
        == ConnectorConfig(engine_id="other", num_kv_heads=8, head_dim=128).compat_hash()
    )
    for change in ({"num_kv_heads": 4}, {"head_dim": 64}, {"block_size": 32}, {"dtype": "bfloat16"},
                   {"kv_layout": "other"}, {"model": "m2"}):  # fmt: skip
        assert base.model_copy(update=change).compat_hash() != base.compat_hash(), change


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
    p = KVTransferParams.from_wire({"do_remote_decode": True, "vendor_x": 1})
    assert p is not None and p.to_wire() == {"do_remote_decode": True, "vendor_x": 1}
    assert not p.has_remote_blocks
    with pytest.raises(ValidationError):
        KVTransferParams.from_wire({"remote_block_ids": "nope"})


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


@pytest.mark.parametrize(
    "change",
    [
        {"remote_port": "5600"},  # engine-supplied: a string is not a port
        {"remote_port": True},
        {"remote_port": 0},
        {"remote_port": 70000},
        {"remote_host": ""},
        {"remote_request_id": None},
        {"release_token": ""},
        {"release_token": None},  # stock vLLM: nothing to release with
    ],
)
def test_hold_ref_refuses_params_that_name_no_usable_hold(change: dict[str, object]) -> None:
    good = {"remote_host": "10.0.0.2", "remote_port": 5600, "remote_request_id": "r1",
            "release_token": "tok"}  # fmt: skip
    assert HoldRef.from_params(good) == HoldRef(
        remote_host="10.0.0.2", remote_port=5600, remote_request_id="r1", release_token="tok"
    )
    assert HoldRef.from_params({**good, **change}) is None
    assert HoldRef.from_params(None) is None and HoldRef.from_params({}) is None
