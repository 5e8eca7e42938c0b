"""A raw HTTP/1.1 client on a socket, for requests real clients refuse to send: header bytes
that are not UTF-8, malformed requests, bodies trickled a byte at a time."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def connect(url: str, timeout: float = 10.0) -> socket.socket:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


def request_head(
    method: str, path: str, headers: list[tuple[bytes, bytes]], length: int | None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1"]
    lines += [name + b": " + value for name, value in headers]
    if length is not None:
        lines.append(f"Content-Length: {length}".encode())
    return b"\r\n".join(lines) + b"\r\n\r\n"


def read_response(sock: socket.socket) -> RawResponse:
    """One response (Content-Length bodies only, which the proxy's errors have)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return RawResponse(int(status_line.split()[1]), headers, rest[:length])


def send(
    url: str, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes = b""
) -> RawResponse:
    with connect(url) as sock:
        length = len(body) if body or method in ("POST", "DELETE") else None
        sock.sendall(request_head(method, path, headers, length) + body)
        return read_response(sock)


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes the connection within `timeout` (reads and drops data)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except ConnectionError:
            return True
    return False
