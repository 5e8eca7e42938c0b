"""Tenant isolation and address control.

A tenant (API key) cannot reuse, delete or probe another tenant's conversation, even with the
same conversation id or the same message history; and no client-controlled field can make the
proxy or an engine open a connection to an address the client chose (only engine-supplied
params ever reach `remote_host`).
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvrelay.devtools import chaos_load
from kvrelay.enginesim.reference import reference_chat
from tests.harness import wait_until
from tests.security.conftest import SecureFleet

MODEL = "kvrelay-sim"
SYSTEM = {"role": "system", "content": "You keep secrets for tenants. " * 8}


def _chat(fleet: SecureFleet, headers: dict[str, str], messages: list[dict[str, Any]],
          **extra: Any) -> httpx.Response:  # fmt: skip
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, **extra}
    return httpx.post(fleet.proxy.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=60)  # fmt: skip


def _answer(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    text: str = resp.json()["choices"][0]["message"]["content"]
    return text


def _hits(fleet: SecureFleet) -> float:
    return fleet.proxy.metrics().get('kvrelay_reuse_total{result="hit"}', 0.0)


def _loaded(fleet: SecureFleet) -> float:
    return fleet.prefill.metric("enginesim_prompt_tokens_loaded_total")


@pytest.mark.parametrize("explicit_id", [True, False], ids=["same-id", "same-history"])
def test_tenant_cannot_reuse_consume_or_delete_anothers_conversation(
    secure_fleet: SecureFleet, explicit_id: bool
) -> None:
    fleet = secure_fleet
    conv = f"shared-{explicit_id}"
    a = {**fleet.a, "X-Conversation-Id": conv} if explicit_id else fleet.a
    b = {**fleet.b, "X-Conversation-Id": conv} if explicit_id else fleet.b
    messages = [SYSTEM, {"role": "user", "content": f"My secret is {conv}. Remember it."}]
    first = _answer(_chat(fleet, a, messages))
    follow = [*messages, {"role": "assistant", "content": first},
              {"role": "user", "content": "What was my secret?"}]  # fmt: skip

    # B replays A's exact history (and id): answered correctly, but from scratch.
    hits, loaded = _hits(fleet), _loaded(fleet)
    assert _answer(_chat(fleet, b, follow)) == reference_chat(follow, 8)
    assert _hits(fleet) == hits and _loaded(fleet) == loaded

    if explicit_id:
        # B cannot end A's conversation, and cannot tell it exists: the same answer as for
        # an id nobody ever used.
        mine = httpx.delete(f"{fleet.proxy.url}/v1/conversations/{conv}-b-never", headers=fleet.b)
        theirs = httpx.delete(f"{fleet.proxy.url}/v1/conversations/{conv}", headers=fleet.b)
        # B's own turn above stored an entry under B's namespace; remove it first.
        assert theirs.status_code == 200
        theirs = httpx.delete(f"{fleet.proxy.url}/v1/conversations/{conv}", headers=fleet.b)
        assert theirs.status_code == mine.status_code == 404
        assert chaos_load.is_openai_error(theirs.json())
        assert theirs.json()["error"]["code"] == mine.json()["error"]["code"]

    # A's entry survived B's attempts: A's next turn still reuses D's KV.
    hits = _hits(fleet)
    assert _answer(_chat(fleet, a, follow)) == reference_chat(follow, 8)
    assert _hits(fleet) == hits + 1
    if explicit_id:
        assert httpx.delete(f"{fleet.proxy.url}/v1/conversations/{conv}", headers=a).status_code \
            == 200  # fmt: skip


def test_fingerprint_namespace_is_not_addressable(secure_fleet: SecureFleet) -> None:
    """Clients cannot name the proxy's fingerprint-derived ids (e.g. to probe a history)."""
    fleet = secure_fleet
    resp = _chat(fleet, {**fleet.b, "X-Conversation-Id": "fp:0123456789abcdef"},
                 [{"role": "user", "content": "hi"}])  # fmt: skip
    assert resp.status_code == 400 and chaos_load.is_openai_error(resp.json())
    assert resp.json()["error"]["param"] == "conversation_id"


# -- no client-chosen address is ever contacted ----------------------------------------------


