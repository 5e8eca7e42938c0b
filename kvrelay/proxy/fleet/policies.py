"""Routing policies: where a turn goes, decided once before its legs run, as a `Plan`.

One interface (`TurnPolicy.plan`), one small class per `routing_policy` (docs/OPERATIONS.md
"Routing policy"), chosen by name (`policy_named`). The policies share the fleet's mechanics in
`kvrelay.proxy.fleet.Router` (load, the P and D pickers, the decode-only and spill estimates);
a policy only decides which of them a turn uses:

- `always_p` (`AlwaysP`): every turn P then D; P by least outstanding work, D by conversation
  affinity (the holder first).
- `affinity` (`Affinity`): as `always_p`, and the P leg prefers the P that served the
  conversation's previous turn (its local prefix cache still has the previous prompt, so it
  pulls from D only the blocks beyond it); the router lets that preference yield to an
  overloaded, busy or far more queued P (`Router.pick_prefill`).
- `conditional` (`Conditional`): `affinity`, and a short follow-up goes straight to the D that
  holds the conversation (decode-only: D serves the history from its held blocks and prefills
  only the rest; with `decode_only_cached`, a turn with no held history to the D whose prefix
  cache is expected to hold it, `Router.cached_decode_only`), and a turn that would go
  through a backed-up P *spills* to a D that prefills it itself (`Router.spill`). Both are
  estimated from the prompt's characters, which the client chooses, then confirmed on the
  count of the D that would prefill (`TokenCounter`, its own `/tokenize`); a turn that does
  not fit on that count goes through P.

A plan names engines to try first; the legs' retries still ask the router for the next one.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

from kvrelay.kvcache_map import KVEntry
from kvrelay.proxy.fleet.prefix_index import PromptPrefixes
from kvrelay.proxy.fleet.routing import PrefixSource, Router

# The prompt's tokens as the engine at this URL counts them; None when it cannot say.
TokenCounter = Callable[[str], Awaitable[int | None]]


class Route(enum.StrEnum):
    """Which legs a turn runs."""

    THROUGH_P = "through_p"  # P prefills (pulling the held history), D decodes
    DECODE_ONLY = "decode_only"  # the D holding the conversation prefills the rest itself
    SPILL = "spill"  # a D prefills a turn P would have taken, P being backed up


class CountCheck(enum.StrEnum):
    """A decode-only turn the estimate allowed, checked on D's own count of the prompt
    (`kvrelay_decode_only_checks_total{result}`)."""

    FITS = "fits"
    TOO_LONG = "too_long"
    UNCOUNTED = "uncounted"


# Not frozen: a frozen dataclass sets each field through `object.__setattr__`, and a plan is
# made on every turn. Treat it as a value all the same: nothing changes it once made.
@dataclass(slots=True)
class Plan:
    """Where one turn goes: its route, the engines to try first, what D prefills itself."""

    route: Route
    prefill_first: str | None = None  # P to try first: the conversation's previous P
    decode_first: str | None = None  # D to try first: the holder, or the D a spill goes to
    decode_tokens: int | None = None  # D's own prefill work, in tokens; None through P
    # That D holds the conversation's history (its prefix-cache hit). A decode-only turn
    # without it went by D's expected prefix cache (`decode_only_cached`).
    to_holder: bool = False
    check: CountCheck | None = None  # the decode-only count check, when one was made
    pull_from: PrefixSource | None = None  # a spill: the P whose cached prefix D pulls

    @property
    def reads_held(self) -> bool:
        """A spill whose D, not the holder, reads the conversation's held history from it."""
        return self.pull_from is not None and self.pull_from.held


class TurnPolicy(Protocol):
    """A routing policy: the plan for one turn, from the conversation's usable entry (None for
    a first turn or an unusable one), the prompt's characters (+1, `work`), the tenant, and
    the prompt's prefixes when P is chosen by what it caches (`Router.routes_by_prefix`)."""

    name: ClassVar[str]

    async def plan(
        self,
        entry: KVEntry | None,
        work: int,
        tenant: str,
        count: TokenCounter,
        prompt: PromptPrefixes | None = None,
    ) -> Plan: ...


