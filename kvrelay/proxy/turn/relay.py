"""One client turn through the fleet: the hallway between its steps, each done by its own part.

Order of a turn (docs/DESIGN.md §1, the proxy README's "One turn"): take the conversation's
entry (atomic, single use) and check it (history, expiry, verifiability) → P prefills, pulling
the old turn's KV when there is a usable entry (`prefill_leg`) → D decodes with P's params and,
when the conversation may continue, holds its blocks (`decode_leg`) → D's answer goes to the
client (`answer`) and D's final params become the conversation's new entry (`store`).

`Turn` only sequences the steps and keeps what they hand each other. Where a leg goes is the
router's decision (`kvrelay.proxy.fleet.Router`); how a leg tries engines and judges their
statuses is written once (`attempts`); what the turn did is counted and reported by its
`TurnReport` (`report`); the client is a small interface (`client`), so a turn runs without
aiohttp in a unit test. Every way out of a turn frees what the turn made someone hold: the
taken entry once P is done with it, P's blocks when no D took them, D's blocks when they cannot
be stored (`Owed`, in `kvrelay.proxy.turn.owed`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

from kvrelay.connector.protocol import REFUSED_HASH
from kvrelay.kvcache_map import ConversationKey, InvalidKeyError, KVEntry, MapUnavailableError
from kvrelay.proxy.base import ProxyError
from kvrelay.proxy.engines import prompt_tokens
from kvrelay.proxy.fleet import Backend, Fleet
from kvrelay.proxy.turn.answer import Answer
from kvrelay.proxy.turn.attempts import Attempts, Engines, fleet_engines
from kvrelay.proxy.turn.client import Client
from kvrelay.proxy.turn.conversation import PromptShape, chat_store_key_id, prompt_chars
from kvrelay.proxy.turn.decode_leg import DecodeLeg
from kvrelay.proxy.turn.owed import Debt, Owed
from kvrelay.proxy.turn.prefill_leg import PrefillAnswer, PrefillLeg
from kvrelay.proxy.turn.report import TurnReport
from kvrelay.proxy.turn.store import Store


@dataclass
class Turn:
    """One client request while it crosses P and D; `run` answers the client."""

    fleet: Fleet
    client: Client
    route: str  # "chat" | "completions"
    body: dict[str, Any]
    request_id: str  # upstream id, on both legs
    tenant: str
    conversation_id: str | None
    shape: PromptShape
    client_request_id: str = ""  # what the client sees in X-Request-Id
    forwarded: tuple[tuple[str, str], ...] = ()  # client headers for the engines (forward_headers)
    engines: Engines | None = None  # where the legs' requests go; None: the fleet's engine client
    entry: KVEntry | None = None  # the conversation's entry, taken from the map and usable
    prefill: PrefillAnswer | None = None  # P's answer; None: no P (decode-only)
    # Conditional routing sent the turn straight to the holding D, which prefills this many
    # (estimated) tokens itself; None: the turn goes through P.
    decode_only_tokens: int | None = None
    # A decode-only turn the router spilled off a backed-up P: the D it goes to.
    spilled_to: str | None = None
    owed: Owed = field(default_factory=Owed)  # holds nobody else will free (see `owed`)
    report: TurnReport = field(init=False)  # what happened: metrics, spans, the log line
    _attempts: Attempts = field(init=False)
    _decode: DecodeLeg | None = None
    _work: int | None = None  # `_work_estimate`, once computed

    def __post_init__(self) -> None:
        self.report = TurnReport(
            route=self.route,
            request_id=self.request_id,
            client_request_id=self.client_request_id,
            tenant=self.tenant,
            stream=self.body.get("stream") is True,
            parent_headers=self.client.headers,
            lookup_key=self._lookup_key(),
            store_key=self._store_key(),
        )
        engines = self.engines or fleet_engines(self.fleet)
        self._attempts = Attempts(self.fleet, engines, self.report, self.forwarded)

    @property
    def suspect_input(self) -> tuple[Backend, ...]:
        """Every D tried answered 5xx/429 and they blame the input (`Pool.blames_input`):
        a strike against the key (`kvrelay.proxy.tenants`). Empty otherwise."""
        return self._decode.suspect_input if self._decode is not None else ()

    # -- keys ----------------------------------------------------------------------------------

    def _lookup_key(self) -> ConversationKey | None:
        if self.conversation_id is not None:
            return ConversationKey(self.tenant, self.conversation_id)
        fingerprinting = self.route == "chat" and self.fleet.settings.fingerprint_conversations
        if fingerprinting and self.shape.lookup_key_id is not None:
            return ConversationKey(self.tenant, self.shape.lookup_key_id)
        return None

    def _store_key(self) -> ConversationKey | None:
        if self.shape.store_fingerprint is None:
            return None
        if self.conversation_id is not None:
            return ConversationKey(self.tenant, self.conversation_id)
        if self.route == "chat" and self.fleet.settings.fingerprint_conversations:
            key_id = chat_store_key_id(self.shape)
            return ConversationKey(self.tenant, key_id) if key_id else None
        return None

    # -- the turn ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the turn: the answer goes to `client`; a `ProxyError` is the client's error."""
        with self.report.turn_scope():
            try:
                await self._run()
            except BaseException:
                self._attempts.judge_5xx(served=None)  # 5xx answers no engine made up for
                self.owed.release_all()
                raise
            # D's answer is complete, so P's blocks need no call from here: D's connector
            # either read them (the read frees them) or released them itself (skipped or
            # failed load).
            self.owed.settle(Debt.PREFILL_BLOCKS)

    async def _run(self) -> None:
        self.report.hold = self.report.store_key is not None
        try:
            with self.report.take_scope():
                await self._take_entry()
            await self._route()
            if self.decode_only_tokens is None:
                with self.report.leg_scope("prefill"):
                    await self._prefill()
                self.report.prefill_leg.ended = time.monotonic()
        finally:
            # The old turn's blocks are superseded. When P answered, its connector read them
            # (freeing them) or released them; otherwise nobody will, so the proxy does.
            if self.decode_only_tokens is None:
                self.owed.release(Debt.PREVIOUS_HOLD)
        if self.decode_only_tokens is None:
            await self._decode_leg()
            return self._learn()
        # Straight to the holder: D serves the history from the held blocks (its prefix-cache
        # hit), so the old hold is given back only once D is done with this turn.
        self.report.routed("spilled" if self.spilled_to is not None else "decode_only")
        try:
            await self._decode_leg()
        finally:
            self.owed.release(Debt.PREVIOUS_HOLD)
        self._learn()

    async def _route(self) -> None:
        """Through P, or straight to a D: the holder for a short follow-up, or any D that is
        quicker than P's queue (a spill, `Router.spill`). Either is estimated from the
        prompt's characters and then confirmed on the D's own count of its tokens (a client
        chooses its characters, not how they tokenize)."""
        router, work, entry = self.fleet.router, self._work_estimate(), self.entry
        if entry is not None and router.decode_only_tokens(entry, work, self.tenant) is not None:
            counted = await self._count_tokens(entry.url)
            uncached = None if counted is None else max(0, counted - entry.num_tokens)
            fits = uncached is not None and router.decode_only_fits(entry, uncached)
            self.report.decode_only_checked(counted is not None, fits)
            if fits:
                self.decode_only_tokens = uncached
                return
        spill = router.spill(entry, work, self.tenant)
        if spill is None:
            return
        counted = await self._count_tokens(spill.backend.url)
        held = entry.num_tokens if entry is not None else 0
        spill = spill.counted(counted, held, work) if counted is not None else None
        if spill is not None:
            self.decode_only_tokens = spill.tokens
            self.spilled_to = spill.backend.url
            self.report.spilled(first=entry is None, holder=spill.holder)

    async def _count_tokens(self, url: str) -> int | None:
        """The prompt's tokens as the engine at `url` counts them (None: it could not say)."""
        fleet = self.fleet
        timeout = fleet.settings.probe_timeout_s
        return await prompt_tokens(fleet.upstream, url, self.route, self.body, timeout)

    def _learn(self) -> None:
        """Tell the router what the engines reported this turn reused (routing that learns:
        `kvrelay.proxy.fleet.ReuseStanding`)."""
        router, report, tenant = self.fleet.router, self.report, self.tenant
        p, d = report.prefill_leg.account, report.decode_leg.account
        d_url = report.decode_leg.engine
        if self.decode_only_tokens is not None:
            if self.spilled_to is not None and not self.report.spilled_to_holder:
                return  # a D without the history: nothing to learn about its prefix cache
            if self.entry is None or not self.entry.has_full_block:
                return  # the held history fills no block: D had nothing it could reuse
            if d is not None and d.reused is not None and d_url is not None:
                router.decode_only_served(d_url, d.reused, tenant)
            return
        if self.prefill is not None and p is not None and p.local_hit is not None:
            # A re-rendered history (blocks refused by hash) is the prompt's doing, not P's.
            changed = any(reason == REFUSED_HASH for reason, _ in p.refused)
            affinity = report.routing == "prefill_affinity" and not changed
            router.prefill_served(
                self.prefill.backend.url, p.local_hit, affinity_turn=affinity, tenant=tenant
            )
        if d is not None and d.local_hit and d_url is not None:
            router.decode_served(d_url, d.local_hit, tenant)

    async def _take_entry(self) -> None:
        report, fleet = self.report, self.fleet
        key = report.lookup_key
        if key is None:
            if self.route == "chat" or self.conversation_id is not None:
                report.reuse_result("miss")
            return
        try:
            entry = await fleet.kvmap.take(key)
        except MapUnavailableError as exc:
            fleet.map_unavailable("take", exc)
            report.reuse_result("map_unavailable")
            report.hold = False  # nowhere to store D's params: do not make D hold
            return
        except InvalidKeyError as exc:
            raise ProxyError(
                400, f"conversation id not accepted: {exc}", param="conversation_id"
            ) from None
        if entry is None:
            report.reuse_result("miss")
            return
        refused = self._refusal(entry)
        if refused is not None:
            report.reuse_result(refused)
            fleet.releaser.release_soon("decode", entry.hold_ref)
            return
        report.reuse_result("hit", entry.num_tokens)
        self.entry = entry
        release = functools.partial(fleet.releaser.release_soon, "decode", entry.hold_ref)
        self.owed.owe(Debt.PREVIOUS_HOLD, release)

    def _refusal(self, entry: KVEntry) -> str | None:
        """Why the taken entry cannot be used (its REUSE result), or None when it can."""
        settings = self.fleet.settings
        if not self.shape.extends(entry.fingerprint):
            return "refused"  # edited or different history: the blocks describe another prompt
        if entry.expires_at - time.time() < settings.entry_safety_margin_s:
            return "expired"
        if entry.block_hashes is None and not settings.stock_vllm_reuse:
            return "unverifiable"
        if not self.fleet.router.holder_available(entry):
            return "holder_unavailable"  # P's pull would only wait for a handshake timeout
        return None

    def _work_estimate(self) -> int:
        # Prompt size in characters is a cheap stand-in for prefill work (no tokenizer here).
        # Computed once: a long chat's history makes it a pass over every message.
        if self._work is None:
            self._work = prompt_chars(self.route, self.body) + 1
        return self._work

    async def _prefill(self) -> None:
        prefill = PrefillLeg(self._attempts)
        answer = await prefill.run(self.body, self.entry, self._work_estimate(), self.tenant)
        if answer is None:
            return
        self.prefill = answer
        self.owed.settle(Debt.PREVIOUS_HOLD)  # P's connector read or released it
        if answer.params is not None:
            releaser = self.fleet.releaser
            release = functools.partial(releaser.release_soon_params, "prefill", answer.params)
            self.owed.owe(Debt.PREFILL_BLOCKS, release)

    async def _decode_leg(self) -> None:
        report = self.report
        store = Store(
            self.fleet,
            report,
            report.store_key,
            self.shape.store_fingerprint,
            previous=self.entry,
            prefill=self.prefill,
            work=self._work_estimate(),
        )
        answer = Answer(self.fleet, report, self.client, self.owed, store)
        self._decode = DecodeLeg(self._attempts, answer)
        holder = self.entry.url if self.entry is not None else None
        holder = self.spilled_to or holder
        with report.leg_scope("decode"):
            await self._decode.run(
                self.body, self.prefill, holder, report.hold, self.decode_only_tokens
            )
        report.decode_leg.ended = time.monotonic()
