"""HMAC authentication of side-channel messages (CONTRACTS §2). Torch-free.

Signature = hex(HMAC-SHA256(secret, ts + "\\n" + METHOD + "\\n" + path + "\\n" + body)). The
timestamp bounds replay to the allowed clock skew; comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Mapping
from enum import StrEnum

from kvrelay.connector.protocol import (
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    MAX_CLOCK_SKEW_S,
    SECRET_ENV,
)


class AuthFailure(StrEnum):
    """Why a message was refused; used as the counter label (never the secret itself)."""

    MISSING = "missing_auth"
    BAD_TIMESTAMP = "bad_timestamp"
    SKEW = "clock_skew"
    BAD_SIGNATURE = "bad_signature"


def secret_from_env() -> bytes | None:
    """The shared secret from `KVRELAY_CONNECTOR_SECRET`, or None when unset or empty."""
    value = os.environ.get(SECRET_ENV, "")
    return value.encode() if value else None


def signature(secret: bytes, timestamp: str, method: str, path: str, body: bytes) -> str:
    message = b"\n".join([timestamp.encode(), method.upper().encode(), path.encode(), body])
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign_headers(
    secret: bytes, method: str, path: str, body: bytes = b"", now: float | None = None
) -> dict[str, str]:
    """Headers that authenticate one request."""
    ts = f"{time.time() if now is None else now:.6f}"
    return {HEADER_TIMESTAMP: ts, HEADER_SIGNATURE: signature(secret, ts, method, path, body)}


def verify(
    secret: bytes,
    headers: Mapping[str, str],
    method: str,
    path: str,
    body: bytes,
    now: float | None = None,
    max_skew_s: float = MAX_CLOCK_SKEW_S,
) -> AuthFailure | None:
    """None when the request is authentic, else the reason it is not."""
    ts = headers.get(HEADER_TIMESTAMP)
    sig = headers.get(HEADER_SIGNATURE)
    if not ts or not sig:
        return AuthFailure.MISSING
    try:
        ts_value = float(ts)
    except ValueError:
        return AuthFailure.BAD_TIMESTAMP
    if ts_value != ts_value:  # NaN compares unequal to itself
        return AuthFailure.BAD_TIMESTAMP
    current = time.time() if now is None else now
    if abs(current - ts_value) > max_skew_s:
        return AuthFailure.SKEW
    expected = signature(secret, ts, method, path, body)
    if not hmac.compare_digest(expected, sig.strip().lower()):
        return AuthFailure.BAD_SIGNATURE
    return None
