"""Who a reader may contact, and replay of a captured side-channel request across clock steps."""

from __future__ import annotations

import pytest

from kvrelay.connector import auth
from kvrelay.connector.allowlist import DEFAULT_ALLOWED_HOLDERS, HolderAllowlist
from kvrelay.connector.auth import AuthFailure, NonceCache, sign_headers, verify

SECRET = b"s"


@pytest.mark.parametrize(
    "host",
    [
        "169.254.169.254",  # cloud metadata (IPv4)
        "fd00:ec2::254",  # AWS metadata over IPv6: inside fc00::/7
        "[fd00:ec2::254]",
        "::ffff:169.254.169.254",  # the same, IPv4-mapped
        "fe80::1",  # link-local
        "fe80::1%eth0",  # with a zone index
        "169.254.10.1",
        "0.0.0.0",
    ],
)
def test_link_local_and_metadata_addresses_are_never_holders(host: str) -> None:
    assert not HolderAllowlist(DEFAULT_ALLOWED_HOLDERS).allows(host)
    # Not even when an operator lists a range that covers them.
    assert not HolderAllowlist(["0.0.0.0/0", "::/0"]).allows(host)


def test_the_fleet_private_ranges_stay_allowed() -> None:
    allowlist = HolderAllowlist(DEFAULT_ALLOWED_HOLDERS)
    for host in ("10.1.2.3", "fd12:3456::1", "127.0.0.1", "::1", "192.168.1.5", "localhost"):
        assert allowlist.allows(host), host
    assert not allowlist.allows("8.8.8.8")


def test_a_wall_clock_step_back_does_not_reopen_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    # The holder accepts a request at wall time 1000; 300 s later the wall clock has been
    # stepped back, so the captured request's timestamp is within the skew again. Its nonce
    # must still be known then (kept on the wall clock the timestamp is checked on).
    wall = [1000.0]
    monkeypatch.setattr(auth.time, "time", lambda: wall[0])
    headers = sign_headers(SECRET, "POST", "/claim", b"{}", dest="h:1")
    nonces = NonceCache(max_skew_s=60)

    def accepted() -> bool:
        ok = verify(SECRET, headers, "POST", "/claim", b"{}", destinations={"h:1"}) is None
        ts = float(headers[auth.HEADER_TIMESTAMP])
        return ok and nonces.first_use(headers[auth.HEADER_NONCE], timestamp=ts)

    assert accepted()
    wall[0] = 1010.0  # 300 s later, after a step back of 290 s
    assert verify(SECRET, headers, "POST", "/claim", b"{}", destinations={"h:1"}) is None
    assert not accepted(), "replayed"
    wall[0] = 1200.0  # the request's window is over: its nonce may go, it cannot verify
    assert (
        verify(SECRET, headers, "POST", "/claim", b"{}", destinations={"h:1"}) == AuthFailure.SKEW
    )
