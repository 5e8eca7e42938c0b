"""Malformed HTTP gets the same OpenAI-shaped 400 as any other bad input.

aiohttp's parser answers these itself, before any route or middleware runs, with a text/plain
400; the proxy's connection handler shapes them (`kvrelay.proxy.http.protocol_errors`).
"""

from __future__ import annotations

import pytest

from kvrelay.devtools import chaos_load
from tests.security.conftest import SecureFleet
from tests.security.rawhttp import connect, read_response

BODY = b'{"model":"kvrelay-sim","prompt":"hi","max_tokens":2}'


def _request(line: bytes, headers: list[bytes], body: bytes = BODY) -> bytes:
    head = [line, b"Host: 127.0.0.1", *headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


CASES = {
    "query-100k": _request(b"POST /v1/completions?q=" + b"a" * 100_000 + b" HTTP/1.1",
                           [b"Content-Length: %d" % len(BODY)]),
    "control-byte-in-header": _request(b"POST /v1/completions HTTP/1.1",
                                       [b"X-Note: a\x01b", b"Content-Length: %d" % len(BODY)]),
    "cl-te-conflict": _request(b"POST /v1/completions HTTP/1.1",
                               [b"Transfer-Encoding: chunked", b"Content-Length: 5"],
                               b"2\r\n{}\r\n0\r\n\r\n"),
    "unknown-method": _request(b"FOO BAR /v1/completions HTTP/1.1", [], b""),
    "content-encoding-br": _request(b"POST /v1/completions HTTP/1.1",
                                    [b"Content-Encoding: br", b"Content-Length: 9"],
                                    b"\x00\x01garbage"),
    "bad-content-length": _request(b"POST /v1/completions HTTP/1.1", [b"Content-Length: nope"]),
}  # fmt: skip
# Bodies whose Content-Encoding aiohttp knows but whose bytes do not decode: read by the route
# (after the key is checked), answered as the parser answers the rest.
UNDECODABLE = {"deflate": b"\x00\x01not-deflate", "gzip": b"\x1f\x8b\x08\x00garbage"}


@pytest.mark.parametrize("encoding", list(UNDECODABLE))
def test_a_body_that_does_not_decode_is_an_openai_shaped_400(
    secure_fleet: SecureFleet, encoding: str
) -> None:
    body = UNDECODABLE[encoding]
    request = _request(b"POST /v1/chat/completions HTTP/1.1", [
        b"Authorization: Bearer " + secure_fleet.key_a.encode(),
        b"Content-Type: application/json", b"Content-Encoding: " + encoding.encode(),
        b"Content-Length: %d" % len(body),
    ], body)  # fmt: skip
    with connect(secure_fleet.proxy.url) as sock:
        sock.sendall(request)
        resp = read_response(sock)
    assert resp.status == 400, (resp.status, resp.body)
    assert chaos_load.is_openai_error(resp.json()), resp.body
    assert resp.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("token", [2**63, -(2**63) - 1, -1], ids=["2^63", "below-int64", "neg"])
def test_token_ids_outside_int64_are_a_400(secure_fleet: SecureFleet, token: int) -> None:
    body = b'{"model":"kvrelay-sim","prompt":[1,2,%d],"max_tokens":2}' % token
    request = _request(b"POST /v1/completions HTTP/1.1", [
        b"Authorization: Bearer " + secure_fleet.key_a.encode(),
        b"Content-Type: application/json", b"Content-Length: %d" % len(body),
    ], body)  # fmt: skip
    with connect(secure_fleet.proxy.url) as sock:
        sock.sendall(request)
        resp = read_response(sock)
    assert resp.status == 400, (resp.status, resp.body)
    assert resp.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_http_is_an_openai_shaped_400(secure_fleet: SecureFleet, case: str) -> None:
    with connect(secure_fleet.proxy.url) as sock:
        sock.sendall(CASES[case])
        resp = read_response(sock)
    assert resp.status == 400, (resp.status, resp.body)
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    body = resp.json()
    assert chaos_load.is_openai_error(body), body
    assert body["error"]["type"] == "invalid_request_error"
