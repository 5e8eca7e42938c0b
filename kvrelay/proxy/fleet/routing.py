"""The fleet's routing mechanics: which P and which D a turn's legs go to, and the estimates
behind skipping P. Which of them a turn uses is its policy's choice
(`kvrelay.proxy.fleet.policies`: `always_p`, `affinity`, `conditional`).

- `pick_prefill`: the least loaded P, or the P a plan prefers (the conversation's previous P,
  whose local prefix cache still has the previous prompt) while that P is usable and not
  overloaded. The preference yields when another P's queued prompt work is shorter by more than
  the whole turn: that P would be done before the preferred one started, and it loses only the
  pull of the history (the holder serves it to any P).
- `pick_decode`: the D holding the conversation unless it is overloaded or busy, else the least
  loaded.
- `decode_only_tokens`: when the D that holds the conversation is not busy and the part of the
  new prompt it does not hold is short (`conditional_max_uncached_tokens`, estimated from the
  previous turn's characters per token), the turn can go straight to that D: D serves the
  history from its own held blocks (a prefix-cache hit) and prefills only the rest, as long as
  the decode-only turns in flight on that D stay within its prefill budget
  (`conditional_max_inflight_tokens`).
- `spill`: a turn that would otherwise go through P (a first turn too) can *spill* to a D when
  P is backed up: when the least loaded P's queued prompt tokens plus the turn's own exceed
  `prefill_spill_factor` times what D would prefill (its decode-only tokens in flight plus the
  turn's, only the uncached part on the holder), D prefills the turn itself, within
  `prefill_spill_max_inflight_tokens` of decode-only prefill on that D, and never onto a D whose
  decodes already run slower than `prefill_spill_max_inter_token_ms` (its own inter-token
  histogram, read with the load gauges; 0, the default, turns that check off: on a P-bound
  fleet it moved more misses to TTFT than it saved in TPOT). D's prefill capacity, idle in a
  P/D split whose P is the bottleneck, then takes the overflow. The D is the one that would be
  done with the turn soonest: the holder (which prefills only what it does not hold), the
  least loaded D, or a D whose prefix cache is expected to hold part of the prompt.

An engine is *busy* when its own fresh load reading (`kvrelay.proxy.fleet.engine_load`) shows more
than `decode_max_waiting` queued requests or KV usage above `decode_max_kv_usage`; busy engines
are chosen last and lose affinity. Without a fresh reading only the in-flight counts decide.

The sizes above are first estimated from the prompt's characters, which the client chooses:
emoji or CJK text run to a token per character where English runs about four. A turn the
estimate would send to D is confirmed on the count of that D's own tokenizer
(`kvrelay.proxy.engines.prompt_tokens`): `decode_only_fits` and `Spill.counted` check the
same bounds on it, and the turn goes through P when it does not fit (or D cannot count it).

The router learns from what the engines report a turn reused (`ReuseStanding`), per engine and
tenant: a D whose decode-only turns show a tenant no cached tokens gets none of that tenant's
until it shows some again, and a P whose affinity turns show no local hit loses that tenant's
affinity until it shows one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from kvrelay.kvcache_map import KVEntry
from kvrelay.proxy.config import Settings
from kvrelay.proxy.fleet.block_index import BlockIndex
from kvrelay.proxy.fleet.engine_load import fresh_load
from kvrelay.proxy.fleet.held_reads import HeldReads
from kvrelay.proxy.fleet.hold_payoff import HoldPayoff
from kvrelay.proxy.fleet.load_reading import EngineLoad
from kvrelay.proxy.fleet.pin_rests import PinRests
from kvrelay.proxy.fleet.pin_wait import PinWaits, PrefillPace
from kvrelay.proxy.fleet.pools import Backend, Pool
from kvrelay.proxy.fleet.prefix_index import PrefixIndex, PromptPrefixes
from kvrelay.proxy.fleet.prefix_wait import PrefixesInFlight
from kvrelay.proxy.fleet.reuse_standing import ReuseStanding
from kvrelay.proxy.telemetry import metrics

# Characters per token until a conversation's entry says (English BPE tokenizers: about 4).
_DEFAULT_CHARS_PER_TOKEN = 4.0
_NO_P_LEFT_OUT: frozenset[str] = frozenset()
# What a pulled token costs P against computing it: a 12k-token pull of an 8B Llama in vLLM's
# per-layer pages is 24,000 NIXL descriptors at about 7 us each on an H200 (bench/RESULTS.md,
# "transfer (GPU)"), about 175 ms, against about 400 ms to prefill it. So a P that caches the
# history itself beats one that would pull it, and both beat one that recomputes it.
PULL_COST = 0.4
# A pin waits for the rest of the holder's current step: half of it, on average.
PIN_WAIT_SHARE = 0.5
# With KV events, how long a prompt just routed to a P counts as cached there before its
# blocks are reported: its prefill (seconds; queued behind others, tens of seconds at most).
KV_EVENTS_PENDING_S = 30.0


@dataclass(slots=True)
class Spill:
    """Where a spilled turn goes, and the prompt tokens that D prefills itself (estimated, until
    `counted` with D's own count). When D pulls a prefix, the choice weighs the pull's cost and
    the pin's wait (`with_pull`), and `tokens` is only what D computes (`computed_after_pull`):
    D's busy count carries its compute, not the wait."""

    backend: Backend
    tokens: int
    holder: bool  # D holds the conversation's history (its decode-only turn reuses it)
    p_queued_chars: float  # the chosen P's queued prompt work, in characters
    d_queued: int  # D's decode-only prompt tokens in flight
    factor: float  # prefill_spill_factor
    p_cached_chars: int = 0  # the prefix that P's cache is expected to hold (prefix routing)
    # `prefix_pull`: the P whose events show the longest prefix, which D pulls (pinned there)
    # instead of computing it, and the wait for its pin, in tokens of the holder's work.
    source: PrefixSource | None = None
    pin_wait_tokens: float = 0.0
    d_cached_chars: int = 0  # the prefix D's own cache is expected to hold (it decoded it)
    # prefill_spill_max_inflight_tokens: D's decode-only tokens queued plus this turn's
    # may not pass it (one spilled long prompt stalls every decode on D until it is done).
    d_budget: float = math.inf
    # The share of the holder's held reads that found their blocks (`HeldReads`): P, too,
    # reads the held history only that often.
    held_share: float = 1.0

    def counted(self, prompt_tokens: int, held_tokens: int, prompt_chars: int) -> Spill | None:
        """This spill judged again with the prompt's tokens as D counts them (`held_tokens`:
        what the conversation's holder keeps, 0 without an entry; P's queue and cached prefix,
        kept in characters, are converted at this prompt's own characters per token); None
        when it no longer pays, and the turn goes through P."""
        per_char = prompt_tokens / max(prompt_chars, 1)
        p_cached = round(self.p_cached_chars * per_char)
        # What P would compute: it reads the held history as often as the holder's holds
        # were there to read (`held_share`).
        p_held = round(held_tokens * self.held_share)
        uncached = max(0, prompt_tokens - max(p_held, p_cached))
        d_cached = round(self.d_cached_chars * per_char)
        d_tokens = prompt_tokens - (held_tokens if self.holder else min(d_cached, prompt_tokens))
        d_tokens = max(0, d_tokens)
        uncached, d_work, d_tokens, source = _weigh_pull(
            prompt_tokens, uncached, d_tokens, d_cached, self.source, self.pin_wait_tokens
        )
        p_queued = self.p_queued_chars * per_char
        if p_queued + uncached <= self.factor * (self.d_queued + d_work):
            return None
        if self.d_queued + d_tokens > self.d_budget:
            return None
        return Spill(
            self.backend,
            d_tokens,
            self.holder,
            self.p_queued_chars,
            self.d_queued,
            self.factor,
            self.p_cached_chars,
            source,
            self.pin_wait_tokens,
            self.d_cached_chars,
            self.d_budget,
            self.held_share,
        )


def _weigh_pull(
    prompt_tokens: int,
    p_tokens: int,
    d_tokens: int,
    d_cached: int,
    source: PrefixSource | None,
    pin_wait_tokens: float,
) -> tuple[int, int, int, PrefixSource | None]:
    """A spill's two sides with `source`'s prefix pulled: P would pull it too
    (`Router._by_prefix`), D pulls it unless computing beyond its own cache (`d_cached`) is
    cheaper. Returns P's and D's work in tokens (what the choice weighs), the tokens D computes
    (what its busy count carries: `computed_after_pull` when it pulls) and the source D pulls
    from (None: none)."""
    if source is None:
        return p_tokens, d_tokens, d_tokens, None
    p_tokens = min(p_tokens, with_pull(prompt_tokens, source.tokens, pin_wait_tokens))
    pulled = with_pull(prompt_tokens, source.tokens, pin_wait_tokens, d_cached)
    if pulled < d_tokens:
        computed = computed_after_pull(prompt_tokens, source.tokens, d_cached)
        return p_tokens, pulled, computed, source
    return p_tokens, d_tokens, d_tokens, None


def computed_after_pull(prompt_tokens: int, prefix_tokens: int, local_tokens: int = 0) -> int:
    """The tokens an engine computes of a prompt whose first `prefix_tokens` it pulls and whose
    first `local_tokens` its own cache holds: what its prefill budget carries (the pull's cost
    and the pin's wait weigh the choice, `with_pull`, but are not its compute)."""
    prefix = min(prefix_tokens, max(0, prompt_tokens - 1))  # the last token is computed
    return max(1, prompt_tokens - max(prefix, min(max(0, local_tokens), prompt_tokens)))


def with_pull(
    prompt_tokens: int, prefix_tokens: int, pin_wait_tokens: float, local_tokens: int = 0
) -> int:
    """The work, in tokens, of a prompt whose first `prefix_tokens` are pulled from a pin by an
    engine whose own cache holds its first `local_tokens`: the rest computed, the pulled part
    beyond the local one at `PULL_COST`, and the pin's wait."""
    prefix = min(prefix_tokens, max(0, prompt_tokens - 1))  # the last token is computed
    local = min(max(0, local_tokens), prefix)
    pulled = prefix - local
    return max(1, round(prompt_tokens - prefix + PULL_COST * pulled + pin_wait_tokens))


class PrefixSource(NamedTuple):
    """Another engine whose cache holds a prefix of the turn's prompt, which the chosen P (or a
    spill's D) pulls from it (`prefix_pull`): that engine, the prefix's tokens (whole blocks,
    as its events said) and its pool's role ("prefill", or "decode": a D's cache keeps the
    prompts it decoded, a conversation's history among them). `held`: the prefix is the
    conversation's history that D keeps for this turn (the taken entry's blocks), read without
    a pin."""

    backend: Backend
    tokens: int
    holder: str = "prefill"
    held: bool = False


class PrefillPick(NamedTuple):
    """The P a turn's P leg tries, whether it is the one the plan preferred (affinity), the
    prompt characters it is expected to compute (what its queue counts while it does), and
    the P it pulls a cached prefix from, if any."""

    backend: Backend | None
    by_affinity: bool
    work: int
    source: PrefixSource | None = None


@dataclass
class _CharsPerToken:
    """The latest characters per token an entry carried: sizes first turns' prompts in tokens."""

    value: float = _DEFAULT_CHARS_PER_TOKEN


@dataclass
class _LastLookup:
    """The prompt last looked up in the KV events' index and what it found. A turn's routing
    looks its prompt up for the spill, the spill's pull source and P's pick: it reads one
    snapshot of the index, taken at its first lookup (the same prompt object), instead of
    walking the prompt's blocks three times."""

    tokens: tuple[int, ...] | None = None
    salt: str | None = None
    found: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Router:
    """The routing policy of one worker, over its two pools."""

    settings: Settings
    prefill: Pool
    decode: Pool
    decode_only: ReuseStanding = field(init=False)  # Ds whose decode-only turns reuse nothing
    # Ds whose decode-only turns sent by their expected prefix cache (`decode_only_cached`)
    # reuse nothing: kept apart, so a stale expectation does not withdraw a holder's turns.
    decode_cached: ReuseStanding = field(init=False)
    affinity: ReuseStanding = field(init=False)  # Ps whose affinity turns hit nothing locally
    prefixes: PrefixIndex | None = field(init=False)  # what each P caches (prefix_routing)
    blocks: BlockIndex | None = field(init=False)  # what each P says it caches (KV events)
    holds: HoldPayoff = field(init=False)  # whose holds are read (hold_min_use)
    held_reads: HeldReads = field(default_factory=HeldReads)  # whose holds last to their read
    in_flight: PrefixesInFlight = field(init=False)  # prefixes being computed (prefix_wait)
    _chars_per_token: _CharsPerToken = field(default_factory=_CharsPerToken)
    pin_rests: PinRests = field(init=False)  # holders resting after late pins
    pin_waits: PinWaits = field(init=False)  # how long each holder's pins took lately
    prefill_pace: PrefillPace = field(default_factory=PrefillPace)  # P's tokens per busy second
    _last_lookup: _LastLookup = field(default_factory=_LastLookup)

    def __post_init__(self) -> None:
        s = self.settings
        interval = s.reuse_probe_interval_s
        object.__setattr__(self, "decode_only", ReuseStanding("decode", "decode_only", interval))
        object.__setattr__(
            self, "decode_cached", ReuseStanding("decode", "decode_only_cached", interval)
        )
        object.__setattr__(self, "affinity", ReuseStanding("prefill", "affinity", interval))
        events = s.prefix_routing and bool(s.kv_events_port or s.kv_events_endpoints)
        # With the engines' events the routing-fed index only covers a prompt still being
        # computed (its blocks not yet reported): what P evicted, the events say.
        ttl = min(s.prefix_index_ttl_s, KV_EVENTS_PENDING_S) if events else s.prefix_index_ttl_s
        prefixes = PrefixIndex(ttl, s.prefix_index_max_entries) if s.prefix_routing else None
        object.__setattr__(self, "prefixes", prefixes)
        object.__setattr__(self, "blocks", BlockIndex(s.kv_events_max_blocks) if events else None)
        holds = HoldPayoff(s.hold_min_use, s.hold_judge_s, s.conversation_ttl_s, s.hold_brief_s)
        object.__setattr__(self, "holds", holds)
        wait_s = s.prefix_wait_max_s if s.prefix_routing else 0.0
        min_chars = s.prefix_pull_min_tokens * _DEFAULT_CHARS_PER_TOKEN
        object.__setattr__(self, "in_flight", PrefixesInFlight(wait_s, min_chars))
        rests = PinRests(s.prefix_pull_timeout_s, s.reuse_probe_interval_s)
        object.__setattr__(self, "pin_rests", rests)
        object.__setattr__(self, "pin_waits", PinWaits(s.reuse_probe_interval_s))

    # -- load --------------------------------------------------------------------------------

    def busy(self, backend: Backend) -> bool:
        """The engine says its queue or KV cache is past the thresholds (fresh readings only;
        the KV usage less what this worker's turns freed since: `kv_usage`)."""
        load = fresh_load(backend, self.settings.load_poll_interval_s)
        if load is None:
            return False
        return load.waiting > self.settings.decode_max_waiting or self._kv_over(backend, load)

    def _kv_full(self, backend: Backend) -> bool:
        """The engine's fresh reading shows its KV cache past `decode_max_kv_usage`."""
        load = fresh_load(backend, self.settings.load_poll_interval_s)
        return load is not None and self._kv_over(backend, load)

    def _kv_over(self, backend: Backend, load: EngineLoad) -> bool:
        """`load`'s KV usage, less what this worker's turns freed since (`kv_usage`), is past
        `decode_max_kv_usage`. What was freed can only lower the reading: counted only when the
        reading itself is over."""
        bound = self.settings.decode_max_kv_usage
        return load.kv_usage > bound and kv_usage(backend, load) > bound

    def released(self, url: str, tokens: int) -> None:
        """A turn this worker sent to the D at `url` has ended and left `tokens` of KV free
        there (no hold kept them): its KV usage reads that much lower until the next reading
        (`FreedTokens`)."""
        backend = self.decode.get(url)
        if backend is not None:
            backend.freed.freed(tokens, time.monotonic())

    def _queued(self, backend: Backend) -> float:
        """Requests the engine has, as far as this worker can tell: its own in flight, or the
        engine's running + waiting when a fresh reading says more (other workers' too)."""
        load = fresh_load(backend, self.settings.load_poll_interval_s)
        seen = load.running + load.waiting if load is not None else 0.0
        return max(float(backend.inflight), seen)

    # -- P -----------------------------------------------------------------------------------

    @property
    def routes_by_prefix(self) -> bool:
        """P is chosen by the prefixes the Ps cache (`prefix_routing`, and more than one P to
        choose from: with one, the index would cost every turn and decide nothing, unless the
        engines' events may name a D's cache for that P to pull from: `prefix_pull`)."""
        if self.prefixes is None:
            return False
        if len(self.prefill.backends) > 1:
            return True
        return self.blocks is not None and self.settings.prefix_pull

    @property
    def finds_unheld_history(self) -> bool:
        """A turn whose history nobody holds can still be sent to the D whose prefix cache has
        it: the engines' KV events say what each D caches and a turn goes decode-only by them
        (`decode_only_cached` under `conditional`). Only then may a conversation's pace stand
        in for a hold (`HoldPayoff`'s `cache_keeps`): without it an unheld history is computed
        again."""
        s = self.settings
        return (
            self.blocks is not None and s.decode_only_cached and s.routing_policy == "conditional"
        )

    @property
    def wants_tokens(self) -> bool:
        """P is chosen by the engines' KV events: the prompt's token ids are looked up."""
        return self.blocks is not None and self.routes_by_prefix

    def cached_chars(
        self, prompt: PromptPrefixes, reported: Mapping[str, int] | None = None
    ) -> dict[str, int]:
        """For each engine expected to cache a prefix of `prompt`, that prefix in characters:
        the longer of what the routing-fed index expects and what the engine's own events reported
        (`reported`, else looked up: tokens counted as the prompt's characters in
        proportion)."""
        assert self.prefixes is not None
        cached = self.prefixes.cached_chars(prompt)
        if reported is None:
            reported = self.reported_tokens(prompt)
        if reported:
            n = len(prompt.tokens or ())
            for url, tokens in reported.items():
                chars = prompt.total * tokens // n
                if chars > cached.get(url, 0):
                    cached[url] = chars
        return cached

    def decoded(self, url: str, prompt: PromptPrefixes) -> None:
        """The D at `url` decoded a turn of `prompt`, whose whole prompt it read or computed:
        its prefix cache is expected to hold it (D publishes no events the proxy follows), in
        the routing-fed index, for a spill's choice (`spill`)."""
        if self.prefixes is not None:
            self.prefixes.record(url, prompt)

    def sent_to(self, url: str, prompt: PromptPrefixes) -> None:
        """The turn of `prompt` goes to the engine at `url` (the P a pick chose, or the D its
        decode leg tries): with its token ids known, the blocks that engine stores after a
        prefix it cached before this worker followed its events name that prefix through this
        prompt (`BlockIndex.expect`)."""
        if self.blocks is not None and prompt.tokens:
            self.blocks.expect(url, prompt.tokens, prompt.salt)

    def reported_tokens(self, prompt: PromptPrefixes) -> Mapping[str, int]:
        """For each engine (P or D) whose KV events show a prefix of `prompt` cached, its tokens
        (as the first lookup of this prompt object found them: `_LastLookup`)."""
        tokens = prompt.tokens
        if self.blocks is None or not tokens:
            return {}
        last = self._last_lookup
        if tokens is last.tokens and prompt.salt == last.salt:
            return last.found
        found = self.blocks.cached_tokens(tokens, prompt.salt)
        last.tokens, last.salt, last.found = tokens, prompt.salt, found
        return found

    def pin_too_slow(self, url: str) -> None:
        """The engine at `url` did not answer a pin within `prefix_pull_timeout_s` (its queue
        is not ordered by priority, or it is that busy): no pulls from it for a while, longer
        after each late pin in a row, up to `reuse_probe_interval_s` (`PinRests`)."""
        self.pin_rests.late(url)

    def pin_answered(self, url: str, pool: str, seconds: float) -> None:
        """The engine at `url`, of `pool` ("prefill" or "decode"), answered a pin `seconds`
        after it was asked (`PinWaits`: how a pull from it, or from its pool, is weighed)."""
        self.pin_waits.answered(url, pool, seconds)

    def prefill_started(self, url: str) -> None:
        """A prefill leg was sent to the P at `url` (`PrefillPace`)."""
        self.prefill_pace.started(url)

    def prefill_ended(self, url: str, computed: int) -> None:
        """A prefill leg on the P at `url` ended, P having computed `computed` prompt tokens
        (0: unknown or failed) (`PrefillPace`)."""
        if self.prefill_pace.ended(url, computed):
            metrics.PREFILL_PACE.set(self.prefill_pace.tokens_per_s() or 0.0)

    def pin_on_time(self, url: str) -> None:
        """The engine at `url` answered a pin in time: its series of late pins ends."""
        self.pin_rests.on_time(url)

    def serves_pulls(self, url: str) -> bool:
        """The engine at `url` is not resting after a late pin (`pin_too_slow`)."""
        return self.pin_rests.serves(url)

    def _pull_source(
        self,
        reported: Mapping[str, int],
        candidates: list[Backend],
        ds: bool = False,
        reader: Backend | None = None,
    ) -> PrefixSource | None:
        """The engine whose events show the longest prefix of the prompt, at least
        `prefix_pull_min_tokens`, when it can pin it now: usable, its pins on time, its KV
        cache not full (a long queue is no bar: the pin goes ahead of it). Among
        `candidates` (Ps) and, with `ds`, the usable Ds publishing events other than `reader`
        (the D that would pull); a P first where they show as much (a pin there does not
        take a decode step)."""
        s = self.settings
        best: PrefixSource | None = None
        pools = (("prefill", candidates), ("decode", self.decode.usable() if ds else []))
        for holder, engines in pools:
            for b in engines:
                tokens = reported.get(b.url, 0)
                if (
                    tokens < s.prefix_pull_min_tokens
                    or (best is not None and tokens <= best.tokens)
                    or b is reader
                ):
                    continue
                if not self.serves_pulls(b.url) or self._kv_full(b):
                    continue
                best = PrefixSource(b, tokens, holder)
        return best

    def pick_prefill(
        self,
        preferred: str | None,
        exclude: set[str],
        work: int = 0,
        tenant: str = "",
        prompt: PromptPrefixes | None = None,
        held_chars: int = 0,
    ) -> PrefillPick:
        """P for the turn, whether it is `preferred` (the conversation's previous P: affinity),
        and the characters it computes. `work`: the turn's prompt characters. With `prompt`
        (`routes_by_prefix`) the P whose queued work plus what it would compute of the prompt
        is least (`_by_prefix`); else the preference yields to a P whose queue is shorter by
        more than the turn, and without one the least loaded P."""
        if prompt is not None and self.prefixes is not None:
            return self._by_prefix(prompt, preferred, exclude, work, held_chars)
        if preferred and preferred not in exclude:
            backend = self._affine(self.prefill, preferred, self.settings.prefill_overload_inflight)
            if backend is not None and self.affinity.admits(backend.url, tenant):
                shorter = self._shorter_queue(backend, exclude, work)
                if shorter is None:
                    return PrefillPick(backend, True, work)
                return PrefillPick(shorter, False, work)
        candidates = [b for b in self.prefill.usable() if b.url not in exclude]
        if len(candidates) <= 1:  # nothing to weigh (the load readings cost a few calls)
            return PrefillPick(candidates[0] if candidates else None, False, work)
        best = min(
            candidates,
            key=lambda b: (self.busy(b), b.outstanding_work, self._queued(b), b.inflight),
        )
        return PrefillPick(best, False, work)

    def _by_prefix(
        self,
        prompt: PromptPrefixes,
        preferred: str | None,
        exclude: set[str],
        work: int,
        held_chars: int,
    ) -> PrefillPick:
        """The P that would be done with the turn first: least queued prompt work plus the
        prompt characters it would compute, those being the prompt less the prefix its cache
        is expected to hold (`cached_chars`) and less the history any P pulls from the
        conversation's holder (`held_chars`) beyond that prefix, which counts at `PULL_COST`.
        Busy Ps last. With `prefix_pull` and no held history, a P may instead pull the longest
        prefix another P's events show (`_pull_source`), also at `PULL_COST`, after the
        holder's pin: sent ahead of the holder's queue (`prefix_pull_priority`), it waits for
        the rest of the holder's current step (`prefill_step_tokens`; `PIN_WAIT_SHARE` of it),
        counted as work."""
        index = self.prefixes
        assert index is not None
        candidates = [b for b in self.prefill.usable() if b.url not in exclude]
        if not candidates:
            return PrefillPick(None, False, work)
        reported = self.reported_tokens(prompt)
        cached = self.cached_chars(prompt, reported)
        source = None
        if self.settings.prefix_pull and reported and not held_chars:
            # A D's cache too: the prompts it decoded, a history whose hold was declined or
            # ended among them (one P: a D is the only other place to pull from).
            source = self._pull_source(reported, candidates if len(candidates) > 1 else [], True)
        source_chars = pin_wait = 0
        if source is not None:
            per_token = prompt.total / len(prompt.tokens or (1,))
            source_chars = round(source.tokens * per_token)
            pin_wait = round(self._pin_wait_chars(source.backend, work, per_token))

        def computed(b: Backend) -> int:
            local = cached.get(b.url, 0)
            pulled = max(0, held_chars - local)
            return max(1, round(work - local - pulled + PULL_COST * pulled))

        def pulling(b: Backend) -> int | None:
            """What `b` computes when it pulls the source's prefix; None when it would not
            (it is the source, or its own cache holds as much)."""
            local = cached.get(b.url, 0)
            if source is None or b is source.backend or source_chars <= local:
                return None
            pulled = source_chars - local
            return max(1, round(work - source_chars + PULL_COST * pulled)) + pin_wait

        def cost(b: Backend) -> tuple[bool, float, float, int]:
            own = computed(b)
            pull = pulling(b)
            least = own if pull is None else min(own, pull)
            return (self.busy(b), self._queued_work(b, work) + least, self._queued(b), b.inflight)

        best = min(candidates, key=cost)
        self.sent_to(best.url, prompt)
        pull = pulling(best)
        if pull is not None and pull < computed(best):
            assert source is not None
            index.record(best.url, prompt)
            metrics.PREFIX_INDEX_ENTRIES.set(len(index))
            metrics.PREFIX_ROUTING.labels("pull").inc()
            return PrefillPick(best, best.url == preferred, pull, source)
        # Recorded as the turn is sent, not when P has answered: a request sharing the prefix
        # that comes meanwhile queues behind it on the same P and reuses its blocks as they
        # are computed, where on another P it would compute them all again.
        index.record(best.url, prompt)
        metrics.PREFIX_INDEX_ENTRIES.set(len(index))
        hit = cached.get(best.url, 0)
        if hit:
            metrics.PREFIX_ROUTING.labels("cached").inc()
            metrics.PREFIX_CACHED_CHARS.inc(hit)
        elif any(b.url in cached for b in candidates):
            metrics.PREFIX_ROUTING.labels("elsewhere").inc()
        else:
            metrics.PREFIX_ROUTING.labels("none").inc()
        return PrefillPick(best, best.url == preferred, computed(best))

    # -- D -----------------------------------------------------------------------------------

    def holder_available(self, entry: KVEntry) -> bool:
        """The D holding `entry` can serve P's pull of its blocks: it is in the pool and
        healthy (a draining holder still serves what it holds)."""
        holder = self.decode.get(entry.url)
        return holder is not None and holder.healthy

    def pick_decode(self, preferred: str | None, exclude: set[str]) -> Backend | None:
        """D by affinity (the holder) unless it is overloaded or busy, else the D whose first
        token for this turn is expected soonest: the fewest whole steps of decode-only and
        spilled prompt still to prefill, then the least loaded (`least_loaded`). A turn P
        prefilled waits on D for the step that follows its KV's arrival, and a step that also
        prefills another turn's prompt lasts as long as that prompt's chunk: hundreds of
        milliseconds against a few for decodes alone."""
        if preferred is not None and preferred not in exclude:
            backend = self._affine(self.decode, preferred, self.settings.decode_overload_inflight)
            if backend is not None:
                return backend
        return self.least_loaded(self.decode, exclude, self.settings.prefill_step_tokens)

    def _affine(self, pool: Pool, preferred: str, overload_inflight: int) -> Backend | None:
        """The `preferred` engine of `pool` when it can take the turn: usable, under
        `overload_inflight` requests, not busy; else None."""
        backend = pool.get(preferred)
        if (
            backend is not None
            and backend.usable
            and backend.inflight < overload_inflight
            and not self.busy(backend)
        ):
            return backend
        return None

    def least_loaded(self, pool: Pool, exclude: set[str], prefill_step: int = 0) -> Backend | None:
        """The usable engine of `pool` (not in `exclude`) with the least queued, busy ones
        last: D without affinity, and the pass-through routes. With `prefill_step` (tokens a
        step computes), first the fewest whole steps of decode-only and spilled prompt tokens
        still to prefill (`pick_decode`)."""
        candidates = [b for b in pool.usable() if b.url not in exclude]
        if len(candidates) <= 1:
            return candidates[0] if candidates else None

        def load(b: Backend) -> tuple[bool, int, float, int, int]:
            pending = max(0, b.outstanding_work - b.inflight) // prefill_step if prefill_step else 0
            return self.busy(b), pending, self._queued(b), b.inflight, b.outstanding_work

        return min(candidates, key=load)

    # -- conditional disaggregation ------------------------------------------------------------

    def decode_only_tokens(
        self, entry: KVEntry | None, prompt_chars: int, tenant: str = ""
    ) -> int | None:
        """Send this turn straight to the D holding the conversation (no P, no transfer)?

        Returns the prompt tokens that D would then prefill itself (estimated: confirm with
        `decode_only_fits` on D's count), or None when the turn goes through P: no estimate,
        a holder that is unusable, overloaded or busy, too long an uncached part, or a holder
        whose decode-only turns in flight already add up to
        `conditional_max_inflight_tokens` (P then takes the turn: prefill spread over the Ps
        keeps D's decode steps short)."""
        s = self.settings
        if entry is None or not entry.chars_per_token:
            return None
        self._chars_per_token.value = entry.chars_per_token
        holder = self.decode.get(entry.url)
        if (
            holder is None
            or not holder.usable
            or holder.inflight >= s.decode_overload_inflight
            or self.busy(holder)
        ):
            return None
        uncached = uncached_tokens(entry, prompt_chars)
        if not self._fits_decode_only(holder, uncached):
            return None
        if not self.decode_only.admits(holder.url, tenant):
            return None  # its decode-only turns showed no cached tokens: through P
        return uncached

    def cached_decode_only(
        self, prompt: PromptPrefixes, tenant: str = ""
    ) -> tuple[Backend, int, int] | None:
        """With `decode_only_cached`, a turn with no held history sent straight to the D whose
        prefix cache is expected to hold the most of `prompt` (the routing-fed index: the
        prompts each D decoded; with the engines' KV events followed, also what D's own events
        report: `cached_chars`), as a holder's decode-only turn: that D, the prefix in
        characters and the tokens it would prefill (estimated: confirm with
        `cached_decode_only_fits` on D's count), or None: no D expected to hold any of it, or
        that D unusable, overloaded or busy, too long a rest, its decode-only budget full, or
        withdrawn for `tenant` (its such turns showed no cached tokens)."""
        s = self.settings
        if not s.decode_only_cached or self.prefixes is None:
            return None
        best_url: str | None = None
        most = 0
        for url, chars in self.cached_chars(prompt).items():
            if chars > most and url in self.decode.backends:
                best_url, most = url, chars
        if best_url is None:
            return None
        best = self._affine(self.decode, best_url, s.decode_overload_inflight)
        if best is None:
            return None
        cpt = self.chars_per_token(None, prompt)
        uncached = max(0, round((prompt.total - most) / cpt))
        if not self._fits_decode_only(best, uncached):
            return None
        if not self.decode_cached.admits(best.url, tenant):
            return None
        return best, most, uncached

    def cached_decode_only_fits(self, d: Backend, uncached: int) -> bool:
        """The turn `cached_decode_only` chose, judged again on D's count of what it lacks."""
        return self._fits_decode_only(d, uncached)

    def decode_only_fits(self, entry: KVEntry, uncached: int) -> bool:
        """The decode-only turn that `decode_only_tokens` estimated, judged again with the
        uncached tokens D counted: within both of D's bounds."""
        holder = self.decode.get(entry.url)
        return holder is not None and self._fits_decode_only(holder, uncached)

    def _fits_decode_only(self, holder: Backend, uncached: int) -> bool:
        s = self.settings
        if uncached > s.conditional_max_uncached_tokens:
            return False
        # A decode leg counts 1 of outstanding work, a decode-only one 1 + its tokens.
        in_flight = holder.outstanding_work - holder.inflight
        return in_flight + uncached <= s.conditional_max_inflight_tokens

    def spill(
        self,
        entry: KVEntry | None,
        prompt_chars: int,
        tenant: str = "",
        prompt: PromptPrefixes | None = None,
    ) -> Spill | None:
        """Send this turn, which would go through P, straight to a D that prefills it itself?

        Yes (`prefill_spill_factor` > 0) when P's time, the least loaded
        P's queued prompt tokens plus what P would compute of this turn (the part D does not
        hold when there is an entry to pull), exceeds `prefill_spill_factor` times D's, its
        decode-only tokens in flight plus what it would prefill of this turn. The D is, of the
        conversation's holder when it can take a decode-only turn (it then prefills only the
        part it does not hold), the least loaded D and, with `prompt`, the Ds whose own cache
        is expected to hold part of it, the one that would be done with the turn soonest
        (`_spill_decode`); never a busy or overloaded one, nor
        one whose decode-only tokens still to prefill reach `prefill_spill_max_inflight_tokens`
        or would pass it with this turn's (a decode-only turn's tokens count until its first
        token; a prompt longer than that goes through P, whose queue delays no decode, and
        leaves the Ds to the shorter turns behind it). Prompt tokens are
        estimated from characters (`chars_per_token` of the conversation's entry, else the
        latest one seen); the numbers are the pools' own counts and the load
        readings already kept, so this costs a pass over the engines and nothing else. A spill
        found here is judged again on D's own count before it is taken (`Spill.counted`).
        With `prompt` (prefix routing) P's side is the P that `pick_prefill` would choose:
        its queue, and only what it would compute beyond the prefix its cache holds. A D
        other than the holder pulls the history the holder keeps (`_held_source`) where that
        costs less than computing it, as P would."""
        s = self.settings
        if s.prefill_spill_factor <= 0:
            return None
        cached = (
            self.cached_chars(prompt) if prompt is not None and self.prefixes is not None else None
        )
        least = self._least_queued(prompt_chars, _NO_P_LEFT_OUT, cached)
        if least is None:
            return None  # no P: the P leg finds none and D prefills anyway
        _, p_queued, p_cached = least
        if (
            p_queued <= 0
            and s.prefill_spill_factor >= 1
            and not self._d_caches_more(cached, p_cached)
        ):
            # An idle P computes only the turn's uncached tokens; a D would compute at least
            # those (its queued work is never negative) unless its own cache holds more of the
            # prompt than P's (a D that decoded this history, whose hold is gone), so no
            # factor >= 1 can spill the turn. Said here, before the pass over the D pool: the
            # common case at low load.
            return None
        cpt = self.chars_per_token(entry, prompt)
        tokens = round(prompt_chars / cpt)
        # With an entry P pulls the held history and computes only the rest (what the holder
        # would compute too), as often as the holder's holds were there to read (`HeldReads`);
        # P's own cache may hold more (prefix routing).
        held_rest = (
            uncached_tokens(entry, prompt_chars)
            if entry is not None and entry.chars_per_token
            else None
        )
        held_share = self.held_reads.share(entry.url) if entry is not None else 1.0
        uncached = p_uncached = tokens if held_rest is None else held_rest
        p_share = 1.0  # what P's side reads of the held history (`Spill.held_share`)
        if held_rest is not None:
            p_share = held_share
            p_uncached = tokens - round((tokens - held_rest) * held_share)
        p_cache_rest = max(0, round((prompt_chars - p_cached) / cpt))
        uncached, p_uncached = min(uncached, p_cache_rest), min(p_uncached, p_cache_rest)
        held = self._held_source(entry, held_share)
        target, holder = self._spill_decode(
            entry, tenant, cached, tokens, cpt, held_rest or 0, held.tokens if held else 0
        )
        if target is None:
            return None
        # D's own cache: the prompts of the turns it decoded (it read or computed them whole).
        d_cached_chars = cached.get(target.url, 0) if cached and not holder else 0
        d_cached = min(tokens, round(d_cached_chars / cpt))
        d_tokens = uncached if holder else tokens - d_cached
        source, pin_wait = None, 0.0
        if not holder and prompt is not None:
            # A D without the history may pull the prompt's prefix from the engine caching
            # it, as a P would (`_by_prefix`): both sides then count the pull.
            source, pin_wait = self._spill_source(prompt, cpt, prompt_chars, target)
        if (
            not holder
            and held is not None
            and held.backend is not target  # a holder withdrawn from decode-only turns
            and (source is None or held.tokens >= source.tokens)
        ):
            # Or the history its holder keeps for this turn, as P would read it: no pin to
            # wait for.
            source, pin_wait = held, 0.0
        p_uncached, d_work, d_tokens, source = _weigh_pull(
            tokens, p_uncached, d_tokens, d_cached, source, pin_wait
        )
        p_time = p_queued / cpt + p_uncached
        d_queued = target.outstanding_work - target.inflight
        if p_time <= s.prefill_spill_factor * (d_queued + d_work):
            return None
        if d_queued + d_tokens > s.prefill_spill_max_inflight_tokens:
            # D would prefill past its decode-only budget with this turn's own tokens: a
            # prompt that long goes through P, whose queue delays no decode.
            return None
        return Spill(
            target,
            d_tokens,
            holder,
            p_queued,
            d_queued,
            s.prefill_spill_factor,
            p_cached,
            source,
            pin_wait,
            d_cached_chars,
            s.prefill_spill_max_inflight_tokens,
            p_share,
        )

    def chars_per_token(self, entry: KVEntry | None, prompt: PromptPrefixes | None) -> float:
        """Characters per token for sizing this turn's prompt: exact when it was tokenized (for
        the KV events' index), else its conversation's last turn's, else the latest an entry
        carried."""
        if prompt is not None and prompt.tokens:
            return prompt.total / len(prompt.tokens)
        if entry is not None and entry.chars_per_token:
            return entry.chars_per_token
        return self._chars_per_token.value

    def _d_caches_more(self, cached: Mapping[str, int] | None, p_cached: int) -> bool:
        """A D's prefix cache is expected to hold more of the prompt than `p_cached`, the
        chosen P's (`cached`: URL -> characters, prefix routing)."""
        if not cached:
            return False
        ds = self.decode.backends
        return any(chars > p_cached and url in ds for url, chars in cached.items())

    def _held_source(self, entry: KVEntry | None, share: float) -> PrefixSource | None:
        """With `prefix_pull`, the conversation's held history as a prefix a spilled turn's D
        other than the holder reads from the holder, as P does on a turn through P: the
        holder healthy (busy or not: a read takes none of its steps) and its pins on time,
        the history a whole block and at least `prefix_pull_min_tokens`, weighed by `share`
        (the holder's `HeldReads.share`) at least that long."""
        if (
            entry is None
            or not self.settings.prefix_pull
            or entry.num_tokens < self.settings.prefix_pull_min_tokens
            or not entry.has_full_block
        ):
            return None
        holder = self.decode.get(entry.url)
        if holder is None or not holder.healthy or not self.serves_pulls(holder.url):
            return None
        # Weighed by `share`, how often this holder's holds were still there to read
        # (`HeldReads`): the entry names blocks D may have freed since (budget, pressure).
        tokens = round(entry.num_tokens * share)
        if tokens < self.settings.prefix_pull_min_tokens:
            return None
        return PrefixSource(holder, tokens, "decode", held=True)

    def _spill_source(
        self, prompt: PromptPrefixes, chars_per_token: float, prompt_chars: int, reader: Backend
    ) -> tuple[PrefixSource | None, float]:
        """With `prefix_pull` and the engines' events, the engine a spilled turn's D (`reader`)
        would pull the prompt's prefix from (`_pull_source`: a P, or another D whose cache
        holds it, as a prefix other requests left there), and the pin's wait there in tokens
        (as `_by_prefix` counts it: `PIN_WAIT_SHARE` of the rest of the holder's step)."""
        if not self.settings.prefix_pull:
            return None, 0.0
        reported = self.reported_tokens(prompt)
        if not reported:
            return None, 0.0
        source = self._pull_source(reported, self.prefill.usable(), True, reader)
        if source is None:
            return None, 0.0
        wait = self._pin_wait_chars(source.backend, prompt_chars, chars_per_token)
        return source, wait / chars_per_token

    def _pin_wait_chars(self, holder: Backend, prompt_chars: int, chars_per_token: float) -> float:
        """How long a pin waits on `holder`, in characters of work: it is admitted ahead of the
        holder's queue but after its current step, a step of at most `prefill_step_tokens` and
        at most the work the holder has queued, which a pin arriving at a random moment finds
        half done on average (`PIN_WAIT_SHARE`). Where the holder's pins lately took longer
        than that (`PinWaits`), their measured wait, in the tokens a P computes meanwhile
        (`PrefillPace`): the model misses a slow server and a long step on a D."""
        step = self.settings.prefill_step_tokens * chars_per_token
        modelled = PIN_WAIT_SHARE * min(self._queued_work(holder, prompt_chars), step)
        measured = self.measured_pin_wait_tokens(holder.url, holder.role)
        return max(modelled, measured * chars_per_token)

    def measured_pin_wait_tokens(self, url: str, pool: str) -> float:
        """The recent pin wait of the holder at `url` (else of its `pool`), in prompt tokens a
        P computes meanwhile; 0 where either figure is not measured yet."""
        seconds = self.pin_waits.seconds(url, pool)
        pace = self.prefill_pace.tokens_per_s()
        if seconds is None or pace is None:
            return 0.0
        return seconds * pace

    def _least_queued(
        self,
        prompt_chars: int,
        exclude: set[str] | frozenset[str],
        cached: Mapping[str, int] | None = None,
    ) -> tuple[Backend, float, int] | None:
        """The usable P (not in `exclude`) with the least prompt work queued, less the prefix
        its cache is expected to hold when `cached` says (prefix routing: P URL -> characters):
        that P, its queued work and that prefix."""
        least: tuple[Backend, float, int] | None = None
        best = 0.0
        for b in self.prefill.backends.values():
            if not b.usable or b.url in exclude:
                continue
            work = self._queued_work(b, prompt_chars)
            hit = cached.get(b.url, 0) if cached else 0
            if least is None or work - hit < best:
                least, best = (b, work, hit), work - hit
        return least

    def _queued_work(self, p: Backend, prompt_chars: int) -> float:
        """Prompt work (characters) queued on P: this worker's own, and where a fresh load
        reading shows more requests than this worker sent (other workers'), those counted at
        this worker's mean per request there, or at this turn's size."""
        work = float(p.outstanding_work)
        load = fresh_load(p, self.settings.load_poll_interval_s)
        if load is not None:
            seen = load.running + load.waiting
            if seen > p.inflight:
                mean = work / p.inflight if p.inflight else float(prompt_chars)
                work += (seen - p.inflight) * mean
        return work

    def _shorter_queue(self, p: Backend, exclude: set[str], work: int) -> Backend | None:
        """The usable P whose queued prompt work is shorter than `p`'s by more than the whole
        turn (it would be done with the turn before `p` started it), or None. The conversation's
        previous P saves only the pull of the history its prefix cache still has (the holder
        serves that to any P), so affinity is not worth that wait."""
        own = self._queued_work(p, work)
        if own <= work:
            return None  # not a turn's worth queued beyond this one: no P can be that far ahead
        least = self._least_queued(work, exclude)
        if least is None or own - least[1] <= work:
            return None
        return least[0]

    def _spill_decode(
        self,
        entry: KVEntry | None,
        tenant: str,
        cached: Mapping[str, int] | None = None,
        tokens: int = 0,
        chars_per_token: float = 1.0,
        holder_uncached: int = 0,
        held_pull: int = 0,
    ) -> tuple[Backend | None, bool]:
        """The D a spilled turn would go to and whether it holds the conversation: of the
        holder (when it can take a decode-only turn), the least loaded D and the Ds whose
        prefix cache is expected to hold part of the prompt (`cached`: URL -> characters, with
        prefix routing), the one that would be done with the turn soonest: its decode-only
        tokens queued plus what it would compute of the turn's `tokens` (the holder only
        `holder_uncached`, the part it does not hold; another D, when it can read the
        `held_pull` tokens of history from the holder, those at `PULL_COST`). On a tie the
        holder (its hold is then used, not released), then the least loaded. None busy or
        overloaded, each only within D's decode-only budget. The holder is not taken whatever
        its queue: a holder behind more work than another D's whole prefill of the turn would
        delay the turn more than its history saves (spilled turns' TTFT p90, bench/RESULTS.md
        run Q); the other D then reads the history from it where it can (`_held_source`)."""
        holder: Backend | None = None
        if entry is not None and entry.chars_per_token:
            d = self.decode.get(entry.url)
            if (
                d is not None
                and d.usable
                and self._takes_spill(d)
                and not self.decode_only.withdrawn(d.url, tenant)
            ):
                holder = d
        least = self.least_loaded(self.decode, set())
        candidates = [] if holder is None else [holder]
        others = [] if least is None else [least]
        others += [
            d for url in cached or () if (d := self.decode.get(url)) is not None and d.usable
        ]
        for d in others:
            if all(d is not c for c in candidates) and self._takes_spill(d):
                candidates.append(d)
        if len(candidates) <= 1:
            best = candidates[0] if candidates else None
            return best, best is not None and best is holder

        def done_after(d: Backend) -> tuple[float, bool, bool]:
            if d is holder:
                computed = holder_uncached
            else:
                held = cached.get(d.url, 0) if cached else 0
                local = min(tokens, round(held / chars_per_token))
                computed = tokens - local
                if held_pull and (entry is None or d.url != entry.url):
                    computed = min(computed, with_pull(tokens, held_pull, 0.0, local))
            return d.outstanding_work - d.inflight + computed, d is not holder, d is not least

        best = min(candidates, key=done_after)
        return best, best is holder

    def _takes_spill(self, d: Backend) -> bool:
        """D may take a spilled turn: neither overloaded nor busy, its decode-only tokens still
        to prefill under `prefill_spill_max_inflight_tokens`, its decodes not too slow."""
        s = self.settings
        return (
            d.inflight < s.decode_overload_inflight
            and not self.busy(d)
            and d.outstanding_work - d.inflight < s.prefill_spill_max_inflight_tokens
            and not self._decoding_slowly(d)
        )

    def _decoding_slowly(self, d: Backend) -> bool:
        """D's decodes ran slower than `prefill_spill_max_inter_token_ms` between its last
        two fresh load readings: prefill spilled onto it now would slow them further."""
        bound_ms = self.settings.prefill_spill_max_inter_token_ms
        if bound_ms <= 0:
            return False
        load = fresh_load(d, self.settings.load_poll_interval_s)
        gap = load.inter_token_s if load is not None else None
        return gap is not None and gap * 1000 > bound_ms

    # -- learning from what the engines reused -------------------------------------------------

    def cache_keeps_s(self, url: str) -> float | None:
        """How long the D at `url`'s prefix cache keeps an unused block lately, as its own
        residency histogram says (`CacheResidence`; None: it serves none, or too few
        evictions to tell). Read whatever its age: a cache's pressure changes slowly."""
        backend = self.decode.get(url)
        load = backend.load if backend is not None else None
        return load.residence.keeps_s() if load is not None and load.residence else None

    def held_read(self, url: str, found: bool) -> None:
        """An engine was sent the history the D at `url` held for the turn: it loaded some of
        it (`found`), or its read failed, D no longer holding the blocks (`HeldReads`)."""
        self.held_reads.read(url, found)

    def decode_only_served(self, url: str, cached_tokens: int, tenant: str = "") -> None:
        """D served `tenant` a decode-only turn from `cached_tokens` of its own (its report),
        on an entry that offered at least one whole block (less is nothing to reuse)."""
        if cached_tokens > 0:
            self.decode_only.paid(url, tenant)
        else:
            self.decode_only.unpaid(url, tenant)

    def cached_decode_served(self, url: str, cached_tokens: int, tenant: str = "") -> None:
        """D served `tenant` a decode-only turn sent by its expected prefix cache
        (`cached_decode_only`) from `cached_tokens` of its own (its report)."""
        if cached_tokens > 0:
            self.decode_cached.paid(url, tenant)
        else:
            self.decode_cached.unpaid(url, tenant)

    def decode_served(self, url: str, local_hit_tokens: int, tenant: str = "") -> None:
        """D served `tenant` a turn through P with this local prefix hit: a hit shows its
        prefix cache works, so its decode-only turns come back."""
        if local_hit_tokens > 0:
            self.decode_only.paid(url, tenant)

    def prefill_served(
        self, url: str, local_hit_tokens: int, *, affinity_turn: bool, tenant: str = ""
    ) -> None:
        """P served `tenant` a turn with this local prefix hit; `affinity_turn`: it was chosen
        as the conversation's previous P, with the same history (nothing refused by hash)."""
        if local_hit_tokens > 0:
            self.affinity.paid(url, tenant)
        elif affinity_turn:
            self.affinity.unpaid(url, tenant)


def kv_usage(backend: Backend, load: EngineLoad) -> float:
    """`load`'s KV usage less the share of the pool this worker's turns freed on `backend`
    since it was read (the reading as it is where the engine does not say its pool's size)."""
    freed = backend.freed.since(load.at)
    if not freed or not load.pool_tokens:
        return load.kv_usage
    return max(0.0, load.kv_usage - freed / load.pool_tokens)


def uncached_tokens(entry: KVEntry, prompt_chars: int) -> int:
    """Estimated prompt tokens beyond what the holder keeps, from the previous turn's
    characters per token (no tokenizer in the proxy)."""
    assert entry.chars_per_token
    return max(0, round(prompt_chars / entry.chars_per_token) - entry.num_tokens)
