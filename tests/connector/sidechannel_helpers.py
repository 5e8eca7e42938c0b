"""Helpers for in-process scheduler tests: hold a request, run a holder's engine step."""

from __future__ import annotations

import socket
import time
from typing import Any

from connector.auth import destination, sign_headers
from connector.metadata import RequestView
from connector.scheduler import ConnectorScheduler
from tests.connector.peer import SECRET


def hold_params(
    sched: ConnectorScheduler, rid: str, n_tokens: int = 10, client: str | None = None
) -> dict[str, Any]:
    tokens = list(range(n_tokens + 1))
    view = RequestView(rid, client, tokens[:n_tokens], tokens, {"do_remote_decode": True})
    blocks = list(range(100, 100 + (n_tokens + 3) // 4 + 1))
    delay, params = sched.request_finished(view, [blocks])
    assert delay and params is not None
    return params


def drain(sched: ConnectorScheduler) -> set[str]:
    """One engine step as a holder with no readers: free what the scheduler ordered freed."""
    frees = sched.build_connector_meta().reqs_to_free
    sched.update_connector_output(frees, set(), set())
    return frees


def signed(port: int, method: str, path: str, body: bytes = b"") -> dict[str, str]:
    """Headers of one correctly signed side-channel request to the holder at `port`."""
    dest = destination("127.0.0.1", port)
    return {
        "Content-Type": "application/json",
        **sign_headers(SECRET.encode(), method, path, body, dest=dest),
    }


def raw_request(port: int, head: bytes, body_parts: list[bytes]) -> bytes:
    """Send one HTTP request in separate TCP segments (each part flushed on its own)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(head)
        for part in body_parts:
            # The server must already be waiting on the body when the next part arrives.
            sock.sendall(part)
            time.sleep(0.1)  # segment spacing on the wire, not synchronisation
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data
