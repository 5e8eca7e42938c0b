"""The map's side of step 6 of a turn: D's final params become the conversation's map entry,
or D's blocks are released when they cannot be (not asked to hold, a stock engine without
`stock_vllm_reuse`, params past their expiry, unusable params, the map unavailable). A hold D
declined (the turn alone over its `hold_max_fraction`) stores nothing: D kept no blocks.

A put that timed out may have been stored all the same (`UnconfirmedPutError`): D's blocks stay
held until the map says it was not (`Releaser.release_unless_stored`), so a next turn never
finds an entry whose blocks were released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvrelay.connector.protocol import REMOTE_NUM_TOKENS, KVTransferParams
from kvrelay.kvcache_map import (
    ConversationKey,
    KVEntry,
    KVMap,
    MapUnavailableError,
    UnconfirmedPutError,
)
from kvrelay.proxy.engines import Releaser
from kvrelay.proxy.fleet import Backend
from kvrelay.proxy.turn.accounting import PromptAccount, TurnAccounts
from kvrelay.proxy.turn.context import TurnContext
from kvrelay.proxy.turn.legs import capped_num_tokens
from kvrelay.proxy.turn.prefill_leg import PrefillAnswer
from kvrelay.proxy.turn.report import TurnReport
from kvrelay.proxy.turn.settings import TurnSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Storing:
    """What a worker's turns store D's params with, made once per worker (`TurnCrew`)."""

    kvmap: KVMap
    releaser: Releaser
    map_unavailable: Callable[[str, Exception], None]  # counts and logs a map error
    settings: TurnSettings
    side_channel_of: Callable[[Backend], tuple[str, int] | None]  # an engine's side channel
    # Told once an entry is in the map (tenant, key): from then on the next turn can take the
    # hold (`HoldPayoff.made`: a hold's patience counts from here).
    stored: Callable[[str, ConversationKey], None]
    # Told when D declined the hold (tenant, key, D's URL): the conversation's next turn reads
    # the gap since (`HoldPayoff.unheld`, then `missed`), and holds brief where it came back at
    # once (`HoldPayoff.brief`) or weighs it against D's cache (the pace rule). None where
    # neither reads a gap: nothing is recorded.
    declined: Callable[[str, ConversationKey, str], None] | None


class Store:
    """Where and how one turn stores D's params (made on every turn that reaches D: a plain
    class, its worker's parts in one `Storing`)."""

    __slots__ = ("accounts", "ctx", "declined", "prefill", "previous", "report", "storing")

    def __init__(
        self,
        storing: Storing,
        ctx: TurnContext,  # its store key, its prompt's fingerprint and characters
        report: TurnReport,  # written, never read
        accounts: TurnAccounts,  # D's connector report goes here; its prompt tokens size the entry
        previous: KVEntry | None,  # the entry the turn took (its routing hints carry over)
        prefill: PrefillAnswer | None,
    ) -> None:
        self.storing, self.ctx, self.report, self.accounts = storing, ctx, report, accounts
        self.previous, self.prefill = previous, prefill
        self.declined = False  # D was asked to hold and kept nothing (over its hold_max_fraction)

    async def put(
        self, raw: KVTransferParams | dict[str, Any], backend: Backend, hold: bool
    ) -> None:
        """Make D's params the conversation's entry, or release D's blocks if they cannot be.
        `raw` is D's params as they came (from its answer, its stream or its side channel):
        parsed here, once, into the one wire type."""
        storing, ctx, report = self.storing, self.ctx, self.report
        releaser, settings, key = storing.releaser, storing.settings, ctx.store_key
        params = KVTransferParams.from_wire_or_none(raw)
        if params is None:
            if key is not None and hold:
                log.warning("decode engine %s returned unusable params", backend.url)
                releaser.release_soon_params("decode", raw)  # reads only the hold's fields
            return
        self.accounts.decode_reported(PromptAccount.from_connector(params))
        host, port = params.remote_host, params.remote_port
        if host is not None and port is not None:
            backend.side_channel = (host, port)  # learnt for later streams
        if params.hold_declined:
            # D kept nothing: the turn alone is over its hold_max_fraction of the pool.
            if key is not None and hold:
                self.declined = True
                report.hold_declined()
                if storing.declined is not None:
                    storing.declined(ctx.tenant, key, backend.url)
            return
        stock = not params.release_token and not params.remote_block_hashes
        if key is None or not hold:
            # Not asked to hold: kvrelay's D freed them already; a stock D holds until its lease.
            if stock and params.remote_num_tokens:
                report.hold_unsupported()
            return
        if stock and not settings.stock_vllm_reuse:
            report.hold_unsupported()
            return
        expiry = params.remote_blocks_expiry_time
        ttl = settings.conversation_ttl_s
        if expiry is not None:
            ttl = min(ttl, expiry - time.time() - settings.entry_safety_margin_s)
        if ttl <= 0:
            releaser.release_soon_params("decode", params)
            return
        prompt_tokens = self.prefill.prompt_tokens if self.prefill is not None else None
        to_store = params
        if stock:
            # Stock engines cannot verify tokens: trust only the previous prompt's part.
            capped = capped_num_tokens(params, prompt_tokens)
            to_store = params.model_copy(update={REMOTE_NUM_TOKENS: capped})
        fingerprint = ctx.shape.store_fingerprint
        try:
            assert fingerprint is not None
            entry = KVEntry.from_kv_transfer_params(
                to_store, url=backend.url, fingerprint=fingerprint, **self._routing_hints()
            )
        except ValueError as exc:
            log.warning("decode engine %s returned unusable params: %s", backend.url, exc)
            releaser.release_soon_params("decode", params)
            return
        with report.put_scope(entry.num_tokens, ttl):
            try:
                await storing.kvmap.put(key, entry, ttl)
                storing.stored(ctx.tenant, key)
            except UnconfirmedPutError as exc:
                storing.map_unavailable("put", exc)
                # The entry may be stored all the same: D's blocks stay held until the map
                # says it is not (else a next turn could find an entry pointing at nothing).
                releaser.spawn(releaser.release_unless_stored("decode", exc.settle, params))
            except MapUnavailableError as exc:
                storing.map_unavailable("put", exc)
                releaser.release_soon_params("decode", params)

    def _routing_hints(self) -> dict[str, Any]:
        """What the next turn's routing needs (kvrelay.proxy.fleet.routing): this turn's P and its
        prompt's characters per token; a turn without P keeps the previous turn's, or takes
        D's prompt tokens (from its connector's report) when there is none (a first turn that
        D prefilled: its next turn may go straight to D)."""
        previous, prefill = self.previous, self.prefill
        prefill_url = prefill.backend.url if prefill is not None else None
        prompt_tokens = prefill.prompt_tokens if prefill is not None else None
        if previous is not None:
            prefill_url = prefill_url or previous.prefill_url
            if not prompt_tokens and previous.chars_per_token:
                return {"prefill_url": prefill_url, "chars_per_token": previous.chars_per_token}
        if prefill is None and self.accounts.decode is not None:
            prompt_tokens = self.accounts.decode.prompt_tokens
        chars_per_token = None
        if prompt_tokens:
            # Floored so that an odd prompt (no text content) cannot make the entry invalid.
            chars_per_token = round(max(self.ctx.work / prompt_tokens, 1e-3), 4)
        return {"prefill_url": prefill_url, "chars_per_token": chars_per_token}
