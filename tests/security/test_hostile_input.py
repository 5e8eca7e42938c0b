"""Hostile input: every decoding step of a request is bounded and answers a shaped error.

Deeply nested JSON, header bytes that are not UTF-8, bodies trickled a byte at a time, bodies
that would not fit in the proxy's in-flight budget, malformed HTTP, unencodable text: each gets
an OpenAI-shaped 4xx (or 503 for the budget) naming the limit, never an unshaped 500, and no
error a client can read names an engine's internal URL.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from kvrelay.devtools import ProxyFactory, ProxyServer, chaos_load
from tests.harness import wait_until
from tests.security.conftest import BODY_READ_TIMEOUT_S, SecureFleet
from tests.security.rawhttp import (
    RawResponse,
    closed_by_peer,
    connect,
    read_response,
    request_head,
    send,
)

MODEL = "kvrelay-sim"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def _shaped(resp: RawResponse | httpx.Response, status: int, code: str | None = None) -> Any:
    status_code = resp.status if isinstance(resp, RawResponse) else resp.status_code
    body = resp.json()
    assert status_code == status, (status_code, body)
    assert chaos_load.is_openai_error(body), body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# -- JSON depth ----------------------------------------------------------------------------------


def _deep_bodies() -> dict[str, tuple[str, bytes]]:
    return {
        "chat-100k-levels": ("/v1/chat/completions",
                             b'{"model":"kvrelay-sim","messages":' + _nested(100_000) + b"}"),
        "chat-990-in-a-field": ("/v1/chat/completions",
                                b'{"model":"kvrelay-sim","messages":[{"role":"user","content":'
                                + _nested(990) + b"}]}"),
        "completion-65-levels": ("/v1/completions",
                                 b'{"model":"kvrelay-sim","prompt":"hi","metadata":'
                                 + _nested(64) + b"}"),
        "admin-add-100k-levels": ("/admin/backends", b'{"role":' + _nested(100_000) + b"}"),
        "admin-drain-990-levels": ("/admin/backends/drain", b'{"url":' + _nested(990) + b"}"),
    }  # fmt: skip


@pytest.mark.parametrize("case", list(_deep_bodies()))
def test_deep_json_is_a_shaped_400_naming_the_limit(secure_fleet: SecureFleet, case: str) -> None:
    path, raw = _deep_bodies()[case]
    headers = {"Authorization": f"Bearer {secure_fleet.admin_key}"} if "admin" in path else \
        secure_fleet.a  # fmt: skip
    resp = httpx.post(secure_fleet.proxy.url + path, content=raw, timeout=30,
                      headers={**headers, "Content-Type": "application/json"})  # fmt: skip
    body = _shaped(resp, 400, "json_too_deep")
    assert "json_max_depth" in body["error"]["message"]
    assert "64" in body["error"]["message"]


def test_nesting_within_the_limit_is_served(secure_fleet: SecureFleet) -> None:
    body = {**CHAT, "metadata": json.loads(_nested(60))}
    resp = httpx.post(secure_fleet.proxy.url + "/v1/chat/completions", json=body,
                      headers=secure_fleet.a, timeout=60)  # fmt: skip
    assert resp.status_code == 200, resp.text


# -- header bytes that are not UTF-8 -------------------------------------------------------------

ROUTES: list[tuple[str, str, bytes]] = [
    ("POST", "/v1/chat/completions", json.dumps(CHAT).encode()),
    ("POST", "/v1/completions", b'{"model":"kvrelay-sim","prompt":"hi","max_tokens":2}'),
    ("GET", "/v1/models", b""),
    ("POST", "/v1/embeddings", b'{"model":"kvrelay-sim","input":"hi"}'),
    ("POST", "/tokenize", b'{"model":"kvrelay-sim","prompt":"hi"}'),
    ("DELETE", "/v1/conversations/some-id", b""),
    ("GET", "/health", b""),
    ("GET", "/ready", b""),
    ("GET", "/metrics", b""),
    ("GET", "/openapi.json", b""),
    ("GET", "/admin/backends", b""),
    # An invalid role: authorised admin calls are refused (400) and cannot change the fleet.
    ("POST", "/admin/backends", b'{"role":"none","url":"http://127.0.0.1:9"}'),
    ("POST", "/admin/backends/drain", b'{"role":"none","url":"http://127.0.0.1:9"}'),
    ("DELETE", "/admin/backends", b'{"role":"none","url":"http://127.0.0.1:9"}'),
]
BAD_HEADERS: list[tuple[bytes, bytes]] = [
    (b"Authorization", b"Bearer \xff\xfe\xfd"),
    (b"Authorization", b"\xc3\x28"),
    (b"X-Admin-Key", b"\xff\xff"),
    (b"X-Conversation-Id", b"conv-\xe2\x28\xa1"),
    (b"X-Request-Id", b"\xf0\x28\x8c\x28"),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_header_bytes_that_are_not_utf8_never_give_a_500(
    secure_fleet: SecureFleet, method: str, path: str, body: bytes
) -> None:
    admin = path.startswith("/admin")
    for name, value in BAD_HEADERS:
        headers = [(b"Content-Type", b"application/json"), (name, value)]
        credential = name == b"Authorization" or (name == b"X-Admin-Key" and admin)
        if not credential:
            # The rest of the request is authorised, so only the odd header is in question.
            key = secure_fleet.admin_key if admin else secure_fleet.key_a
            if path == "/metrics":
                key = secure_fleet.metrics_key
            headers.append((b"Authorization", f"Bearer {key}".encode()))
        resp = send(secure_fleet.proxy.url, method, path, headers, body)
        assert resp.status < 500, (name, value, resp.status, resp.body[:300])
        if resp.status >= 400:
            _shaped(resp, resp.status)
        if credential and path not in ("/health", "/ready", "/openapi.json"):
            assert resp.status == 401, (value, resp.body)
        if name == b"X-Conversation-Id" and path.endswith("completions"):
            _shaped(resp, 400, "invalid_header")


# -- slow and large bodies -----------------------------------------------------------------------


def test_trickled_authenticated_body_gets_408_and_its_connection_closed(
    secure_fleet: SecureFleet,
) -> None:
    body = json.dumps(CHAT).encode()
    headers = [(b"Content-Type", b"application/json"),
               (b"Authorization", f"Bearer {secure_fleet.key_a}".encode())]  # fmt: skip
    started = time.monotonic()
    with connect(secure_fleet.proxy.url) as sock:
        sock.sendall(request_head("POST", "/v1/chat/completions", headers, len(body) + 1000))
        sent = 0
        sock.settimeout(0.5)
        while True:  # one byte every 0.5 s until the proxy answers
            try:
                first = sock.recv(1, socket.MSG_PEEK)
                break
            except TimeoutError:
                sock.sendall(body[sent : sent + 1])
                sent += 1
            assert time.monotonic() - started < BODY_READ_TIMEOUT_S + 10, "no answer"
        assert first
        sock.settimeout(10)
        resp = read_response(sock)
        waited = time.monotonic() - started
        assert closed_by_peer(sock, 5.0), "the slow client's connection stayed open"
    body_json = _shaped(resp, 408, "body_timeout")
    assert "body_read_timeout_s" in body_json["error"]["message"]
    assert BODY_READ_TIMEOUT_S - 0.5 <= waited <= BODY_READ_TIMEOUT_S + 5, waited


BODY_LIMIT = 100_000


@pytest.fixture(scope="module")
def tight_proxy(secure_fleet: SecureFleet) -> Iterator[ProxyServer]:
    """A second proxy on the same engines: a small body limit and in-flight budget (room for
    two largest bodies), open metrics labelled with URLs (the operator's opt-in)."""
    proxies = ProxyFactory()
    try:
        yield proxies([secure_fleet.prefill], [secure_fleet.decode], ready_path="/ready",
                      body_limit_bytes=str(BODY_LIMIT), inflight_body_bytes=str(2 * BODY_LIMIT),
                      metrics_backend_urls="true")  # fmt: skip
    finally:
        proxies.close()


def _chat_ok(url: str) -> bool:
    return httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


@contextmanager
def _budget_taken(proxy: ProxyServer) -> Iterator[None]:
    """Two bodies announced in full, only their first bytes sent, hold the whole in-flight
    budget for as long as the block runs; their share comes back when their clients leave."""
    head = request_head("POST", "/v1/chat/completions",
                        [(b"Content-Type", b"application/json")], BODY_LIMIT)  # fmt: skip
    holders = [connect(proxy.url) for _ in range(2)]
    try:
        for sock in holders:
            sock.sendall(head + b'{"model":')

        # The proxy reserves each announced body on arrival: wait until both are held.
        def third_refused() -> bool:
            resp = send(proxy.url, "POST", "/v1/chat/completions",
                        [(b"Content-Type", b"application/json")],
                        json.dumps(CHAT).encode().ljust(BODY_LIMIT // 2))  # fmt: skip
            return resp.status == 503 and resp.json()["error"]["code"] == "body_budget_exhausted"

        wait_until(third_refused, 10, interval=0.1, what="a body over the budget to be refused")
        yield
    finally:
        for sock in holders:
            sock.close()
    wait_until(lambda: _chat_ok(proxy.url), 15, interval=0.2, what="the budget back")


def test_bodies_over_the_in_flight_budget_get_a_shaped_503(tight_proxy: ProxyServer) -> None:
    with _budget_taken(tight_proxy):
        resp = send(
            tight_proxy.url,
            "POST",
            "/v1/chat/completions",
            [(b"Content-Type", b"application/json")],
            b"{}".ljust(BODY_LIMIT // 2),
        )
        body = _shaped(resp, 503, "body_budget_exhausted")
        assert "inflight_body_bytes" in body["error"]["message"]


def _send_slowly(url: str, body: bytes) -> RawResponse:
    """`body` announced in full and sent in five pieces 0.4 s apart (2 s in all, past the
    proxy's 1 s linger); like httpx, the client reads nothing until the body is all sent."""
    step = len(body) // 5
    with connect(url) as sock:
        sock.sendall(request_head("POST", "/v1/chat/completions",
                                  [(b"Content-Type", b"application/json")], len(body)))  # fmt: skip
        for start in range(0, len(body), step):
            time.sleep(0.4)  # the client's own pace, not a wait for the proxy
            sock.sendall(body[start : start + step])
        return read_response(sock)


# A client that sends its whole body before reading (httpx, the openai SDK) must read the answer
# to a refused body, not a reset from a connection closed while it still sends: the SDK retries
# a connection error with the same body, where a 413 says not to and a 503 says to retry later.


def test_a_refused_body_sent_slowly_still_gets_its_503(tight_proxy: ProxyServer) -> None:
    with _budget_taken(tight_proxy):
        resp = _send_slowly(tight_proxy.url, b"{}".ljust(BODY_LIMIT // 2))
    _shaped(resp, 503, "body_budget_exhausted")


def test_a_body_over_the_limit_sent_slowly_still_gets_its_413(tight_proxy: ProxyServer) -> None:
    resp = _send_slowly(tight_proxy.url, b"{}".ljust(3 * BODY_LIMIT))
    _shaped(resp, 413, "body_too_large")


def test_a_body_far_over_the_limit_is_not_read_in_full(tight_proxy: ProxyServer) -> None:
    # Draining a refused body stops a few times past the limit, then aiohttp's 1 s linger: a
    # client announcing 64 GiB meets a closed connection within seconds, long before the 30 s
    # a body may take to arrive (the default body_read_timeout_s, this proxy's), however fast
    # the link.
    announced = 2**36
    sent = 0
    started = time.monotonic()
    with connect(tight_proxy.url) as sock:
        sock.sendall(request_head("POST", "/v1/chat/completions",
                                  [(b"Content-Type", b"application/json")], announced))  # fmt: skip
        chunk = b" " * 2**20
        with pytest.raises(OSError):  # broken pipe or reset: the proxy stopped reading
            while sent < announced:
                sock.sendall(chunk)
                sent += len(chunk)
    assert time.monotonic() - started < 15, (time.monotonic() - started, sent)


def test_bodies_over_the_size_limit_get_a_shaped_413(tight_proxy: ProxyServer) -> None:
    announced = send(
        tight_proxy.url,
        "POST",
        "/v1/completions",
        [(b"Content-Type", b"application/json")],
        b" " * (BODY_LIMIT + 1),
    )
    body = _shaped(announced, 413, "body_too_large")
    assert "body_limit_bytes" in body["error"]["message"]
    # Chunked: no length up front, refused once the bytes pass the limit.
    chunk = b" " * 50_000
    chunked = b"".join(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" for _ in range(3))
    with connect(tight_proxy.url) as sock:
        sock.sendall(request_head("POST", "/v1/completions",
                                  [(b"Content-Type", b"application/json"),
                                   (b"Transfer-Encoding", b"chunked")], None)
                     + chunked + b"0\r\n\r\n")  # fmt: skip
        _shaped(read_response(sock), 413, "body_too_large")
    assert _chat_ok(tight_proxy.url)


# -- engines named without their URLs ------------------------------------------------------------


def _engine_names(fleet: SecureFleet) -> dict[str, str]:
    listed = httpx.get(fleet.proxy.url + "/admin/backends",
                       headers=fleet.auth(fleet.admin_key)).json()  # fmt: skip
    return {b["url"]: b["name"] for role in listed.values() for b in role}


def test_client_errors_name_engines_by_role_and_hash_not_url(secure_fleet: SecureFleet) -> None:
    fleet = secure_fleet
    names = _engine_names(fleet)
    assert fleet.decode.request("/admin/faults", {"fail_next_n": 2, "fail_status": 500})[0] == 200
    try:
        resp = httpx.post(fleet.proxy.url + "/v1/chat/completions", json=CHAT, headers=fleet.a,
                          timeout=60)  # fmt: skip
    finally:
        fleet.decode.request("/admin/faults", {"fail_next_n": 0})
    message = _shaped(resp, 502, "decode_unavailable")["error"]["message"]
    assert names[fleet.decode.url] in message and names[fleet.decode.url].startswith("decode-")
    assert "127.0.0.1" not in message and str(fleet.decode.port) not in message
    assert httpx.get(fleet.proxy.url + "/ready").status_code == 200


def test_metrics_need_the_key_and_name_engines_without_urls(secure_fleet: SecureFleet) -> None:
    fleet = secure_fleet
    url = fleet.proxy.url + "/metrics"
    for headers in ({}, fleet.a, fleet.auth(fleet.admin_key), {"Authorization": "Bearer x"}):
        _shaped(httpx.get(url, headers=headers), 401, "invalid_metrics_key")
    text = fleet.proxy.metrics_text()
    assert "kvrelay_backend_healthy" in text
    for engine in (fleet.prefill, fleet.decode):
        assert engine.url not in text and f":{engine.port}" not in text
    for name in _engine_names(fleet).values():
        assert f'backend="{name}"' in text


def test_version_lists_engines_only_to_a_key_and_their_names_cannot_be_hashed_back(
    secure_fleet: SecureFleet,
) -> None:
    # Anyone gets the proxy's version (vLLM's answer); only a tenant gets the engines, named by
    # a hash keyed with the deployment's secret: hashing candidate addresses finds none of them.
    fleet = secure_fleet
    anonymous = httpx.get(fleet.proxy.url + "/version", timeout=10)
    assert anonymous.status_code == 200 and set(anonymous.json()) == {"version"}
    wrong = httpx.get(fleet.proxy.url + "/version", headers={"Authorization": "Bearer x"})
    assert set(wrong.json()) == {"version"}
    listed = httpx.get(fleet.proxy.url + "/version", headers=fleet.b, timeout=10).json()
    names = {e["engine"] for e in listed["engines"]}
    assert names == set(_engine_names(fleet).values())
    for engine in (fleet.prefill, fleet.decode):
        for role in ("prefill", "decode"):
            plain = f"{role}-{hashlib.sha256(engine.url.encode()).hexdigest()[:8]}"
            assert plain not in names


def test_metrics_show_urls_only_when_the_operator_opts_in(tight_proxy: ProxyServer) -> None:
    text = tight_proxy.metrics_text()  # this proxy has no metrics key: open
    for engine in tight_proxy.decode:
        assert not isinstance(engine, str)
        assert f'backend="{engine.url}"' in text


# -- protocol errors and unencodable text ----------------------------------------------------------


def test_malformed_http_is_one_warning_line_without_traceback(secure_fleet: SecureFleet) -> None:
    fleet = secure_fleet
    before = len(fleet.logs()["proxy"])
    for raw in (b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
                b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n"):  # fmt: skip
        with connect(fleet.proxy.url) as sock:
            sock.sendall(raw)
            assert read_response(sock).status == 400

    def logged() -> str:
        return fleet.logs()["proxy"][before:]

    wait_until(lambda: logged().count("malformed HTTP") >= 2, 10, what="the protocol errors")
    new = logged()
    assert "Traceback" not in new and " ERROR " not in new, new
    lines = [line for line in new.splitlines() if "malformed HTTP" in line]
    assert len(lines) == 2 and all(" WARNING " in line for line in lines), lines


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_lone_surrogate_is_a_400_for_its_sender_and_ejects_nothing(
    secure_fleet: SecureFleet, route: str
) -> None:
    fleet = secure_fleet
    if route == "chat":
        path, body = (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]},
        )
    else:
        path, body = "/v1/completions", {"model": MODEL, "prompt": "a\udfffb", "max_tokens": 2}
    for _ in range(6):  # more than eject_after_failures
        resp = httpx.post(
            fleet.proxy.url + path,
            content=json.dumps(body).encode(),
            headers={**fleet.b, "Content-Type": "application/json"},
            timeout=30,
        )
        err = _shaped(resp, 400)["error"]
        assert "surrogate" in err["message"], err
    assert httpx.get(fleet.proxy.url + "/ready").json() == {
        "ready": True, "prefill_healthy": 1, "decode_healthy": 1}  # fmt: skip
    ok = httpx.post(fleet.proxy.url + "/v1/chat/completions", json=CHAT, headers=fleet.a,
                    timeout=60)  # fmt: skip
    assert ok.status_code == 200, ok.text
