"""The fault injector itself (fast, runs in the default suite): it relays, and each fault does
what the chaos suite relies on it to do."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvrelay.devtools import FaultProxy
from tests.harness import wait_until


class EchoServer:
    """Echoes every byte back, one thread per connection."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # a reset from the relay ends it
            while data := conn.recv(4096):
                conn.sendall(data)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def relay() -> Iterator[FaultProxy]:
    echo = EchoServer()
    proxy = FaultProxy("127.0.0.1", echo.port).start()
    try:
        yield proxy
    finally:
        proxy.stop()
        echo.close()


def _connect(relay: FaultProxy) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", relay.listen_port), timeout=5)
    sock.settimeout(5)
    return sock


def test_relays_bytes_both_ways(relay: FaultProxy) -> None:
    with _connect(relay) as sock:
        sock.sendall(b"hello")
        assert sock.recv(100) == b"hello"
    assert relay.counters.connections == 1


def test_delay_slows_each_chunk(relay: FaultProxy) -> None:
    relay.set_delay(0.3)
    with _connect(relay) as sock:
        start = time.monotonic()
        sock.sendall(b"x")
        assert sock.recv(10) == b"x"
        # Two relayed chunks (there and back), each delayed.
        assert time.monotonic() - start >= 0.5
    assert relay.counters.delayed_chunks >= 2


def test_refused_connections_are_reset(relay: FaultProxy) -> None:
    relay.refuse_next(1)
    # The reset may surface at connect, send or receive time.
    with pytest.raises((ConnectionResetError, BrokenPipeError)), _connect(relay) as sock:
        sock.sendall(b"x")
        if not sock.recv(10):
            raise ConnectionResetError("closed")
    wait_until(lambda: relay.counters.refused == 1, 5, what="the refusal to be counted")
    with _connect(relay) as sock:  # only the next one was refused
        sock.sendall(b"y")
        assert sock.recv(10) == b"y"
    assert relay.counters.refused == 1


def test_drop_all_resets_open_connections(relay: FaultProxy) -> None:
    with _connect(relay) as sock:
        sock.sendall(b"a")
        assert sock.recv(10) == b"a"
        assert relay.drop_all() >= 1
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            if not sock.recv(10):
                raise ConnectionResetError("closed")


def test_blackhole_accepts_but_never_answers(relay: FaultProxy) -> None:
    relay.blackhole(True)
    with _connect(relay) as sock:
        sock.settimeout(0.3)
        sock.sendall(b"z")
        with pytest.raises(TimeoutError):
            sock.recv(10)
    relay.heal()
    with _connect(relay) as sock:
        sock.sendall(b"w")
        assert sock.recv(10) == b"w"
