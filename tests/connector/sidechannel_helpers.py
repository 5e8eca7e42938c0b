"""Helpers for in-process scheduler tests: hold a request, run a holder's engine step."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvrelay.connector.auth import destination, response_signature, sign_headers
from kvrelay.connector.metadata import RequestView
from kvrelay.connector.protocol import HEADER_NONCE, HEADER_SIGNATURE
from kvrelay.connector.scheduler import ConnectorScheduler
from kvrelay.devtools import nixl_peer


def hold_params(
    sched: ConnectorScheduler,
    rid: str,
    n_tokens: int = 10,
    client: str | None = None,
    next_turn: bool = False,
    owner: str | None = None,
) -> dict[str, Any]:
    """Finish `rid` holding its blocks: a P leg's hold, or (`next_turn`) D's for a later turn
    (`owner`: the tenant the proxy names in `hold_owner`)."""
    tokens = list(range(n_tokens + 1))
    asked: dict[str, Any] = {"hold_blocks": True} if next_turn else {"do_remote_decode": True}
    if owner is not None:
        asked["hold_owner"] = owner
    view = RequestView(rid, client, tokens[:n_tokens], tokens, asked)
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
        **sign_headers(nixl_peer.SECRET.encode(), method, path, body, dest=dest),
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


class FakeHolder:
    """A fake holder (plain HTTP server): answers every POST with `answer`, signed with `key` for
    the request's nonce (or for `nonce`), or unsigned when `key` is None; counts requests."""

    def __init__(
        self,
        key: bytes | None,
        nonce: str | None = None,
        answer: dict[str, Any] | None = None,
    ) -> None:
        fake = self
        raw = json.dumps(
            answer or {"status": "held", "block_ids": [[1, 2]], "num_tokens": 8}
        ).encode()
        self.requests = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                fake.requests += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                if key is not None:
                    signed_for = nonce or self.headers.get(HEADER_NONCE, "")
                    self.send_header(
                        HEADER_SIGNATURE, response_signature(key, signed_for, 200, raw)
                    )
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
