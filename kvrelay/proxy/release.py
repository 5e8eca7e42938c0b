"""Freeing held KV blocks through the holders' side channels, and fetching D's final params.

The proxy releases whenever it abandons blocks: D's entry of a conversation that was
superseded, evicted, expired, deleted or refused; P's blocks that no D took. Releases run as
background tasks (the client never waits on them) that `drain()` awaits at shutdown. Without
a release token (stock vLLM) or a connector secret nothing can be released; that is counted.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from kvrelay.connector.protocol import (
    RELEASE_TOKEN,
    REMOTE_ENGINE_ID,
    REMOTE_HOST,
    REMOTE_PORT,
    REMOTE_REQUEST_ID,
)
from kvrelay.connector.sidechannel_client import AsyncSideChannelClient, SideChannelError
from kvrelay.kvcache_map import ConversationKey, EvictionReason, KVEntry
from kvrelay.proxy import metrics

log = logging.getLogger(__name__)


class Releaser:
    """Side-channel calls the proxy makes: release (fire and forget) and finished-params."""

    def __init__(
        self, secret: str | None, session: aiohttp.ClientSession, timeout_s: float
    ) -> None:
        self._client = (
            AsyncSideChannelClient(secret.encode(), timeout_s=timeout_s, session=session)
            if secret
            else None
        )
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self._client is not None

    async def release(
        self, holder: str, host: str | None, port: int | None, request_id: str | None,
        token: str | None,
    ) -> bool:  # fmt: skip
        """Release one hold now; True when the holder freed blocks."""
        # Engine-supplied values: anything that is not a plausible address and id is unusable.
        valid_port = isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536
        if (
            self._client is None
            or not valid_port
            or not (isinstance(token, str) and token)
            or not (isinstance(host, str) and host)
            or not (isinstance(request_id, str) and request_id)
        ):
            metrics.RELEASES.labels(holder, "unsupported").inc()
            return False
        assert port is not None  # checked by valid_port
        try:
            released = await self._client.release(host, port, request_id, token)
        except SideChannelError as exc:
            metrics.RELEASES.labels(holder, "failed").inc()
            log.warning("release on %s %s:%s failed: %s", holder, host, port, exc)
            return False
        metrics.RELEASES.labels(holder, "released" if released else "already_free").inc()
        return released

    def release_soon_entry(self, entry: KVEntry) -> None:
        """Release D's blocks of a map entry in the background."""
        self.spawn(
            self.release("decode", entry.host, entry.port, entry.request_id, entry.release_token)
        )

    def release_soon_params(self, holder: str, params: dict[str, Any] | None) -> None:
        """Release the blocks that engine-returned params describe, in the background."""
        if not params:
            return
        port = params.get(REMOTE_PORT)
        self.spawn(
            self.release(
                holder,
                params.get(REMOTE_HOST),
                port if isinstance(port, int) else None,
                params.get(REMOTE_REQUEST_ID),
                params.get(RELEASE_TOKEN),
            )
        )

    async def on_evict(self, key: ConversationKey, entry: KVEntry, reason: EvictionReason) -> None:
        """The map's callback: an entry left without being used, so its blocks go."""
        await self.release("decode", entry.host, entry.port, entry.request_id, entry.release_token)

    async def finished_params(
        self, host: str, port: int, client_request_id: str
    ) -> dict[str, Any] | None:
        """D's published params of a finished request (streams carry none), or None."""
        if self._client is None:
            return None
        try:
            return await self._client.finished(host, port, client_request_id)
        except SideChannelError as exc:
            log.warning("finished-params fetch from %s:%s failed: %s", host, port, exc)
            return None

    def spawn(self, coro: Any) -> None:
        """Run `coro` in the background, tracked so `drain()` can wait for it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for background releases (shutdown, tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def engine_id_of(params: dict[str, Any] | None) -> str | None:
    value = (params or {}).get(REMOTE_ENGINE_ID)
    return value if isinstance(value, str) else None
