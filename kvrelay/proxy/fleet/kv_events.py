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
vLLM's replay socket (which resends missed batches) is not used: a cleared engine's cache is
relearnt within the prompts it serves next, and a replay could resend a whole buffer.
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


async def _drain(sock: Any, stream: EngineEvents) -> None:
    """Apply every message `sock` has received, in order, without waiting for more."""
    import zmq

    while True:
        try:
            frames = await sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            stream.take(frames)
        except Exception:  # a batch this worker cannot apply: forget, go on
            log.exception("a KV event batch could not be applied")
            stream.forget()


def _connected(stream: EngineEvents, now: bool) -> None:
    """The feed's connection to `stream`'s engine is now up or down."""
    stream.connected = now
    metrics.KV_EVENTS_CONNECTED.inc(1 if now else -1)


class EngineEvents:
    """One engine's event stream applied to the index, in order (`take`)."""

    def __init__(self, url: str, index: BlockIndex) -> None:
        self.url = url
        self._index = index
        from kvrelay import kv_events_wire

        self._wire: ModuleType = kv_events_wire
        self._last_seq: int | None = None
        self.connected = False  # the subscription's handshake with the engine is done

    def forget(self) -> None:
        """What the index has of this engine is no longer known to be true."""
        self._index.cleared(self.url)

    def take(self, frames: list[bytes], now: float | None = None) -> None:
        """Apply one message (`[topic, seq, payload]`)."""
        if len(frames) != 3:
            metrics.KV_EVENTS.labels("malformed").inc()
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        last, self._last_seq = self._last_seq, seq
        if last is not None and seq != last + 1:
            # Missed batches (a gap) or a publisher counting from 0 again (a restart): either
            # way some blocks' fate is unknown, so all of this engine's are forgotten.
            metrics.KV_EVENTS_GAPS.labels("restart" if seq <= last else "gap").inc()
            self.forget()
        w = self._wire
        try:
            batch = w.DECODER.decode(frames[2])
        except w.DecodeError:
            metrics.KV_EVENTS.labels("malformed").inc()
            self.forget()
            return
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
    ) -> None:
        self._pools = tuple(pools)
        self._index = index
        self._endpoint_of = endpoint_of
        self._interval = max(0.05, interval)
        self._heartbeat_s = max(MIN_HEARTBEAT_S, interval)
        self._subscribed: dict[str, asyncio.Task[None]] = {}
        self._streams: dict[str, EngineEvents] = {}
        self._task: asyncio.Task[None] | None = None
        self._ctx: Any = None

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
                stream = self._streams[url] = EngineEvents(url, self._index)
                self._subscribed[url] = asyncio.get_running_loop().create_task(
                    self._listen(stream, endpoint), name="kvrelay-kv-events-engine"
                )
            elif not backend.healthy:
                self._streams[url].forget()

    async def _listen(self, stream: EngineEvents, endpoint: str) -> None:
        import zmq
        import zmq.asyncio
        from zmq.utils.monitor import parse_monitor_message

        sock = self._ctx.socket(zmq.SUB)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
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
                ready = dict(await poller.poll())
                if sock in ready:
                    await _drain(sock, stream)
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())["event"]
                    now = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
                    if now != stream.connected:
                        _connected(stream, now)
                        if now:
                            log.info("connected to the KV events of %s", stream.url)
                        else:
                            # ZMQ reconnects by itself, but evictions meanwhile are missed: what
                            # the index has of the engine could turn false, so it is forgotten
                            # (after what arrived before the drop), and again at the gap in the
                            # numbers when the events resume.
                            log.warning("disconnected from the KV events of %s", stream.url)
                            await _drain(sock, stream)
                            stream.forget()
        finally:
            if stream.connected:
                _connected(stream, False)
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
