"""A loopback TCP fault injector: a relay `127.0.0.1:port -> target` that delays, drops and
refuses connections on command.

The chaos suite puts one in front of an engine (the proxy is given the relay's URL) and then
injects what a real network does to a fleet: slow peers (`set_delay`), connections reset in
the middle of a request (`drop_all`, RST, not a polite FIN), peers that refuse new connections
(`refuse_next`) and peers that accept but never answer (`blackhole`). It runs its own asyncio
loop on a daemon thread so synchronous tests can drive it; every control call is thread-safe
and bounded. The target may restart on its port at any time: each new client connection opens
a new upstream connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from dataclasses import dataclass, field

from kvrelay.devtools.process import free_port

_CHUNK = 64 * 1024


@dataclass
class FaultCounters:
    """What the relay saw and did (read by tests for their summaries)."""

    connections: int = 0
    refused: int = 0
    dropped: int = 0
    upstream_failures: int = 0
    delayed_chunks: int = 0
    holding: int = 0  # chunks being delayed now (not yet forwarded)


@dataclass
class FaultProxy:
    """TCP relay from `listen_port` to `target_host:target_port` with injectable faults."""

    target_host: str
    target_port: int
    listen_port: int = field(default_factory=free_port)
    counters: FaultCounters = field(default_factory=FaultCounters)
    delay_s: float = 0.0
    _refuse: int = 0
    _blackhole: bool = False
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _server: asyncio.AbstractServer | None = None
    _conns: set[asyncio.StreamWriter] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        loop = asyncio.new_event_loop()
        self._loop = loop
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self._listen())
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._close_all())
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=run, name="faultproxy", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise TimeoutError("fault proxy did not start listening within 10s")
        return self

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(
            self._on_client, "127.0.0.1", self.listen_port, reuse_address=True
        )

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        self._loop = self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- faults (thread-safe) ----------------------------------------------------------------

    def set_delay(self, seconds: float) -> None:
        """Delay every forwarded chunk (both directions) by `seconds`; 0 turns it off."""
        self.delay_s = max(0.0, seconds)

    def refuse_next(self, n: int) -> None:
        """Reset the next `n` new connections as soon as they are accepted."""
        with self._lock:
            self._refuse = max(0, n)

    def blackhole(self, on: bool) -> None:
        """Accept new connections but forward nothing (a hung peer) while on."""
        self._blackhole = on

    def drop_all(self) -> int:
        """Reset every open connection now (RST both ways); returns how many were dropped."""
        loop = self._loop
        if loop is None:
            return 0
        future = asyncio.run_coroutine_threadsafe(self._drop_all(), loop)
        return future.result(timeout=10)

    def heal(self) -> None:
        """Remove every standing fault (delay, refusals, blackhole)."""
        self.set_delay(0.0)
        self.refuse_next(0)
        self.blackhole(False)

    # -- relay -------------------------------------------------------------------------------

    async def _drop_all(self) -> int:
        conns = list(self._conns)
        for writer in conns:
            _reset(writer)
        self.counters.dropped += len(conns)
        return len(conns)

    async def _close_all(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._conns):
            _reset(writer)

    def _take_refusal(self) -> bool:
        with self._lock:
            if self._refuse > 0:
                self._refuse -= 1
                return True
            return False

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.counters.connections += 1
        if self._take_refusal():
            self.counters.refused += 1
            _reset(writer)
            return
        self._conns.add(writer)
        try:
            if self._blackhole:
                # Hold the connection open without answering until the client or a drop ends it.
                await reader.read()
                return
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(self.target_host, self.target_port), timeout=5
                )
            except (OSError, TimeoutError):
                self.counters.upstream_failures += 1
                _reset(writer)
                return
            self._conns.add(up_writer)
            try:
                await asyncio.gather(
                    self._pipe(reader, up_writer),
                    self._pipe(up_reader, writer),
                    return_exceptions=True,
                )
            finally:
                self._conns.discard(up_writer)
                _close(up_writer)
        finally:
            self._conns.discard(writer)
            _close(writer)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await src.read(_CHUNK)
                if not data:
                    break
                if self.delay_s > 0:
                    self.counters.delayed_chunks += 1
                    self.counters.holding += 1
                    try:
                        await asyncio.sleep(self.delay_s)
                    finally:
                        self.counters.holding -= 1
                if dst.is_closing():
                    break
                dst.write(data)
                await dst.drain()
            if not dst.is_closing() and dst.can_write_eof():
                dst.write_eof()  # half-close: HTTP keeps working both ways
        except (OSError, ConnectionError):
            _reset(dst)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Abort with RST (SO_LINGER 0), as a crashed peer or a broken network would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.close()