class Listener:
    """A TCP listener that counts every connection made to it (accepts and closes)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port: int = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    lst = Listener()
    try:
        yield lst
    finally:
        lst.close()


def _evil_params(port: int) -> dict[str, Any]:
    return {
        "do_remote_decode": True, "do_remote_prefill": True, "remote_engine_id": "SD",
        "remote_request_id": "victim", "remote_host": "127.0.0.1", "remote_port": port,
        "remote_block_ids": [[0, 1, 2]], "remote_num_tokens": 40, "tp_size": 1,
        "remote_blocks_expiry_time": 4e9, "remote_block_hashes": ["0" * 16],
        "release_token": "x", "remote_url": f"http://127.0.0.1:{port}", "hold_blocks": True,
    }  # fmt: skip


def test_client_fields_never_make_anyone_contact_a_chosen_address(
    secure_fleet: SecureFleet, listener: Listener
) -> None:
    fleet = secure_fleet
    port = listener.port
    evil = _evil_params(port)
    target = f"127.0.0.1:{port}"
    user = [SYSTEM, {"role": "user", "content": "hello"}]
    base = fleet.proxy.url

    # 1. Client kv_transfer_params: refused outright on both routes, stream or not.
    for path, body in (
        ("/v1/chat/completions", {"model": MODEL, "messages": user, "kv_transfer_params": evil}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "kv_transfer_params": evil}),
        ("/v1/chat/completions", {"model": MODEL, "messages": user, "stream": True,
                                  "kv_transfer_params": evil}),
    ):  # fmt: skip
        resp = httpx.post(base + path, json=body, headers=fleet.a, timeout=30)
        assert resp.status_code == 400 and chaos_load.is_openai_error(resp.json()), resp.text
        assert resp.json()["error"]["param"] == "kv_transfer_params"

    # 2. Address-looking values everywhere else a client controls: served normally.
    conv = f"{target}:release"
    attempts: list[tuple[dict[str, str], list[dict[str, Any]], dict[str, Any]]] = [
        ({"X-Conversation-Id": conv}, user, {}),
        ({"X-Conversation-Id": conv}, user, {}),  # second turn: a reuse hit on that id
        ({"X-Forwarded-Host": target, "X-Remote-Url": f"http://{target}"}, user, {}),
        ({}, [SYSTEM, {"role": "user", "content": "hi", "kv_transfer_params": evil}], {}),
        ({}, user, {k: v for k, v in evil.items() if k.startswith("remote_")}),
        ({}, user, {"conversation_id": target, "extra_body": {"kv_transfer_params": evil}}),
    ]
    for extra_headers, messages, fields in attempts:
        resp = _chat(fleet, {**fleet.a, **extra_headers}, messages, **fields)
        assert resp.status_code == 200, resp.text
    # Flush: end both id'd conversations; once D has received those two releases, the
    # proxy's background releaser has run every earlier task too.
    released = fleet.decode.metric("enginesim_connector_releases_received")
    for ended in (target, conv):  # `target`: the body-field id of the last attempt
        assert httpx.delete(f"{base}/v1/conversations/{ended}", headers=fleet.a).status_code == 200
    wait_until(
        lambda: fleet.decode.metric("enginesim_connector_releases_received") >= released + 2,
        15,
        what="the ended conversations' releases to reach D",
    )
    assert listener.connections == 0


def test_reused_request_id_cannot_release_another_tenants_blocks(
    secure_fleet: SecureFleet,
) -> None:
    """X-Request-Id is client-chosen and keys D's published finished params: tenant B reusing
    tenant A's request id and walking away mid-stream must not make the proxy release A's
    held blocks (A's next turn must still pull them)."""
    fleet = secure_fleet
    rid = "rid-" + secrets.token_hex(4)
    conv = "victim-" + secrets.token_hex(4)
    a = {**fleet.a, "X-Conversation-Id": conv, "X-Request-Id": rid}
    messages = [SYSTEM, {"role": "user", "content": "Keep my context warm."}]
    first = _answer(_chat(fleet, a, messages))
    released = fleet.decode.metric("enginesim_connector_releases_received")

    body = {"model": MODEL, "stream": True, "max_tokens": 400,
            "messages": [SYSTEM, {"role": "user", "content": "Talk for a long time."}]}  # fmt: skip
    with httpx.stream("POST", fleet.proxy.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={**fleet.b, "X-Request-Id": rid}) as resp:  # fmt: skip
        assert resp.status_code == 200
        for _ in resp.iter_raw(1):
            break  # B walks away after the first bytes
    # The proxy's clean-up after B's disconnect runs in the background; give it its bounded
    # retry window to act (it releases something, or finds nothing to release).
    with contextlib.suppress(TimeoutError):
        wait_until(
            lambda: fleet.decode.metric("enginesim_connector_releases_received") > released,
            5, what="a release after B's disconnect",
        )  # fmt: skip
    follow = [*messages, {"role": "assistant", "content": first},
              {"role": "user", "content": "Still there?"}]  # fmt: skip
    loaded = _loaded(fleet)
    a_next = {**fleet.a, "X-Conversation-Id": conv}
    assert _answer(_chat(fleet, a_next, follow)) == reference_chat(follow, 8)
    assert _loaded(fleet) > loaded, "A's held blocks were released by B's disconnect"
    ended = httpx.delete(f"{fleet.proxy.url}/v1/conversations/{conv}", headers=fleet.a)
    assert ended.status_code == 200
