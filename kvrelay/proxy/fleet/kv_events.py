"""The engines' KV cache events, followed into the `BlockIndex`: `KVEventsFeed`.

vLLM started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'` publishes on a ZMQ PUB socket one message per scheduler step
that changed its cache: three frames, the topic, an 8-byte big-endian sequence number counting
from 0, and a msgpack `KVEventBatch` (`[ts, [event, ...], data_parallel_rank]`, each event a
map tagged `type`: `BlockStored`, `BlockRemoved` or `AllBlocksCleared`; `vllm/distributed/
kv_events.py`). enginesim publishes the same messages from its in-pool cache.

The feed subscribes to every engine of the P and D pools (an engine's endpoint is
`kv_events_endpoints` [its URL], else its host at `kv_events_port`), follows the pools as
discovery changes them, and applies each batch to the index. A P's events say which prefixes it
can serve a turn from; a D's say which prompts it decoded are still in its cache (a
conversation's history among them, held or not), for a P to pull (`Router._pull_source`) or a
spill to be sent to. ZMQ reconnects by itself; what an engine published while this
worker was not connected is missed, so:
- a sequence number that skips ahead (a gap) or goes back (the engine restarted) clears what
  the index has of that engine, and it is learnt again from the events after;
- an engine leaving the pool, failing its health probes, or dropping this worker's connection
  to its events (closed, or silent for three ZMTP heartbeats, one per probe interval) is
  cleared the same way;
- blocks whose parent the index never saw (cached before it subscribed) cannot be named and
  are skipped (`BlockIndex.stored`): the index only ever under-reports a cache.
Whether the feed is connected to an engine (its ZMQ handshake done, so what the engine publishes
from then on arrives) is watched through the socket's monitor: `connected`, the admin API's
`kv_events_connected` and the `kvrelay_kv_events_connected` gauge, for an endpoint that is
wrong or unreachable, which ZMQ itself retries in silence.
An engine started with a `replay_endpoint` too (vLLM keeps its last `buffer_steps` batches, 10,000
by default, and resends them from a sequence number asked on a ZMQ ROUTER socket), and given
to the proxy (`kv_events_replay_endpoints`, else its host at `kv_events_replay_port`), is asked
for them instead of being forgotten blind: on each connection every batch it keeps (a proxy
started or reconnected late learns the cache those built), and at a gap the batches missed,
the live ones after it kept back meanwhile (`EngineEvents.replayed`). Only what the engine no
longer keeps, or a replay left `REPLAY_TIMEOUT_S` without an answer or its next part, still
forgets it. A worker reads `REPLAYS_AT_ONCE` replays at once, `READ_AT_ONCE` messages of one
between two turns of its loop, and queues an answer without limit: a proxy started after a
large fleet learns it without stalling its requests, and without the gaps vLLM's replay socket
leaves when a reader's queue is full (bench/kv_events_replay.py).
Only blocks in GPU memory count (`medium` "GPU", or unset); offloaded tiers are not routed to.

The message shapes are `kvrelay.kv_events_wire`'s. Needs `pyzmq` and `msgspec` (the
`kv-events` extra), imported only when events are on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

from kvrelay.proxy.base import cancel_and_wait
from kvrelay.proxy.fleet.block_index import BlockIndex
from kvrelay.proxy.fleet.pools import Pool
from kvrelay.proxy.telemetry import metrics

log = logging.getLogger(__name__)

# A subscription sends a ZMTP heartbeat every probe interval (at least this often: a loaded
# host must not drop a live link) and drops the connection after this many go unanswered.
MIN_HEARTBEAT_S = 1.0
HEARTBEATS_MISSED = 3
# How long an engine may leave a replay request unanswered, and an answer under way without
# its next part (vLLM sends one in a loop between two of its publishing steps, so a second is
# plenty), after which it is forgotten instead.
REPLAY_TIMEOUT_S = 5.0
# Replayed batches applied between two turns of the event loop.
REPLAY_CHUNK = 64
# Replays one worker reads at once. Each reads and applies its answer a part at a time, between
# the loop's turns; a proxy started after a fleet of 64 engines, asking all of them at once,
# would have every turn of its loop wait for a part of each (bench/kv_events_replay.py). An
# engine whose replay waits for one of these looks again every `REPLAY_SLOT_WAIT_MS`, its live
# messages kept back meanwhile.
REPLAYS_AT_ONCE = 4
REPLAY_SLOT_WAIT_MS = 50
# Messages read off one socket between two turns of the event loop: an engine answering a
# replay sends thousands back to back, and a socket read until it is empty would keep the loop
# (every request of this worker) waiting for as long as they keep coming.
READ_AT_ONCE = 64


def events_endpoint(url: str, endpoints: Mapping[str, str], port: int) -> str | None:
    """Where the engine at `url` publishes its KV events: `endpoints[url]`, else its host at
    `port` (0: not known, no subscription)."""
    explicit = endpoints.get(url) or endpoints.get(url.rstrip("/"))
    if explicit:
        return explicit
    if port <= 0:
        return None
    host = urlsplit(url).hostname
    if not host:
        return None
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _in_gpu_memory(event: Any, gpu_medium: str) -> bool:
    """The event is about the engine's GPU prefix cache (its one attention group), not an
    offloaded tier; `AllBlocksCleared` carries neither field and always is."""
    medium, group = getattr(event, "medium", None), getattr(event, "group_idx", None)
    return medium in (None, gpu_medium) and group in (None, 0)


async def _received(sock: Any) -> list[list[bytes]]:
    """The messages `sock` has received so far, in order, at most `READ_AT_ONCE` (the rest
    stay queued, and the socket polls ready again), without waiting for more."""
    import zmq

    messages: list[list[bytes]] = []
    while len(messages) < READ_AT_ONCE:
        try:
            messages.append(await sock.recv_multipart(flags=zmq.NOBLOCK))
        except zmq.Again:
            break
    return messages


async def _drain(sock: Any, stream: EngineEvents) -> None:
    """Apply the messages `sock` has received, in order, without waiting for more (at most
    `READ_AT_ONCE`: the rest on the loop's next turn)."""
    for frames in await _received(sock):
        try:
            stream.take(frames)
        except Exception:  # a batch this worker cannot apply: forget, go on
            log.exception("a KV event batch could not be applied")
            stream.forget()


class _Replay:
    """One replay request to an engine's replay endpoint (vLLM's ROUTER socket): the first
    batch wanted sent on a DEALER socket of its own (so a late answer to an abandoned request
    never mixes with the next one), the batches gathered until the end mark or the deadline."""

    def __init__(self, ctx: Any, endpoint: str, first: int) -> None:
        import zmq

        from kvrelay import kv_events_wire

        self._wire: ModuleType = kv_events_wire
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # No cap on what is queued here: the engine's ROUTER drops what it cannot queue for a
        # reader whose queue is full (vLLM sends a whole replay in one loop), which would leave
        # gaps in the answer; the answer is at most the engine's `buffer_steps` batches.
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        self.sock.send_multipart(kv_events_wire.replay_request(first))
        self._deadline = time.monotonic() + REPLAY_TIMEOUT_S
        self._batches: list[tuple[int, bytes]] = []

    def left_ms(self) -> int:
        return max(0, round(1000 * (self._deadline - time.monotonic())))

    async def read(self) -> list[tuple[int, bytes]] | None:
        """What has arrived; the whole answer once its end mark is read, else None. The
        deadline counts from the last part received: a long answer read at the loop's pace is
        not an engine that stopped answering."""
        received = await _received(self.sock)
        if received:
            self._deadline = time.monotonic() + REPLAY_TIMEOUT_S
        for frames in received:
            batch = self._wire.replayed_batch(frames)
            if batch is None:
                continue
            if batch[0] == self._wire.REPLAY_END:
                return self._batches  # nothing follows an end mark
            self._batches.append(batch)
        return None

    def close(self) -> None:
        self.sock.close(linger=0)


def _connected(stream: EngineEvents, now: bool) -> None:
    """The feed's connection to `stream`'s engine is now up or down."""
    stream.connected = now
    metrics.KV_EVENTS_CONNECTED.inc(1 if now else -1)


class EngineEvents:
    """One engine's event stream applied to the index, in order (`take`).

    With a replay endpoint (`replays`) a gap is not forgotten: the live messages after it are
    kept back (`pending`) while the missed batches are asked for again (`replay_from`, served
    by `KVEventsFeed`), then `replayed` applies those and the kept-back ones in order. Only
    when the engine no longer keeps the missed batches is it forgotten, as without replay."""

    def __init__(self, url: str, index: BlockIndex, replays: bool = False) -> None:
        self.url = url
        self._index = index
        from kvrelay import kv_events_wire

        self._wire: ModuleType = kv_events_wire
        self._last_seq: int | None = None
        self.connected = False  # the subscription's handshake with the engine is done
        self.replays = replays
        # The first batch to ask the engine for again, until the feed asks (then None).
        self.replay_from: int | None = None
        self._pending: list[list[bytes]] | None = None  # live messages kept back meanwhile

    @property
    def replaying(self) -> bool:
        """A replay is wanted or awaited: live messages are kept back until it ends."""
        return self._pending is not None

    def forget(self) -> None:
        """What the index has of this engine is no longer known to be true."""
        self._index.cleared(self.url)

    def relearn(self) -> None:
        """A new connection: forget the engine and, with replay, ask for every batch it still
        keeps (its cache as those batches built it, the older part of it unnamed)."""
        self.forget()
        self._last_seq = None
        if self.replays:
            self._pending, self.replay_from = [], 0

    async def replayed(self, batches: Sequence[tuple[int, bytes]] | None) -> None:
        """The replay asked for ended: the batches the engine sent back (`[seq, payload]`, in
        order), None when it did not answer in time (what was missed stays unknown). They are
        applied `REPLAY_CHUNK` at a time (a replay may carry thousands: the proxy's turns run
        between the parts, live messages still kept back), then the live messages kept back;
        a batch still missing then forgets the engine, as a gap without replay does."""
        kept = batches or ()
        for at in range(0, len(kept), REPLAY_CHUNK):
            for seq, payload in kept[at : at + REPLAY_CHUNK]:
                self._in_order(seq, payload, replay_gaps=False, live=False)
            await asyncio.sleep(0)  # a yield to the loop, not a wait
        pending, self._pending, self.replay_from = self._pending or [], None, None
        if batches is not None:
            metrics.KV_EVENTS_REPLAYS.labels("answered").inc()
        else:
            metrics.KV_EVENTS_REPLAYS.labels("timeout").inc()
            self.forget()  # learnt again from here
            self._last_seq = None
        for frames in pending:
            self._take(frames, replay_gaps=False)

    def take(self, frames: list[bytes], now: float | None = None) -> None:
        """Apply one message (`[topic, seq, payload]`), or keep it back during a replay."""
        if self._pending is not None:
            self._pending.append(frames)
            return
        self._take(frames, self.replays, now)

    def _take(self, frames: list[bytes], replay_gaps: bool, now: float | None = None) -> None:
        if len(frames) != 3:
            metrics.KV_EVENTS.labels("malformed").inc()
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if replay_gaps and self._last_seq is not None and seq > self._last_seq + 1:
            # Missed batches: asked for again; this one and those after wait for them.
            metrics.KV_EVENTS_GAPS.labels("gap").inc()
            self._pending, self.replay_from = [frames], self._last_seq + 1
            return
        self._in_order(seq, frames[2], replay_gaps, now)

    def _in_order(
        self,
        seq: int,
        payload: bytes,
        replay_gaps: bool,
        now: float | None = None,
        live: bool = True,
    ) -> None:
        last = self._last_seq
        after_replay = self.replays and not replay_gaps
        if last is not None and after_replay and seq <= last:
            return  # a batch the replay already carried
        self._last_seq = seq
        if last is not None and seq != last + 1:
            # Missed batches (a gap) or a publisher counting from 0 again (a restart): either
            # way some blocks' fate is unknown, so all of this engine's are forgotten.
            if after_replay:
                metrics.KV_EVENTS_REPLAYS.labels("short").inc()  # no longer kept by the engine
            else:
                metrics.KV_EVENTS_GAPS.labels("restart" if seq <= last else "gap").inc()
            self.forget()
        self._apply(payload, now, live)

    def _apply(self, payload: bytes, now: float | None, live: bool) -> None:
        w = self._wire
        try:
            batch = w.DECODER.decode(payload)
        except w.DecodeError:
            metrics.KV_EVENTS.labels("malformed").inc()
            self.forget()
            return
        if live:  # a replayed batch's stamp says when it was first sent
            metrics.KV_EVENTS_LAG.observe(max(0.0, (now or time.time()) - batch.ts))
        index, url = self._index, self.url
        for event in batch.events:
            if not _in_gpu_memory(event, w.GPU_MEDIUM):
                continue
            if isinstance(event, w.BlockStored):
                adopted = index.adopted
                recorded = index.stored(
                    url,
                    event.block_hashes,
                    event.parent_block_hash,
                    event.token_ids,
                    event.block_size,
                    event.extra_keys,
                )
                if index.adopted != adopted:
                    kind = "adopted"  # its parent named through a prompt routed there
                elif recorded:
                    kind = "stored"
                else:
                    kind = "orphaned"  # its parent unknown, no routed prompt names it
                metrics.KV_EVENTS.labels(kind).inc()
            elif isinstance(event, w.BlockRemoved):
                index.removed(url, event.block_hashes)
                metrics.KV_EVENTS.labels("removed").inc()
            else:
                index.cleared(url)
                metrics.KV_EVENTS.labels("cleared").inc()
        metrics.PREFIX_INDEX_BLOCKS.set(index.pairs)


class KVEventsFeed:
    """Subscribes to the KV events of every engine of `pools` (module docstring), until
    stopped; every `interval` seconds it follows the pools' membership and health, and each
    subscription sends a heartbeat (a connection silent for `HEARTBEATS_MISSED` of them is
    dropped, and the engine forgotten)."""

    def __init__(
        self,
        pools: Sequence[Pool],
        index: BlockIndex,
        endpoint_of: Callable[[str], str | None],
        interval: float,
        replay_endpoint_of: Callable[[str], str | None] | None = None,
    ) -> None:
        self._pools = tuple(pools)
        self._index = index
        self._endpoint_of = endpoint_of
        self._replay_endpoint_of = replay_endpoint_of or (lambda url: None)
        self._interval = max(0.05, interval)
        self._heartbeat_s = max(MIN_HEARTBEAT_S, interval)
        self._subscribed: dict[str, asyncio.Task[None]] = {}
        self._streams: dict[str, EngineEvents] = {}
        self._task: asyncio.Task[None] | None = None
        self._ctx: Any = None
        self._replays_open = 0  # replays asked and not yet ended (`REPLAYS_AT_ONCE`)

    def start(self) -> None:
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self.follow_pools()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvrelay-kv-events")

    async def stop(self) -> None:
        await cancel_and_wait([self._task, *self._subscribed.values()])
        self._subscribed.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def subscribed(self) -> list[str]:
        return list(self._subscribed)

    def connected(self, url: str) -> bool:
        """This worker is connected to the KV events of the engine at `url`: what it publishes
        from now on arrives (False for an engine not followed, or not reached yet)."""
        stream = self._streams.get(url)
        return stream is not None and stream.connected

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                self.follow_pools()
            except Exception:  # one bad round must not end the feed
                log.exception("following the pools' KV events failed")

    def follow_pools(self) -> None:
        """Subscribe to engines that joined, drop those that left, forget the unhealthy."""
        backends = {url: b for pool in self._pools for url, b in pool.backends.items()}
        for url in [u for u in self._subscribed if u not in backends]:
            self._subscribed.pop(url).cancel()  # its `_listen` says it is no longer connected
            self._streams.pop(url).forget()
        for url, backend in backends.items():
            if url not in self._subscribed:
                endpoint = self._endpoint_of(url)
                if endpoint is None:
                    continue
                replay = self._replay_endpoint_of(url)
                stream = self._streams[url] = EngineEvents(url, self._index, replay is not None)
                self._subscribed[url] = asyncio.get_running_loop().create_task(
                    self._listen(stream, endpoint, replay), name="kvrelay-kv-events-engine"
                )
            elif not backend.healthy:
                self._streams[url].forget()

    def _end_replay(self, asked: _Replay, poller: Any) -> None:
        """`asked` is over (answered, timed out, or superseded): its socket closed, its slot
        free for another engine's replay."""
        if poller is not None:
            poller.unregister(asked.sock)
        asked.close()
        self._replays_open -= 1
        metrics.KV_EVENTS_REPLAYING.dec()

    async def _listen(self, stream: EngineEvents, endpoint: str, replay: str | None) -> None:
        import zmq
        import zmq.asyncio
        from zmq.utils.monitor import parse_monitor_message

        sock = self._ctx.socket(zmq.SUB)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        asked: _Replay | None = None
        try:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.LINGER, 0)
            # A link that goes silent without closing (a host gone, a partition) would leave the
            # index trusting an engine it no longer hears: ZMTP heartbeats (the publisher's ZMQ
            # answers them itself) drop a connection silent for three heartbeats.
            heartbeat_ms = round(1000 * self._heartbeat_s)
            sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEATS_MISSED * heartbeat_ms)
            sock.connect(endpoint)
            log.info("following KV events of %s", stream.url)
            while True:
                wanted = stream.replay_from if replay is not None else None  # from this batch
                if asked is None and wanted is not None and self._replays_open < REPLAYS_AT_ONCE:
                    assert replay is not None  # `wanted` is only read with a replay endpoint
                    asked = _Replay(self._ctx, replay, wanted)
                    self._replays_open += 1
                    metrics.KV_EVENTS_REPLAYING.inc()
                    stream.replay_from = None
                    poller.register(asked.sock, zmq.POLLIN)
                if asked is not None:
                    wait_ms: int | None = asked.left_ms()
                else:  # a replay waiting for a slot looks again soon
                    wait_ms = REPLAY_SLOT_WAIT_MS if wanted is not None else None
                ready = dict(await poller.poll(wait_ms))
                if asked is not None and (asked.sock in ready or asked.left_ms() == 0):
                    batches = await asked.read()
                    if batches is not None or asked.left_ms() == 0:
                        self._end_replay(asked, poller)
                        asked = None
                        await stream.replayed(batches)
                if sock in ready:
                    await _drain(sock, stream)
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())["event"]
                    now = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
                    if now != stream.connected:
                        _connected(stream, now)
                        if now:
                            log.info("connected to the KV events of %s", stream.url)
                            if replay is not None:
                                if asked is not None:  # a replay of the last connection
                                    self._end_replay(asked, poller)
                                    asked = None
                                stream.relearn()  # what it still keeps, asked for again
                        else:
                            # ZMQ reconnects by itself, but evictions meanwhile are missed: what
                            # the index has of the engine could turn false, so it is forgotten
                            # (after what arrived before the drop), and again at the gap in the
                            # numbers when the events resume.
                            log.warning("disconnected from the KV events of %s", stream.url)
                            await _drain(sock, stream)
                            stream.forget()
        finally:
            if asked is not None:
                self._end_replay(asked, None)
            if stream.connected:
                _connected(stream, False)
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