class AlwaysP:
    """Every turn through P; D by affinity to the conversation's holder."""

    name: ClassVar[str] = "always_p"

    def __init__(self, router: Router) -> None:
        self._router = router

    async def plan(
        self,
        entry: KVEntry | None,
        work: int,
        tenant: str,
        count: TokenCounter,
        prompt: PromptPrefixes | None = None,
    ) -> Plan:
        return Plan(Route.THROUGH_P, decode_first=entry.url if entry is not None else None)


class Affinity(AlwaysP):
    """Through P, the conversation's previous P first."""

    name: ClassVar[str] = "affinity"

    async def plan(
        self,
        entry: KVEntry | None,
        work: int,
        tenant: str,
        count: TokenCounter,
        prompt: PromptPrefixes | None = None,
    ) -> Plan:
        return self._through_p(entry, None)

    @staticmethod
    def _through_p(entry: KVEntry | None, check: CountCheck | None) -> Plan:
        if entry is None:
            return Plan(Route.THROUGH_P, check=check)
        return Plan(
            Route.THROUGH_P, prefill_first=entry.prefill_url, decode_first=entry.url, check=check
        )


class Conditional(Affinity):
    """`affinity`, with decode-only follow-ups on the holder and spills off a backed-up P."""

    name: ClassVar[str] = "conditional"

    async def plan(
        self,
        entry: KVEntry | None,
        work: int,
        tenant: str,
        count: TokenCounter,
        prompt: PromptPrefixes | None = None,
    ) -> Plan:
        router = self._router
        check: CountCheck | None = None
        if entry is not None and router.decode_only_tokens(entry, work, tenant) is not None:
            counted = await count(entry.url)
            uncached = None if counted is None else max(0, counted - entry.num_tokens)
            if uncached is None:
                check = CountCheck.UNCOUNTED
            elif router.decode_only_fits(entry, uncached):
                return Plan(
                    Route.DECODE_ONLY,
                    decode_first=entry.url,
                    decode_tokens=uncached,
                    to_holder=True,
                    check=CountCheck.FITS,
                )
            else:
                check = CountCheck.TOO_LONG
        elif entry is None and prompt is not None:
            cached = router.cached_decode_only(prompt, tenant)
            if cached is not None:
                d, held_chars, _ = cached
                counted = await count(d.url)
                if counted is None:
                    check = CountCheck.UNCOUNTED
                else:
                    uncached = max(0, counted - counted * held_chars // prompt.total)
                    if router.cached_decode_only_fits(d, uncached):
                        return Plan(
                            Route.DECODE_ONLY,
                            decode_first=d.url,
                            decode_tokens=uncached,
                            check=CountCheck.FITS,
                        )
                    check = CountCheck.TOO_LONG
        spill = router.spill(entry, work, tenant, prompt)
        if spill is not None:
            counted = await count(spill.backend.url)
            held = entry.num_tokens if entry is not None else 0
            confirmed = spill.counted(counted, held, work) if counted is not None else None
            if confirmed is not None:
                return Plan(
                    Route.SPILL,
                    decode_first=confirmed.backend.url,
                    decode_tokens=confirmed.tokens,
                    to_holder=confirmed.holder,
                    check=check,
                    pull_from=confirmed.source,
                )
        return self._through_p(entry, check)


POLICIES: dict[str, Callable[[Router], TurnPolicy]] = {
    policy.name: policy for policy in (AlwaysP, Affinity, Conditional)
}


def policy_named(name: str, router: Router) -> TurnPolicy:
    """The policy `routing_policy` names, over `router`'s pools."""
    try:
        return POLICIES[name](router)
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}") from None
