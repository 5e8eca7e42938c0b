"""`EncodingProcess`: the tokenizer with its `encode` in a process of its own.

vLLM tokenizes in its API server process, apart from the engine core that steps the model, so
encoding a long prompt (or a router's `/tokenize` of it) never holds up a step. enginesim
serves HTTP and steps its engine in one interpreter: a 15k-token prompt's encoding holds the
interpreter lock for milliseconds, during which the engine's thread cannot run its modelled
step, and on a host that runs a whole simulated fleet that shows as engines running behind
their model (bench/RESULTS.md, run O). With `--tokenizer-process` the HTTP side's `encode`
calls go over a pipe to a child process and the caller waits on the pipe, the lock free. The
child keeps the tokenizer's cache of recent texts, so a router's `/tokenize` and the request
that follows it encode the prompt once, as in one process.

Decoding (one token at a time, on the engine's thread) stays in this process. The child exits
when its pipe closes: when `close` is called, or when this process dies and the pipe with it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
from multiprocessing.connection import Connection

from kvrelay.enginesim.tokenizer import Tokenizer

# Seconds `close` waits for the child to exit before it is terminated.
_CLOSE_WAIT_S = 5.0


def _serve(conn: Connection) -> None:
    """The child: encode each (text, parse_special) received, answer the ids or the error."""
    tokenizer = Tokenizer()
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed its end, or died
        if request is None:
            return
        text, parse_special = request
        try:
            answer: list[int] | BaseException = tokenizer.encode(text, parse_special=parse_special)
        except Exception as exc:  # the caller's error to raise (a lone surrogate: a 400)
            answer = exc
        conn.send(answer)


class EncodingProcess(Tokenizer):
    """A `Tokenizer` whose `encode` runs in a child process (see the module docstring); every
    other method runs here. Thread-safe: one request on the pipe at a time."""

    def __init__(self) -> None:
        super().__init__()
        # spawn, not fork: this process runs threads (the engine's, NIXL's), and a forked
        # child would inherit their locks in whatever state they were.
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self._child = context.Process(
            target=_serve, args=(child_end,), name="enginesim-tokenizer", daemon=True
        )
        self._child.start()
        child_end.close()  # the child's end lives in the child: its death closes the pipe
        self._lock = threading.Lock()

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        with self._lock:
            self._conn.send((text, parse_special))
            answer = self._conn.recv()
        if isinstance(answer, BaseException):
            raise answer
        ids: list[int] = answer
        return ids

    @property
    def pid(self) -> int | None:
        return self._child.pid

    def close(self) -> None:
        """Stop the child: its pipe closed, it exits (terminated if it does not)."""
        with self._lock:
            if self._conn.closed:
                return
            with contextlib.suppress(OSError):  # the child already gone
                self._conn.send(None)
            self._conn.close()
        self._child.join(_CLOSE_WAIT_S)
        if self._child.is_alive():
            self._child.terminate()
            self._child.join(_CLOSE_WAIT_S)
