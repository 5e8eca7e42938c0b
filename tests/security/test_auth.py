"""Authentication: client API keys, the admin key, and the engines' side-channel HMAC.

Every refusal must be a clear OpenAI-shaped 401 (proxy) or 401 JSON (side channel), must not
act on the request, and a tenant key must never open the admin API.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from kvrelay.connector.auth import destination, sign_headers, verify_response
from kvrelay.connector.protocol import HEADER_NONCE, HEADER_SIGNATURE, HEADER_TIMESTAMP
from kvrelay.devtools import CONNECTOR_SECRET, chaos_load
from tests.harness import wait_until
from tests.security.conftest import SecureFleet

MODEL = "kvrelay-sim"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def _refused(resp: httpx.Response, code: str) -> None:
    assert resp.status_code == 401, resp.text
    assert chaos_load.is_openai_error(resp.json()), resp.text
    assert resp.json()["error"]["code"] == code
    assert resp.json()["error"]["type"] == "authentication_error"


def _bad_headers(fleet: SecureFleet) -> list[dict[str, str]]:
    return [
        {},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer wrong-key"},
        {"Authorization": f"Basic {fleet.key_a}"},
        {"Authorization": f"Bearer {fleet.key_a.upper()}"},
        {"Authorization": f"Bearer {fleet.key_a}x"},
        {"Authorization": f"Bearer {fleet.key_a[:-1]}"},
        {"Authorization": f"Bearer {fleet.admin_key}"},  # the admin key is not a tenant key
        {"X-Api-Key": fleet.key_a},
    ]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
        ("GET", "/v1/models", None),
        ("DELETE", "/v1/conversations/some-id", None),
        ("POST", "/v1/embeddings", {"model": MODEL, "input": "hi"}),
        ("POST", "/v1/responses", {"model": MODEL, "input": "hi", "stream": True}),
        ("POST", "/tokenize", {"model": MODEL, "prompt": "hi"}),
    ],
)
def test_client_routes_refuse_missing_or_wrong_keys(
    secure_fleet: SecureFleet, method: str, path: str, body: Any
) -> None:
    requests_before = secure_fleet.decode.metric("enginesim_requests_total")
    with httpx.Client(base_url=secure_fleet.proxy.url, timeout=30) as client:
        for headers in _bad_headers(secure_fleet):
            _refused(client.request(method, path, json=body, headers=headers), "invalid_api_key")
        ok = client.request(method, path, json=body, headers=secure_fleet.a)
        assert ok.status_code in (200, 404), ok.text  # 404: no such conversation (authorised)
    # Refused requests never reached an engine (the one allowed request may have).
    assert secure_fleet.decode.metric("enginesim_requests_total") <= requests_before + 1


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/admin/backends", None),
        ("POST", "/admin/backends", {"role": "decode", "url": "http://127.0.0.1:9"}),
        ("POST", "/admin/backends/drain", {"role": "decode", "url": "http://127.0.0.1:9"}),
        ("DELETE", "/admin/backends", {"role": "decode", "url": "http://127.0.0.1:9"}),
    ],
)
def test_admin_routes_need_the_admin_key(
    secure_fleet: SecureFleet, method: str, path: str, body: Any
) -> None:
    admin = secure_fleet.auth(secure_fleet.admin_key)

    def pools(client: httpx.Client) -> dict[str, list[dict[str, Any]]]:
        # The pools' members and states; each engine's load reading changes on its own.
        listing = client.get("/admin/backends", headers=admin).json()
        return {
            role: [{k: v for k, v in b.items() if k != "load"} for b in backends]
            for role, backends in listing.items()
        }

    with httpx.Client(base_url=secure_fleet.proxy.url, timeout=30) as client:
        before = pools(client)
        for headers in [*_bad_headers(secure_fleet)[:-2], secure_fleet.a, secure_fleet.b,
                        {"X-Admin-Key": "wrong"}]:  # fmt: skip
            if headers.get("Authorization") == f"Bearer {secure_fleet.admin_key}":
                continue
            _refused(client.request(method, path, json=body, headers=headers), "invalid_admin_key")
        # Nothing changed in the pools.
        assert pools(client) == before
        listing = client.get("/admin/backends", headers={"X-Admin-Key": secure_fleet.admin_key})
        assert listing.status_code == 200


# -- the side channel -------------------------------------------------------------------------


def _side(fleet: SecureFleet) -> str:
    return f"http://127.0.0.1:{fleet.decode.side_channel_port}"


def _held_turn(fleet: SecureFleet, conversation: str) -> dict[str, str]:
    """Run one turn that leaves D holding blocks; returns the hold's id and release token."""
    body = {**CHAT, "messages": [{"role": "system", "content": "Hold this. " * 30},
                                 {"role": "user", "content": "Hi"}]}  # fmt: skip
    headers = {**fleet.a, "X-Conversation-Id": conversation}
    resp = httpx.post(fleet.proxy.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=60)  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert fleet.decode.metric("enginesim_blocks_held_for_remote") > 0
    entry = fleet.entry(fleet.key_a, conversation)
    assert entry is not None and entry.release_token is not None
    return {"request_id": entry.request_id, "release_token": entry.release_token}


