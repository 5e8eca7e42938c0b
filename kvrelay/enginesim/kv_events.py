"""enginesim's KV cache events, as vLLM publishes them: `KVEventPublisher`.

With `--kv-events-config` (the JSON vLLM takes: `enable_kv_cache_events`, `publisher` "zmq",
`endpoint`, `topic`) the engine notes every block its prefix cache newly stores and every one
an allocation evicts (`EngineCore.follow_cache`), and after each step that changed the cache
the runner publishes one `KVEventBatch` (`kvrelay.kv_events_wire`) on a ZMQ PUB socket,
numbered from 0 as vLLM numbers them; as vLLM's, the socket binds a wildcard endpoint
(`tcp://*:5557`) and connects to any other. A block is named by a 64-bit hash of its
cache key (the prefix hash of its last token under the request's `cache_salt`), stable within
the process as vLLM's seeded hashes are; its tokens, its parent's hash and the salt (on the
first block) are sent as vLLM sends them, so a reader names blocks as it would vLLM's.

With `replay_endpoint` in the config, as vLLM's publisher, the engine keeps its last
`buffer_steps` batches and answers replay requests on a ZMQ ROUTER socket: a subscriber sends
the first sequence number it wants (8 bytes, big-endian) and gets back every kept batch from
there, then an end mark, in vLLM 0.32's frames (`kvrelay.kv_events_wire.replay_answer`). A
thread of its own serves them, so an idle engine answers too.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

_MASK = (1 << 64) - 1


class StoredBlock(NamedTuple):
    """A block the prefix cache newly stored: its key, its parent's (None: the prompt's first
    block), its tokens and, on a prompt's first block, the request's `cache_salt`."""

    key: Hashable
    parent: Hashable | None
    tokens: Sequence[int]
    salt: str | None


def event_hash(key: Hashable) -> int:
    """A cache key's name in the events (unsigned 64 bits, as vLLM's int block hashes)."""
    return hash(key) & _MASK


class EventsConfig(NamedTuple):
    """What enginesim takes of vLLM's `--kv-events-config`."""

    endpoint: str
    topic: str
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000


def parse_events_config(text: str) -> EventsConfig | None:
    """The events settings from vLLM's `--kv-events-config` JSON; None when events are off."""
    config: dict[str, Any] = json.loads(text)
    if not config.get("enable_kv_cache_events"):
        return None
    publisher = config.get("publisher", "zmq")
    if publisher != "zmq":
        raise ValueError(f"kv events publisher {publisher!r}: only 'zmq' is simulated")
    replay = config.get("replay_endpoint")
    return EventsConfig(
        str(config.get("endpoint", "tcp://*:5557")),
        str(config.get("topic", "")),
        None if replay is None else str(replay),
        int(config.get("buffer_steps", 10_000)),
    )


def _bind_or_connect(sock: Any, endpoint: str) -> None:
    """As vLLM: a wildcard or ipc endpoint is bound, any other one connected to."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


class KVEventPublisher:
    """A ZMQ PUB socket and the sequence numbering (engine thread only: sockets are not
    thread-safe). A slow subscriber loses messages at the high-water mark, as vLLM's."""

    def __init__(
        self,
        endpoint: str,
        topic: str,
        block_size: int,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        replay_send_hwm: int | None = None,
    ) -> None:
        """`replay_send_hwm`: the replay socket's send queue per reader (None: ZMQ's default,
        1000 messages, as vLLM leaves it; past it the socket drops what it sends that reader).
        """
        import zmq

        from kvrelay import kv_events_wire

        self._wire = kv_events_wire
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        _bind_or_connect(self._sock, endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._block_size = block_size
        self._seq = 0
        self._drop = 0  # batches still to lose on the PUB socket (`drop_next`)
        # The batches kept for replay, (seq, payload), shared with the replay thread.
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=max(1, buffer_steps))
        self._kept_lock = threading.Lock()
        self._replay_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            if replay_send_hwm is not None:
                router.setsockopt(zmq.SNDHWM, replay_send_hwm)
            _bind_or_connect(router, replay_endpoint)
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_thread = threading.Thread(
                target=self._serve_replays, args=(router,), daemon=True, name="kv-events-replay"
            )
            self._replay_thread.start()

    def _serve_replays(self, router: Any) -> None:
        """Answer replay requests until closed (the ROUTER socket is this thread's alone)."""
        try:
            while not self._stopping.is_set():
                if not router.poll(100):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3:
                    continue  # not a replay request, as vLLM ignores it
                client, _, start = frames
                first = int.from_bytes(start, "big")
                with self._kept_lock:
                    kept = [(seq, payload) for seq, payload in self._kept if seq >= first]
                w = self._wire
                for seq, payload in kept:
                    router.send_multipart((client, *w.replay_answer(self._topic, seq, payload)))
                router.send_multipart((client, *w.replay_answer(b"", w.REPLAY_END, b"")))
        finally:
            router.close(linger=0)

    def publish(self, changes: Sequence[StoredBlock | Hashable]) -> None:
        """One batch for one step's changes, in the order they happened: a `StoredBlock` for
        each block cached, the key of each block evicted (nothing sent when nothing changed).
        The order matters: a key evicted and then cached again in one step is cached."""
        if not changes:
            return
        w = self._wire
        events: list[Any] = []
        last_key: Hashable | None = None
        for change in changes:
            if not isinstance(change, StoredBlock):
                last_key = None
                if events and isinstance(events[-1], w.BlockRemoved):
                    events[-1].block_hashes.append(event_hash(change))
                else:
                    events.append(
                        w.BlockRemoved(block_hashes=[event_hash(change)], medium=w.GPU_MEDIUM)
                    )
                continue
            block = change
            if (
                events
                and isinstance(events[-1], w.BlockStored)
                and block.parent is not None
                and block.parent == last_key
            ):
                run = events[-1]  # the next block of the same prompt: one event, as vLLM's
                run.block_hashes.append(event_hash(block.key))
                run.token_ids.extend(block.tokens)
                if run.extra_keys is not None:
                    run.extra_keys.append(None)
            else:
                events.append(
                    w.BlockStored(
                        block_hashes=[event_hash(block.key)],
                        parent_block_hash=(
                            None if block.parent is None else event_hash(block.parent)
                        ),
                        token_ids=list(block.tokens),
                        block_size=self._block_size,
                        medium=w.GPU_MEDIUM,
                        extra_keys=[[block.salt]] if block.salt else None,
                    )
                )
            last_key = block.key
        batch = w.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)
        frames = w.frames(self._topic, self._seq, batch)
        if self._drop > 0:
            self._drop -= 1
        else:
            self._sock.send_multipart(frames)
        if self._replay_thread is not None:  # kept only where a replay can ask for them
            with self._kept_lock:
                self._kept.append((self._seq, frames[2]))
        self._seq += 1

    def drop_next(self, batches: int) -> None:
        """Fault injection: the next `batches` are numbered (and kept for replay, with a
        replay endpoint) but never sent, as a PUB socket drops messages past its high-water
        mark."""
        self._drop = max(0, batches)

    def close(self) -> None:
        self._stopping.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()
