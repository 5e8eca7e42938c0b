"""What a worker's turns work with: `TurnCrew`, built once per worker from its `Fleet`.

A turn's steps are each given the parts they use (the take step the map, the legs their pool
and the router, the store the map and the releaser), never the fleet: a step can be read with
only its own collaborators in mind. This module is where the turn's room meets the fleet.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from kvrelay.kvcache_map import ConversationKey, KVEntry, KVMap, MapUnavailableError
from kvrelay.proxy.engines import Releaser, Upstream, prompt_token_ids, prompt_tokens
from kvrelay.proxy.fleet import Backend, Fleet, Pool, PromptPrefixes, Router, TurnPolicy
from kvrelay.proxy.telemetry import metrics
from kvrelay.proxy.turn.attempts import Engines, UpstreamEngines
from kvrelay.proxy.turn.settings import TurnSettings
from kvrelay.proxy.turn.store import Storing
from kvrelay.proxy.turn.take import Take


@dataclass(frozen=True, slots=True)
class TurnCrew:
    """The parts of one worker that its turns use (see the module's docstring)."""

    settings: TurnSettings
    kvmap: KVMap
    router: Router  # the pickers and what the fleet learns from each turn
    policy: TurnPolicy  # `routing_policy`: each turn's plan
    releaser: Releaser  # frees holds in the background, fetches D's finished params
    engines: Engines  # where the legs' requests go
    upstream: Upstream  # the worker's engine client: prompt counts on `/tokenize`
    side_channel_of: Callable[[Backend], tuple[str, int] | None]  # an engine's side channel
    map_unavailable: Callable[[str, Exception], None]  # counts and logs a map error
    take: Take  # step 1: the conversation's entry from the map, checked
    storing: Storing  # step 6: D's params stored as the conversation's entry

    @classmethod
    def of(cls, fleet: Fleet, engines: Engines | None = None) -> TurnCrew:
        """The crew of `fleet`'s worker; `engines`: where legs go (a unit test's fake), by
        default the fleet's engine client with the settings' timeouts."""
        settings, upstream = fleet.settings, fleet.upstream
        if engines is None:
            engines = UpstreamEngines(
                upstream,
                settings.first_byte_timeout,
                settings.total_timeout,
                settings.probe_timeout_s,
            )
        turn_settings, kvmap, router = TurnSettings.of(settings), fleet.kvmap, fleet.router
        releaser, map_unavailable = fleet.releaser, fleet.map_unavailable
        return cls(
            settings=turn_settings,
            kvmap=kvmap,
            router=router,
            policy=fleet.policy,
            releaser=releaser,
            engines=engines,
            upstream=upstream,
            side_channel_of=fleet.side_channel_of,
            map_unavailable=map_unavailable,
            take=Take(kvmap, releaser, map_unavailable, router.holder_available, turn_settings),
            storing=Storing(
                kvmap,
                releaser,
                map_unavailable,
                turn_settings,
                fleet.side_channel_of,
                router.holds.made,
                # A declined turn's gap is read by brief holds and by the pace rule only.
                router.holds.unheld
                if router.holds.brief_s > 0 or router.finds_unheld_history
                else None,
            ),
        )

    @property
    def prefill(self) -> Pool:
        return self.router.prefill

    @property
    def decode(self) -> Pool:
        return self.router.decode

    async def count_tokens(self, url: str, route: str, body: dict[str, Any]) -> int | None:
        """The prompt's tokens as the engine at `url` counts them (None: it could not say)."""
        return await prompt_tokens(self.upstream, url, route, body, self.settings.probe_timeout_s)

    async def with_tokens(
        self, prompt: PromptPrefixes, route: str, body: dict[str, Any]
    ) -> PromptPrefixes:
        """`prompt` with its token ids, for the KV events' index (`Router.wants_tokens`), as
        the least busy P tokenizes it (its template and tokenizer are what its cache hashes;
        busy as routing weighs it, the engines' load readings included: a P busy computing
        answers its `/tokenize` late); as it was when no P answers within the probe timeout
        (`kvrelay_prompt_tokenize_total{result="failed"}`: that turn is routed blind to the
        Ps' events)."""
        least = self.router.least_loaded(self.prefill, set())
        if least is None:
            return prompt
        tokens = await prompt_token_ids(
            self.upstream, least.url, route, body, self.settings.probe_timeout_s
        )
        metrics.PROMPT_TOKENIZE.labels("failed" if tokens is None else "ok").inc()
        if tokens is None:
            return prompt
        salt = body.get("cache_salt")
        return prompt.with_tokens(tokens, salt if isinstance(salt, str) else None)

    def give_back(self, keys: Sequence[Hashable]) -> None:
        """Release, in the background, the holds stored under `keys` (`HoldPayoff.unpaid`: holds
        counted unused for a tenant whose holds do not pay): each map entry deleted, its
        blocks freed on D now instead of at the lease's end."""
        if keys:
            self.releaser.spawn(self._give_back(keys))

    async def _give_back(self, keys: Sequence[Hashable]) -> None:
        for key in keys:
            if not isinstance(key, ConversationKey):
                continue
            try:
                entry = await self.kvmap.delete(key)
            except MapUnavailableError as exc:
                self.map_unavailable("delete", exc)
                return  # the leases still end them
            if entry is not None:  # not taken meanwhile, nor expired
                self.releaser.spawn(self._release_given_back(entry))

    async def _release_given_back(self, entry: KVEntry) -> None:
        """Free a given-back hold's blocks on D; counted (`decision="released"`) only when D
        freed them: one its hold budget or block pressure already ended is D's to count, and
        counting it here too would count one unused hold twice."""
        if await self.releaser.release("decode", entry.hold_ref):
            metrics.HOLD_DECISIONS.labels("released").inc()
