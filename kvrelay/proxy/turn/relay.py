"""One client turn through the fleet: the hallway between its steps, each done by its own part.

Order of a turn (docs/DESIGN.md §1, the proxy README's "One turn"): take the conversation's
entry (atomic, single use) and check it (`take`) → the routing policy plans the turn (through
P, decode-only on the holder, or spilled to a D: `kvrelay.proxy.fleet.policies`) → P
prefills, pulling the old turn's KV when there is a usable entry (`prefill_leg`) → D decodes
with P's params and, when the conversation may continue, holds its blocks (`decode_leg`) → D's
answer goes to the client but for its last bytes (`answer`) → D's final params become the
conversation's new entry (`settle`, `store`) → the answer's last bytes → the router learns
what the engines reused.

The turn knows its request (`TurnContext`, fixed), decides (the plan, the entry, the hold, kept
here) and reports (`TurnReport`, written and never read). Its steps get the worker's parts
they use from the `TurnCrew`, never the fleet. Every way out of a turn frees what the turn made
someone hold: the taken entry once P is done with it, P's blocks when no D took them, D's
blocks when they cannot be stored (`Owed`, in `kvrelay.proxy.turn.owed`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

from kvrelay.connector.protocol import REFUSED_FAILED, REFUSED_HASH, KVTransferParams
from kvrelay.kvcache_map import KVEntry
from kvrelay.proxy.fleet import Backend, Lead, Plan, PrefixSource, PromptPrefixes, Route
from kvrelay.proxy.telemetry import metrics
from kvrelay.proxy.tenants import CACHE_SALT
from kvrelay.proxy.turn.accounting import PromptAccount, TurnAccounts
from kvrelay.proxy.turn.answer import Answer, Relayed
from kvrelay.proxy.turn.attempts import Attempts
from kvrelay.proxy.turn.client import Client
from kvrelay.proxy.turn.context import TurnContext
from kvrelay.proxy.turn.crew import TurnCrew
from kvrelay.proxy.turn.decode_leg import DecodeLeg
from kvrelay.proxy.turn.owed import Debt, Owed
from kvrelay.proxy.turn.prefill_leg import PrefillAnswer, PrefillLeg
from kvrelay.proxy.turn.prefix_pin import PrefixPin
from kvrelay.proxy.turn.report import TurnReport
from kvrelay.proxy.turn.settle import Settle
from kvrelay.proxy.turn.store import Store

log = logging.getLogger(__name__)


class Turn:
    """One client request while it crosses P and D; `run` answers the client.

    A plain class whose decisions default to class attributes: one is made on every request,
    and only what the turn decides is written to it."""

    # What the turn decided, and what its steps hand each other:
    entry: KVEntry | None = None  # the conversation's entry, taken from the map and usable
    plan: Plan | None = None  # the routing policy's plan
    hold: bool = False  # D is asked to hold its blocks for a next turn
    _brief: bool = False  # ... and to keep it over its max briefly (`HoldPayoff.brief`)
    _hold_age: float | None = None  # the taken entry's hold's age (`HoldPayoff.taken`)
    prefill: PrefillAnswer | None = None  # P's answer; None: no P (decode-only, or none answered)
    routing: str | None = None  # the routing decision, as reported (`usage.kvrelay.routing`)
    decode_url: str | None = None  # the D that served
    _decode: DecodeLeg | None = None
    _prompt: PromptPrefixes | None = None  # the prompt's prefixes, when P is chosen by them
    _lead: Lead | None = None  # prefixes this turn computes that others wait for (prefix_wait)

    def __init__(self, crew: TurnCrew, client: Client, ctx: TurnContext) -> None:
        self.crew, self.client, self.ctx = crew, client, ctx
        self.accounts = TurnAccounts()  # what the engines reported
        self.owed = Owed()  # holds nobody else will free (see `owed`)
        self.report = TurnReport(ctx, client.headers, self.accounts)  # metrics, spans, log line
        self._attempts = Attempts(ctx, crew.engines, self.report, crew.settings.retries)

    @property
    def suspect_input(self) -> tuple[Backend, ...]:
        """Every D tried answered 5xx/429 and they blame the input (`Pool.blames_input`):
        a strike against the key (`kvrelay.proxy.tenants`). Empty otherwise."""
        return self._decode.suspect_input if self._decode is not None else ()

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
            finally:
                self._end_lead()  # no turn waits for a prefix this one no longer computes
            # D's answer is complete, so P's blocks (or a spill's pinned prefix) need no call
            # from here: D's connector either read them (the read frees them) or released them
            # itself (skipped or failed load).
            self.owed.settle(Debt.PREFILL_BLOCKS)
            self.owed.settle(Debt.PINNED_PREFIX)
            self.owed.settle(Debt.PREVIOUS_HOLD)  # a spill's D read the held history

    async def _run(self) -> None:
        crew, ctx, report = self.crew, self.ctx, self.report
        holds = crew.router.holds
        # Whether a conversation's pace may stand in for a hold: only where an unheld history
        # can be found in D's cache at all (`HoldPayoff`).
        by_pace = crew.router.finds_unheld_history
        plan: Plan | None = None
        try:
            with report.take_scope():
                taken = await crew.take.take(ctx, report, self.owed)
            self.entry = taken.entry
            # Whether the conversation's last turn came back sooner than its D's cache keeps
            # an unused block (`HoldPayoff`: then this turn does not hold either).
            sooner = False
            gap: float | None = None  # since the conversation's last turn, where known
            if taken.entry is not None:
                gap = self._hold_age = holds.taken(ctx.tenant, ctx.lookup_key)
                sooner = by_pace and self._cache_kept(taken.entry)
            elif ctx.lookup_key is not None:
                last = holds.missed(ctx.tenant, ctx.lookup_key)
                if last is not None:
                    gap = last[0]
                    sooner = by_pace and self._sooner_than_cache(*last)
            self.hold = (
                ctx.store_key is not None
                and taken.map_available
                and holds.worth_holding(ctx.tenant, sooner)
            )
            if self.hold:
                self._brief = holds.brief(gap)
            crew.give_back(holds.unpaid(ctx.tenant))
            if crew.router.routes_by_prefix:
                self._prompt = ctx.shape.prefixes(ctx.body.get(CACHE_SALT) or "", ctx.body)
                if self._prompt is not None and crew.router.in_flight.on:
                    # Another turn computing most of this prompt: routed once it is cached.
                    await crew.router.in_flight.wait(self._prompt)
                    self._lead_prompt(self._prompt)  # led until planned (prefix_wait.py)
                if self._prompt is not None and crew.router.wants_tokens:
                    self._prompt = await crew.with_tokens(self._prompt, ctx.route, ctx.body)
            plan = self.plan = await crew.policy.plan(
                self.entry, ctx.work, ctx.tenant, self._count_tokens, self._prompt
            )
            self._report_plan(plan)
            through_p = plan.route is Route.THROUGH_P
            if plan.route is Route.DECODE_ONLY:
                self._end_lead()  # D's cache serves it: nothing computed to wait for
            elif self._prompt is not None:
                self._lead_prompt(self._prompt)  # through P or spilled: it computes it
            if through_p:
                try:
                    with report.leg_scope("prefill"):
                        await self._prefill(plan)
                finally:
                    self._end_lead()  # P computed the prompt (or did not answer)
                report.leg_ended("prefill")
        finally:
            # The old turn's blocks are superseded. When P answered, its connector read them
            # (freeing them) or released them; otherwise nobody will, so the proxy does.
            if plan is None or plan.route is Route.THROUGH_P:
                self.owed.release(Debt.PREVIOUS_HOLD)
            self.owed.release(Debt.PINNED_PREFIX)  # no P was sent it (or none answered)
        report.holding(self.hold)
        if through_p:
            await self._decode_step(plan)
        else:
            # Straight to a D: the holder serves the history from the held blocks (its
            # prefix-cache hit), so the old hold is given back only once D is done. A spill's
            # other D that reads the history from the holder frees it as P would: owed until
            # D's answer is complete (released at once if that D was never sent it).
            try:
                await self._decode_step(plan)
            finally:
                if not plan.reads_held:
                    self.owed.release(Debt.PREVIOUS_HOLD)
        self._learn(plan)
        if by_pace and not self.hold and ctx.store_key is not None and self.decode_url is not None:
            holds.unheld(ctx.tenant, ctx.store_key, self.decode_url)  # its next turn's gap
        if self.entry is not None:
            holds.used(ctx.tenant, self._hold_read(plan, self.entry), self._cache_kept(self.entry))
            self._learn_held_read(plan, self.entry)

    def _lead_prompt(self, prompt: PromptPrefixes) -> None:
        """This turn computes `prompt` (as far as it knows: once planned it leads again on what
        it then knows): what no engine caches yet, other turns may wait for
        (`prefix_wait_max_s`) until `_end_lead`."""
        router = self.crew.router
        if router.in_flight.on:
            self._lead = router.in_flight.relead(self._lead, prompt, router.cached_chars(prompt))

    def _end_lead(self) -> None:
        if self._lead is not None:
            self._lead.done()

    async def _count_tokens(self, url: str) -> int | None:
        """The prompt's tokens as the engine at `url` counts them (the policy's check)."""
        return await self.crew.count_tokens(url, self.ctx.route, self.ctx.body)

    def _report_plan(self, plan: Plan) -> None:
        report = self.report
        if plan.check is not None:
            report.decode_only_checked(plan.check)
        if plan.route is Route.THROUGH_P:
            return
        if plan.route is Route.SPILL:
            report.spilled(first=self.entry is None)
            self.routing = "spilled"
        else:
            self.routing = "decode_only"
        report.routed(self.routing)

    async def _prefill(self, plan: Plan) -> None:
        crew, ctx = self.crew, self.ctx
        leg = PrefillLeg(self._attempts, crew.prefill, crew.router, ctx.request_id)
        answer = await leg.run(
            ctx.body,
            self.entry,
            plan.prefill_first,
            ctx.work,
            ctx.tenant,
            self._prompt,
            functools.partial(self._pin, leg="prefill") if crew.settings.prefix_pull else None,
            crew.settings.prefill_priority_tokens,
        )
        if answer is None:
            return
        if answer.pulled_prefix:
            self.owed.settle(Debt.PINNED_PREFIX)  # P's connector read or released it
            _count_pull("prefill", answer.backend.url, answer.account)
        self.prefill = answer
        self.routing = "prefill_affinity" if answer.by_affinity else "prefill_chosen"
        self.report.routed(self.routing)
        self.accounts.prefill_answered(answer.account, for_decode=answer.params is not None)
        self.owed.settle(Debt.PREVIOUS_HOLD)  # P's connector read or released it
        if answer.params is not None:
            releaser = crew.releaser
            release = functools.partial(releaser.release_soon_params, "prefill", answer.params)
            self.owed.owe(Debt.PREFILL_BLOCKS, release)

    async def _pin(
        self, source: PrefixSource, tokens: Sequence[int], leg: str
    ) -> KVTransferParams | None:
        """Ask `source` to keep the prompt's prefix for this turn's `leg` (its P, or a spill's
        D) to pull (`PrefixPin`); the turn owes its release until the engine sent it answers."""
        crew, settings = self.crew, self.crew.settings
        pinner = PrefixPin(
            self.ctx,
            crew.engines,
            crew.router,
            crew.releaser,
            settings.prefix_pull_priority,
            settings.prefix_pull_timeout_s,
            leg,
        )
        params = await pinner.pin(source, tokens)
        if params is not None:
            release = functools.partial(crew.releaser.release_soon_params, source.holder, params)
            self.owed.owe(Debt.PINNED_PREFIX, release)
        return params

    async def _decode_step(self, plan: Plan) -> None:
        """D's leg, its answer relayed, its params stored, the answer's last bytes."""
        crew, ctx, report, settings = self.crew, self.ctx, self.report, self.crew.settings
        p_params = p_url = None
        d_pulls = False  # a spill's D is sent a prefix pinned on a P, or the held history
        if self.prefill is not None:
            p_params, p_url = self.prefill.params, self.prefill.backend.url
        elif plan.reads_held and self.entry is not None:
            # A spill to a D other than the holder: it reads the held history as P would.
            p_params, p_url = self.entry.to_kv_transfer_params(), self.entry.url
            d_pulls = True
        elif plan.pull_from is not None and self._prompt is not None and self._prompt.tokens:
            # A spill whose D pulls the prompt's prefix from the P caching it: pinned there,
            # owed until D's answer is complete (D's connector reads or releases it).
            p_params = await self._pin(plan.pull_from, self._prompt.tokens, "decode")
            p_url = plan.pull_from.backend.url if p_params is not None else None
            d_pulls = p_params is not None
        store = Store(crew.storing, ctx, report, self.accounts, self.entry, self.prefill)
        settle = Settle(store, self.owed)
        answer = Answer(ctx, report, self.client, self.owed, self.accounts)
        leg = self._decode = DecodeLeg(
            self._attempts,
            crew.decode,
            crew.router,
            crew.side_channel_of,
            settings.first_byte_timeout,
        )
        relayed = Relayed(streamed=ctx.stream)
        with report.leg_scope("decode"):
            served = await leg.serve(
                ctx,
                p_params,
                p_url,
                plan.decode_first,
                self.hold,
                plan.decode_tokens,
                self._prompt,
                self._brief,
            )
            lead = self._lead
            if lead is not None and ctx.stream:
                # A spill's D has computed the prompt at its first token.
                served.prefilled = _then(served.prefilled, lead.done)
            else:
                self._end_lead()  # a whole answer: D computed the prompt long before
            with served:
                self.decode_url = served.backend.url
                if served.hold:
                    settle.owe_hold(served.backend)
                try:
                    await answer.relay(served, relayed)
                except BaseException:
                    if relayed.streamed and relayed.complete:
                        # The client left after D finished: the turn is complete, so D's
                        # params are stored all the same (in the background).
                        settle.in_background(relayed, served)
                    raise
                if not relayed.broken:
                    await settle.after(relayed, served)
                    await answer.finish(relayed, self.routing)
        report.leg_ended("decode")
        if not served.hold or store.declined:
            # No hold kept the turn's blocks: D freed them as it finished, which its last load
            # reading does not show yet (`Router.released`). A hold D kept, or may still be
            # storing, frees nothing now.
            crew.router.released(served.backend.url, self._prompt_tokens())
        if served.own_blocks:
            # D served the blocks the params named from its own cache (`Served.own_blocks`):
            # no connector read them, so the proxy frees them now that D is done (whichever
            # of the three debts named them; any other still owed is freed right after anyway).
            for debt in (Debt.PREFILL_BLOCKS, Debt.PINNED_PREFIX, Debt.PREVIOUS_HOLD):
                self.owed.release(debt)
        elif d_pulls and self.accounts.decode is not None:
            _count_pull("decode", served.backend.url, self.accounts.decode)

    def _prompt_tokens(self) -> int:
        """The prompt's tokens as D reported them, else as the router estimates them from its
        characters (a stream whose client asked no usage)."""
        account = self.accounts.decode
        if account is not None and account.prompt_tokens:
            return account.prompt_tokens
        cpt = self.crew.router.chars_per_token(self.entry, self._prompt)
        return round(self.ctx.work / cpt)

    def _learn(self, plan: Plan) -> None:
        """Tell the router what the engines reported this turn reused (routing that learns:
        `kvrelay.proxy.fleet.reuse_standing.ReuseStanding`)."""
        router, tenant = self.crew.router, self.ctx.tenant
        p, d, d_url = self.accounts.prefill, self.accounts.decode, self.decode_url
        if self._prompt is not None and d_url is not None:
            router.decoded(d_url, self._prompt)  # D read or computed the whole prompt
        if plan.route is not Route.THROUGH_P:
            if plan.route is Route.SPILL and not plan.to_holder:
                return  # a D without the history: nothing to learn about its prefix cache
            if not plan.to_holder:  # decode-only by D's expected prefix cache
                if d is not None and d.reused is not None and d_url is not None:
                    router.cached_decode_served(d_url, d.reused, tenant)
                return
            if self.entry is None or not self.entry.has_full_block:
                return  # the held history fills no block: D had nothing it could reuse
            if d is not None and d.reused is not None and d_url is not None:
                router.decode_only_served(d_url, d.reused, tenant)
            return
        if self.prefill is not None and p is not None and p.local_hit is not None:
            # A re-rendered history (blocks refused by hash) is the prompt's doing, not P's.
            changed = any(reason == REFUSED_HASH for reason, _ in p.refused)
            affinity = self.prefill.by_affinity and not changed
            router.prefill_served(
                self.prefill.backend.url, p.local_hit, affinity_turn=affinity, tenant=tenant
            )
        if d is not None and d.local_hit and d_url is not None:
            router.decode_served(d_url, d.local_hit, tenant)

    def _learn_held_read(self, plan: Plan, entry: KVEntry) -> None:
        """Tell the router whether the engine sent the held history (P, or a spill's D other
        than the holder) found its blocks still held (`HeldReads`: how the next spills weigh a
        read from that holder)."""
        sent, account = self._other_reader(plan, entry)
        if not sent:
            return  # the holder served the turn, or no engine was sent the history
        found = _read_found(account)
        if found is not None:
            metrics.HELD_READS.labels("found" if found else "gone").inc()
            self.crew.router.held_read(entry.url, found)

    def _other_reader(self, plan: Plan, entry: KVEntry) -> tuple[bool, PromptAccount | None]:
        """Whether an engine other than the holder was sent the held history to read (P, or
        a spill's other D), and that engine's account (None: it gave none)."""
        if plan.route is Route.THROUGH_P:
            return True, self.accounts.prefill
        to_holder = plan.to_holder or self.decode_url == entry.url  # a retry can land on it
        if plan.reads_held and not to_holder:
            return True, self.accounts.decode
        return False, None

    def _cache_kept(self, entry: KVEntry) -> bool:
        """The hold was taken sooner than its holder's prefix cache lately keeps a block nobody
        uses (`Router.cache_keeps_s`): unheld, the history would most likely have been there
        all the same. False where either figure is unknown (holds are judged by reads alone)."""
        return self._hold_age is not None and self._sooner_than_cache(self._hold_age, entry.url)

    def _sooner_than_cache(self, gap_s: float, url: str) -> bool:
        """`gap_s` is shorter than the D at `url` lately keeps a block nobody uses; False where
        that D's figure is unknown (vLLM without `--kv-cache-metrics`)."""
        keeps = self.crew.router.cache_keeps_s(url)
        return keeps is not None and gap_s < keeps

    def _hold_read(self, plan: Plan, entry: KVEntry) -> bool:
        """Whether an engine read the held history this turn took (`HoldPayoff.used`): P, or
        a spill's other D, loaded from it, or its holder served the turn from it. A turn that
        went to another D without it read nothing of it. Where the engine gave no figure it
        counts as read (a stock engine's answer: the take is all that is known)."""
        sent, account = self._other_reader(plan, entry)
        if sent:
            return _loaded_some(account)
        to_holder = plan.to_holder or self.decode_url == entry.url
        if not to_holder or not entry.has_full_block:
            return False  # another D, or a history that fills no block D could reuse
        d = self.accounts.decode
        return d is None or d.reused is None or d.reused > 0


def _read_found(account: PromptAccount | None) -> bool | None:
    """Whether an engine sent a holder's blocks found them: it loaded some (True), or its read
    of them failed (False: the holder no longer had them, as a rule); None when its report says
    neither (no report, or nothing to load: its own cache had the history, the blocks described
    another prompt)."""
    if account is None or account.loaded is None:
        return None
    if account.loaded > 0:
        return True
    if any(reason == REFUSED_FAILED for reason, _ in account.refused):
        return False
    return None


def _loaded_some(account: PromptAccount | None) -> bool:
    """The engine reported loading some of the offered blocks, or gave no figure (a stock
    engine's answer)."""
    return account is None or account.loaded is None or account.loaded > 0


def _then(first: Callable[[], None] | None, then: Callable[[], None]) -> Callable[[], None]:
    """`first` (if any), then `then`: two hooks where a leg takes one."""
    if first is None:
        return then

    def both() -> None:
        first()
        then()

    return both


def _count_pull(leg: str, url: str, account: PromptAccount) -> None:
    """What the engine that was sent a pinned prefix (`leg` prefill or decode, at `url`) loaded
    of it, as its connector reported (`kvrelay_prefix_pulls_total{leg,result=pulled|not_pulled}`
    and the tokens it loaded)."""
    loaded = account.loaded
    metrics.PREFIX_PULLS.labels(leg, "pulled" if loaded else "not_pulled").inc()
    if loaded:
        metrics.PREFIX_PULLED_TOKENS.inc(loaded)
    else:
        log.info(
            "the %s engine %s loaded none of the pinned prefix (local hit %s, refused %s)",
            leg,
            url,
            account.local_hit,
            dict(account.refused),
        )
