"""Step 1 of a turn: take the conversation's entry from the map (atomic, single use) and check
it: the history must extend the stored one, the entry must not be about to expire, its blocks
must be verifiable (or stock reuse allowed) and its holder able to serve a pull.

An entry that fails a check is given back to its holder at once (released in the background);
a usable one becomes the turn's debt (`PREVIOUS_HOLD`) until P reads or releases it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import NamedTuple

from kvrelay.kvcache_map import InvalidKeyError, KVEntry, KVMap, MapUnavailableError
from kvrelay.proxy.base import ProxyError
from kvrelay.proxy.engines import Releaser
from kvrelay.proxy.turn.context import TurnContext
from kvrelay.proxy.turn.owed import Debt, Owed
from kvrelay.proxy.turn.report import TurnReport
from kvrelay.proxy.turn.settings import TurnSettings


class Taken(NamedTuple):
    """The map's answer: the usable entry (None: nothing to reuse), and whether the map can
    store this turn's entry (when it is unavailable D is not asked to hold)."""

    entry: KVEntry | None
    map_available: bool = True


class Take:
    """Taking one turn's entry."""

    def __init__(
        self,
        kvmap: KVMap,
        releaser: Releaser,
        map_unavailable: Callable[[str, Exception], None],
        holder_available: Callable[[KVEntry], bool],
        settings: TurnSettings,
    ) -> None:
        self._kvmap = kvmap
        self._releaser = releaser
        self._map_unavailable = map_unavailable
        self._holder_available = holder_available
        self._margin_s = settings.entry_safety_margin_s
        self._stock_reuse = settings.stock_vllm_reuse

    async def take(self, ctx: TurnContext, report: TurnReport, owed: Owed) -> Taken:
        """The entry of `ctx`'s conversation, if there is a usable one (see the module)."""
        key = ctx.lookup_key
        if key is None:
            if ctx.route == "chat" or ctx.conversation_id is not None:
                report.reuse_result("miss")
            return Taken(None)
        try:
            entry = await self._kvmap.take(key)
        except MapUnavailableError as exc:
            self._map_unavailable("take", exc)
            report.reuse_result("map_unavailable")
            return Taken(None, map_available=False)  # nowhere to store D's params
        except InvalidKeyError as exc:
            raise ProxyError(
                400, f"conversation id not accepted: {exc}", param="conversation_id"
            ) from None
        if entry is None:
            report.reuse_result("miss")
            return Taken(None)
        refused = self._refusal(ctx, entry)
        if refused is not None:
            report.reuse_result(refused)
            self._releaser.release_soon("decode", entry.hold_ref)
            return Taken(None)
        report.reuse_result("hit", entry.num_tokens)
        owed.owe(
            Debt.PREVIOUS_HOLD,
            functools.partial(self._releaser.release_soon, "decode", entry.hold_ref),
        )
        return Taken(entry)

    def _refusal(self, ctx: TurnContext, entry: KVEntry) -> str | None:
        """Why the taken entry cannot be used (its REUSE result), or None when it can."""
        if not ctx.shape.extends(entry.fingerprint):
            return "refused"  # edited or different history: the blocks describe another prompt
        if entry.expires_at - time.time() < self._margin_s:
            return "expired"
        if entry.block_hashes is None and not self._stock_reuse:
            return "unverifiable"
        if not self._holder_available(entry):
            return "holder_unavailable"  # P's pull would only wait for a handshake timeout
        return None
