"""`EngineRunner`: drives an `EngineCore` on its own thread and bridges it to asyncio.

HTTP handlers (event loop thread) submit, abort and reject through a command queue; outputs
come back through each request's sink, which hops onto the event loop with
`call_soon_threadsafe`. The thread keeps stepping while anything is in flight (the connector
must be polled every step, also while this engine only holds blocks for a remote reader).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvrelay.enginesim.engine import EngineCore
from kvrelay.enginesim.kv_events import KVEventPublisher
from kvrelay.enginesim.request import SimRequest

log = logging.getLogger(__name__)

# Wait between steps: short while loads or queued requests are in flight, a little longer
# when the engine only holds blocks (NIXL still needs polling for remote readers' progress
# and notifications), longest when fully idle.
BUSY_POLL_S = 0.001
HOLDING_POLL_S = 0.004
IDLE_POLL_S = 0.01


class EngineRunner:
    """One engine thread; every `EngineCore` call happens on it."""

    def __init__(self, core: EngineCore, events: KVEventPublisher | None = None) -> None:
        self.core = core
        self._events = events  # KV cache events, published after each step that made some
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="enginesim-engine", daemon=True)
        self.snapshot: dict[str, Any] = {}
        self.error: BaseException | None = None

    def start(self) -> None:
        self._publish()
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread before its next step."""
        self._commands.put(fn)
        self._wake.set()

    def submit(self, req: SimRequest) -> None:
        self.call(lambda: self.core.add_request(req))

    def abort(self, request_id: str) -> None:
        self.call(lambda: self.core.abort(request_id))

    def reject(self, req: SimRequest) -> None:
        self.call(lambda: self.core.reject(req))

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                while True:
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    command()
                self.core.step()
                if self._events is not None:
                    self._events.publish(self.core.take_kv_events())
                self._publish()
                self.core.deliver_outputs()
                busy = self.core.busy
                if busy and self._ready_to_run():
                    continue
                if busy:
                    wait = BUSY_POLL_S
                elif self.core.held:
                    wait = HOLDING_POLL_S
                else:
                    wait = IDLE_POLL_S
                self._wake.wait(wait)
                self._wake.clear()
        except BaseException as exc:  # the engine is dead: make it visible on /health
            self.error = exc
            log.exception("engine thread crashed")
        finally:
            self.core.kv.shutdown()
            if self._events is not None:
                self._events.close()

    def _ready_to_run(self) -> bool:
        # Step again at once when there is compute to do; loads and queues wait for a poll.
        return bool(self.core.running)

    def _publish(self) -> None:
        core = self.core
        snap: dict[str, Any] = dict(core.counters)
        snap.update(
            blocks_total=core.pool.num_blocks,
            block_size=core.pool.block_size,
            blocks_free=core.pool.num_free,
            blocks_held_for_remote=core.num_held_blocks(),
            requests_held=len(core.held),
            requests_waiting=len(core.waiting),
            # Arriving requests still wait for their KV (its modelled transfer time).
            requests_loading=len(core.loading) + len(core.arriving),
            requests_running=len(core.running),
            connector=core.kv.stats(),
            # Modelled step time, and the time the engine thread fell behind it (the host's
            # doing, not the model's: `timeline`).
            modelled_step_seconds=core.timeline.modelled_s,
            behind_model_seconds=core.timeline.behind_s,
            itl_buckets=core.token_gaps.cumulative(),
            itl_sum=core.token_gaps.sum,
            idle_before_evict=None
            if core.pool.residency is None
            else (
                core.pool.residency.idle_before_evict.cumulative(),
                core.pool.residency.idle_before_evict.sum,
            ),
            at=time.time(),
        )
        self.snapshot = snap
