"""`FakeRefusingDecode`: a decode engine that refuses every completion with 503, as an
overloaded vLLM does, and answers everything else (health, models, `/tokenize`) by asking a
real engine behind it. A real HTTP server on loopback; the fake is only in what it answers.

It has no `/metrics`, so the proxy reads no load from it (it never looks busy), and no side
channel: it takes non-streamed turns only, which is all a refusal needs.
"""

from __future__ import annotations

import http.server
import threading
import urllib.error
import urllib.request
from typing import Any

from kvrelay.devtools import free_port

_REFUSAL = b'{"error": {"message": "fake: overloaded", "type": "ServiceUnavailable", "code": 503}}'


class _QuietServer(http.server.ThreadingHTTPServer):
    """A client (the proxy's pool) closing a kept-alive connection is no error here."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class FakeRefusingDecode:
    """Refuses completions (counted in `refused`); forwards the rest to `behind`."""

    def __init__(self, behind: str) -> None:
        self.behind = behind.rstrip("/")
        self.refused = 0
        self._lock = threading.Lock()
        self._server = _QuietServer(("127.0.0.1", free_port()), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeRefusingDecode:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _forward(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        request = urllib.request.Request(
            self.behind + path, data=body, method=method,
            headers={"Content-Type": "application/json"} if body is not None else {},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: the test asserts on counts

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path.startswith("/metrics"):
                    self._answer(404, b'{"error": "fake: no metrics"}')
                    return
                self._answer(*fake._forward("GET", self.path, None))

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.startswith("/tokenize"):
                    self._answer(*fake._forward("POST", self.path, body))
                    return
                with fake._lock:
                    fake.refused += 1
                self._answer(503, _REFUSAL)

        return Handler
