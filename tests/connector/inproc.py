"""Engines of the connector in the test's own process (real NIXL over loopback, CPU caches).

`InProcEngine` is a `ConnectorScheduler` and one `ConnectorWorker` stepped by the test, which
plays the engine: it asks, allocates, ships the metadata and feeds the worker's output back,
in the documented order. A holder that is not stepped does not progress NIXL (no progress
thread), which is how a stalled holder worker looks to its readers. `HungHolder` accepts TCP
connections and never answers: a holder hung after its side channel's accept.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

import torch

from kvrelay.connector.config import ConnectorConfig
from kvrelay.connector.layout import CacheLayout
from kvrelay.connector.metadata import RequestView
from kvrelay.connector.scheduler import ConnectorScheduler
from kvrelay.connector.worker import ConnectorWorker
from kvrelay.devtools import nixl_peer

BS = 16
NUM_BLOCKS = 32


class InProcEngine:
    """Scheduler + one worker rank, stepped by hand (see module docstring)."""

    def __init__(self, engine_id: str, seed: int, **config: Any) -> None:
        cfg: dict[str, Any] = {
            "engine_id": engine_id, "secret": nixl_peer.SECRET, "block_size": BS, "num_layers": 2,
            "dtype": "float32", "model": "m", "kv_layout": "split",
        }  # fmt: skip
        cfg.update(config)
        self.config = ConnectorConfig(**cfg)
        gen = torch.Generator().manual_seed(seed)
        self.caches = {
            f"l{i}": torch.randn((2, NUM_BLOCKS, BS, 4, 8), generator=gen) for i in range(2)
        }
        self.worker = ConnectorWorker(self.config, 0, 1)
        self.worker.register_kv_caches(self.caches, CacheLayout(block_dim=1))
        self.sched = ConnectorScheduler(self.config)
        self.sched.start()
        self.sched.set_xfer_handshake_metadata({0: self.worker.get_handshake_metadata()})
        self.recving: list[str] = []
        self.invalid: set[int] = set()

    def step(self) -> set[str]:
        """One engine step; returns the loads reported over in it."""
        self.worker.start_load_kv(self.sched.build_connector_meta())
        sending, recving = self.worker.get_finished()
        invalid = self.worker.get_block_ids_with_load_errors()
        self.sched.update_connector_output(sending, recving, invalid)
        self.recving.extend(sorted(recving))
        self.invalid |= invalid
        return recving

    def hold(self, rid: str, prompt: list[int], blocks: list[int]) -> dict[str, Any]:
        view = RequestView(rid, None, prompt, [*prompt, 7], {"do_remote_decode": True})
        delay, params = self.sched.request_finished(view, [blocks])
        assert delay and params is not None
        self.step()
        return params

    def load(self, rid: str, prompt: list[int], params: dict[str, Any], blocks: list[int]) -> int:
        """Plan a load of `params` into `blocks` (the engine's allocation); tokens to load."""
        view = RequestView(
            rid, None, prompt, prompt,
            {**params, "do_remote_prefill": True, "do_remote_decode": False},
        )  # fmt: skip
        n, is_async = self.sched.get_num_new_matched_tokens(view, 0)
        self.sched.update_state_after_alloc(view, [blocks], n if is_async else 0)
        return n

    def close(self) -> None:
        self.sched.shutdown()
        self.worker.shutdown()


class HungHolder:
    """A side-channel address that accepts connections and never answers."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._sock.close()
        for conn in self.accepted:
            conn.close()
        self._thread.join(timeout=5)


def prompt_of(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))
