"""Freeing held KV blocks through the holders' side channels, and fetching D's final params.

The proxy releases whenever it abandons blocks: D's entry of a conversation that was
superseded, evicted, expired, deleted or refused; P's blocks that no D took. Releases run as
background tasks (the client never waits on them) that `drain()` awaits at shutdown; each is
its own task, so a dead holder delays no other release. A network failure is retried a bounded
number of times with backoff; an answer (released, unknown, refused) is final. Without a
release token (stock vLLM) or a connector secret nothing can be released; that is counted.
D's finished params (for streams) are fetched through `finished_lookups.py`, which
coalesces the lookups to one holder.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from kvrelay.connector.protocol import HoldRef, KVTransferParams
from kvrelay.connector.sidechannel_client import AsyncSideChannelClient, SideChannelError
from kvrelay.kvcache_map import ConversationKey, EvictionReason, KVEntry, MapUnavailableError
from kvrelay.proxy.engines.finished_lookups import FinishedLookups
from kvrelay.proxy.engines.upstream import Upstream
from kvrelay.proxy.telemetry import metrics, tracing

log = logging.getLogger(__name__)

RELEASE_ATTEMPTS = 3
_BACKOFF_S = 0.1
# A put whose outcome is unknown is settled within about 10 s (a Redis stall of a few seconds).
SETTLE_ATTEMPTS = 10
_SETTLE_BACKOFF_MAX_S = 2.0


class Releaser:
    """Side-channel calls the proxy makes: release (fire and forget) and finished-params."""

    def __init__(self, secret: str | None, upstream: Upstream, timeout_s: float) -> None:
        self._client = (
            AsyncSideChannelClient(
                secret.encode(), timeout_s=timeout_s, transport=upstream.side_channel_call
            )
            if secret
            else None
        )
        self._lookups = FinishedLookups(self._client) if self._client is not None else None
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def enabled(self) -> bool:
        return self._client is not None

    async def release(self, holder: str, ref: HoldRef | None) -> bool:
        """Release one hold now; True when the holder freed blocks."""
        if self._client is None or ref is None:
            metrics.RELEASES.labels(holder, "unsupported").inc()
            return False
        if not tracing.enabled():
            return await self._release(self._client, holder, ref)
        # The span names the holder's side channel, never the release token.
        attributes: tracing.Attributes = {
            "kvrelay.holder": holder,
            "server.address": ref.remote_host,
            "server.port": ref.remote_port,
        }
        with tracing.span("kvrelay.side_channel.release", kind="client", attributes=attributes):
            released = await self._release(self._client, holder, ref)
            tracing.annotate({"kvrelay.released": released})
            return released

    async def _release(self, client: AsyncSideChannelClient, holder: str, ref: HoldRef) -> bool:
        for attempt in range(RELEASE_ATTEMPTS):
            if attempt:
                tracing.annotate({"kvrelay.retries": attempt})
            try:
                released = await client.release(
                    ref.remote_host, ref.remote_port, ref.remote_request_id, ref.release_token
                )
            except SideChannelError as exc:
                if exc.status is None and attempt + 1 < RELEASE_ATTEMPTS:
                    await asyncio.sleep(_BACKOFF_S * 2**attempt)  # retry backoff
                    continue
                metrics.RELEASES.labels(holder, "failed").inc()
                log.warning(
                    "release on %s %s:%s failed: %s", holder, ref.remote_host, ref.remote_port, exc
                )
                return False
            metrics.RELEASES.labels(holder, "released" if released else "already_free").inc()
            return released
        return False  # pragma: no cover - the loop always returns

    def release_soon(self, holder: str, ref: HoldRef | None) -> None:
        """Release one hold in the background (`holder`: "prefill" or "decode", for metrics)."""
        self.spawn(self.release(holder, ref))

    def release_soon_params(
        self, holder: str, params: KVTransferParams | dict[str, Any] | None
    ) -> None:
        """Release the hold that engine-returned params describe, in the background."""
        if params:
            self.release_soon(holder, HoldRef.from_params(params))

    async def release_unless_stored(
        self,
        holder: str,
        settle: Callable[[], Awaitable[bool]],
        params: KVTransferParams | dict[str, Any],
    ) -> None:
        """A put that may have been stored (`UnconfirmedPutError`): free its blocks only once
        the map says it was not, so no entry points at released blocks. Asked again with
        backoff while the map cannot answer; past that the holder's lease frees them."""
        for attempt in range(SETTLE_ATTEMPTS):
            try:
                stored = await settle()
            except MapUnavailableError:
                if attempt + 1 < SETTLE_ATTEMPTS:
                    await asyncio.sleep(min(_SETTLE_BACKOFF_MAX_S, _BACKOFF_S * 2**attempt))
                continue
            metrics.UNCONFIRMED_PUTS.labels("stored" if stored else "not_stored").inc()
            if not stored:
                await self.release(holder, HoldRef.from_params(params))
            return
        metrics.UNCONFIRMED_PUTS.labels("unsettled").inc()
        log.warning("could not settle a put with the map; the holder's lease frees its blocks")

    async def on_evict(self, key: ConversationKey, entry: KVEntry, reason: EvictionReason) -> None:
        """The map's callback: an entry left without being used, so its blocks go."""
        await self.release("decode", entry.hold_ref)

    async def finished_params(
        self, host: str, port: int, client_request_id: str
    ) -> dict[str, Any] | None:
        """D's published params of a finished request (streams carry none), or None."""
        if self._lookups is None:
            return None
        if not tracing.enabled():
            return await self._finished(self._lookups, host, port, client_request_id)
        attributes: tracing.Attributes = {"server.address": host, "server.port": port}
        with tracing.span("kvrelay.side_channel.finished", kind="client", attributes=attributes):
            params = await self._finished(self._lookups, host, port, client_request_id)
            tracing.annotate({"kvrelay.found": params is not None})
            return params

    async def _finished(
        self, lookups: FinishedLookups, host: str, port: int, client_request_id: str
    ) -> dict[str, Any] | None:
        try:
            return await lookups.get(host, port, client_request_id)
        except SideChannelError as exc:
            log.warning("finished-params fetch from %s:%s failed: %s", host, port, exc)
            return None

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `coro` in the background, tracked so `drain()` can wait for it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self) -> None:
        """Wait for background releases (shutdown, tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
