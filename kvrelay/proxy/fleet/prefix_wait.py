"""Prefixes an engine is computing for a turn right now, and the turns that wait for them:
`PrefixesInFlight`.

An engine caches a prompt's blocks as it computes them, but a request admitted while another
is still computing the same prefix is scheduled beside it (continuous batching admits it at
once, and its prefix-cache lookup happens then) and computes its own copy. A burst of requests
sharing a new system prompt, tool schema or document is computed once per request of the
burst, each copy slowing the others. So with `prefix_wait_max_s` > 0 a turn whose prompt is at
least half a prefix another turn of this worker is computing, and at least
`prefix_pull_min_tokens` long, waits until that turn's engine has computed it (its P answered,
or its spilled D sent the first token), at most `prefix_wait_max_s`, and is routed only then: to
the engine that now caches the prefix, as its KV events or the routing-fed index say.

A turn leads the prefixes of its prompt that no engine is expected to cache, by at least the
minimum (`lead`), as soon as it knows its prompt: before it is tokenized and planned, which
takes long enough under a burst that a turn sharing the prefix could otherwise come, find no
leader and be planned beside it. Once planned the turn leads again on what it then knows
(`relead`: the engines' KV events looked up with its tokens, and whether it computes at all):
the old lead ends and its waiters look again, waiting on the new lead if it still covers them.
A turn ends its lead (`Lead.done`) once its engine computed the prefixes, or when it fails:
every way out of a turn ends it. Only turns of the same worker wait for each other (each worker
knows its own). Waits are counted in `kvrelay_prefix_waits_total{result=computed|timeout}`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from kvrelay.proxy.fleet.prefix_index import PromptPrefixes
from kvrelay.proxy.telemetry import metrics


class Lead:
    """One turn's prefixes in flight (`PrefixesInFlight.lead`); `done` ends it, once."""

    __slots__ = ("_done", "_keys", "_owner")

    def __init__(self, owner: PrefixesInFlight, keys: list[str]) -> None:
        self._owner = owner
        self._keys = keys
        self._done = asyncio.Event()

    def done(self) -> None:
        """The turn's engine computed the prefixes (or the turn ended): waiters go on."""
        if self._done.is_set():
            return
        self._done.set()
        self.release()

    def release(self) -> None:
        """Its prefixes are no longer led by it (waiters wake only at `done`)."""
        leaders = self._owner._leaders
        for key in self._keys:
            if leaders.get(key) is self:
                del leaders[key]

    async def wait(self, timeout_s: float) -> bool:
        """True once `done`, False after `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._done.wait()
        except TimeoutError:
            return False
        return True


class PrefixesInFlight:
    """The prefixes this worker's turns are computing now (see the module's docstring)."""

    def __init__(self, max_wait_s: float, min_chars: float) -> None:
        self.max_wait_s = max_wait_s
        self.on = max_wait_s > 0
        self._min_chars = min_chars
        self._leaders: dict[str, Lead] = {}  # prefix key -> the turn computing it

    def __len__(self) -> int:
        return len(self._leaders)

    def leader_of(self, prompt: PromptPrefixes) -> Lead | None:
        """The turn computing the longest prefix of `prompt` that is at least half of it and
        at least the minimum, if one is."""
        leaders = self._leaders
        if not leaders:
            return None
        least = max(self._min_chars, prompt.total / 2)
        for key, chars in zip(reversed(prompt.keys), reversed(prompt.chars), strict=True):
            if chars < least:
                return None
            lead = leaders.get(key)
            if lead is not None:
                return lead
        return None

    async def wait(self, prompt: PromptPrefixes) -> None:
        """Wait for the turn computing most of `prompt`, if one is (module docstring); a lead
        that ends because its turn led again is looked up again, within the one bound."""
        lead = self.leader_of(prompt)
        if lead is None:
            return
        deadline = time.monotonic() + self.max_wait_s
        while lead is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not await lead.wait(left):
                metrics.PREFIX_WAITS.labels("timeout").inc()
                return
            lead = self.leader_of(prompt)
        metrics.PREFIX_WAITS.labels("computed").inc()

    def lead(self, prompt: PromptPrefixes, cached: Mapping[str, int]) -> Lead | None:
        """This turn computes `prompt` beyond what any engine is expected to cache (`cached`:
        engine URL -> characters): its prefixes longer than that by at least the minimum (a
        turn waiting for less would save less than a pull is worth), none of them already led,
        are in flight until the returned lead is done. None when there are none."""
        if not self.on:
            return None
        beyond = max(cached.values(), default=0) + self._min_chars
        leaders = self._leaders
        keys = [
            key
            for key, chars in zip(prompt.keys, prompt.chars, strict=True)
            if chars >= beyond and key not in leaders
        ]
        if not keys:
            return None
        lead = Lead(self, keys)
        for key in keys:
            leaders[key] = lead
        return lead

    def relead(
        self, lead: Lead | None, prompt: PromptPrefixes, cached: Mapping[str, int]
    ) -> Lead | None:
        """The turn that holds `lead` (None: none) now knows more of what the engines cache
        (`cached`) and still computes `prompt`: it leads what is left (`lead`), and the old
        lead ends, its waiters looking again (`wait`)."""
        if lead is not None:
            lead.release()
        new = self.lead(prompt, cached)
        if lead is not None:
            lead.done()
        return new
