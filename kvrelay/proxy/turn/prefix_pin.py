"""A pin: the engine whose cache holds a turn's prompt prefix keeps it for another to pull.

vLLM's connector API lets a connector hold the blocks of a request that finished, and nothing
else: blocks merely cached (a prefix some earlier request computed) are not a connector's to
lend, and are reused or evicted at the engine's will. So the proxy asks the holder for a
request of its own (the pin): the prefix's token ids as a completion prompt, one output token,
`do_remote_decode` (hold the blocks for a reader), under the turn's model and `cache_salt` so
it hits exactly the blocks the turn's prompt would. The holder serves it from its prefix cache
(it computes the last block only: vLLM always computes a prompt's last token), holds the
blocks under its lease and answers with their ids and hashes, as a P answers for D. The turn's
P then pulls them like a conversation's held history: by hash, claim before read, refused and
computed when anything differs (`kvrelay.connector`).

The pin carries `prefix_pull_priority` so that a holder under `--scheduling-policy priority`
admits it ahead of its queue; where it does not come back within `prefix_pull_timeout_s` the
turn goes on without it (its P computes the prefix) and the holder serves no pulls for a while,
longer after each late pin in a row (`Router.pin_too_slow`, `PinRests`). A pin that answers
late is released.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

from kvrelay.connector.protocol import (
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    KV_TRANSFER_PARAMS,
    KVTransferParams,
)
from kvrelay.proxy.base import jsoncodec
from kvrelay.proxy.engines import Releaser, UpstreamError
from kvrelay.proxy.fleet import PrefixSource, Router
from kvrelay.proxy.telemetry import metrics
from kvrelay.proxy.tenants import CACHE_SALT
from kvrelay.proxy.turn.attempts import Engines
from kvrelay.proxy.turn.context import TurnContext
from kvrelay.proxy.turn.prefill_leg import read_prefill_answer

log = logging.getLogger(__name__)

PIN_PATH = "/v1/completions"


def pin_body(ctx: TurnContext, tokens: Sequence[int], priority: int) -> dict[str, Any]:
    """The pin's request: the prefix's token ids under the turn's model and cache scope."""
    body: dict[str, Any] = {
        "model": ctx.body.get("model"),
        "prompt": list(tokens),
        "max_tokens": 1,
        "stream": False,
        KV_TRANSFER_PARAMS: {DO_REMOTE_DECODE: True, DO_REMOTE_PREFILL: False},
    }
    salt = ctx.body.get(CACHE_SALT)
    if salt is not None:
        body[CACHE_SALT] = salt
    if priority:
        body["priority"] = priority
    return body


class PrefixPin:
    """Pins of one turn (at most one is made: `Turn` asks once)."""

    def __init__(
        self,
        ctx: TurnContext,
        engines: Engines,
        router: Router,
        releaser: Releaser,
        priority: int,
        timeout_s: float,
        leg: str,
    ) -> None:
        """`leg`: the leg that pulls the pin ("prefill", or "decode" for a spill), as counted."""
        self._ctx = ctx
        self._leg = leg
        self._engines = engines
        self._router = router
        self._releaser = releaser
        self._priority = priority
        self._timeout_s = timeout_s

    async def pin(self, source: PrefixSource, tokens: Sequence[int]) -> KVTransferParams | None:
        """The holder's params for its pinned prefix (`source.tokens` of `tokens`), or None
        when it made no hold in time; the caller owes the hold's release from then on."""
        ctx = self._ctx
        body = pin_body(ctx, tokens[: source.tokens], self._priority)
        headers = (
            ("Content-Type", "application/json"),
            ("X-Request-Id", ctx.request_id + "-pin"),
            *ctx.forwarded,
        )
        url = source.backend.url
        holder = source.holder
        task = asyncio.ensure_future(self._ask(url, holder, jsoncodec.dumps(body), headers))
        release_late = functools.partial(self._release_late, holder)
        try:
            # shield: a pin that answers after the wait must still be released (below).
            params = await asyncio.wait_for(asyncio.shield(task), self._timeout_s)
        except TimeoutError:
            metrics.PREFIX_PULLS.labels(self._leg, "pin_timeout").inc()
            log.info("pin on %s took over %.3fs: its prefix is computed", url, self._timeout_s)
            self._router.pin_too_slow(url)
            task.add_done_callback(release_late)
            return None
        except BaseException:
            # The turn ended while waiting (its client left): nobody will read the hold.
            task.add_done_callback(release_late)
            raise
        if params is None:
            metrics.PREFIX_PULLS.labels(self._leg, "pin_failed").inc()
            return None
        self._router.pin_on_time(url)
        metrics.PREFIX_PULLS.labels(self._leg, "pinned").inc()
        metrics.PREFIX_PINS.labels(holder).inc()
        return params

    async def _ask(
        self, url: str, holder: str, payload: bytes, headers: tuple[tuple[str, str], ...]
    ) -> KVTransferParams | None:
        started = time.monotonic()
        try:
            resp = await self._engines.post(url, PIN_PATH, payload, headers)
            try:
                status, raw = resp.status, await resp.read()
            finally:
                resp.release()
        except UpstreamError as exc:
            log.info("pin on %s failed: %s", url, type(exc).__name__)
            return None
        waited = time.monotonic() - started
        metrics.PREFIX_PIN_SECONDS.labels(holder).observe(waited)
        self._router.pin_answered(url, holder, waited)
        if status != 200:
            log.info("pin on %s answered %d", url, status)
            return None
        answer = read_prefill_answer(raw)
        params = answer[0] if answer is not None else None
        if params is None or not params.has_remote_blocks:
            if params is not None:
                self._releaser.release_soon_params(holder, params)
            return None
        return params

    def _release_late(self, holder: str, task: asyncio.Future[KVTransferParams | None]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        self._releaser.release_soon_params(holder, task.result())