def _signed(port: int, secret: bytes, method: str, path: str, body: bytes = b"",
            now: float | None = None, dest: str | None = None) -> dict[str, str]:  # fmt: skip
    dest = destination("127.0.0.1", port) if dest is None else dest
    return {"Content-Type": "application/json",
            **sign_headers(secret, method, path, body, now, dest=dest)}  # fmt: skip


def test_side_channel_refuses_claims_and_releases_without_the_secret(
    secure_fleet: SecureFleet,
) -> None:
    fleet = secure_fleet
    hold = _held_turn(fleet, "side-1")
    right = CONNECTOR_SECRET.encode()
    path = f"/v1/finished/{hold['request_id']}"
    held = fleet.decode.metric("enginesim_blocks_held_for_remote")
    rejected = fleet.decode.metric("enginesim_connector_auth_rejected")

    release = json.dumps(hold).encode()
    claim = json.dumps({"request_id": hold["request_id"], "reader_engine_id": "evil"}).encode()
    wrong = b"not-the-secret"
    port = fleet.decode.side_channel_port
    elsewhere = destination("127.0.0.1", port + 1)
    attempts: list[tuple[str, str, bytes, dict[str, str]]] = [
        ("POST", "/v1/release", release, {"Content-Type": "application/json"}),
        ("POST", "/v1/release", release, _signed(port, wrong, "POST", "/v1/release", release)),
        ("POST", "/v1/release", release,
         _signed(port, right, "POST", "/v1/release", release, now=time.time() - 3600)),  # stale
        ("POST", "/v1/release", release,
         _signed(port, right, "POST", "/v1/claim", release)),  # signed for another path
        ("POST", "/v1/release", release,
         _signed(port, right, "POST", "/v1/release", b"{}")),  # signed for another body
        ("POST", "/v1/claim", claim, {"Content-Type": "application/json"}),
        ("POST", "/v1/claim", claim, _signed(port, wrong, "POST", "/v1/claim", claim)),
        ("GET", "/v1/handshake", b"", {}),
        ("GET", path, b"", _signed(port, wrong, "GET", path)),
        ("GET", path, b"", {HEADER_TIMESTAMP: "nan", HEADER_SIGNATURE: "00"}),
        ("POST", "/v1/release", release,
         _signed(port, right, "POST", "/v1/release", release, dest=elsewhere)),  # another engine
    ]  # fmt: skip
    with httpx.Client(base_url=_side(fleet), timeout=10) as client:
        for method, p, body, headers in attempts:
            resp = client.request(method, p, content=body, headers=headers)
            assert resp.status_code == 401, (method, p, resp.status_code, resp.text)
            assert "error" in resp.json() and "release_token" not in resp.text
        # Right secret, wrong release token: authenticated but forbidden.
        forged = json.dumps({**hold, "release_token": "guessed"}).encode()
        once = _signed(port, right, "POST", "/v1/release", forged)
        resp = client.post("/v1/release", content=forged, headers=once)
        # The holder signed its answer for this very request.
        assert verify_response(right, once[HEADER_NONCE], resp.status_code, resp.content,
                               resp.headers.get(HEADER_SIGNATURE))  # fmt: skip
        assert resp.status_code == 403
        # The same signed request again is a replay: refused before it is looked at.
        resp = client.post("/v1/release", content=forged, headers=once)
        assert resp.status_code == 401
    # Every refusal was counted. The side channel counts before it answers, but the engine's
    # /metrics is a snapshot its loop republishes every few milliseconds: wait for it.
    wait_until(
        lambda: (
            fleet.decode.metric("enginesim_connector_auth_rejected")
            >= rejected + len(attempts) + 1  # the replay
        ),
        10,
        what="the engine's metrics to show every refused side-channel call",
    )
    # That snapshot is newer than every refused call, and none of them acted: the hold is intact.
    assert fleet.decode.metric("enginesim_blocks_held_for_remote") == held
    # The legitimate path still works and frees the blocks.
    resp = httpx.delete(fleet.proxy.url + "/v1/conversations/side-1", headers=fleet.a, timeout=10)
    assert resp.status_code == 200
    wait_until(
        lambda: fleet.decode.metric("enginesim_blocks_held_for_remote") < held,
        10,
        what="the conversation's blocks to be released",
    )
